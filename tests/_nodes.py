"""Two "nodes" on one machine: rank 1 runs in its own mount namespace, where an empty tmpfs is
mounted over a path (then filled by a shell command, if given): the same path, another
directory, as a node-local disk (``/tmp``, ``$TMPDIR``, local scratch) is. Needs root and
util-linux's ``unshare`` (``NODES``: the skip mark)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.md.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
NODES = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a node-local directory (a mount namespace) needs root and util-linux's unshare",
)


def ranks(local: Path, argv: list[str], node_local: bool, fill: str = "",
          kill_on_bad_exit: bool = False) -> list[subprocess.CompletedProcess]:  # fmt: skip
    """``argv`` (after ``python``) as 2 ranks in ``local``'s parent; rank 1 the first rank of a
    second node where ``local`` is its own tmpfs (``node_local``), into which the shell command
    ``fill`` (``$0`` is ``local``) puts what that node's disk holds; else rank 1 of the same
    node. ``kill_on_bad_exit``: rank 1 failing kills rank 0, as ``srun --kill-on-bad-exit``
    ends the other nodes' torchrun (else rank 0 waits for it at the rendezvous)."""
    local.mkdir(parents=True, exist_ok=True)  # (the mount point)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = []
    for r in (0, 1):
        cmd = [sys.executable, *argv]
        if r == 1 and node_local:
            mount = 'mount -t tmpfs tmpfs "$0" && ' + (f"{fill} && " if fill else "")
            cmd = ["unshare", "-m", "sh", "-c", mount + 'exec "$@"', str(local), *cmd]
        here = "0" if node_local else str(r)
        procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": here},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, cwd=local.parent))  # fmt: skip
    outs = []
    if kill_on_bad_exit and procs[1].wait(timeout=300) != 0:
        procs[0].kill()
    for p in procs:
        out, err = p.communicate(timeout=300)
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs
