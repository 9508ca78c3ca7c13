"""The fork server (megatron/md/forkserver.py): a forked rank is the process a fresh start makes,
and the server starts a rank afresh where it could not be. The launcher's own guarantees
(signals, failures, a killed launcher) run both ways in tests/test_launch.py."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from megatron.md import forkserver
from megatron.md.launch import local_ranks

pytestmark = [
    pytest.mark.distributed,  # launches that import torch (~70 s in all): not the quick tier
    pytest.mark.skipif(
        os.environ.get("MEGATRON_MD_FORKSERVER", "0") == "0",
        reason="no fork server in this session (MEGATRON_MD_FORKSERVER=0)",
    ),
]

# what a rank can see of how it was started: the environment, arguments, import path,
# directory, process group, signal dispositions, open files, __main__, stdin, a draw of numpy's
# global generator; then rank 1 finishes and rank 0 ends as asked: an exception, sys.exit, a
# signal, or normally
PROBE = """
import importlib, json, os, resource, signal, sys, time
import numpy
for name in %r:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
main = sys.modules["__main__"]
sigs = {s.name: str(signal.getsignal(s)) for s in signal.valid_signals()
        if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)}
fds = sorted(int(f) for f in os.listdir("/proc/self/fd"))
with open(f"/proc/{os.getppid()}/cmdline") as f:
    parent = f.read().split("\\0")
facts = {"env": dict(os.environ), "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(),
         "pgid": os.getpgid(0), "sigs": sigs, "wakeup_fd": signal.set_wakeup_fd(-1),
         "fds": fds[:-1], "main": [main.__name__, main.__file__], "ppid": os.getppid(),
         "parent": parent, "numpy": int(numpy.random.randint(2**31)), "stdin": sys.stdin.read(),
         "limits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource)
                    if n.startswith("RLIMIT_")},
         "umask": os.umask(0o22), "cpus": sorted(os.sched_getaffinity(0))}
r = os.environ["RANK"]
with open(f"facts{r}.json", "w") as f:
    json.dump(facts, f)
os.write(1, f"rank {r} up\\n".encode())  # one write: the two ranks share the pipe
if r != "0":
    open("finished", "w").close()
    sys.exit(0)
while os.environ["WORLD_SIZE"] != "1" and not os.path.exists("finished"):
    time.sleep(0.01)
how = sys.argv[1]
if how == "raise":
    def inner():
        raise ValueError("from the script")
    inner()
if how == "exit":
    sys.exit(3)
if how == "signal":
    os.kill(os.getpid(), signal.SIGKILL)
