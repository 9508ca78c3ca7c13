"""Train a byte-level BPE tokenizer offline (HF ``tokenizers``) into a local folder.

The folder loads with ``transformers.AutoTokenizer.from_pretrained(dir)`` and with
megatron-core's ``MegatronTokenizer.from_pretrained(dir)`` (library ``huggingface``), and is what
``tools/preprocess_data.py --tokenizer`` reads. ``<|endoftext|>`` is the end-of-document token.

    python tools/train_tokenizer.py --input corpus/*.txt --vocab-size 8192 --out tok/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EOD = "<|endoftext|>"


def iter_texts(paths: list[Path], json_key: str):
    """Documents of .txt files (one per file) and .jsonl files (one per line, ``json_key``)."""
    for path in paths:
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield json.loads(line)[json_key]
        else:
            yield path.read_text(encoding="utf-8")


def input_files(patterns: list[str]) -> list[Path]:
    files = []
    for pat in patterns:
        p = Path(pat)
        found = sorted(p.parent.glob(p.name)) if any(c in pat for c in "*?[") else [p]
        missing = [f for f in found if not f.is_file()]
        if not found or missing:
            raise SystemExit(f"error: no input file matches {pat!r}")
        files += found
    return files


def train(files: list[Path], vocab_size: int, out: Path, json_key: str = "text") -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(files, json_key), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD, bos_token=EOD).save_pretrained(out)
    from megatron.core.tokenizers import MegatronTokenizer

    MegatronTokenizer.write_metadata(str(out), "huggingface", overwrite=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help=".txt / .jsonl files or globs")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--json-key", default="text", help="field holding the text in .jsonl")
    ap.add_argument("--out", type=Path, required=True, help="folder to write")
    ap.add_argument("--overwrite", action="store_true", help="replace a tokenizer in --out")
    args = ap.parse_args(argv)
    if args.vocab_size < 257:
        raise SystemExit("error: --vocab-size must exceed 256 (the byte alphabet + <|endoftext|>)")
    if (args.out / "tokenizer.json").exists() and not args.overwrite:
        raise SystemExit(f"error: {args.out} holds a tokenizer (the datasets made with it need "
                         "it): give another --out, or --overwrite to replace it")  # fmt: skip
    out = train(input_files(args.input), args.vocab_size, args.out, args.json_key)
    print(f"wrote a {args.vocab_size}-token byte-level BPE tokenizer to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
