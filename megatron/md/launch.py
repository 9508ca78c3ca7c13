"""Command lines: launching a script under torchrun on this machine (the one command builder
the tests, the tools and the demo share; multi-node launches are the SLURM launcher's,
examples/), and reading a flag's value back from one."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def free_port() -> int:
    """A free local TCP port for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str | Path, nproc: int, args=(), port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run`` of ``script`` with ``nproc`` local processes."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={port or free_port()}", str(script), *map(str, args)]  # fmt: skip


def flag_value(argv: list[str], flag: str) -> str | None:
    """The last value given for ``flag`` (``--flag=V`` or ``--flag V``: argparse's rule)."""
    found = None
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            found = a.split("=", 1)[1]
        elif a == flag and i + 1 < len(argv):
            found = argv[i + 1]
    return found
