"""One run at a time in a ``--save`` directory: the run's writers hold a lock on
``<save>/.run.lock`` for their whole life.

Two runs saving in one directory (a job submitted twice, a run started by hand beside its own
queued job) write ``iter_N`` and the tracker over each other's, and each resumes the other's
state: both runs' work is lost. megatron-core saves into ``--save`` whatever else writes there.
Rank 0 (the tracker, the checkpoints' common files, the console) locks byte 0 and says the
refusal; the last rank (megatron's writer of the metrics file, wandb and TensorBoard) locks
byte 1 and leaves silently, so a refused run writes nothing anywhere before the launcher stops
its other ranks. Two launches of one run starting in the same moment can each win one byte:
both stop, one of them without the sentence.
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
_held: list[int] = []  # the open lock file: closing it would drop the lock


def holder() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    return (f"pid {os.getpid()} on {socket.gethostname()}"
            + (f", SLURM job {job}" if job else "")
            + f", since {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")  # fmt: skip


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
        other = os.pread(fd, 400, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        errors.fail(
            f"--save {save} is in use by another run ({other}): two runs saving in one "
            "directory write over each other's checkpoints. Wait for it to end, or give this "
            "run a directory of its own"
        )
    if rank == 0:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder() + "\n").encode(), 0)
    _held.append(fd)
    return None
