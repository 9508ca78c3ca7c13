"""What each rank's node sees, gathered for the checks that compare nodes with rank 0's."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import socket
import sys
from pathlib import Path

import torch

from megatron.md import errors

#: the distributions whose code a step runs (transformer-engine and apex where installed;
#: importlib.metadata matches a name with "-" or "_" alike)
PACKAGES = ("torch", "megatron-core", "emerging-optimizers", "transformer-engine", "apex", "numpy")


def gather(value) -> list[tuple[str, object]]:
    """Every rank's (host name, ``value``), in rank order (a collective, on every rank)."""
    views: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(views, (socket.gethostname(), value))
    return views


@functools.cache
def source_digest() -> str:
    """SHA-1 of megatron-md's own source (every ``.py`` under ``megatron/md``, with its path)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


def software() -> dict[str, str | None]:
    """Python's version, each of ``PACKAGES``' installed version, and ``source_digest``."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["megatron-md source"] = source_digest()
    return out


def check_same_software() -> None:
    """Every rank runs rank 0's software (a collective, on every rank, after ``torch.distributed``
    is set up). A node with its own environment or checkout (a venv or repository on its local
    disk, a container image pulled at another time) ran other code without a word: its ranks'
    shards of the step computed otherwise than rank 0's, and the model became a mix."""
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    views = gather(software())
    host0, ref = views[0]
    for rank, (host, mine) in enumerate(views):
        diff = [f"{k} {mine.get(k)} (rank 0: {v})" for k, v in ref.items() if mine.get(k) != v]
        if diff:
            errors.fail(
                f"rank {rank} on {host} runs other software than rank 0 on {host0}: "
                f"{'; '.join(diff)}. Its ranks would compute other steps than rank 0's without "
                "a word: give every node the same environment and checkout"
            )
