"""The local launcher (megatron/md/localrun.py: torchrun's job on one machine, without its
agent) and the end of a finished run (megatron/md/train/shutdown.py). Every launcher test runs
with fresh ranks and with ranks forked by the session's fork server (megatron/md/forkserver.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.md.launch import local_ranks

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(params=["fresh", "forked"])
def via(request, monkeypatch) -> str:
    """How the ranks start: fresh processes, or forked by the session's fork server."""
    if request.param == "fresh":
        monkeypatch.setenv("MEGATRON_MD_FORKSERVER", "0")
    elif os.environ.get("MEGATRON_MD_FORKSERVER", "0") == "0":
        pytest.skip("no fork server in this session (MEGATRON_MD_FORKSERVER=0)")
    return request.param


def script(tmp: Path, body: str) -> Path:
    """A rank that writes ``up<rank>`` (its pid and parent's) first, then runs ``body``."""
    p = tmp / "rank.py"
    p.write_text("import json, os, signal, sys, time\nr = int(os.environ['RANK'])\n"
                 "open(f'up{r}', 'w').write(f'{os.getpid()} {os.getppid()}')\n" + body)  # fmt: skip
    return p


def started(tmp: Path, body: str, via: str) -> tuple[subprocess.Popen, list[int]]:
    """A 2-rank launch of ``body`` once both ranks are up, and their pids; they were started
    ``via`` (a forked rank is the fork server's child, a fresh one the launcher's)."""
    proc = subprocess.Popen(local_ranks(script(tmp, body), 2), cwd=tmp)
    deadline = time.time() + 30
    while not all((tmp / f"up{r}").exists() and (tmp / f"up{r}").read_text() for r in (0, 1)):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    ids = [tuple(map(int, (tmp / f"up{r}").read_text().split())) for r in (0, 1)]
    assert {ppid == proc.pid for _, ppid in ids} == {via == "fresh"}, (ids, proc.pid)
    return proc, [pid for pid, _ in ids]


def test_every_rank_gets_torchruns_variables(tmp_path, via):
    # one write per line: with PYTHONUNBUFFERED a print's text and its newline are two writes,
    # and the ranks' lines could interleave
    body = "sys.stdout.write(json.dumps({k: os.environ[k] for k in %r}) + '\\n')\n" % (ENV_KEYS,)
    out = subprocess.run(local_ranks(script(tmp_path, body), 3, port=29555), capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = sorted((json.loads(ln) for ln in out.stdout.splitlines()), key=lambda e: e["RANK"])
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in got] == [("0", "0"), ("1", "1"), ("2", "2")]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_PORT"]) for e in got} == {
        ("3", "3", "29555")
    }


