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

    runs = [s for s in gpu_check.plan() if s.script == "pretrain_gpt.py" and not s.needs_te]
    assert len(runs) == 4
    for run in runs:  # the resumed runs too (on the H100 one lacked --save-interval, 2026-11-25)
        argv = [a.replace("{out}", str(tmp_path)) for a in run.args]
        for name in run.fresh:  # a check run before into the same folder left its runs
            if name.endswith(".jsonl"):
                (tmp_path / name).write_text('{"type": "run"}\n')
            else:
                (tmp_path / name / "iter_0000024").mkdir(parents=True, exist_ok=True)
                (tmp_path / name / "latest_checkpointed_iteration.txt").write_text("24")
        gpu_check.clear_fresh(run, tmp_path)
        gv.unset_global_variables()
        # as the GPU machine parses them (on_cpu=True refuses --md-cuda-graph)
        args, md = cli.parse(argv, on_cpu=False)
        # 24 iterations: tools/long_run_check.py reads at least 20 losses
        assert md is not None and args.train_iters == 24 and args.save_interval == 12
        # AdamMD's pair in a CUDA graph through the save and the resume, MuonMD's without
        assert md.cuda_graph == (args.optimizer == "adam"), argv
        if args.load:  # the first run also saved at 24: resuming the latest trains nothing
            assert args.ckpt_step == 12  # (on the H200 it did, 2026-11-26)
        else:  # the first run starts from scratch, its run directory cleared
            assert run.fresh and not any((tmp_path / f).exists() for f in run.fresh)


def test_verdicts_read_the_numbers():
    """A correctness line over the bound, or a resumed loss that differs, fails the step."""
    step = next(s for s in gpu_check.plan() if s.name == "correctness")
    good = ('{"worst_rel": 0.0, "worst_dir_rel": 0.0, "bf16_excess": 0.0, "sphere_err": 0.0, '
            '"graph_replays": 5}')  # fmt: skip
    ok, lines = gpu_check.verdict(step, 0, "\n".join([good] * len(gpu_check.MD_JOBS)), Path("."))
    assert ok and len(lines) == 1 + len(gpu_check.MD_JOBS)
    # --cuda-graph jobs: the steps after the warm-up must have come from the graph
    eager = good.replace('"graph_replays": 5', '"graph_replays": 0')
    ok, lines = gpu_check.verdict(step, 0, "\n".join([eager] * len(gpu_check.MD_JOBS)), Path("."))
    graph = [x for x in lines if "--cuda-graph" in x]
    assert not ok and len(graph) == 3 and all(x.startswith("BAD") for x in graph)
    bad = good.replace('"worst_rel": 0.0', '"worst_rel": 2e-7')  # MD off must be bit for bit
    ok, lines = gpu_check.verdict(step, 0, "\n".join([bad] * len(gpu_check.MD_JOBS)), Path("."))
    off = [x for x in lines if "--vs megatron --optimizer" in x and "replicated" in x]
    assert not ok and "BAD --vs megatron --optimizer adam --dist replicated" in off[0]
    # ... but for Muon on a GPU an fp32 rounding: batched against per-matrix Newton–Schulz
    assert off[1].startswith("ok  --vs megatron --optimizer muon")
    # a capture that fails ends the launch: the graph's jobs come last
    assert all("--cuda-graph" in j for j in gpu_check.MD_JOBS[-3:])


def test_the_step_cost_report_keeps_the_whole_table():
    """The report shows bench_md_step.py's ratio table, not the last lines of its log (the first
    GPU report lost the 181M and 457M rows, 2026-11-25)."""
    step = next(s for s in gpu_check.plan() if s.name == "step-cost")
    rows = [f"{m} bf16    adam_md/adam step      1.3   0.013 -> 0.017" for m in ("181M", "457M")]
    noise = ["457M bf16 adam: built in 0.0 s", "  adam: first step 0.1 s"] * 10
    text = "\n".join(["MD optimizer-step cost, X", "model   ratio", *rows, *noise])
    ok, lines = gpu_check.verdict(step, 0, text, Path("."))
    assert ok and lines == ["exit 0", "MD optimizer-step cost, X", "model   ratio", *rows]


def test_the_throughput_report_keeps_every_row():
    """The report shows throughput.py's whole table and its failures, however many methods (the
    H100's report kept the last 12 lines of the log, 2026-11-26: AdamW's and Muon's rows lost)."""
    step = next(s for s in gpu_check.plan() if s.name == "throughput")
    methods = step.args[step.args.index("--methods") + 1 : step.args.index("--out")]
    assert len(methods) >= 7  # more rows than the last 12 lines hold, with the lines below
    head = ["## dense-181M (medians after 8 warm-up iterations)", "", "method | tok/s/GPU | MFU",
            "--- | --- | ---"]  # fmt: skip
    rows = [f"{m} | 66,065 | 5.0% |  | 124.0" for m in methods]
    runs = [f"[throughput] {m}: 20 iterations on 1 ranks" for m in methods]
    failed = "[throughput] muon failed (exit 1); see /tmp/gc/muon.log"
    text = "\n".join([*head, *rows, "", "[throughput] wrote /tmp/gc/throughput.{json,csv,png}",
                      *runs, failed])  # fmt: skip
    ok, lines = gpu_check.verdict(step, 0, text, Path("."))
    assert ok and lines[1:] == [head[0], *head[2:], *rows, lines[-2], failed]
    assert lines[-2].startswith("[throughput] wrote")
