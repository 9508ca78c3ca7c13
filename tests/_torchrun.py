"""Run a tests/distributed script under torchrun (gloo, CPU) and return its JSON line."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

DIST = Path(__file__).parent / "distributed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, *args: str, expect_fail: bool = False):
    """The script's last JSON line; with ``expect_fail``, its combined output (it must fail)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={_free_port()}",
        str(DIST / script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if expect_fail:
        assert out.returncode != 0, out.stdout[-3000:]
        return out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-5000:]
    return json.loads(lines[-1])
