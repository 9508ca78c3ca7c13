"""Dataset index caches written whole: a file in the cache is either absent or complete.

megatron-core caches a dataset's indices (GPTDataset: document, sample and shuffle index;
BlendedDataset: dataset and sample index) as ``.npy`` files named by a hash of the dataset's
settings, by default beside the data (``<prefix>/cache/GPTDataset_indices``), so every run on
that data with the same sequence length, seed and sample count shares them. Its rank 0 writes
them in place with ``numpy.save`` (``gpt_dataset.py:603``, ``blended_dataset.py:201``), which
first truncates the file. The runs of a sweep, started together on a new cache, all miss it and
all build: the last writer truncates the files the others' ranks have already mapped, and
those die of SIGBUS at their next read (measured: a reader holding a 40 MB sample index is
killed while a second build writes it; ``tests/test_datacache.py``), or a run starting
meanwhile reads a cut file.

Here rank 0 builds a missed cache in a private directory inside the cache directory and renames
each file into place (``os.replace``: atomic in one directory), the description last (megatron
counts a hit only when every file is there). A mapped file is never rewritten: a later build
replaces the name, and a reader keeps the file it mapped. Concurrent builds do the same work,
as they did. A build killed outright leaves its private directory behind (a sample index can be
gigabytes): its name says which process built it (host, boot, PID namespace, pid), and the next
build in that cache directory on the same host removes those whose process is gone.

megatron's cache names hold the settings, not the data: a corpus preprocessed again under the
same prefix (another tokenizer, other documents) met the old indices, and megatron read the new
files through them without a word (samples cut at the old documents' lengths and offsets; new
documents never drawn). Each build here also notes what it was built from
(``<name>md_source.json``: the sizes of the corpus's ``.bin`` and ``.idx``; a blend's datasets'
lengths); a cache whose note differs from the data is built again, said on rank 0. A cache
without the note (built by megatron alone) is used as it is.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import socket

import torch

from megatron.md import errors

DESCRIPTION = "description.txt"
SOURCE = "md_source.json"


def cache_dir(ds) -> str | None:
    """Where megatron caches ``ds``'s indices: the config's ``path_to_cache``, or for a
    GPTDataset on real data ``<prefix>/cache/<class>_indices`` (gpt_dataset.py:470)."""
    path = ds.config.path_to_cache
    if path is None and not ds.config.mock and hasattr(ds, "dataset"):  # not BlendedDataset
        path = default_dir(ds.dataset.path_prefix, type(ds).__name__)
    return path


def default_dir(prefix: str, cls: str = "GPTDataset") -> str:
    """megatron's cache directory of a dataset ``prefix`` without ``--data-cache-path``."""
    return os.path.join(prefix, "cache", f"{cls}_indices")


def stem(ds) -> str:
    """The cache files' common name start (gpt_dataset.py:477, blended_dataset.py:133)."""
    split = ds.split if hasattr(ds, "split") else ds.index_split  # BlendedDataset / GPTDataset
    return f"{ds.unique_description_hash}-{type(ds).__name__}-{split.name}-"


def source(ds) -> dict | None:
    """What ``ds``'s indices are built from, as far as a change of it changes them: a
    GPTDataset's corpus files' sizes, a BlendedDataset's datasets' lengths (None: mock data, or
    files that cannot be sized, such as object storage)."""
    from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

    if hasattr(ds, "datasets"):  # BlendedDataset
        return {"lengths": [len(d) for d in ds.datasets]}
    prefix = getattr(getattr(ds, "dataset", None), "path_prefix", None)
    try:
        return {"bin": os.path.getsize(get_bin_path(prefix)),
                "idx": os.path.getsize(get_idx_path(prefix))} if prefix else None  # fmt: skip
    except OSError:
        return None


