"""``--save`` is one directory for every node of the job, checked before the first iteration.

megatron-core writes a torch_dist checkpoint from every rank into ``--save`` on the rank's own
node: rank 0 the metadata and the tracker, each rank its shard. A ``--save`` on a node-local
disk (``/tmp``, ``$TMPDIR``, a local scratch) in a job of several nodes saves without an error,
each node its own shards, and the first resume finds a checkpoint with shards missing, after
the job has ended and its nodes' local disks may have been wiped: the run's work is lost. Here
rank 0 writes a file of a name drawn for this launch in ``--save``; the first rank of each node
looks for it there; a node that does not see it stops the run, named, before any training.
"""

from __future__ import annotations

import os
import secrets
import socket

import torch

from megatron.md import errors
from megatron.md.train import nodes

PREFIX = ".megatron-md-shared-"


def check(save: str | None) -> None:
    """On every rank, after ``torch.distributed`` is set up (a collective): refuse a ``--save``
    that some node does not share with rank 0."""
    dist = torch.distributed
    if not save or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    name = [PREFIX + secrets.token_hex(8) if rank == 0 else None]
    if rank == 0:  # written before its name is sent: the broadcast is the only wait needed
        os.makedirs(save, exist_ok=True)
        with open(os.path.join(save, name[0]), "w") as f:
            f.write(f"rank 0 on {socket.gethostname()}\n")
    dist.broadcast_object_list(name, src=0)
    probe = os.path.join(save, name[0])
    first_here = int(os.environ.get("LOCAL_RANK", "0")) == 0  # one look per node
    seen = os.path.exists(probe) if first_here else True
    views = nodes.gather(seen)
    if rank == 0:
        os.remove(probe)
    blind = {}
    for r, (host, ok) in enumerate(views):
        if not ok:
            blind.setdefault(host, r)
    if blind:
        who = ", ".join(f"rank {r} on {host}" for host, r in blind.items())
        errors.fail(
            f"--save {save} is not one directory for every node: {who} cannot see the file "
            f"rank 0 on {views[0][0]} wrote there (a node-local disk such as /tmp?). megatron "
            "would save each node's checkpoint shards on that node, and the checkpoint could "
            "not be loaded: give --save a directory on a file system every node shares"
        )
