"""Start-up checks of ``--data-path`` datasets (megatron's ``.idx``/``.bin`` pairs), so a
truncated, empty or mis-tokenized dataset is named before the model is built.

Index layout (megatron/core/datasets/indexed_dataset.py, ``_IndexReader``): 9-byte magic,
u64 version, u8 dtype code, u64 sequence count S, u64 document count D, then int32 lengths[S],
int64 byte pointers[S], int64 document indices[D] (and int8 modes[S] for multimodal data).
"""

from __future__ import annotations

import os
import socket
import struct
import zlib

import numpy as np
import torch

from megatron.md import errors

MAGIC = b"MMIDIDX\x00\x00"
HEADER = 34
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}  # fmt: skip
SAMPLE_TOKENS = 1 << 22  # tokens read from the start and the end of .bin for the id check


def check_prefix(prefix: str, scan_tokens: bool = True) -> tuple[str | None, int]:
    """(error message or None, largest token id seen in the sampled tokens; 0 unscanned)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    size = os.path.getsize(idx)
    if size < HEADER:
        return f"{idx} is {size} bytes: empty or truncated (an index has a {HEADER}-byte header)", 0
    with open(idx, "rb") as f:
        head = f.read(HEADER)
    if head[:9] != MAGIC:
        return f"{idx} is not a megatron index file (bad magic bytes)", 0
    (version,) = struct.unpack("<Q", head[9:17])
    code = head[17]
    seqs, docs = struct.unpack("<QQ", head[18:34])
    if version != 1 or code not in DTYPES:
        return f"{idx}: unknown version {version} or dtype code {code}", 0
    want = HEADER + 12 * seqs + 8 * docs
    if size not in (want, want + seqs):
        return (f"{idx} is corrupt or truncated: {size} bytes, its header "
                f"({seqs} sequences, {docs} documents) needs {want}"), 0  # fmt: skip
    if seqs == 0:
        return f"{prefix}: the dataset holds no sequences (empty)", 0
    dtype = np.dtype(DTYPES[code])
    lengths = np.memmap(idx, np.int32, "r", HEADER, (seqs,))
    pointers = np.memmap(idx, np.int64, "r", HEADER + 4 * seqs, (seqs,))
    need = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize
    have = os.path.getsize(bin_)
    if have != need:
        return (f"{bin_} is {have} bytes but its index says {need}: truncated or not the "
                f"pair of {idx}"), 0  # fmt: skip
    if not scan_tokens:
        return None, 0
    n = have // dtype.itemsize
    tokens = np.memmap(bin_, dtype, "r")
    top = max(
        int(tokens[: min(n, SAMPLE_TOKENS)].max()), int(tokens[max(0, n - SAMPLE_TOKENS) :].max())
    )
    return None, top


def tokenizer_vocab(args) -> int | None:
    """The tokenizer's vocabulary size, when it can be known before megatron builds it."""
    if args.tokenizer_type == "NullTokenizer":
        return args.vocab_size + 1  # its EOD id is vocab_size
    if args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return None
        path = os.path.join(args.tokenizer_model, "tokenizer.json")
        return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    return None


def check_data(prefixes: list[str], args, scan_tokens: bool | None = None) -> str | None:
    """The first problem with the datasets, or None. The headers and sizes are checked in every
    process (a few bytes per file); the token-id scan (8M tokens per file) by one process per
    node, local rank 0 (``scan_tokens`` None): with a 50-prefix blend on 512 ranks every
    process scanning would read hundreds of GB from a shared file system before training. A
    failing node stops its torchrun, and with it the job."""
    if scan_tokens is None:
        scan_tokens = os.environ.get("LOCAL_RANK", "0") == "0"
    vocab = tokenizer_vocab(args) if scan_tokens else None
    for prefix in prefixes:
        err, top = check_prefix(prefix, scan_tokens)
        if err:
            return err
        if vocab is not None and top >= vocab:
            return (
                f"{prefix}.bin holds token id {top} but the tokenizer has {vocab} tokens: the "
                "data was made with another tokenizer (or --vocab-size is too small)"
            )
    return None


#: samples compared across ranks per split (evenly spaced, the first and the last included)
PICKS = 8


def fingerprint(ds) -> tuple | None:
    """A split's length and the CRC-32 of the tokens of ``PICKS`` of its samples."""
    if ds is None:
        return None
    n = len(ds)
    picks = sorted({round(i * (n - 1) / (PICKS - 1)) for i in range(PICKS)}) if n else []
    return n, [(i, zlib.crc32(np.asarray(ds[i]["tokens"]).tobytes())) for i in picks]


def check_same_samples(splits) -> None:
    """Every rank reads the samples rank 0 reads (a collective, on every rank after the
    datasets are built). Each node reads its own ``--data-path`` files and dataset cache: a
    corpus copied to each node's disk and a cache beside it on that disk are the node's own, and
    a copy of another version of the corpus, or a cache megatron built from one (it names caches
    by the settings, not the data), trained that node on other samples than the flags say,
    without a word."""
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = [fingerprint(ds) for ds in splits]
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (socket.gethostname(), mine))
    host0, ref = views[0]
    for rank, (host, theirs) in enumerate(views):
        for split, a, b in zip(("train", "valid", "test"), ref, theirs):
            if a == b:
                continue
            errors.fail(
                f"rank {rank} on {host} reads other {split} samples than rank 0 on {host0} "
                f"({differ(a, b)}): its --data-path files or "
                "their dataset cache are not rank 0's (a node-local copy of another version of "
                "the corpus, or a node-local cache built from one): give every node the same "
                "data, and --data-cache-path a directory every node shares"
            )


def differ(a: tuple | None, b: tuple | None) -> str:
    """How split fingerprint ``b`` differs from rank 0's ``a``."""
    if not (a and b) or a[0] != b[0]:
        return f"{b[0] if b else 0} samples, rank 0 {a[0] if a else 0}"
    return "sample {} differs".format(next(i for (i, x), (_, y) in zip(a[1], b[1]) if x != y))
