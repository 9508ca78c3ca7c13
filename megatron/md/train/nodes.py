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


def unlike_rank0(mine: dict) -> list[tuple[str, list[tuple]]]:
    """Every rank's (host name, [(key, its value, rank 0's)] where its ``mine`` differs from
    rank 0's at a key both hold, in rank 0's key order), in rank order (a collective, on every
    rank). Rank 0's dict
    goes to every rank and each compares where it is: a gather of every rank's whole dict
    would send each rank the whole job's."""
    ref = [mine if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(ref, src=0)
    return gather([(k, mine[k], v) for k, v in ref[0].items() if mine.get(k, v) != v])


@functools.cache
def source_digest() -> str:
    """SHA-1 of megatron-md's own source (every ``.py`` under ``megatron/md``, with its path)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


#: the packages whose imported modules' source is compared: a git checkout installed in place
#: reports its release's version at every commit, so equal versions can run other code
SOURCE_PACKAGES = ("megatron.core", "megatron.training", "emerging_optimizers")


def module_digests() -> dict[str, str]:
    """SHA-1 (12 hex digits) of the source file of each module of ``SOURCE_PACKAGES`` this
    process has imported (the code that runs; the files are in the page cache: ~30 ms for
    megatron-core's ~370 modules of a training run)."""
    out = {}
    for name, module in list(sys.modules.items()):
        if not any(name == p or name.startswith(p + ".") for p in SOURCE_PACKAGES):
            continue
        path = getattr(module, "__file__", None)
        if path and path.endswith(".py"):
            try:
                out[name] = hashlib.sha1(Path(path).read_bytes()).hexdigest()[:12]
            except OSError:
                pass
    return out


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
    # one exchange for both: software() has every key on every rank; a module one side has
    # not imported is not compared
    views = unlike_rank0({**software(), **{(m,): d for m, d in module_digests().items()}})
    host0 = views[0][0]
    for rank, (host, unlike) in enumerate(views):
        diff = [f"{k} {mine} (rank 0: {v})" for k, mine, v in unlike if isinstance(k, str)]
        modules = sorted(k[0] for k, _, _ in unlike if isinstance(k, tuple))
        if modules:
            more = f" and {len(modules) - 3} more" if len(modules) > 3 else ""
            diff.append(f"the source of {', '.join(modules[:3])}{more} (not rank 0's: the "
                        "same versions from another checkout?)")  # fmt: skip
        if diff:
            errors.fail(
                f"rank {rank} on {host} runs other software than rank 0 on {host0}: "
                f"{'; '.join(diff)}. Its ranks would compute other steps than rank 0's without "
                "a word: give every node the same environment and checkout"
            )
