"""The test session's page keeper (tests/_pagekeep.py), run as conftest runs it: a listed file
is locked whole, a process's libraries only where they are in memory, and where it may not
lock it says so and ends."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

KEEPER = Path(__file__).with_name("_pagekeep.py")
MIB = 1 << 20


def locked_kib(pid: int) -> dict[str, tuple[int, int]]:
    """(size, locked) in KiB of each file the keeper ``pid`` maps, from /proc/PID/smaps: its
    pages in memory (Rss), which only locking put there (it reads none; smaps' own "Locked"
    is a share of the pages other processes map too)."""
    out: dict[str, tuple[int, int]] = {}
    path = None
    for line in open(f"/proc/{pid}/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 6:  # a mapping's first line
            path = fields[5]
        elif fields[0] in ("Size:", "Rss:") and path is not None:
            size, locked = out.get(path, (0, 0))
            n = int(fields[1])
            out[path] = (size + n, locked) if fields[0] == "Size:" else (size, locked + n)
    return out


def wait_for_line(log: Path, proc: subprocess.Popen) -> str:
    deadline = time.time() + 60
    while not (log.exists() and log.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.poll()
        time.sleep(0.2)
    return log.read_text().splitlines()[0]


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and mlock: Linux only")
def test_listed_files_whole_and_libraries_as_far_as_in_memory(tmp_path):
    data = tmp_path / "module.pyc"
    with open(data, "wb") as f:
        f.write(os.urandom(8 * MIB))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # out of memory
    (tmp_path / "list").write_text(f"{data}\n{tmp_path / 'gone.pyc'}\n")
    cmd = [sys.executable, str(KEEPER), str(tmp_path / "log"), str(tmp_path / "list"),
           str(os.getpid())]  # fmt: skip
    proc = subprocess.Popen(cmd)
    try:
        line = wait_for_line(tmp_path / "log", proc)
        if line.startswith("cannot keep"):
            pytest.skip(line)  # (not root and a small `ulimit -l`: what the session then prints)
        kept = locked_kib(proc.pid)
        assert kept[str(data)] == (8 * 1024, 8 * 1024), line  # read from disk for it
        # this process's libraries (torch's: ~1.3 GB of ~3 GB of files in memory after its
        # import), only as far as they are in memory: none whole, none nothing (seen: 1.4 GB)
        lib = str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")
        assert 0 < kept[lib][1] < kept[lib][0], kept[lib]
        assert str(tmp_path / "gone.pyc") not in kept
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and mlock: Linux only")
def test_a_keeper_that_may_not_lock_says_so_and_ends(tmp_path):
    """No CAP_IPC_LOCK (root's dropped with setpriv) and `ulimit -l 0`."""
    (tmp_path / "list").write_text(f"{KEEPER}\n")
    cmd = ["prlimit", "--memlock=0", sys.executable, str(KEEPER), str(tmp_path / "log"),
           str(tmp_path / "list"), str(os.getpid())]  # fmt: skip
    if os.geteuid() == 0:
        cmd = ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "log").read_text()
    assert text.startswith("cannot keep pages in memory: mlock: ") and "ulimit -l 0 KiB" in text
