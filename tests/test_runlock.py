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


def _python(save: Path, then: str, rank: int = 0, world: int = 1, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", HOLD, str(save), then, str(rank), str(world)],
                            env=env, text=True, **kw)  # fmt: skip


def _take(save: Path, rank: int = 0, world: int = 1) -> subprocess.CompletedProcess:
    """Another process asking for the lock as ``rank`` of ``world``: status 0 (taken, then
    released by its exit), or the refusal."""
    p = _python(save, "exit", rank, world, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
