"""megatron/md/train/runlock.py: one run at a time in a --save directory, and no stale lock.

Each side is its own process, as two runs' ranks are (a POSIX lock is per process). The
refusal of a real pretrain_gpt.py run: test_pretrain_e2e.py."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from megatron.md import errors

ROOT = Path(__file__).resolve().parents[1]

# take the lock of argv[1] as rank argv[3] of argv[4] (refused: pretrain_gpt.py's one line
# from rank 0 and status 2), say so, then: "sleep" (a running rank), "exit", or "fork" (fork a
# child that lives on, then end at once, as a rank whose DataLoader worker outlives it)
HOLD = r"""
import os, sys, time
from megatron.md import errors
from megatron.md.train import runlock
os.environ["RANK"] = sys.argv[3]
runlock.WAIT_S = float(os.environ.get("TEST_WAIT_S", runlock.WAIT_S))
with errors.one_line():
    runlock.hold(sys.argv[1], int(sys.argv[3]), int(sys.argv[4]))
if sys.argv[2] == "fork" and os.fork() == 0:
    os.write(1, f"child {os.getpid()}\n".encode())  # one write: the parent's may interleave
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the pipe ends with the parent
    time.sleep(600)
os.write(1, b"held\n")
if sys.argv[2] == "sleep":
    time.sleep(600)
"""


def _python(save: Path, then: str, rank: int = 0, world: int = 1, launch=None, **kw):
    """A rank of a run (``launch``: the launcher's rendezvous port its ranks share, or none)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        env.pop(k, None)
    if launch:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(launch), TEST_WAIT_S="2")
    return subprocess.Popen([sys.executable, "-c", HOLD, str(save), then, str(rank), str(world)],
                            env=env, text=True, **kw)  # fmt: skip


def _take(save: Path, rank: int = 0, world: int = 1, launch=None) -> subprocess.CompletedProcess:
    """Another process asking for the lock as ``rank`` of ``world``: status 0 (taken, then
    released by its exit), or the refusal."""
    p = _python(save, "exit", rank, world, launch, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_a_held_directory_is_refused_naming_the_holder(tmp_path):
    """A run's rank 0 and last rank hold it (here one process: a run of one rank)."""
    save = tmp_path / "run"
    holder = _python(save, "sleep", stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == "held\n"
        rank0 = _take(save, 0, 4)
        assert rank0.returncode == errors.STATUS and "held" not in rank0.stdout
        head = (
            f"pretrain_gpt.py: error: --save {save} is in use by another run (pid {holder.pid} on "
        )
        assert rank0.stderr.startswith(head), rank0.stderr
        assert "write over each other's checkpoints" in rank0.stderr
        last = _take(save, 3, 4)  # the metrics file's writer: refused too, silently
        assert (last.returncode, last.stdout, last.stderr) == (errors.STATUS, "", "")
        assert _take(save, 2, 4).returncode == 0  # writes nothing before the others stop
    finally:
        holder.kill()
        holder.wait()
    assert _take(save).returncode == 0  # a killed holder leaves no stale lock
    assert _take(save).returncode == 0  # nor does one that ended


def test_two_launches_that_each_win_one_byte_leave_one_run(tmp_path):
    """Two launches of one run in the same moment (a job submitted twice, started at once): B's
    last rank takes byte 1 first, A's rank 0 byte 0. B's rank 0 is refused with the sentence,
    naming A's; A's last rank waits while B is stopped (the launcher stops B's ranks at its
    rank 0's failure: here by hand), then takes byte 1, and A runs."""
    save = tmp_path / "run"
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    b_last = _python(save, "sleep", 1, 2, 2002, **pipe)
    procs = [b_last]
    try:
        assert b_last.stdout.readline() == "held\n"
        a_last = _python(save, "sleep", 1, 2, 1001, **pipe)  # refused byte 1: waits
        procs.append(a_last)
        a0 = _python(save, "sleep", 0, 2, 1001, **pipe)
        procs.append(a0)
        assert a0.stdout.readline() == "held\n"
        b0 = _take(save, 0, 2, 2002)
        assert b0.returncode == errors.STATUS, b0
        assert f"is in use by another run (pid {a0.pid} on " in b0.stderr, b0.stderr
        assert a_last.poll() is None  # still waiting for byte 1
        b_last.kill()
        assert a_last.stdout.readline() == "held\n"  # A runs
        assert a_last.poll() is None and a0.poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_last_rank_that_cannot_get_its_byte_says_so(tmp_path):
    """This launch's rank 0 holds the directory, and byte 1 stays held by another process (a
    rank of an earlier run still alive): after its wait the last rank says so itself, the only
    rank that knows; refused by another launch's rank 0 it leaves silently (its rank 0 says
    why), as a last rank outside a launcher does at once."""
    save = tmp_path / "run"
    pipe = dict(stdout=subprocess.PIPE)
    other_last = _python(save, "sleep", 1, 2, 2002, **pipe)
    a0 = _python(save, "sleep", 0, 2, 1001, **pipe)
    try:
        assert other_last.stdout.readline() == "held\n" and a0.stdout.readline() == "held\n"
        a_last = _take(save, 1, 2, 1001)
        assert a_last.returncode == errors.STATUS and a_last.stdout == ""
        said = f"pretrain_gpt.py: error: --save {save}: another process holds the lock of its "
        assert a_last.stderr.startswith(said + "last rank"), a_last.stderr
        assert "a rank of an earlier run still alive?" in a_last.stderr
        silent = _take(save, 1, 2, 3003)  # another launch's last rank
        assert (silent.returncode, silent.stdout, silent.stderr) == (errors.STATUS, "", "")
    finally:
        for p in (other_last, a0):
            p.kill()
            p.wait()


def test_rank_0_and_the_last_rank_of_one_run_do_not_refuse_each_other(tmp_path):
    save = tmp_path / "run"
    rank0 = _python(save, "sleep", 0, 2, stdout=subprocess.PIPE)
    try:
        assert rank0.stdout.readline() == "held\n"
        assert _take(save, 1, 2).returncode == 0
        assert _take(save, 0, 2).returncode == errors.STATUS
    finally:
        rank0.kill()
        rank0.wait()


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    save = tmp_path / "run"
    holder = _python(save, "fork", stdout=subprocess.PIPE)
    out, _ = holder.communicate(timeout=60)
    assert "held" in out and "child" in out, out
    child = int(out.split("child ")[1].split()[0])
    try:
        os.kill(child, 0)  # still alive, the lock's file open in it
        assert _take(save).returncode == 0
    finally:
        os.kill(child, signal.SIGKILL)


def test_no_save_no_lock_and_the_file_names_the_run(tmp_path):
    from megatron.md.train import runlock

    assert runlock.hold(None) is None
    assert runlock.hold(str(tmp_path / "unused"), 1, 4) is None  # a rank that writes nothing
    assert not (tmp_path / "unused").exists()
    save = tmp_path / "run"
    assert _take(save).returncode == 0
    text = (save / runlock.NAME).read_text()
    assert text.startswith("pid ") and " on " in text and "since " in text
