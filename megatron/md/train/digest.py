"""Checksums of a checkpoint's files, which neither megatron nor torch's distributed checkpoint
keeps: a flipped block inside a shard of the right size otherwise loads without a word.

After each torch_dist save every rank computes the CRC-32 of the files it wrote (its
``__<rank>_*.distcp`` shards; rank 0 also the metadata and common state) in a background
thread, overlapping training, and writes ``md_checksums.<rank>.json`` beside them; the next save
and the end of the run wait for it. At load the files are checked (each rank a share of them)
before megatron reads anything: a mismatch names the shard and nothing is loaded. A checkpoint
without checksums (saved by other code, or a run stopped before its thread finished) loads
with a note. ``--no-ckpt-checksums`` turns both off. Cost: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import zlib

from megatron.md.train import files as files_

PREFIX = "md_checksums."
CHUNK = 16 << 20
_pending: list[threading.Thread] = []


def crc32(path: str) -> int:
    """CRC-32 of a file (zlib: fast, and it releases the GIL, so the thread overlaps)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


def own_files(path: str, rank: int) -> list[str]:
    """The files of checkpoint ``path`` that ``rank`` wrote: its shards; rank 0 everything else
    too (metadata, common state)."""
    mine = []
    for name in sorted(os.listdir(path)):
        if name.startswith(PREFIX) or os.path.isdir(os.path.join(path, name)):
            continue
        if name.startswith("__") and name.endswith(".distcp"):
            if name.split("_")[2] == str(rank):
                mine.append(name)
        elif rank == 0:
            mine.append(name)
    return mine


def _write(path: str, rank: int) -> None:
    t0 = time.perf_counter()
    out = os.path.join(path, f"{PREFIX}{rank}.json")
    try:
        files = {n: [os.path.getsize(os.path.join(path, n)), crc32(os.path.join(path, n))]
                 for n in own_files(path, rank)}  # fmt: skip
        seconds = time.perf_counter() - t0
        files_.write_whole(out, json.dumps(
            {"algorithm": "crc32", "files": files, "seconds": round(seconds, 3)}))  # fmt: skip
    except OSError as e:  # a full disk, say: the checkpoint itself is complete
        msg = (f"[megatron-md] rank {rank}: the checksums of {path} were not written ({e}); "
               "the checkpoint is complete and loads without their check")  # fmt: skip
        print(msg, file=sys.stderr, flush=True)


def wait() -> None:
    """Wait for the checksums of the last save (before the next one, and at the end)."""
    while _pending:
        _pending.pop().join()


def write_after_save(path: str, rank: int) -> None:
    """Start this rank's checksums of the checkpoint just saved at ``path``."""
    wait()
    t = threading.Thread(target=_write, args=(path, rank), name="md-checksums")
    t.start()
    _pending.append(t)


def recorded(path: str) -> dict[str, tuple[int, int]]:
    """file name -> (size, CRC-32) from every checksum file of checkpoint ``path``."""
    out = {}
    for name in os.listdir(path):
        if name.startswith(PREFIX) and name.endswith(".json"):
            with open(os.path.join(path, name)) as f:
                out.update({k: tuple(v) for k, v in json.load(f)["files"].items()})
    return out


def mismatches(path: str, rank: int = 0, world: int = 1) -> tuple[list[str], int]:
    """(the files of checkpoint ``path`` whose size or CRC-32 differ from the recorded ones,
    this rank's share: every ``world``-th file; the number of shards with no checksum)."""
    rec = recorded(path)
    names = sorted(n for n in os.listdir(path)
                   if n.endswith(".distcp") or n in (".metadata", "common.pt"))  # fmt: skip
    unrecorded = sum(n not in rec for n in names)
    bad = []
    for i, name in enumerate(sorted(rec)):
        if i % world != rank:
            continue
        f = os.path.join(path, name)
        size, crc = rec[name]
        if not os.path.isfile(f):
            bad.append(f"{name} is missing")
        elif os.path.getsize(f) != size:
            bad.append(f"{name} is {os.path.getsize(f)} bytes, {size} when saved")
        elif crc32(f) != crc:
            bad.append(f"{name} does not match its checksum (CRC-32 {crc:08x} when saved)")
    return bad, unrecorded


def verify(path: str) -> None:
    """Check checkpoint ``path`` against its checksums (each rank a share, agreed over the
    ranks); a mismatch is a refusal naming the shard."""
    import torch.distributed as dist

    from megatron.md import errors

    on = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    bad, unrecorded = mismatches(path, rank, world)
    if on and world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, bad)
        bad = [b for part in everyone for b in part]
    if bad:
        errors.fail(
            f"--load: checkpoint {path}: {bad[0]}"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            + ": the file changed after it was saved (a copy or a disk corrupted it); nothing "
            "was loaded. Resume an earlier checkpoint with --ckpt-step N"
        )
    if unrecorded and rank == 0:
        print(f"[megatron-md] {path}: {unrecorded} file(s) without a checksum (saved without "
              "them, or the run stopped before they were written): not verified",
              flush=True)  # fmt: skip