def test_the_first_failure_stops_the_others_and_is_the_status(tmp_path, via):
    """Rank 1 fails with 3 while rank 0 would run a minute: the launch ends at once with 3 and
    rank 0 is stopped by SIGTERM (it says so). Rank 1 fails only once rank 0 handles SIGTERM
    (its file ``handles0``): on a busy machine a fixed wait could end first."""
    body = (
        "signal.signal(signal.SIGTERM, lambda *a: (print('rank 0 stopped', flush=True), "
        "sys.exit(15)))\n"
        "open(f'handles{r}', 'w').close()\n"
        "if r == 1:\n"
        "    while not os.path.exists('handles0'):\n        time.sleep(0.01)\n"
        "    sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    t = time.monotonic()
    out = subprocess.run(local_ranks(script(tmp_path, body), 2), capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 3 and time.monotonic() - t < 10, (out.returncode, out.stdout)
    assert "rank 0 stopped" in out.stdout


def test_sigterm_to_the_launcher_reaches_every_rank(tmp_path, via):
    """What scancel or a time limit sends: each rank handles it (megatron saves and exits 0)."""
    body = (
        "signal.signal(signal.SIGTERM, lambda *a: (open(f'got{r}', 'w').close(), sys.exit(0)))\n"
        "open(f'ready{r}', 'w').close()\ntime.sleep(60)\n"
    )
    proc, _ = started(tmp_path, body, via)
    while not ((tmp_path / "ready0").exists() and (tmp_path / "ready1").exists()):
        assert proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert (tmp_path / "got0").exists() and (tmp_path / "got1").exists()


def test_no_rank_outlives_a_killed_launcher(tmp_path, via):
    """A caller's timeout kills the launcher outright (SIGKILL): its ranks go with it."""
    import psutil

    proc, pids = started(tmp_path, "time.sleep(60)\n", via)
    ranks = [psutil.Process(pid) for pid in pids]
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive and len(gone) == 2


def test_a_refusal_is_the_launchs_last_line(tmp_path, via):
    """Rank 0 refuses (megatron/md/errors.py) and rank 1, still starting, prints a warning after
    it before it is stopped: the launch repeats the refusal as its last line, with the
    refusal's status; its private error file is gone. A launch that did not refuse (a crash)
    repeats nothing, and a caller's own error file is left for the caller to say."""
    body = (
        "from megatron.md import errors\n"
        "err = os.environ['MEGATRON_MD_ERROR_FILE']\n"
        "open(f'err{r}', 'w').write(err)\n"
        "if r == 0:\n"
        "    errors.say('--data-path /nowhere: no such file') if len(sys.argv) < 2 else None\n"
        "    while not os.path.exists('warned'):\n        time.sleep(0.01)\n"
        "    sys.exit(2)\n"
        "while r == 1 and not (os.path.exists(err) or len(sys.argv) > 1):\n    time.sleep(0.01)\n"
        "print('UserWarning: still importing', file=sys.stderr, flush=True)\n"
        "open('warned', 'w').close()\n"
        "time.sleep(60)\n"
    )
    said = "pretrain_gpt.py: error: --data-path /nowhere: no such file"
    rank = script(tmp_path, body)
    out = subprocess.run(local_ranks(rank, 2), capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)  # fmt: skip
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-1] == said, out.stderr
    assert lines.index("UserWarning: still importing") < len(lines) - 1 and lines.count(said) == 2
    private = Path((tmp_path / "err0").read_text())
    assert private.name == "error" and not private.parent.exists()
    (tmp_path / "warned").unlink()
    crash = subprocess.run(local_ranks(rank, 2, ["crash"]), capture_output=True, text=True,
                           timeout=60, cwd=tmp_path)  # fmt: skip
    assert crash.returncode == 2 and crash.stderr.strip().splitlines()[-1] != said, crash.stderr
    (tmp_path / "warned").unlink()
    own = tmp_path / "callers_error"
    env = {**os.environ, "MEGATRON_MD_ERROR_FILE": str(own)}
    out = subprocess.run(local_ranks(rank, 2), capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=env)  # fmt: skip
    assert out.returncode == 2 and out.stderr.count(said) == 1, out.stderr
    assert own.read_text() == said + "\n"


@pytest.mark.distributed  # imports megatron-core (~5 s)
def test_the_checkpoint_writers_manager_dies_with_its_rank():
    """CPU mode's fork Manager serving torch_dist's write results (patches.fork_results_queue)
    goes with a rank killed outright (an out-of-memory kill): left behind, the forked server
    keeps the rank's copy-on-write memory until killed by hand (seen after a SIGKILLed rank)."""
    import psutil

    code = """
import time
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
from megatron.md.train import patches
get = patches.fork_results_queue(fa.get_write_results_queue)
q = get()
q.put(7)
assert q.get() == 7 and get() is q and fa._results_queue is q
print("up", flush=True)
time.sleep(600)
"""
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "up\n"
        servers = psutil.Process(rank.pid).children()
        assert len(servers) == 1
    finally:
        rank.kill()
        rank.wait()
    gone, alive = psutil.wait_procs(servers, timeout=10)
    assert not alive and len(gone) == 1


@pytest.mark.distributed  # imports megatron.training (~5 s)
def test_a_finished_run_exits_at_once_with_its_output_written(tmp_path):
    """shutdown.exit_now: status 0, threads that are not daemons waited for (a thread pool's
    idle worker told to end first, as the interpreter does: joined unasked, it never ends; seen
    as a checkpoint test's rank hanging at its end), the exit handlers run, garbage in
    reference cycles finalized (the collection before the exit does it: without it this one
    stays), buffered standard output flushed, and megatron's TensorBoard writer's last scalar
    in its event file (megatron never closes the writer; exit_now does)."""
    code = f"""
import atexit, gc, sys
from torch.utils.tensorboard import SummaryWriter
from megatron.training import global_vars
from megatron.md.train import shutdown

global_vars._GLOBAL_TENSORBOARD_WRITER = w = SummaryWriter({str(tmp_path / "tb")!r})
w.add_scalar("lm loss", 4.25, 7)
atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").close())

class Cycle:
    def __del__(self):
        open({str(tmp_path / "finalized")!r}, "w").close()

a = Cycle(); a.me = a; del a
gc.disable()  # only the exit's collection can finalize it
import threading, time
def late():
    time.sleep(0.5)
    open({str(tmp_path / "thread")!r}, "w").close()
threading.Thread(target=late).start()  # not a daemon: a normal exit waits for it
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1)  # its idle worker ends when told the interpreter exits
pool.submit(int).result()
sys.stdout.write("no newline, buffered")
shutdown.exit_now()
print("not reached")
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env, stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "no newline, buffered"
    assert (tmp_path / "atexit").exists() and (tmp_path / "finalized").exists()
    assert (tmp_path / "thread").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("lm loss")] == [(7, 4.25)]