def stale(final: str, name: str, now: dict | None) -> str | None:
    """Why the cached indices ``name`` in ``final`` were built from other data than ``now``
    (None: the same, or not known)."""
    try:
        with open(os.path.join(final, name + SOURCE)) as f:
            then = json.load(f)
    except (OSError, ValueError):
        return None
    if now is None or then == now:
        return None
    return f"built from {then}, the data now {now}"


def builder() -> str:
    """This process as a build directory names it: host, boot, PID namespace and pid (a pid
    alone means nothing on another host, after a reboot, or in another container)."""

    def read(f, link=False):
        try:
            return os.readlink(f) if link else open(f).read()
        except OSError:
            return ""

    boot = read("/proc/sys/kernel/random/boot_id").strip()[:8]
    ns = "".join(c for c in read("/proc/self/ns/pid", link=True) if c.isdigit())
    return f"building-{socket.gethostname()}-{boot}-{ns}-{os.getpid()}"


def remove_stale(final: str, me: str) -> None:
    """Remove the build directories in ``final`` that a process of this host, boot and PID
    namespace left when it was killed; another's are left alone."""
    mine = me.rsplit("-", 1)[0] + "-"
    for entry in os.listdir(final):
        pid = entry.rsplit("-", 1)[-1]
        if entry.startswith(".") and entry.endswith(mine + pid) and pid.isdigit() and gone(pid):
            shutil.rmtree(os.path.join(final, entry), ignore_errors=True)


def gone(pid: str) -> bool:
    """Whether no process runs as ``pid`` but this one (a process builds one index at a time)."""
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process
        pass
    return False


def builds_here() -> bool:
    """megatron's rank that builds on a miss (rank 0, or a lone process)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def atomic_build(orig, run=None):
    """Wrap an index builder (``GPTDataset._build_document_sample_shuffle_indices``,
    ``BlendedDataset._build_indices``): a miss on the building rank is built into a private
    directory and renamed into the cache; a hit, another rank, or no cache: megatron's own."""

    @functools.wraps(orig)
    def build(self):
        cfg = self.config
        final = cache_dir(self)
        if final is None or cfg.defer_npy_index_mmap or cfg.fast_cache_load or not builds_here():
            return orig(self)
        name = stem(self)
        now, why = source(self), None
        if os.path.isfile(os.path.join(final, name + DESCRIPTION)):
            why = stale(final, name, now)
            if why is None:
                return orig(self)  # a hit (megatron checks the other files)
            print(f"[megatron-md] dataset cache {os.path.join(final, name)}*: {why}; building "
                  "it again", flush=True)  # fmt: skip
        me = builder()
        tmp = os.path.join(final, f".{name}{me}")
        try:
            os.makedirs(final, exist_ok=True)
            remove_stale(final, me)
            os.mkdir(tmp)
        except OSError as e:
            errors.fail(
                f"dataset cache {final}: {type(self).__name__}'s indices for this run "
                f"({name}*) are not there{' for this data' if why else ''}, and it cannot be "
                f"written ({e.strerror}): give --data-cache-path a directory this job can write"
            )
        try:
            self.config = copy.copy(cfg)  # this instance's: train/valid/test share cfg
            self.config.path_to_cache = tmp
            try:
                out = orig(self)
            finally:
                self.config = cfg
            written = sorted(os.listdir(tmp))
            if name + DESCRIPTION not in written:
                raise RuntimeError(
                    f"megatron-md's seam into megatron-core's dataset cache no longer fits: "
                    f"{type(self).__name__} wrote {written} to its cache, not {name}{DESCRIPTION} "
                    "(megatron/md/train/datacache.py, written against 0.19.2)"
                )
            written.remove(name + DESCRIPTION)
            if now is not None:
                with open(os.path.join(tmp, name + SOURCE), "w") as f:
                    json.dump(now, f)
                written.append(name + SOURCE)
            for f in [*written, name + DESCRIPTION]:  # the description last: then a hit
                os.replace(os.path.join(tmp, f), os.path.join(final, f))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out

    return build
