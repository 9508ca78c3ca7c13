"""The test session's page keeper (tests/_pagekeep.py), run as conftest runs it: a listed file
is locked whole, a process's libraries only where they are in memory, and where it may not
lock it says so and ends."""

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import _pagekeep
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
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line (anonymous: 5)
            path = fields[5] if len(fields) >= 6 else None
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


def written(path: Path, mib: int, out_of_memory: slice) -> Path:
    """``mib`` MiB of random bytes on disk, the pages of ``out_of_memory`` (in MiB) dropped
    from memory (the others stay as the write left them)."""
    with open(path, "wb") as f:
        f.write(os.urandom(mib * MIB))
        f.flush()
        os.fsync(f.fileno())  # clean pages: dropped when asked
        lo, hi = out_of_memory.start * MIB, out_of_memory.stop * MIB
        os.posix_fadvise(f.fileno(), lo, hi - lo, os.POSIX_FADV_DONTNEED)
    return path


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and mlock: Linux only")
def test_listed_files_whole_and_libraries_as_far_as_in_memory(tmp_path):
    listed = written(tmp_path / "module.pyc", 8, slice(0, 8))
    # a "library" this process maps code from, its first 4 MiB in memory (a 2 MiB boundary:
    # the page cache drops whole folios, up to 2 MiB)
    lib = written(tmp_path / "lib.so", 8, slice(4, 8))
    fd = os.open(lib, os.O_RDONLY)
    code = mmap.mmap(fd, 0, prot=mmap.PROT_READ | mmap.PROT_EXEC)  # (no page touched)
    (tmp_path / "list").write_text(f"{listed}\n{tmp_path / 'gone.pyc'}\n")
    cmd = [sys.executable, str(KEEPER), str(tmp_path / "log"), str(tmp_path / "list"),
           str(os.getpid())]  # fmt: skip
    proc = subprocess.Popen(cmd)
    try:
        line = wait_for_line(tmp_path / "log", proc)
        if line.startswith("cannot keep"):
            pytest.skip(line)  # (not root and a small `ulimit -l`: what the session then prints)
        kept = locked_kib(proc.pid)
        assert kept[str(listed)] == (8 * 1024, 8 * 1024), line  # read from disk for it
        assert kept[str(lib)] == (8 * 1024, 4 * 1024), line  # what was in memory, no more
        assert str(tmp_path / "gone.pyc") not in kept
        # and torch's libraries, as far as they are in memory (~1.4 GB after its import)
        torch_cpu = str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")
        assert kept[torch_cpu][1] > 0, line
        # what the session's summary prints (tests/conftest.py): at least the 8 + 4 MiB
        said = _pagekeep.said(str(tmp_path / "log"))
        assert said.endswith(" MiB kept in memory") and int(said.split()[0]) >= 12, said
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        code.close()
        os.close(fd)


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
    assert _pagekeep.said(str(tmp_path / "log")) == text.strip()
