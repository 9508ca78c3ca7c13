"""Command lines: launching a script in several processes on this machine (the one command
builder the tests, the tools and the demo share; cluster launches are the SLURM launcher's
torchrun, examples/), and reading a flag's value back from one."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def free_port() -> int:
    """A free local TCP port for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ranks(script: str | Path, nproc: int, args=(), port: int | None = None) -> list[str]:
    """``script`` in ``nproc`` local processes with torchrun's worker variables, started by
    ``localrun.py`` (torchrun's job on one machine, without its agent's ~2 s start)."""
    return [sys.executable, str(Path(__file__).with_name("localrun.py")), str(nproc),
            str(port or free_port()), str(script), *map(str, args)]  # fmt: skip


def flag_value(argv: list[str], flag: str) -> str | None:
    """The last value given for ``flag`` (``--flag=V`` or ``--flag V``: argparse's rule)."""
    found = None
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            found = a.split("=", 1)[1]
        elif a == flag and i + 1 < len(argv):
            found = argv[i + 1]
    return found
