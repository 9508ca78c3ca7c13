"""What each rank's node sees, gathered for the checks that compare nodes with rank 0's."""

from __future__ import annotations

import socket

import torch


def gather(value) -> list[tuple[str, object]]:
    """Every rank's (host name, ``value``), in rank order (a collective, on every rank)."""
    views: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(views, (socket.gethostname(), value))
    return views
