"""``--save`` and the run's logs are one directory for every node, checked before the first
iteration.

megatron-core writes a torch_dist checkpoint from every rank into ``--save`` on the rank's own
node: rank 0 the metadata and the tracker, each rank its shard. A ``--save`` on a node-local
disk (``/tmp``, ``$TMPDIR``, a local scratch) in a job of several nodes saves without an error,
each node its own shards, and the first resume finds a checkpoint with shards missing, after
the job has ended and its nodes' local disks may have been wiped: the run's work is lost. The
logs (``--metrics-file``, ``--tensorboard-dir``, offline wandb's ``--wandb-save-dir``) are
written by the last rank alone, on its node: on a node-local disk they stayed there, out of
sight of the node the run was looked at from, and went with it. Here rank 0 writes a file of a
name drawn for this launch in each of those directories; the first rank of each node looks for
them; a node that does not see one stops the run, named, before any training.
"""

from __future__ import annotations

import os
import secrets
import socket

import torch

from megatron.md import errors
from megatron.md.train import nodes

PREFIX = ".megatron-md-shared-"


def log_dirs(args) -> list[tuple[str, str]]:
    """(flag, directory) of each log the last rank writes, as megatron and metrics.py pick
    them (megatron: training/global_vars.py, ``_set_tensorboard_writer``, ``_set_wandb_writer``;
    wandb's default is under ``--save``, checked with it, and its directory matters only
    offline: online, its runs are on wandb's server)."""
    from megatron.md.train import metrics

    out = [("--metrics-file", os.path.dirname(os.path.abspath(metrics.file_of(args))))]
    if getattr(args, "tensorboard_dir", None):
        out.append(("--tensorboard-dir", args.tensorboard_dir))
    offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun")  # online: wandb has them
    if offline and getattr(args, "wandb_project", None) and getattr(args, "wandb_save_dir", None):
        out.append(("--wandb-save-dir", args.wandb_save_dir))
    return out


def check(save: str | None, logs: list[tuple[str, str]] = ()) -> None:
    """On every rank, after ``torch.distributed`` is set up (a collective): refuse a ``--save``,
    or a directory of ``logs`` (``log_dirs``), that some node does not share with rank 0."""
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    dirs: dict[str, str] = {}  # directory -> the flag that names it (the first)
    for flag, d in ([("--save", save)] if save else []) + list(logs):
        dirs.setdefault(os.path.abspath(d), flag)
    if not dirs:
        return
    rank = dist.get_rank()
    name = [PREFIX + secrets.token_hex(8) if rank == 0 else None, None]  # (name, rank 0's error)
    written = []
    if rank == 0:  # written before its name is sent: the broadcast is the only wait needed
        for d, flag in dirs.items():
            try:
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, name[0]), "w") as f:
                    f.write(f"rank 0 on {socket.gethostname()}\n")
                written.append(d)
            except OSError as e:  # (every rank stops on it: none waits on the others)
                name[1] = f"{flag} {d} cannot be written ({e.strerror or e})"
                break
    dist.broadcast_object_list(name, src=0)
    if name[1]:
        for d in written:
            os.remove(os.path.join(d, name[0]))
        errors.fail(name[1])
    first_here = int(os.environ.get("LOCAL_RANK", "0")) == 0  # one look per node
    seen = [not first_here or os.path.exists(os.path.join(d, name[0])) for d in dirs]
    views = nodes.gather(seen)
    if rank == 0:
        for d in dirs:
            os.remove(os.path.join(d, name[0]))
    for i, (d, flag) in enumerate(dirs.items()):
        blind = {}
        for r, (host, ok) in enumerate(views):
            if not ok[i]:
                blind.setdefault(host, r)
        if blind:
            who = ", ".join(f"rank {r} on {host}" for host, r in blind.items())
            errors.fail(
                f"{flag} {save if flag == '--save' else d} is not one directory for every node:"
                f" {who} cannot see the file rank 0 on {views[0][0]} wrote there (a node-local "
                f"disk such as /tmp?). {_loss(flag, views[-1][0])}: give {flag} a directory "
                "on a file system every node shares"
            )


def _loss(flag: str, last_host: str) -> str:
    if flag == "--save":
        return ("megatron would save each node's checkpoint shards on that node, and the "
                "checkpoint could not be loaded")  # fmt: skip
    return (f"The run's last rank, on {last_host}, writes its logs there: they would stay on "
            "that node's disk alone")  # fmt: skip