"""
STATUS = {"done": 0, "raise": 1, "exit": 3, "signal": 128 + signal.SIGKILL}


def launch(tmp: Path, how: str, via: str, nproc: int = 2, imports: bool = True, **kw):
    """The launch's result and each rank's facts, its ranks started ``via``; ``imports``: the
    probe imports what the server preloads (a fresh rank then costs ~4 s of CPU: the tests
    that only ask who started the ranks leave them out)."""
    d = tmp / via
    d.mkdir(parents=True)
    (d / "probe.py").write_text(PROBE % ((forkserver.PRELOAD if imports else ()),))
    env = {**os.environ, **({"MEGATRON_MD_FORKSERVER": "0"} if via == "fresh" else {})}
    out = subprocess.run(local_ranks(d / "probe.py", nproc, [how]), cwd=d, env=env, text=True,
                         capture_output=True, timeout=120, input="stdin text", **kw)  # fmt: skip
    return out, [json.loads((d / f"facts{r}.json").read_text()) for r in range(nproc)]


def parent(facts: dict) -> str:
    """What started the rank: the launcher or the fork server."""
    cmd = " ".join(facts["parent"])
    return "launcher" if "localrun.py" in cmd else "server" if "forkserver" in cmd else cmd


@pytest.mark.parametrize("how", list(STATUS))
def test_a_forked_rank_is_the_process_a_fresh_start_makes(tmp_path, how):
    fresh, fresh_facts = launch(tmp_path, how, "fresh")
    forked, forked_facts = launch(tmp_path, how, "forked")
    assert forked.returncode == fresh.returncode == STATUS[how], fresh.stderr + forked.stderr
    # the same output, a traceback included (paths aside: each ran in its own directory)
    assert sorted(forked.stdout.splitlines()) == sorted(fresh.stdout.splitlines())
    assert forked.stderr.replace("/forked/", "/fresh/") == fresh.stderr, forked.stderr
    if how == "raise":
        assert 'in inner\n    raise ValueError("from the script")' in fresh.stderr
    assert [parent(f) for f in fresh_facts + forked_facts] == ["launcher"] * 2 + ["server"] * 2
    assert forked_facts[0]["numpy"] != forked_facts[1]["numpy"]  # each drew its own seed
    # stdin: one rank reads what the launcher was given, the other what is left (nothing)
    assert sorted(f.pop("stdin") for f in fresh_facts) == sorted(
        f.pop("stdin") for f in forked_facts
    )
    for a, b in zip(fresh_facts, forked_facts):
        for f in (a, b):
            del f["ppid"], f["parent"], f["numpy"], f["env"]["MASTER_PORT"]
            del f["env"]["MEGATRON_MD_FORKSERVER"]
            # each launch's own (localrun.py: a refusal repeated as its last line)
            assert f["env"].pop("MEGATRON_MD_ERROR_FILE").endswith(".localrun/error")
        a["cwd"], a["path"][0], a["main"][1] = b["cwd"], b["path"][0], b["main"][1]
        a["argv"][0] = b["argv"][0]
        assert a == b


def test_a_launcher_in_another_session_gets_fresh_ranks(tmp_path):
    """Signals sent to that session's process group must reach the ranks (sbatch; a test that
    kills a launch's group): a forked rank would be in the server's session."""
    out, facts = launch(tmp_path, "done", "forked", start_new_session=True, imports=False)
    assert out.returncode == 0, out.stderr
    assert [parent(f) for f in facts] == ["launcher"] * 2
    assert all(f["pgid"] == f["ppid"] for f in facts)  # the launcher leads its new group


def test_a_launcher_with_other_resource_limits_gets_fresh_ranks(tmp_path):
    """A rank inherits its launcher's resource limits (``ulimit -f``: the failed-save test runs
    under one); a forked rank would have the server's."""
    import resource

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (10 << 20, 10 << 20))

    out, facts = launch(tmp_path, "done", "forked", preexec_fn=small_files, imports=False)
    assert out.returncode == 0, out.stderr
    assert [parent(f) for f in facts] == ["launcher"] * 2
    assert [f["limits"]["RLIMIT_FSIZE"] for f in facts] == [[10 << 20, 10 << 20]] * 2


@pytest.mark.parametrize(
    "preexec, differs",
    [(lambda: os.umask(0o077), "umask"),
     (lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}), "CPU affinity")],
)  # fmt: skip
def test_a_launcher_with_another_umask_or_affinity_is_refused(preexec, differs):
    """What else a child inherits (a fresh rank gets its launcher's; the probe above compares
    both between forked and fresh ranks): read from a process set up so, no launch needed."""
    if differs == "CPU affinity" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no other affinity to give the launcher")
    other = subprocess.Popen(["sleep", "30"], preexec_fn=preexec)
    try:
        assert forkserver._other_process_state(other.pid) == differs
        assert forkserver._other_process_state(os.getpid()) is None
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize(
    "name, started_by",
    [("OMP_NUM_THREADS", "launcher"), ("TORCH_COMPILE_DISABLE", "launcher"),
     ("KMP_DUPLICATE_LIB_OK", "server"), ("WANDB_API_KEY", "server")],
)  # fmt: skip
def test_ranks_are_forked_unless_a_variable_the_imports_read_differs(
    tmp_path, monkeypatch, name, started_by
):
    """OMP_NUM_THREADS (read by OpenMP as torch loads) and a variable read through os.environ
    while torch is imported: a rank forked from imports that read another value would differ.
    Variables no import read fork: Intel OpenMP's (not loaded by torch's CPU wheel; inductor
    sets KMP_DUPLICATE_LIB_OK in the test process once it compiles) and wandb's key."""
    monkeypatch.setenv(name, "2")
    out, facts = launch(tmp_path, "done", "forked", imports=False)
    assert out.returncode == 0, out.stderr
    assert [(f["env"][name], parent(f)) for f in facts] == [("2", started_by)] * 2


