"""Start-up checks of ``--data-path`` datasets (megatron's ``.idx``/``.bin`` pairs), so a
truncated, empty or mis-tokenized dataset is named before the model is built.

Index layout (megatron/core/datasets/indexed_dataset.py, ``_IndexReader``): 9-byte magic,
u64 version, u8 dtype code, u64 sequence count S, u64 document count D, then int32 lengths[S],
int64 byte pointers[S], int64 document indices[D] (and int8 modes[S] for multimodal data).
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np
import torch

from megatron.md import errors
from megatron.md.train import datacache, nodes
from megatron.md.train.files import unwritable

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


#: megatron's sample-order indices (gpt_dataset.py, blended_dataset.py), and how much of each
#: is compared: its length and ``INDEX_PIECES`` evenly spread pieces of ``INDEX_PIECE`` bytes
INDEX_ARRAYS = ("dataset_index", "dataset_sample_index", "document_index", "sample_index",
                "shuffle_index")  # fmt: skip
INDEX_PIECES, INDEX_PIECE = 64, 1 << 16


def fingerprint(ds) -> tuple | None:
    """A split's length, the CRC-32 of the tokens of ``PICKS`` of its samples, and of its
    sample order (``order_crc``)."""
    if ds is None:
        return None
    n = len(ds)
    picks = sorted({round(i * (n - 1) / (PICKS - 1)) for i in range(PICKS)}) if n else []
    samples = [(i, zlib.crc32(np.asarray(ds[i]["tokens"]).tobytes())) for i in picks]
    return n, samples, order_crc(ds)


def pieces_crc(b: np.ndarray, pieces: int, piece: int, crc: int = 0) -> int:
    """CRC-32 of ``pieces`` evenly spaced pieces of ``piece`` bytes of the byte array ``b``."""
    for start in range(0, b.size, max(b.size // pieces, 1))[:pieces]:
        crc = zlib.crc32(b[start : start + piece].tobytes(), crc)
    return crc


def order_crc(ds, crc: int = 0) -> int:
    """CRC-32 of the indices that fix the order ``ds`` serves its samples in (a blend's, then
    each of its datasets'): the samples compared could agree where a node-local cache, built
    from another version of the corpus, orders them otherwise. Pieces of each index, not all
    of it: an index of a large run is hundreds of MB, read by every node at start-up."""
    if getattr(ds, "shuffle_index", 0) is None and len(ds):
        ds[0]  # megatron memory-maps the indices at the first sample it reads
    for name in INDEX_ARRAYS:
        a = getattr(ds, name, None)
        if a is None:
            continue
        b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        crc = pieces_crc(b, INDEX_PIECES, INDEX_PIECE, zlib.crc32(f"{name} {b.size}".encode(), crc))
    for sub in getattr(ds, "datasets", None) or []:
        crc = order_crc(sub, crc)
    return crc


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
    names, each = [], []
    for name, ds in zip(("train", "valid", "test"), splits):
        # --multiple-validation-sets: a list, one validation set per dataset of the blend
        many = isinstance(ds, list)
        for i, d in enumerate(ds if many else [ds]):
            names.append(f"{name} {i}" if many else name)
            each.append(d)
    views = nodes.gather([fingerprint(ds) for ds in each])
    host0, ref = views[0]
    for rank, (host, theirs) in enumerate(views):
        for split, a, b in zip(names, ref, theirs):
            if a == b:
                continue
            errors.fail(
                f"rank {rank} on {host} reads other {split} samples than rank 0 on {host0} "
                f"({differ(a, b)}): its --data-path files or "
                "their dataset cache are not rank 0's (a node-local copy of another version of "
                "the corpus, or a node-local cache built from one): give every node the same "
                "data, and --data-cache-path a directory every node shares"
            )


#: pieces of each ``.idx`` read for ``file_fingerprint`` (4 KiB each, spread over the file)
IDX_PIECES = 16


def file_fingerprint(prefix: str) -> tuple[int, int, int]:
    """(``.bin`` size, ``.idx`` size, CRC-32 of ``IDX_PIECES`` pieces of the ``.idx``): the
    index holds every sequence's length and its byte offset in the ``.bin``, a running sum
    that one changed length shifts from there on, so another version of a corpus differs here
    almost always, for 64 KiB read (the samples' tokens are compared once the datasets are
    built, ``check_same_samples``)."""
    idx = np.memmap(prefix + ".idx", np.uint8, "r")  # (check_files: at least its header)
    return os.path.getsize(prefix + ".bin"), idx.size, pieces_crc(idx, IDX_PIECES, 4096)


def check_same_files(args) -> None:
    """Every rank's node holds rank 0's ``--data-path`` files (a collective, on every rank,
    before the model is built; ``check_files`` has found them on each node). A node-local copy
    of another version of the corpus was found only once the datasets were built, after the
    model and the checkpoint load (``check_same_samples``, which stays for what this cannot
    see: the same index over other tokens, a node-local cache built from other data)."""
    dist = torch.distributed
    if args.mock_data or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    # (every node reads the same objects)
    prefixes = dict.fromkeys(p for _, ps in dataset_lists(args) for p in ps if not remote(p))
    views = nodes.unlike_rank0({p: file_fingerprint(p) for p in prefixes})
    host0 = views[0][0]
    for rank, (host, unlike) in enumerate(views):
        if not unlike:
            continue
        prefix, (b, i, _), (b0, i0, _) = unlike[0]
        how = "the same sizes, other document lengths in its .idx"
        if (b, i) != (b0, i0):
            how = f".bin {b} bytes, rank 0's {b0}; .idx {i} bytes, rank 0's {i0}"
        more = f" (and {len(unlike) - 1} more datasets)" if len(unlike) > 1 else ""
        errors.fail(
            f"rank {rank} on {host} reads other data than rank 0 on {host0}: {prefix} ({how})"
            f"{more}: that node's copy of the corpus is not rank 0's (another version of it): "
            "give every node the same data"
        )


def differ(a: tuple | None, b: tuple | None) -> str:
    """How split fingerprint ``b`` differs from rank 0's ``a``."""
    if not (a and b) or a[0] != b[0]:
        return f"{b[0] if b else 0} samples, rank 0 {a[0] if a else 0}"
    if a[1] != b[1]:
        return "sample {} differs".format(next(i for (i, x), (_, y) in zip(a[1], b[1]) if x != y))
    return "the samples compared agree, their order differs: megatron's dataset indices"


#: megatron's flags naming datasets: a blend for every split, or one per split (megatron's
#: get_blend_and_blend_per_split); the per-split ones were not checked, and a missing file
#: stopped the run with megatron's traceback after the model was built
DATA_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
SPLITS = ("train", "valid", "test")


def dataset_lists(args) -> list[tuple[str, list[str]]]:
    """Each flag that names datasets, as its refusals name it, with its prefixes: megatron's
    ``--data-args-path`` (a file holding what ``--data-path`` would) and
    ``--per-split-data-args-path`` (JSON: ``train``/``valid``/``test``, each a string or a list)
    read as megatron reads them (training/utils/common_utils.py,
    ``get_blend_and_blend_per_split``). Those were refused as if no data were given."""
    out = [("--" + f.replace("_", "-"), data_prefixes(getattr(args, f)))
           for f in DATA_FLAGS if getattr(args, f, None)]  # fmt: skip
    for flag, per_split in (("data_args_path", False), ("per_split_data_args_path", True)):
        path = getattr(args, flag, None)
        if not path:
            continue
        name = f"--{flag.replace('_', '-')} {path}"
        try:
            with open(path) as f:
                text = f.read()
            if not per_split:
                out.append((name, data_prefixes(text.split())))
                continue
            splits = json.loads(text)
            for split in SPLITS:
                items = splits[split] or []  # (megatron: no dataset for a null split)
                out.append((f"{name} ({split})", data_prefixes(
                    items.split() if isinstance(items, str) else list(items))))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            errors.fail(f"{name} cannot be read as megatron reads it ({type(e).__name__}: {e})",
                        node=True)  # fmt: skip
    return out


def split_sets(args) -> dict[str, list[str] | None] | None:
    """Each split's own datasets (``train``, ``valid``, ``test``: ``--per-split-data-args-path``'s,
    else ``--train/valid/test-data-path``, ``get_blend_and_blend_per_split``'s precedence;
    ``--multiple-validation-sets`` builds one set per ``valid`` dataset); None where the splits
    are shares of one blend (``--data-path``, ``--data-args-path``) or mock data."""
    if args.mock_data or args.data_path or args.data_args_path:
        return None
    lists = dict(dataset_lists(args))
    if path := args.per_split_data_args_path:
        return {s: lists[f"--per-split-data-args-path {path} ({s})"] for s in SPLITS}
    return {s: lists.get(f"--{s}-data-path") for s in SPLITS}


def check_files(args) -> None:
    """The files a run reads, on this node, before the model is built: the tokenizer folder, every
    dataset named by any of megatron's flags (present, whole, tokenized within the vocabulary)
    and the directory of their index cache. A refusal about them is said by each node's first
    rank as well (``node=True``): another node may see other files."""
    if args.tokenizer_type == "HuggingFaceTokenizer":
        check_tokenizer_dir(args.tokenizer_model)
    if not args.mock_data:
        lists = dataset_lists(args)
        if not lists:
            errors.fail("give --data-path PREFIX (from tools/preprocess_data.py) or --mock-data")
        if args.data_args_path and args.split is None:  # megatron's assert, after the model
            errors.fail(
                "--data-args-path needs --split (megatron sets its default for --data-path "
                "only, and asserts one later): add e.g. --split 969,30,1"
            )
        every = []
        for name, given in lists:
            prefixes = [p for p in given if not remote(p)]
            if len(prefixes) < len(given):
                check_remote(name, args)
            every += prefixes
            for prefix in prefixes:
                for ext in (".bin", ".idx"):
                    if not os.path.isfile(prefix + ext):
                        errors.fail(
                            f"{name}: {prefix + ext} does not exist "
                            "(build it with tools/preprocess_data.py)",
                            node=True,
                        )
            err = check_data(prefixes, args)
            if err:
                errors.fail(f"{name}: {err}", node=True)
        check_data_cache(every, args.data_cache_path)


def remote(prefix: str) -> bool:
    """A dataset in object storage (``s3://``, ``msc://``: megatron-core reads it there)."""
    from megatron.core.datasets.object_storage_utils import is_object_storage_path

    return is_object_storage_path(prefix)


def check_remote(name: str, args) -> None:
    """What megatron needs to read datasets from object storage, before the model is built:
    a local directory for their indices (``--object-storage-cache-path``: megatron-core
    asserts it as it builds the datasets) and for the dataset cache (``--data-cache-path``:
    without it megatron makes the cache directory beside the data, a local path beginning
    ``s3:``). The objects themselves are not read here."""
    for flag in ("object_storage_cache_path", "data_cache_path"):
        if not getattr(args, flag, None):
            errors.fail(f"{name} names datasets in object storage: give --"
                        f"{flag.replace('_', '-')} a local directory (megatron keeps their "
                        "index files there)")  # fmt: skip


def check_data_cache(prefixes: list[str], cache_path: str | None) -> None:
    """The directory megatron writes the dataset indices into when they are not cached yet
    (``--data-cache-path``, default beside the data: ``datacache.default_dir``) can be made, or
    exists (its files may be all a run needs). megatron builds the datasets after the model and
    the checkpoint load; its write error came then."""
    dirs = [cache_path] if cache_path else [datacache.default_dir(p) for p in prefixes]
    for d in dirs:
        bad = None if os.path.isdir(d) else unwritable(d)
        if bad:
            why = "is not a directory" if bad[1] is None else "is not writable"
            flag = "--data-cache-path" if cache_path else "--data-path's cache, beside the data,"
            errors.fail(f"{flag} {d} cannot be created ({bad[0]} {why}), and megatron writes "
                        "the dataset indices there when they are not cached yet: give "
                        "--data-cache-path a writable directory", node=True)  # fmt: skip


def check_tokenizer_dir(tok: str | None) -> None:
    if not tok or not os.path.isfile(os.path.join(tok, "tokenizer.json")):
        errors.fail(
            f"--tokenizer-model {tok!r} is not a tokenizer folder with tokenizer.json "
            "(make one with tools/train_tokenizer.py)",
            node=True,
        )


def data_prefixes(items: list[str]) -> list[str]:
    """Prefixes of a megatron --data-path list (``P``, or ``W1 P1 W2 P2 ...``)."""

    def is_num(s):
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(items) > 1 and all(is_num(x) for x in items[0::2]):
        return items[1::2]
    return list(items)
