"""tools/gpu_check.py off a GPU: its plan runs as a dry run, and a flag a script no longer has
is caught here rather than on the GPU machine."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402


def test_dry_run_prints_the_whole_plan_and_exits_0(tmp_path):
    tool = str(ROOT / "tools" / "gpu_check.py")
    cmd = [sys.executable, tool, "--dry-run", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "stale plan" not in out.stderr
    for section in ("correctness", "dispatch", "step-cost", "throughput", "resume", "te"):
        assert f"[{section}] cap" in out.stdout
    assert out.stdout.count(" + ") == len(gpu_check.MD_JOBS) - 1  # one launch, every layout
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_a_renamed_flag_is_caught():
    steps = gpu_check.plan()
    assert gpu_check.stale_flags(steps) == []
    old = gpu_check.Step("dispatch", "tools/bench_dispatch.py", ["--vocab", "128"], 10)
    assert gpu_check.stale_flags([old]) == ["dispatch: tools/bench_dispatch.py has no --vocab"]
    gone = gpu_check.Step("x", "tools/no_such_tool.py", [], 10)
    assert gpu_check.stale_flags([gone]) == ["x: tools/no_such_tool.py does not exist"]


def test_the_pretraining_runs_of_the_plan_parse(tmp_path):
    """The resume step's flags are megatron's and ours: the real parser takes them (on CPU, bf16
    and the rest as the GPU run would give them)."""
    import megatron.training.global_vars as gv

    from megatron.md.train import cli

    first = next(s for s in gpu_check.plan() if s.script == "pretrain_gpt.py")
    argv = [a.replace("{out}", str(tmp_path)) for a in first.args]
    gv.unset_global_variables()
    args, md = cli.parse(argv, on_cpu=True)
    assert md is not None and args.train_iters == 12 and args.save_interval == 6


def test_verdicts_read_the_numbers():
    """A correctness line over the bound, or a resumed loss that differs, fails the step."""
    step = next(s for s in gpu_check.plan() if s.name == "correctness")
    good = '{"worst_rel": 0.0, "worst_dir_rel": 0.0, "bf16_excess": 0.0, "sphere_err": 0.0}'
    ok, lines = gpu_check.verdict(step, 0, "\n".join([good] * len(gpu_check.MD_JOBS)), Path("."))
    assert ok and len(lines) == 1 + len(gpu_check.MD_JOBS)
    bad = good.replace('"worst_rel": 0.0', '"worst_rel": 2e-7')  # MD off must be bit for bit
    ok, lines = gpu_check.verdict(step, 0, "\n".join([bad] * len(gpu_check.MD_JOBS)), Path("."))
    assert not ok and lines[-1].startswith("BAD --vs megatron")