def test_which_ranks_the_cpu_mode_process_forks(tmp_path):
    """pretrain_gpt.py's ranks where its ``cpu_mode.start`` puts CPU mode on first (the same
    decision on the request): not where it stops as a GPU job, nor with
    ``MEGATRON_MD_CPU_MODE=0``; no other script."""
    root = Path(forkserver.CPU_MODE_SCRIPT).parent
    assert (root / "pretrain_gpt.py").is_file() and (root / "megatron" / "md").is_dir()

    def rank(script, *args, cwd=tmp_path, **env):
        return forkserver.cpu_mode_rank(
            {"argv": ["python", str(script), *args], "env": env, "cwd": str(cwd)}
        )

    assert rank(root / "pretrain_gpt.py", "--preset=tiny")
    assert rank("pretrain_gpt.py", cwd=root)  # relative to the launcher's directory
    assert not rank("pretrain_gpt.py")  # (another directory's)
    assert not rank(root / "pretrain_gpt.py", MEGATRON_MD_CPU_MODE="0")
    assert not rank(root / "pretrain_gpt.py", "--distributed-backend=nccl")
    assert not rank(root / "pretrain_gpt.py", MEGATRON_MD_LAUNCHER="slurm")
    assert rank(root / "pretrain_gpt.py", "--distributed-backend", "nccl", MEGATRON_MD_CPU_MODE="1")
    assert not rank(root / "tools" / "bench_md_step.py")


def test_pretrain_ranks_from_the_cpu_mode_process_are_what_a_fresh_start_makes(tmp_path):
    """pretrain_gpt.py's ranks are forked with CPU mode on and megatron imported (the server's
    CPU-mode process): the same losses, bit for bit, and the same output as a rank started
    afresh (times and measured numbers aside; one rank: two would interleave their lines),
    the line that CPU mode is on included, once."""
    import re

    flags = ["--mock-data", "--tokenizer-type=NullTokenizer", "--vocab-size=512",
             "--seq-length=32", "--max-position-embeddings=32", "--micro-batch-size=2",
             "--global-batch-size=4", "--log-interval=1", "--eval-iters=0", "--seed=3",
             "--preset=tiny", "--optimizer=adam", "--md-decoupling", "--lr=1e-2",
             "--train-iters=3"]  # fmt: skip
    log = Path(os.environ["MEGATRON_MD_FORKSERVER"]).parent / "log"
    before = log.read_text().count("by the CPU-mode process: ['")
    outs, losses = {}, {}
    for via in ("fresh", "forked"):
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               **({"MEGATRON_MD_FORKSERVER": "0"} if via == "fresh" else {})}  # fmt: skip
        metrics = tmp_path / f"{via}.jsonl"
        out = subprocess.run(local_ranks(Path(forkserver.CPU_MODE_SCRIPT), 1,
                                         [*flags, f"--metrics-file={metrics}"]),
                             cwd=tmp_path, env=env, text=True, capture_output=True,
                             timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        losses[via] = [r["lm loss"] for r in map(json.loads, metrics.open())
                       if r["type"] == "train"]  # fmt: skip
        text = (out.stdout + out.stderr).replace(str(metrics), "METRICS")
        outs[via] = re.sub(r"\d{4}-\d\d-\d\d[ T][\d:.,]+|\d+\.\d+|W\d{4} \S+ \d+", "N", text)
    assert log.read_text().count("by the CPU-mode process: ['") == before + 1
    assert losses["forked"] == losses["fresh"] and len(losses["fresh"]) == 3
    assert outs["forked"].splitlines() == outs["fresh"].splitlines()
    assert outs["fresh"].count("[megatron-md] no CUDA device: CPU mode on") == 1
