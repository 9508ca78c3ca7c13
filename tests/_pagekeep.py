"""``python tests/_pagekeep.py LOG LIST PID...``: keeps the files the test session's processes
have read in memory while the session runs (started by tests/conftest.py).

The 2-core VM type the suite is timed on pages out every page nobody touched for about a
minute, with most of its memory free (DAMON's proactive reclaim, ``/sys/kernel/mm/damon``: a
``pageout`` scheme for regions idle 12 aggregations of 5 s). A process that imports torch
after such a minute reads the ~1 GB of library pages the import touches back from the disk at
a few MB/s: a fresh ``python -c "import torch"`` took 37-59 s instead of 4.6 s (torch 2.15.0,
2026-12-02), and every SLURM job, process started afresh and rank forked after a pause paid
some of it. A page locked in memory (``mlock``) is never paged out, so this process locks
(standard library only, no import of torch):

- the pages of every file PID maps (the shared libraries the imports loaded) that are in
  memory, looked at again every ``PERIOD_S`` (ranks forked from the fork server run library
  code the import did not touch);
- the whole of every file named in LIST, one path a line (the Python modules the test process
  imported; read again when LIST changes).

With those locked, a fresh ``import torch`` after two idle minutes took 4.6 s. It keeps at most
``MAX_BYTES`` and stops when the PIDs have ended or its parent has. Where it cannot lock (not
root and a small ``ulimit -l``), it says so in LOG and ends: the tests run as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import sys
import time

from megatron.md.localrun import die_with_parent  # (standard library only)

PERIOD_S = 15.0
MAX_BYTES = 4 << 30
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]  # fmt: skip
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class CannotLock(Exception):
    pass


class Kept:
    """One file mapped read-only and shared (its page-cache pages, whoever read them), and
    which of its pages are locked."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            addr = _libc.mmap(None, self.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        self.addr = addr
        self.locked = bytearray((self.size + PAGE - 1) // PAGE)

    def lock(self, first: int, end: int) -> int:
        """Lock pages [first, end); the bytes newly locked."""
        length = min(end * PAGE, self.size) - first * PAGE
        if _libc.mlock(self.addr + first * PAGE, length) != 0:
            err = ctypes.get_errno()
            raise CannotLock(f"mlock: {os.strerror(err)} (ulimit -l {_memlock_limit()})")
        self.locked[first:end] = b"\1" * (end - first)
        return length

    def lock_resident(self) -> int:
        """Lock the pages in memory now that are not locked yet."""
        n = len(self.locked)
        vec = ctypes.create_string_buffer(n)
        if _libc.mincore(self.addr, self.size, vec) != 0:
            return 0
        resident, got, i = vec.raw, 0, 0
        while i < n:
            if resident[i] & 1 and not self.locked[i]:
                j = i
                while j < n and resident[j] & 1 and not self.locked[j]:
                    j += 1
                got += self.lock(i, j)
                i = j
            else:
                i += 1
        return got

    def lock_all(self) -> int:
        return self.lock(0, len(self.locked)) if self.size and not all(self.locked) else 0


def _memlock_limit() -> str:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"


def mapped_libraries(pid: int) -> set[str]:
    """The files ``pid`` maps code from (its shared libraries), none deleted since; not the
    data files it maps."""
    try:
        lines = open(f"/proc/{pid}/maps").read().splitlines()
    except OSError:
        return set()
    fields = [ln.split(None, 5) for ln in lines]
    return {f[5] for f in fields if len(f) == 6 and "x" in f[1] and f[5].startswith("/")
            and not f[5].endswith(" (deleted)")}  # fmt: skip


class Keeper:
    def __init__(self, listing: str, pids: list[int]):
        self.listing, self.pids = listing, pids
        self.files: dict[str, Kept | None] = {}  # None: cannot be mapped (gone, empty, ...)
        self.listed_mtime = 0.0
        self.bytes = 0

    def _kept(self, path: str) -> Kept | None:
        if path not in self.files:
            try:
                self.files[path] = Kept(path) if os.path.getsize(path) else None
            except OSError:
                self.files[path] = None
        return self.files[path]

    def _lock(self, path: str, how) -> int:
        """``how()``; a file that cannot be locked (truncated since, say) is left alone, but
        the first lock failing means none can be (``CannotLock``)."""
        try:
            return how()
        except CannotLock:
            if not self.bytes:
                raise
            self.files[path] = None
            return 0

    def once(self) -> int:
        """One pass over the listed and the mapped files; the bytes newly locked."""
        before = self.bytes
        try:
            mtime = os.stat(self.listing).st_mtime
        except OSError:
            mtime = self.listed_mtime
        if mtime != self.listed_mtime:  # first: small, and wanted whole
            self.listed_mtime = mtime
            for path in open(self.listing).read().splitlines():
                if (kept := self._kept(path)) is not None and self.bytes < MAX_BYTES:
                    self.bytes += self._lock(path, kept.lock_all)
        for pid in self.pids:
            for path in sorted(mapped_libraries(pid)):
                if (kept := self._kept(path)) is not None and self.bytes < MAX_BYTES:
                    self.bytes += self._lock(path, kept.lock_resident)
        return self.bytes - before

    def alive(self) -> bool:
        return os.getppid() != 1 and any(os.path.exists(f"/proc/{p}") for p in self.pids)


CANNOT = "cannot keep pages in memory: "


def said(log: str) -> str | None:
    """What the keeper's LOG says last, in a few words: how much it keeps, or why it keeps
    nothing; None before its first line."""
    try:
        lines = open(log).read().splitlines()
    except OSError:
        return None
    if not lines:
        return None
    if lines[-1].startswith(CANNOT):
        return lines[-1]
    return f"{lines[-1].split()[2]} MiB kept in memory"  # "HH:MM:SS kept N MiB (+M)"


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        sys.exit("usage: python tests/_pagekeep.py LOG LIST PID...")
    die_with_parent(signal.SIGTERM)  # the session's end
    log = open(argv[0], "a", buffering=1)
    keeper = Keeper(argv[1], [int(p) for p in argv[2:]])
    while keeper.alive():
        try:
            if got := keeper.once():
                log.write(f"{time.strftime('%T')} kept {keeper.bytes >> 20} MiB (+{got >> 20})\n")
        except CannotLock as e:
            log.write(f"{CANNOT}{e}\n")
            return
        time.sleep(PERIOD_S)


if __name__ == "__main__":
    main(sys.argv[1:])
