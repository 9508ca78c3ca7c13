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
lengths); a cache whose note differs from the data is built again, said by the rank that
builds it. A cache without the note (built by megatron alone) is used as it is.

megatron builds a miss on rank 0 only; a node that does not see rank 0's cache (a node-local
one) builds its own, once (``atomic_build``).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import json
import os
import shutil
import socket

import numpy as np
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


#: the files of a cache hit, after the stem (gpt_dataset.py:480, blended_dataset.py:138)
FILES = {
    "GPTDataset": ("document_index.npy", "sample_index.npy", "shuffle_index.npy"),
    "BlendedDataset": ("dataset_index.npy", "dataset_sample_index.npy"),
}


def cached(ds, final: str, name: str) -> bool:
    """Whether every file megatron counts for a hit of ``ds``'s indices is in ``final``."""
    kind = "BlendedDataset" if hasattr(ds, "datasets") else "GPTDataset"
    return all(os.path.isfile(os.path.join(final, name + f)) for f in (DESCRIPTION, *FILES[kind]))


@contextlib.contextmanager
def node_lock(final: str, name: str):
    """Held by one process of this node at a time (``flock`` on ``.<name>lock`` in the cache):
    the ranks of a node that all miss build once. Without locks (a Lustre mount without
    ``flock``) each builds, which is safe, only slower."""
    try:
        fd = os.open(os.path.join(final, f".{name}lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)


def atomic_build(orig, run=None):
    """Wrap an index builder (``GPTDataset._build_document_sample_shuffle_indices``,
    ``BlendedDataset._build_indices``): a miss is built into a private directory and renamed
    into the cache; a hit, or no cache: megatron's own.

    megatron builds a miss on rank 0 only; the other ranks, after a barrier, load the files,
    and a rank whose node does not see rank 0's cache (the default cache beside a corpus copied
    to each node's local disk, or a node-local ``--data-cache-path``) stopped there with a
    FileNotFoundError, after the model was built and the checkpoint loaded (reproduced: 2 ranks,
    the second with its own empty cache directory). Here such a rank builds the indices in its
    own node's cache, once per node; the build is deterministic (the data, the settings, the
    seed), so every node reads what rank 0 reads. The same holds for a node-local cache built
    from other data (its note differs)."""

    @functools.wraps(orig)
    def build(self):
        cfg = self.config
        final = cache_dir(self)
        if final is None or cfg.defer_npy_index_mmap or cfg.fast_cache_load:
            return orig(self)
        name, now = stem(self), source(self)
        if builds_here():
            why = None
            if os.path.isfile(os.path.join(final, name + DESCRIPTION)):
                why = stale(final, name, now)
                if why is None:
                    return orig(self)  # a hit (megatron checks the other files)
                print(f"[megatron-md] dataset cache {os.path.join(final, name)}*: {why}; "
                      "building it again", flush=True)  # fmt: skip
            return whole(self, orig, final, name, now, why)
        if cached(self, final, name) and stale(final, name, now) is None:
            return orig(self)
        writable(self, final, name, None)
        with node_lock(final, name):  # the node's first rank builds; the others then hit
            if cached(self, final, name) and stale(final, name, now) is None:
                return orig(self)
            why = stale(final, name, now)
            print(f"[megatron-md] dataset cache {os.path.join(final, name)}*: "
                  f"{why or 'not there'} on {socket.gethostname()}, where rank "
                  f"{torch.distributed.get_rank()} reads it (rank 0's is another: a cache on "
                  "a node-local disk?); building it on this node (a --data-cache-path every "
                  "node shares is built once)", flush=True)  # fmt: skip
            return whole(self, orig, final, name, now, why)

    return build


def writable(ds, final: str, name: str, why: str | None, me: str | None = None) -> str | None:
    """Make ``final`` and, for the builder ``me``, its private build directory there (this
    host's killed builds' removed first), or stop the run naming the cache that this run misses
    and cannot write (said by rank 0 and each other node's first rank: errors.say)."""
    try:
        os.makedirs(final, exist_ok=True)
        if me is None:
            return None
        remove_stale(final, me)
        tmp = os.path.join(final, f".{name}{me}")
        os.mkdir(tmp)
        return tmp
    except OSError as e:
        errors.fail(
            f"dataset cache {final}: {type(ds).__name__}'s indices for this run ({name}*) are "
            f"not there{' for this data' if why else ''}, and it cannot be written "
            f"({e.strerror}): give --data-cache-path a directory this job can write",
            node=True,
        )


def whole(ds, orig, final: str, name: str, now: dict | None, why: str | None):
    """``orig`` builds ``ds``'s indices into a private directory, then each file is renamed
    into ``final``, the description last (then megatron counts a hit). megatron writes the files
    on rank 0; on another rank it builds only without a cache (``path_to_cache`` ``""``), and
    the files are written here as megatron writes them (gpt_dataset.py:603,
    blended_dataset.py:201)."""
    tmp = writable(ds, final, name, why, builder())
    cfg = ds.config
    try:
        ds.config = copy.copy(cfg)  # this instance's: train/valid/test share cfg
        ds.config.path_to_cache = tmp if builds_here() else ""
        try:
            out = orig(ds)
        finally:
            ds.config = cfg
        if not builds_here():
            write(ds, tmp, name, out)
        written = sorted(os.listdir(tmp))
        if name + DESCRIPTION not in written:
            raise RuntimeError(
                f"megatron-md's seam into megatron-core's dataset cache no longer fits: "
                f"{type(ds).__name__} wrote {written} to its cache, not {name}{DESCRIPTION} "
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


def write(ds, tmp: str, name: str, out) -> None:
    """Write the indices ``out`` that megatron built without a cache into ``tmp``, as its rank 0
    writes them."""
    files = FILES["BlendedDataset" if hasattr(ds, "datasets") else "GPTDataset"]
    if not (isinstance(out, tuple) and len(out) == len(files)):
        raise RuntimeError(
            f"megatron-md's seam into megatron-core's dataset cache no longer fits: "
            f"{type(ds).__name__}'s index builder returned {type(out).__name__}, not the "
            f"{len(files)} arrays {files} (megatron/md/train/datacache.py, written against 0.19.2)"
        )
    for f, array in zip(files, out):
        np.save(os.path.join(tmp, name + f), array, allow_pickle=True)
    with open(os.path.join(tmp, name + DESCRIPTION), "wt") as f:
        f.write(ds.unique_description)
