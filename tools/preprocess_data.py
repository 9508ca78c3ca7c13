"""Text / JSONL → megatron ``.bin/.idx`` (one document per .txt file or JSONL line), tokenized
with a local HF tokenizer folder (``tools/train_tokenizer.py``), in parallel, with progress.

    python tools/preprocess_data.py --input corpus/*.txt --tokenizer-model tok \
        --output-prefix data/c
    # -> data/c_text_document.bin/.idx ; use --data-path data/c_text_document

Each document ends with the end-of-document token (``<|endoftext|>``) unless --no-append-eod.
An existing output is refused unless --overwrite (a typo'd prefix would otherwise truncate a
dataset that took hours). The files are written under ``.partial`` names and renamed once
both are complete, so an interrupted run leaves no half-written ``.bin`` beside an ``.idx``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tokenizer import EOD, input_files  # noqa: E402

from megatron.md.progress import Progress  # noqa: E402

_tok = None


def _init(tokenizer_dir: str) -> None:
    global _tok
    from tokenizers import Tokenizer

    _tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))


def _encode(item: tuple[str, int]) -> tuple[list[int], int]:
    text, nbytes = item
    return _tok.encode(text, add_special_tokens=False).ids, nbytes


def _texts_and_bytes(files, json_key: str):
    """(document, bytes of input read for it, blank lines before it included): what the
    progress line counts."""
    for path in files:
        if path.suffix == ".jsonl":
            pending = 0
            with path.open("rb") as f:
                for raw in f:
                    pending += len(raw)
                    if raw.strip():
                        yield json.loads(raw)[json_key], pending
                        pending = 0
        else:
            yield path.read_text(encoding="utf-8"), path.stat().st_size


def preprocess(
    files,
    tokenizer_dir: Path,
    prefix: str,
    workers: int = 2,
    eod: bool = True,
    json_key: str = "text",
    overwrite: bool = False,
) -> tuple[str, int, int]:
    """Write ``{prefix}_text_document.{bin,idx}``; returns (path prefix, documents, tokens).
    Refused where either file exists, unless ``overwrite``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tokenizers import Tokenizer

    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise SystemExit(f"error: {tokenizer_dir} has no tokenizer.json (tools/train_tokenizer.py)")
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eod_id = tok.token_to_id(EOD)
    if eod and eod_id is None:
        raise SystemExit(f"error: the tokenizer has no {EOD} token (or pass --no-append-eod)")
    vocab = tok.get_vocab_size()
    out = f"{prefix}_text_document"
    there = [f"{out}{ext}" for ext in (".bin", ".idx") if Path(out + ext).exists()]
    if there and not overwrite:
        raise SystemExit(f"error: {' and '.join(there)} exist: give another --output-prefix, or "
                         "--overwrite to replace them")  # fmt: skip
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    partial = {ext: f"{out}{ext}.partial" for ext in (".bin", ".idx")}
    try:
        dtype = np.uint16 if vocab < 65500 else np.int32
        builder = IndexedDatasetBuilder(partial[".bin"], dtype=dtype)
        n_docs = n_tok = 0
        total = sum(f.stat().st_size for f in files)
        bar = Progress("preprocess", total, every=10, unit_fmt=lambda b: f"{b / 2**20:,.1f} MiB")
        with mp.Pool(workers, initializer=_init, initargs=(str(tokenizer_dir),)) as pool:
            for ids, nbytes in pool.imap(_encode, _texts_and_bytes(files, json_key), chunksize=16):
                if eod:
                    ids.append(eod_id)
                builder.add_document(np.array(ids, dtype=np.int64), [len(ids)])
                n_docs, n_tok = n_docs + 1, n_tok + len(ids)
                bar.update(nbytes, note=f"{n_docs} documents, {n_tok:,} tokens")
        bar.finish(note=f"{n_docs} documents, {n_tok:,} tokens")
        builder.finalize(partial[".idx"])
        for ext, path in partial.items():  # .bin, then .idx: complete once the .idx appears
            os.replace(path, out + ext)
    finally:
        for path in partial.values():
            Path(path).unlink(missing_ok=True)
    print(f"wrote {n_docs} documents, {n_tok} tokens to {out}.bin/.idx", file=sys.stderr)
    return out, n_docs, n_tok


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help=".txt / .jsonl files or globs")
    ap.add_argument("--tokenizer-model", type=Path, required=True, help="local HF tokenizer folder")
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--no-append-eod", action="store_true")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output")
    args = ap.parse_args(argv)
    preprocess(
        input_files(args.input),
        args.tokenizer_model,
        args.output_prefix,
        args.workers,
        not args.no_append_eod,
        args.json_key,
        args.overwrite,
    )


if __name__ == "__main__":
    main()
