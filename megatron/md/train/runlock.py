"""One run at a time in a ``--save`` directory: the run's writers hold a lock on
``<save>/.run.lock`` for their whole life.

Two runs saving in one directory (a job submitted twice, a run started by hand beside its own
queued job) write ``iter_N`` and the tracker over each other's, and each resumes the other's
state: both runs' work is lost. megatron-core saves into ``--save`` whatever else writes there.
Rank 0 (the tracker, the checkpoints' common files, the console) locks byte 0 and says the
refusal; the last rank (megatron's writer of the metrics file, wandb and TensorBoard) locks
byte 1 and leaves silently, so a refused run writes nothing anywhere before the launcher stops
its other ranks. Two launches of one run starting in the same moment can each win one byte: the
last rank refused then waits (``WAIT_S``) while the launcher stops the rank 0 that was refused
with it, or for its own rank 0 to name this launch in the file; then it takes byte 1 once the
other launch's last rank has been stopped, and the first launch runs, the other stops with the
sentence.
The lock is a POSIX record lock (``fcntl.lockf``): the kernel (or the file system's lock
service) drops it when the process ends, however it ends, so a crashed run leaves no stale lock,
and the processes a rank forks (DataLoader workers, a lingering ``multiprocessing`` manager) do
not hold it. The file names rank 0's process (host, pid, SLURM job, start) for the refusal.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time

from megatron.md import errors

NAME = ".run.lock"
#: how long a refused last rank waits for the other launch to be stopped (its own, if its rank 0
#: was refused too: torchrun stops the ranks at a rank's failure)
WAIT_S = 60.0
_held: list[int] = []  # the open lock file: closing it would drop the lock


def holder() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    return (f"pid {os.getpid()} on {socket.gethostname()}"
            + (f", SLURM job {job}" if job else "")
            + f", since {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")  # fmt: skip


def launch() -> str:
    """What the ranks of one launch share and no other launch does at the same time (torchrun's
    rendezvous address and run id, the SLURM job and attempt); empty outside a launcher."""
    keys = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
            "SLURM_RESTART_COUNT")  # fmt: skip
    if "MASTER_PORT" not in os.environ:
        return ""
    return "launch " + " ".join(os.environ.get(k, "-") for k in keys)


def named(path: str) -> list[str]:
    """The lock file's lines: rank 0's process (``holder``) and its ``launch``. Opened afresh
    (on NFS an open fd may read cached data); only a process holding no lock on it reads it so:
    closing any descriptor of a file drops the process's POSIX locks on it."""
    with open(path, "rb") as f:
        return f.read(1000).decode(errors="replace").splitlines()


def wait_for_last(fd: int, path: str, me: str) -> bool:
    """A last rank refused byte 1: wait while the other launch is stopped, and take byte 1 once
    this launch's rank 0 holds byte 0 (its ``launch`` line in the file) and byte 1 is free.
    False if it could not in ``WAIT_S``."""
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        time.sleep(0.1)
        if me in named(path)[1:2]:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 1)
                return True
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
    return False


def hold(save: str | None, rank: int = 0, world: int = 1) -> str | None:
    """Take ``save``'s lock for this process's life where ``rank`` writes (0 and ``world`` - 1).
    A refusal where another run holds it; the warning to print where the file system keeps no
    locks (None otherwise, or without --save, or for a rank that needs none)."""
    last = world - 1
    if not save or rank not in (0, last):
        return None
    path = os.path.join(save, NAME)
    try:
        os.makedirs(save, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        errors.fail(f"--save {save}: cannot write there ({e.strerror})")
    try:
        for byte, writer in ((0, 0), (1, last)):  # rank 0's byte, the last rank's
            if rank == writer:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # ENOLCK, ENOSYS, EOPNOTSUPP, ...
            os.close(fd)
            return (f"--save {save}: its file system keeps no locks ({e.strerror}): nothing "
                    "stops a second run from saving there too")  # fmt: skip
        me = launch()
        if rank != 0 and me and wait_for_last(fd, path, me):
            _held.append(fd)
            return None
        if rank != 0 and me and me in named(path)[1:2]:
            os.close(fd)
            errors.fail(
                f"--save {save}: another process holds the lock of its last rank (the writer of "
                f"the metrics and wandb) for over {WAIT_S:.0f} s while this run's rank 0 holds "
                "the directory: a rank of an earlier run still alive? Stop it and start again",
                every_rank=True,
            )
        os.close(fd)  # (first: a lone process's byte 0 is given up with the file)
        other = (named(path) or ["unknown"])[0].strip() or "unknown"
        errors.fail(
            f"--save {save} is in use by another run ({other}): two runs saving in one "
            "directory write over each other's checkpoints. Wait for it to end, or give this "
            "run a directory of its own"
        )
    if rank == 0:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder() + "\n" + launch() + "\n").encode(), 0)
    _held.append(fd)
    return None
