"""The analysis tools on synthetic inputs with known answers: the scaling-law fit and its
bootstrap, the LR-sweep tool (optimum, crashed/incomplete/diverged runs), bad input."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import fb_dispatch  # noqa: E402
import lr_sweep  # noqa: E402
import scaling_law  # noqa: E402

TRUE = {"adamw": (12.0, 0.05), "muon": (12.0 * 0.978, 0.05), "muonmd": (12.0 * 0.966, 0.05)}


def synthetic_runs(seed=0, noise=0.002):
    """Per method and compute budget, 4 LRs: the best lands on L = A·C^-α (× lognormal noise),
    the others 1-6 % above it (an LR sweep's suboptimal points)."""
    rng = np.random.default_rng(seed)
    rows = []
    for m, (a, alpha) in TRUE.items():
        for c in np.geomspace(1e18, 1e21, 10):
            best = a * c**-alpha * math.exp(rng.normal(0, noise))
            for k, pen in enumerate((0.0, 0.01, 0.03, 0.06)):
                rows.append({"name": f"{m}-{c:.2g}-{k}", "method": m, "compute": c,
                             "tail_loss": best * (1 + pen), "status": "ok"})  # fmt: skip
    return rows


def write_csv(path, rows):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_scaling_law_recovers_power_law_and_ci_covers_savings(tmp_path):
    path = write_csv(tmp_path / "runs.csv", synthetic_runs())
    target = 12.0 * 1e20**-0.05
    res = scaling_law.main([str(path), "--target-loss", str(target), "--out", str(tmp_path)])
    for m, (a, alpha) in TRUE.items():
        fit = res["fits"][m]
        assert fit["n"] == 10  # the envelope is exactly the best run of each budget
        assert abs(fit["A"] / a - 1) < 0.02 and abs(fit["alpha"] / alpha - 1) < 0.02, (m, fit)
    for m in ("muon", "muonmd"):
        true = (TRUE["adamw"][0] / TRUE[m][0]) ** (1 / 0.05)  # same α: (A_base / A)^(1/α)
        s = res["savings"][m]
        assert abs(s["ratio"] / true - 1) < 0.05, (m, s, true)
        assert s["ci95"]["lo"] <= true <= s["ci95"]["hi"], (m, s, true)
        assert s["ci95"]["resamples"] >= 450
    assert (tmp_path / "scaling_law.png").stat().st_size > 10_000
    assert {r["method"] for r in csv.DictReader((tmp_path / "scaling_law.csv").open())} == set(TRUE)


def test_envelope_keeps_record_lows_only():
    pts = [(1, 5.0), (2, 4.0), (2, 3.9), (3, 4.5), (4, 3.0), (5, 3.2)]
    assert scaling_law.envelope(pts) == [(1, 5.0), (2, 3.9), (4, 3.0)]


def test_scaling_law_bad_input(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("method,loss\nadamw,3.0\n")
    out = run_tool("scaling_law.py", str(bad))
    assert out.returncode != 0 and "needs columns method, tail_loss" in out.stderr
    only = write_csv(tmp_path / "one.csv", [r for r in synthetic_runs() if r["method"] == "muon"])
    out = run_tool("scaling_law.py", str(only))
    assert out.returncode != 0 and "baseline 'adamw' has no runs" in out.stderr


def run_tool(name, *args, timeout=120):
    # one thread, as the suite's fork server has (tests/conftest.py): a tool's 1-process runs are
    # forked from it instead of importing torch afresh
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "tools" / name), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)  # fmt: skip


def fake_run(
    root: Path, name: str, lr: float, best: float, iters=40, stop=None, nan=False, every=1
):
    """A metrics.jsonl whose loss ends near 3 + (log2(lr/best))² / 10, logged as megatron logs
    (``every``: --log-interval; iteration 1 always)."""
    d = root / name
    d.mkdir(parents=True)
    final = 3.0 + math.log2(lr / best) ** 2 / 10
    with (d / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"type": "run", "args": {}}) + "\n")
        for i in range(1, (stop or iters) + 1):
            if i % every and i != 1:
                continue
            loss = final + 2.0 * (1 - i / iters) ** 2
            if nan and i > iters // 2:
                loss = float("nan")
            f.write(json.dumps({"type": "train", "iteration": i, "lm loss": loss}) + "\n")
    if stop:  # killed mid-write: a partial last line
        with (d / "metrics.jsonl").open("a") as f:
            f.write('{"type": "train", "itera')
    return d


def test_a_run_killed_mid_write_and_requeued_reads_on(tmp_path):
    """The requeued run's writer ends the partial line first (metrics.end_partial_line); the
    reader skips a partial row before a restart's run row, on its own line or (files written
    before the writer did that) on the same line, and still refuses garbage elsewhere."""
    from runlog import LogError, read_log

    from megatron.md.train import metrics

    def rows(lo, hi, loss):
        return "".join(json.dumps({"type": "train", "iteration": i, "lm loss": loss}) + "\n"
                       for i in range(lo, hi))  # fmt: skip

    run = json.dumps({"type": "run", "args": {}}) + "\n"
    f = tmp_path / "metrics.jsonl"
    for ended in (True, False):
        f.write_text(run + rows(1, 4, 3.0) + '{"type": "train", "itera')
        if ended:
            metrics.end_partial_line(str(f))
        f.write_text(f.read_text() + run + rows(3, 6, 2.0))  # the requeued run appends
        assert [r["lm loss"] for _, r in sorted(read_log(f).train.items())] == [3.0] * 2 + [2.0] * 3
    metrics.end_partial_line(str(f))  # a whole last line: nothing added
    assert f.read_text().endswith("}\n") and not f.read_text().endswith("\n\n")
    metrics.end_partial_line(str(tmp_path / "none.jsonl"))  # no file: nothing made
    assert not (tmp_path / "none.jsonl").exists()
    f.write_text(run + '{"type": "train", "itera\n' + rows(1, 3, 3.0))
    with pytest.raises(LogError, match="metrics.jsonl:2: not a JSON line"):
        read_log(f)


def test_a_restart_supersedes_what_earlier_attempts_logged_beyond_it(tmp_path):
    """A run logged iterations 1-8 (evaluations at 4 and 8), was rewound to its checkpoint at 4
    (``--ckpt-step 4``) and has logged 5-6 since: its curve is 1-4 of the first attempt and 5-6
    of the second; 7-8 and the evaluation at 8 belong to a branch no longer in the run (the
    tail loss and the last iteration are the second attempt's), the evaluation at 4 stays."""
    from runlog import read_log

    def rows(kind, its, loss):
        return "".join(json.dumps({"type": kind, "iteration": i, "lm loss": loss}) + "\n"
                       for i in its)  # fmt: skip

    run = json.dumps({"type": "run", "args": {}}) + "\n"
    f = tmp_path / "metrics.jsonl"
    f.write_text(run + rows("train", range(1, 5), 3.0) + rows("valid", [4], 3.5)
                 + rows("train", range(5, 9), 2.5) + rows("valid", [8], 3.4)
                 + run + rows("train", range(5, 7), 2.0))  # fmt: skip
    log = read_log(f)
    assert log.losses() == [(1, 3.0), (2, 3.0), (3, 3.0), (4, 3.0), (5, 2.0), (6, 2.0)]
    assert sorted(log.valid) == [4] and log.last_iteration() == 6
    assert log.tail_loss(3) == (3.0 + 2.0 + 2.0) / 3


def test_lr_sweep_finds_optimum_and_reports_broken_runs(tmp_path):
    lrs = [1e-3 * 2**k for k in range(6)]
    optimum = {("tiny", "adamw"): 4e-3, ("tiny", "muonmd"): 32e-3, ("dense-181M", "muonmd"): 8e-3}
    entries = []
    for (size, method), best in optimum.items():
        for lr in lrs:
            name = f"{size}-{method}-lr{lr:g}"
            kw = {}
            if (method, lr) == ("adamw", 32e-3):
                kw = {"nan": True}
            elif (method, lr) == ("adamw", 16e-3):
                kw = {"stop": 30}
            if size == "dense-181M" and lr == 1e-3:  # megatron logging every 2nd iteration
                kw = {"every": 2, "iters": 80}
            if not (method == "muonmd" and lr == 1e-3 and size == "tiny"):  # never started
                fake_run(tmp_path, name, lr, best, **kw)
            iters = kw.get("iters", 40)
            flags = [f"--preset={size}", f"--train-iters={iters}", "--global-batch-size=8",
                     "--seq-length=64"]  # fmt: skip
            meta = {"size": size, "method": method, "matrix_lr": lr}
            entries.append({"name": name, "flags": flags, "meta": meta,
                            "run_dir": str(tmp_path / name)})  # fmt: skip
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"experiment": "synthetic", "runs": entries}))
    out = run_tool("lr_sweep.py", str(manifest), "--out", str(tmp_path / "a"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "a" / "lr_sweep.json").read_text())
    best = {(b["size"], b["method"]): b["best_lr"] for b in report["optima"]}
    assert best == pytest.approx(optimum)
    status = {r["name"]: r["status"] for r in report["runs"]}
    assert status["tiny-adamw-lr0.032"] == "diverged"
    assert status["tiny-adamw-lr0.016"] == "incomplete"
    assert status["tiny-muonmd-lr0.001"] == "missing"
    assert sum(s == "ok" for s in status.values()) == 18 - 3
    for name in ("tiny-adamw-lr0.032", "tiny-adamw-lr0.016", "tiny-muonmd-lr0.001"):
        assert name in out.stderr
    edge = {(b["size"], b["method"]): b["at_grid_edge"] for b in report["optima"]}
    assert edge[("tiny", "muonmd")] and not edge[("tiny", "adamw")]  # 32e-3: the grid's top
    rows = list(csv.DictReader((tmp_path / "a" / "lr_sweep.csv").open()))
    r = next(r for r in rows if r["name"] == "tiny-adamw-lr0.004")
    assert float(r["tail_loss"]) == pytest.approx(3.0 + 2.0 * np.mean(
        [(1 - i / 40) ** 2 for i in range(16, 41)]))  # fmt: skip
    assert int(r["tokens"]) == 40 * 8 * 64 and int(r["n_active_non_embedding"]) > 0
    assert int(r["tail_iterations"]) == 25
    # a run logged every 2nd iteration: scored on its last 25 logged losses (iterations 32-80)
    # and named, not taken for the paper's 25-iteration tail unseen
    r = next(r for r in rows if r["name"] == "dense-181M-muonmd-lr0.001")
    assert r["status"] == "ok" and int(r["tail_iterations"]) == 49
    assert "dense-181M-muonmd-lr0.001: ok (its last 25 logged losses span 49" in out.stderr
    assert sum("span" in ln for ln in out.stderr.splitlines()) == 1
    for png in ("lr_sweep.png", "lr_transfer.png"):
        assert (tmp_path / "a" / png).stat().st_size > 10_000


def test_an_ablation_figure_command_reads_its_runs_beside_the_dense_grid_runs(tmp_path):
    """The gain-axis figure's command as docs/experiments.md gives it, on manifests that
    sweep.py plans (dense-grid and ablation-gains at three LRs, fake logs): lr_sweep reads
    the ablation's scalar, row and column arms and dense-grid's MuonMD at 181M (the recipe, row
    and column gains) and its sphere alone, and nothing else of dense-grid (other sizes and
    methods)."""
    import shlex

    sys.path.insert(0, str(ROOT / "examples" / "md_decoupling"))
    import experiments
    import sweep

    lrs = [4e-3, 8e-3, 16e-3]
    for exp in ("dense-grid", "ablation-gains"):
        root = tmp_path / "runs" / exp
        runs = sweep.plan(exp, lrs, str(root), 1, None)
        for r in runs:
            fake_run(root, r.name, r.meta["matrix_lr"], 8e-3, iters=30)
        entries = [{"name": r.name, "flags": [f for f in r.flags if "train-iters" not in f],
                    "meta": r.meta, "run_dir": str(root / r.name)} for r in runs]  # fmt: skip
        (root / "manifest.json").write_text(json.dumps({"experiment": exp, "runs": entries}))
    cmd = next(c for fig, _, _, c in experiments.PAPER if fig == "Fig. gain-axis (left)")
    argv = shlex.split(cmd.replace("runs/", f"{tmp_path}/runs/"))
    assert argv[:2] == ["python", "tools/lr_sweep.py"]
    out = subprocess.run([sys.executable, str(ROOT / argv[1]), *argv[2:]], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "runs/ablation-gains/analysis/lr_sweep.json").read_text())
    lines = {(b["size"], b["method"], b["variant"]): b["runs"] for b in report["optima"]}
    want = {("dense-181M", "muonmd", v): 3 for v in ("", "frobenius", "scalar", "row", "col")}
    assert lines == want
    assert all(b["best_lr"] == 8e-3 for b in report["optima"])


def test_lr_sweep_bad_manifest(tmp_path):
    out = run_tool("lr_sweep.py", str(tmp_path / "nope.json"))
    assert out.returncode != 0 and "nope.json: no such manifest" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": [{"name": "x"}]}')
    out = run_tool("lr_sweep.py", str(bad))
    assert out.returncode != 0 and "not a sweep manifest" in out.stderr


def test_plot_curves_places_a_continual_run_after_its_source(tmp_path):
    """The re-warming figure: an --init-from run's curve starts at its source's last
    checkpointed iteration; --smooth is a running mean; a run without the metric is named."""
    import plot_curves

    src = fake_run(tmp_path, "source", 1e-3, 1e-3, iters=10)
    (src / "latest_checkpointed_iteration.txt").write_text("10\n")
    arm = fake_run(tmp_path, "arm", 1e-3, 1e-3, iters=6)
    text = (arm / "metrics.jsonl").read_text().splitlines()
    text[0] = json.dumps({"type": "run", "args": {"init_from": str(src)}})
    (arm / "metrics.jsonl").write_text("\n".join(text) + "\n")
    runs = plot_curves.main([str(src), f"reuse={arm}", "--metric", "lm loss", "--smooth", "3",
                             "--out", str(tmp_path / "a")])  # fmt: skip
    assert runs["source"][0] == 0 and [i for i, _ in runs["source"][1]["lm loss"]][0] == 1
    assert runs["reuse"][0] == 10 and [i for i, _ in runs["reuse"][1]["lm loss"]] == list(
        range(11, 17))  # fmt: skip
    assert plot_curves.smooth([(1, 1.0), (2, 2.0), (3, 6.0)], 3) == [(3, 3.0)]
    assert (tmp_path / "a" / "curves.png").stat().st_size > 10_000
    out = run_tool("plot_curves.py", str(src), "--metric", "nope")
    assert out.returncode != 0 and "none of nope" in out.stderr


def test_paired_comparison_by_seed(tmp_path):
    """tools/paired.py: arms paired by seed against the reference; the paired differences'
    t-interval and a verdict against the threshold (ahead / behind / equal / undecided); an arm
    without a shared seed and a run without a validation row are named, not mis-paired."""
    import paired

    finals = {  # arm -> seed -> final validation loss
        "muonmd": {1: 4.000, 2: 4.010, 3: 3.990},
        "sphere": {1: 4.030, 2: 4.041, 3: 4.020},  # behind by 0.030 ± 0.001
        "muonh": {1: 4.001, 2: 4.009, 3: 3.991},  # equal
        "muon": {1: 3.900, 2: 4.050, 3: 4.000},  # spread: undecided
        "adamw": {9: 4.2},  # no shared seed
    }
    runs = []
    for arm, seeds in finals.items():
        for seed, v in seeds.items():
            d = tmp_path / f"{arm}-{seed}"
            d.mkdir()
            rows = [{"type": "run", "args": {}}, {"type": "train", "iteration": 1, "lm loss": 9.0},
                    {"type": "valid", "iteration": 1, "lm loss": v}]  # fmt: skip
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            runs.append({"name": d.name, "meta": {"method": arm, "seed": seed, "part": "long"},
                         "run_dir": str(d)})  # fmt: skip
    (tmp_path / "late").mkdir()  # never validated: left out
    runs.append({"name": "late", "meta": {"method": "muon", "seed": 4, "part": "long"},
                 "run_dir": str(tmp_path / "late")})  # fmt: skip
    (tmp_path / "m.json").write_text(json.dumps({"runs": runs}))
    rep = paired.main([str(tmp_path / "m.json"), "--ref", "muonmd", "--threshold", "0.01"])
    arms = rep["arms"]
    assert arms["sphere"]["verdict"] == "behind" and arms["sphere"]["signs"] == "+++"
    assert arms["sphere"]["diff_mean"] == pytest.approx(0.0303333, abs=1e-6)
    assert arms["muonh"]["verdict"] == "equal"
    assert arms["muon"]["verdict"] == "undecided" and arms["muon"]["seeds"] == [1, 2, 3]
    assert "verdict" not in arms["adamw"] and "verdict" not in arms["muonmd"]
    assert paired.verdict(-0.05, -0.02, 0.01) == "ahead"
    out = run_tool("paired.py", str(tmp_path / "m.json"), "--ref", "nope")
    assert out.returncode != 0 and "reference arm 'nope' has no finished runs" in out.stderr


TOOLS = ("throughput.py", "lr_sweep.py", "scaling_law.py", "plot_diagnostics.py", "plot_curves.py",
         "paired.py", "from_authors.py", "fb_dispatch.py")  # fmt: skip


@pytest.mark.parametrize("tool", TOOLS)
def test_tools_explain_themselves(tool):
    out = run_tool(tool, "--help")
    assert out.returncode == 0 and len(out.stdout) > 500, out.stderr


def test_throughput_eager_variants_are_the_recipes_with_the_eager_step():
    """throughput.py's ``adammd-eager`` / ``muonmd-eager``: AdamMD's / MuonMD's recipe with
    ``--md-fused-step off`` (the GPU check's rows beside the default, compiled on a GPU at
    ``dense-181M``), against AdamW / Muon; not in the default methods."""
    import gpu_check
    import megatron.training.global_vars as gv
    import throughput

    from megatron.md.train import cli

    cases = (("adammd-eager", "adammd", "adamw"), ("muonmd-eager", "muonmd", "muon"))
    for name, recipe, base in cases:
        flags = throughput.method_flags(name, 4e-3)
        assert flags == [*throughput.method_flags(recipe, 4e-3), "--md-fused-step=off"]
        gv.unset_global_variables()
        argv = gpu_check._pretrain_flags("tiny", 2, flags)  # as the GPU check runs it
        _, md = cli.parse(argv, on_cpu=True)
        assert md.fused_step == "off" and not md.use_fused("cuda", 1 << 30)
        assert throughput.BASE[name] == base
        gv.unset_global_variables()
    for name, recipe, base in (
        ("adammd-graph", "adammd", "adamw"),
        ("muonmd-graph", "muonmd", "muon"),
    ):
        flags = throughput.method_flags(name, 4e-3)  # (GPU only: the parse refuses a CPU)
        assert flags == [*throughput.method_flags(recipe, 4e-3), "--md-cuda-graph"]
        assert throughput.BASE[name] == base
    # the base once more, against itself: the spread between two runs of one recipe
    assert throughput.method_flags("adamw-again", 4e-3) == throughput.method_flags("adamw", 4e-3)
    assert throughput.BASE["adamw-again"] == "adamw"


@pytest.mark.distributed
def test_throughput_cpu_smoke_run(tmp_path):
    """Run mode: MuonMD through pretrain_gpt.py (tiny preset, 1 process), its MD phases in the
    table (the slowdown against a base, and all four methods' logs: test_pretrain_e2e.py's
    ``--logs`` test); a method that fails (``muonmd-graph``: a CPU refuses --md-cuda-graph) is
    named, the others are still tabled, and the tool exits 1."""
    out = run_tool("throughput.py", "--preset=tiny", "--iters=6", "--warmup=2", "--nproc=1",
                   "--methods", "muonmd-graph", "muonmd", f"--out={tmp_path}",
                   timeout=900)  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert "muonmd-graph failed (exit " in out.stderr
    assert "failed: muonmd-graph (the table has the others)" in out.stderr
    res = json.loads((tmp_path / "throughput.json").read_text())
    assert list(res) == ["muonmd"]
    r = res["muonmd"]
    assert r["measured_iterations"] == 4 and r["tokens_per_s_per_gpu"] > 0
    assert {"md-step", "optimizer-inner-step"} <= set(r["phases_ms"])
    assert r["slowdown_vs_base"] is None  # Muon did not run: no ratio, not a wrong one
    table = out.stdout.splitlines()
    assert sum(line.split(" | ")[0] in res for line in table) == 1
    assert (tmp_path / "throughput.png").stat().st_size > 10_000


@pytest.mark.distributed
def test_md_adds_no_operation_to_the_forward_backward(tmp_path):
    """fb_dispatch.py: AdamMD's forward-backward in a real pretrain_gpt.py run dispatches exactly
    AdamW's operations, in the same order on tensors of the same dtype, shape, strides and
    storage offset (MD lives in the optimizer step; the model keeps one fused weight): a hook, a
    reparametrized weight or a weight the step left laid out differently would show here. As the
    H100 throughput runs that saw AdamMD's forward-backward slower: bf16 with fp32 main params,
    MD's compiled step."""
    out = run_tool("fb_dispatch.py", "--methods", "adamw", "adammd", "--iters=1",
                   f"--json={tmp_path / 'fb.json'}", "--", "--bf16", "--md-fused-step=on",
                   timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "fb.json").read_text())["results"]
    (base,), (md,) = res["adamw"]["ops"], res["adammd"]["ops"]
    assert base > 1000 and md == base and res["adammd"]["differing_ops"] == {}, res
    assert res["adammd"]["by_op"]["aten.mm.default"] > 10  # the model's products were counted
    seq = res["adamw"]["sequence"]
    assert len(seq) == base and res["adammd"]["sequence_differs"] is None
    mm = next(s for s in seq if s.startswith("aten.mm.default bfloat16["))  # layouts recorded
    assert "/[" in mm and "]+" in mm, mm
    # the comparison sees a layout alone: the same operation, one tensor's strides changed
    moved = [*seq[:5], seq[5].replace("/[", "/[9, ", 1), *seq[6:]]
    assert fb_dispatch.first_difference(seq, moved)["index"] == 5
    assert fb_dispatch.first_difference(seq, moved)["positions_differing"] == 1
    assert fb_dispatch.first_difference(seq, seq[:-1])["index"] == len(seq) - 1


@pytest.mark.distributed
def test_bench_md_step_smoke(tmp_path):
    """bench_md_step.py end to end on small shapes (2 ranks): every ratio, MD's all-reduce
    payload by formula and the state ratio (numbers, not timings)."""
    out = run_tool("bench_md_step.py", "--model", "smoke", "--vocab-size", "512", "--steps", "2",
                   "--json", str(tmp_path / "b.json"), timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (world,) = json.loads((tmp_path / "b.json").read_text())
    row = world["results"]["smoke fp32"]
    pairs = {"adam_md/adam", "adam_md_eager/adam", "adam_md_fused/adam", "muon_md/muon",
             "adam_md layer-wise/zero1"}  # fmt: skip
    assert world["world"] == 2 and set(row["pairs"]) == pairs
    ratios = row["ratios"]
    assert all(v > 0 for v in ratios.values()) and len(ratios) == 15
    # 2 layers × (qkv 384×128 with a norm per Q/K/V block, proj 128×128, fc1 512×128, fc2
    # 128×256): d_out + d_in + one norm per block each; the 512-row embedding and LM head one
    # norm per row, the LM head's row and column gains (512 + 128); fp32
    matrices = 2 * ((384 + 128 + 3) + (128 + 128 + 1) + (512 + 128 + 1) + (128 + 256 + 1))
    assert row["bytes"]["md_allreduce"] == 4 * (matrices + 2 * 512 + 512 + 128)
    assert 1.0 < ratios["state bytes md/base (bf16 params)"] <= 1.02


@pytest.mark.distributed
def test_bench_md_step_profile_compares_each_base_with_its_md_step():
    """--profile (the GPU check's "profile" step): one step each of Adam, AdamMD, Muon and
    MuonMD, the summed self time and the ten costliest ops, the MD steps inside MDInner."""
    out = run_tool("bench_md_step.py", "--profile", "--model", "smoke", "--world", "1",
                   "--vocab-size", "512", timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("prof smoke fp32 ")]
    runs = ("adam", "adam+MD", "muon", "muon+MD")
    for run in runs:
        mine = [x for x in lines if x.split()[3] in (run, run + ":")]
        assert len(mine) == 11 and float(mine[0].split()[4]) > 0, lines
        assert any("MDInner.step" in x for x in mine) == run.endswith("+MD"), mine


def test_profile_sums_each_kernel_once():
    """--profile's total: on a CPU the ops' self time without the optimizer's
    ``record_function`` range (a real profile: the range's own 30 ms sleep is not an op's); on
    a GPU the kernel events alone — an aten op's device time is its kernels', a GPU annotation's
    their span (torch's event fields, stubbed: no GPU here)."""
    import time
    from types import SimpleNamespace as E

    import bench_md_step
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as p:
        with record_function("Optimizer.step#X.step"):
            time.sleep(0.03)
            torch.ones(64, 64) @ torch.ones(64, 64)
    ev = p.key_averages()
    ops = sum(e.self_cpu_time_total for e in ev if not e.is_user_annotation)
    assert bench_md_step._own_time(ev, cuda=False) == pytest.approx(ops)
    assert sum(e.self_cpu_time_total for e in ev) - ops > 2e4  # the range's 30 ms: left out
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    ev = [E(device_type=cpu, is_user_annotation=False, self_device_time_total=7.0),  # aten::bmm
          E(device_type=gpu, is_user_annotation=False, self_device_time_total=7.0),  # its kernel
          E(device_type=gpu, is_user_annotation=True, self_device_time_total=9.0)]  # fmt: skip
    assert bench_md_step._own_time(ev, cuda=True) == 7.0


def test_profile_host_lines_list_the_host_side_of_a_gpu_step():
    """--profile on a GPU adds the host's side: the CPU ops' summed self time, the kernel
    launches (runtime, driver and graph launches; not a kernel's device event) and the costliest
    ops by CPU time, costliest first (torch's event fields, stubbed: no GPU here)."""
    from types import SimpleNamespace as E

    import bench_md_step
    import torch

    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(key, us, n=1, dev=cpu, note=False):
        return E(key=key, self_cpu_time_total=us, count=n, device_type=dev,
                 is_user_annotation=note)  # fmt: skip

    events = [ev("aten::add_", 300.0, 10), ev("cudaLaunchKernel", 900.0, 40),
              ev("cuLaunchKernel", 200.0, 6), ev("triton_poi_fused_0", 50.0, 6, dev=gpu),
              ev("Optimizer.step#MDInner.step", 5000.0, note=True),
              ev("cudaDeviceSynchronize", 1500.0)]  # fmt: skip
    lines = bench_md_step.host_lines("prof host 181M bf16 adam+MD", events, top=3)
    assert lines[0] == "prof host 181M bf16 adam+MD: 2.90 ms of host ops, 46 kernel launches"
    assert [x.split()[-1] for x in lines[1:]] == ["cudaDeviceSynchronize", "cudaLaunchKernel",
                                                  "aten::add_"]  # fmt: skip
    assert lines[2].split()[5:7] == ["0.90", "ms"] and lines[2].split()[7] == "40x"


@pytest.mark.distributed
def test_bench_md_step_under_tensor_parallelism(tmp_path):
    """--tp 2: every matrix split as megatron splits it (column/row-parallel, SwiGLU stride 2,
    vocab-parallel rows); MD's all-reduce payload is the FULL matrices' partials (the TP sum
    folded in, independent of the TP size), set against megatron's TP activation all-reduces
    at the paper's batch."""
    out = run_tool("bench_md_step.py", "--model", "smoke-tp", "--vocab-size", "512", "--steps", "2",
                   "--tp", "2", "--runs", "adam", "adam_md", "--json", str(tmp_path / "b.json"),
                   timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (world,) = json.loads((tmp_path / "b.json").read_text())
    row = world["results"]["smoke-tp fp32"]
    assert (world["world"], world["tp"]) == (2, 2) and set(row["pairs"]) == {"adam_md/adam"}
    # full shapes: 2 layers × (qkv 768×128 with a norm per Q/K/V block, proj 128×256, fc1
    # 512×128, fc2 128×256), rows of the 512-row embedding and LM head, the LM head's gains
    matrices = 2 * ((768 + 128 + 3) + (128 + 256 + 1) + (512 + 128 + 1) + (128 + 256 + 1))
    assert row["bytes"]["md_allreduce"] == 4 * (matrices + 2 * 512 + 512 + 128)
    assert row["bytes"]["megatron_tp_activations"] == 4 * 2 * (128 * 4096) * 128 * 2
    assert 0 < row["ratios"]["md all-reduce / megatron TP all-reduce bytes"] < 1e-4


def test_figure_style_is_one_colour_per_method_and_sizes_in_numeric_order(tmp_path):
    """Every figure colours a method the same way whatever its spelling (MuonMD red, as in the
    paper), orders sizes by their numbers, and lr_sweep.py --replot redraws from its CSV."""
    from megatron.md.figstyle import METHOD_COLORS, method_color, natural_key, ordered_colors

    assert method_color("MuonMD") == method_color("muon_md") == METHOD_COLORS["muonmd"]
    assert method_color("AdamW") == method_color("adam") != method_color("adammd")
    assert method_color("lion") is None and len(set(METHOD_COLORS.values())) == len(METHOD_COLORS)
    assert sorted(["d256", "d64", "d128"], key=natural_key) == ["d64", "d128", "d256"]
    assert list(ordered_colors(["457M", "181M", "1290M"])) == ["181M", "457M", "1290M"]
    csv_path = tmp_path / "lr_sweep.csv"
    csv_path.write_text(
        "name,size,method,variant,matrix_lr,status,tail_loss\n"
        "a,d64,adamw,,0.01,ok,3.0\nb,d64,adamw,,0.02,ok,2.9\nc,d128,muonmd,,0.01,ok,2.8\n"
        "d,d128,muonmd,seed 1235,0.01,ok,2.6\n"
    )
    out = run_tool("lr_sweep.py", str(csv_path), "--replot", "--out", str(tmp_path / "f"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "f" / "lr_sweep.png").stat().st_size > 0
    assert (tmp_path / "f" / "lr_transfer.png").stat().st_size > 0
    # runs that differ only by seed: one curve, the mean and the range
    assert lr_sweep.seedless("seed 1235") == "" and lr_sweep.seedless("sphere row") == "sphere row"
    pts = [
        {"x": 0.01, "tail_loss": 2.8},
        {"x": 0.01, "tail_loss": 2.6},
        {"x": 0.02, "tail_loss": 3.0},
    ]
    xs, mean, lo, hi = lr_sweep.seed_stats(pts)
    assert xs == [0.01, 0.02] and mean == pytest.approx([2.7, 3.0])
    assert (lo, hi) == ([2.6, 3.0], [2.8, 3.0])


@pytest.mark.distributed
def test_bench_dispatch_counts(tmp_path):
    """bench_dispatch.py end to end (one process, megatron's optimizers): MD's step issues
    fewer operations than a few per added matrix (12 → 24 layers' worth at a tiny width: 2 → 4
    here) and its own code reads nothing back to the host (the counts; the timing is printed,
    not asserted)."""
    out = run_tool("bench_dispatch.py", "--hidden-size", "32", "--vocab-size", "128",
                   "--num-layers", "2", "4", "--rounds", "1", "--json", str(tmp_path / "d.json"),
                   timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "d.json").read_text())["results"]
    assert set(res) == {"adam_md/adam", "muon_md/muon"}
    for r in res.values():
        assert r["extra_ops_per_added_matrix"] <= 4, r
        assert r["md_code_syncs"] == {"2": 0, "4": 0}, r
        assert r["time_ratio"] > 0
        for run in r["bytes"]["2"]:  # traffic grows with the layers
            assert r["bytes"]["4"][run] > r["bytes"]["2"][run] > 0, r
        for n in ("2", "4"):  # launches leave out views and host reads (Adam's: its steps)
            for run, ops in r["ops"][n].items():
                assert 0 < r["launches"][n][run] <= ops - r["syncs"][n][run], r
    # MuonMD multiplies the matrices Muon does (Newton–Schulz, batched per shape) and adds only
    # its partials' matrix-vector products (seen: 1.008 here); Adam multiplies none
    muon = res["muon_md/muon"]
    assert 1.0 <= muon["flop_ratio"] < 1.02, muon["matmul_flops"]
    assert res["adam_md/adam"]["flop_ratio"] is None


def test_bench_dispatch_moe_layout_is_regular_pieces():
    """``bench_dispatch.py --experts``' model is the MoE ladder's layout at expert-parallel size
    1 (a dense first layer, then layers of experts, a shared expert and a router: 2 + 4 + 13 a
    layer of 4 experts), built in megatron's DDP and optimizer: its expert groups are no one
    strided view of megatron's gradient buffer but one regular (layers, experts) grid, its
    attention's matrices two pieces (the dense first layer apart); and --experts refuses
    --model. ``--bucket-size`` builds megatron's buckets of that size; ``--nproc 0`` refused."""
    import bench_dispatch

    from megatron.md import testing
    from megatron.md.engine.geometry import strided_rows
    from megatron.md.leaves import leaf_optimizers

    testing.one_process_group()
    opt, matrices = bench_dispatch.build(48, 3, "adam_md", 128, "off", None, 4)
    assert matrices == 2 + 4 + 2 * 13
    pieces = {}
    for g in leaf_optimizers(opt)[0].optimizer.engine.groups:
        grads = [m.main.grad for m in g.members]
        if g.B > 1 and strided_rows(grads) is None:
            pieces[(g.B, g.full)] = g.grad_pieces()[1]
    for shape in ((64, 48), (48, 32)):  # the experts' matrices (fc1: SwiGLU's 2 x 32 rows)
        experts = pieces.pop((8, shape))
        assert len(experts) == 1 and experts[0][1:3] == (2, 4), experts
    assert set(pieces) == {(3, (96, 48)), (3, (48, 48))}, pieces  # QKV and proj: 2 pieces
    assert all(len(p) == 2 for p in pieces.values()), pieces
    out = run_tool("bench_dispatch.py", "--experts", "4", "--model", "181M", timeout=120)
    assert out.returncode == 2 and "leave out --model" in out.stderr
    # --bucket-size: megatron's buckets of about that many elements, overlapped (a cluster's)
    opt, _ = bench_dispatch.build(48, 3, "adam", 128, "off", None, 0, bucket=20000)
    (leaf,) = leaf_optimizers(opt)
    assert sum(len(b.buckets) for b in leaf.buffers) > 3 and leaf.config is not None
    # one rank shards nothing: no slice cut inside a matrix, MD or not
    md, _ = bench_dispatch.build(48, 3, "adam_md", 128, "off", None, 0, bucket=20000)
    assert bench_dispatch.cut_groups(opt) == bench_dispatch.cut_groups(md) == (0, 0)
    assert len(leaf_optimizers(md)[0].optimizer.engine.groups) > 0
    out = run_tool("bench_dispatch.py", "--nproc", "0", timeout=120)
    assert out.returncode == 2 and "at least one rank" in out.stderr


def test_the_merged_run_raises_the_merge_limit_while_its_pair_steps():
    """bench_md_step's ``adam_md_merged`` (the GPU check's 181M row: phase 1 and the fuse one
    compiled call each): MERGE_ELEMENTS 2^28 while its pair steps, as it was after."""
    import bench_md_step

    from megatron.md.engine import compiled

    saved = compiled.MERGE_ELEMENTS
    assert bench_md_step.PAIRS["adam_md_merged/adam"] == ("adam", "adam_md_merged")
    with bench_md_step.merge_limit(bench_md_step.MERGED_ELEMENTS):
        assert compiled.MERGE_ELEMENTS == 1 << 28 == 4 * saved
    with bench_md_step.merge_limit(None):
        assert compiled.MERGE_ELEMENTS == saved
    assert compiled.MERGE_ELEMENTS == saved


def test_dispatch_count_takes_a_compiled_call_as_one_op():
    """bench_dispatch --fused-step on: a compiled MD kernel's call counts as one operation
    (dynamo cannot run under the counter: the call runs its function unseen), with the kernel's
    arithmetic and a fused kernel's bytes (x, row, col read, out written in place: counted as
    read and written); the real kernels are back after the count."""
    import bench_dispatch
    import torch

    from megatron.md.engine import compiled, formulas

    real = compiled._get
    x, row, col = torch.full((2, 3), 2.0), torch.full((2, 1), 3.0), torch.ones(1, 3)
    out = torch.empty(2, 3)
    got = bench_dispatch.count(lambda: compiled._get("fuse", formulas._fuse)(x, row, col, out))
    assert got[0] == 1 and torch.equal(out, torch.full((2, 3), 6.0))
    assert got[3] == 4 * (6 + 2 + 3) + 2 * 4 * 6
    assert compiled._get is real


def test_bytes_moved_count_reads_and_writes_not_views():
    """bench_dispatch.count's traffic: an in-place op reads and writes its tensor, a copy reads
    one and writes the other, a view or an allocation moves nothing, a fill writes only."""
    import bench_dispatch
    import torch

    x, y = torch.zeros(1000), torch.zeros(1000, dtype=torch.bfloat16)
    assert bench_dispatch.count(lambda: x.add_(1))[3] == 8000
    assert bench_dispatch.count(lambda: y.copy_(x))[3] == 4000 + 2 * 2000
    assert bench_dispatch.count(lambda: x.view(10, 100).t())[3] == 0
    # an allocation moves nothing, a fill writes its result only (the argument: a shape)
    assert bench_dispatch.count(lambda: torch.empty_like(x))[3] == 0
    assert bench_dispatch.count(lambda: x.new_ones(10))[3] == 40
    assert bench_dispatch.count(lambda: torch.zeros_like(y))[3] == 2000
    # a reshape that cannot view: one copy (read and write), its _unsafe_view nothing
    assert bench_dispatch.count(lambda: x.view(10, 100).t().reshape(-1))[3] == 8000


def test_launch_count_leaves_out_views_host_reads_and_step_counters():
    """bench_dispatch.count's kernel launches: an elementwise op or a multi-tensor op is one, a
    view, an allocation or a host read none; an op on the host-side step counters alone (torch's
    Adam's ``state["step"]``, CPU tensors on a GPU too) none, Python numbers made tensors for
    it included; a compiled MD call one."""
    import bench_dispatch
    import torch

    from megatron.md.engine import compiled, formulas

    x, step = torch.zeros(10), torch.zeros(())
    launches = lambda f, host=frozenset(): bench_dispatch.count(f, host)[5]  # noqa: E731
    assert launches(lambda: x.add_(1)) == 1
    assert launches(lambda: torch._foreach_mul_([x, x + 0], 2.0)) == 2  # the add, the foreach
    assert launches(lambda: x.view(2, 5).t()) == 0
    assert launches(lambda: torch.empty_like(x)) == 0
    assert launches(lambda: x.sum().item()) == 1  # the sum; its read is the host's
    assert launches(lambda: torch._foreach_add_([step], torch.tensor(1.0)), {id(step)}) == 0
    assert launches(lambda: torch._foreach_add_([step], torch.tensor(1.0))) == 1
    assert launches(lambda: step.fill_(3), {id(step)}) == 0
    # Python numbers as where's branches: made on the host, the where itself launched
    assert launches(lambda: torch.where(x.isnan().all(), 0.0, float("nan"))) >= 2
    x3, row, col = torch.ones(2, 3), torch.ones(2, 1), torch.ones(1, 3)
    assert launches(lambda: compiled._get("fuse", formulas._fuse)(x3, row, col, x3)) == 1


def _phase1_many_args() -> tuple:
    """``formulas._phase1_many``'s arguments for two small groups: column and row gains with a
    Frobenius sphere (2 × 8 × 16), row gains with a row sphere (3 × 4 × 8), one partial
    buffer."""
    import torch

    from megatron.md.engine import formulas

    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.rand(shape, generator=gen) + 0.5

    hp = torch.tensor([1e-3, 1.0, 0.1, 0.999, 1e-3, 1e-8])
    parts = torch.zeros(2 * 25 + 3 * 8)
    one = torch.ones(())
    g1 = [rand(2, 8, 16), rand(2, 8, 16), rand(2, 8, 16), rand(2, 8, 16), rand(2, 8, 1),
          rand(2, 1, 16), hp, True, True, "frobenius", 0, 0, 25, 24, None, None, None]  # fmt: skip
    g2 = [rand(3, 4, 8), rand(3, 4, 8), rand(3, 4, 8), rand(3, 4, 8), rand(3, 4, 1), one, hp,
          True, False, "row", 0, 50, 8, 4, None, None, None]  # fmt: skip
    assert len(g1) == len(g2) == formulas.ITEM1
    return (1, parts, *g1, *g2)


def test_gpu_launches_of_a_multi_tensor_op_follow_multi_tensor_apply():
    """``--gpu-launches``: a multi-tensor op launches as torch's ``multi_tensor_apply`` does on
    a GPU (up to 320 chunks of 65536 elements and, by depth, 110/64/48/36/30 tensors a launch):
    megatron's Adam's two ``_foreach_addcdiv_`` at the 181M shapes (vocab 131072) 9 + 1
    launches, the 10 ``multi_tensor_apply_kernel`` the H200's profile listed (2026-12-04,
    docs/benchmarks/2026-12-04-h200.md); off its fast path (tensors of two dtypes) one a
    tensor; ``_foreach_norm`` its cleanup kernel more; a compiled call its Triton kernels
    (``test_triton_kernels_match_the_cpu_compile``)."""
    import bench_dispatch
    import torch

    chunk = bench_dispatch.MTA_CHUNK
    layer = [1024 * 512, 512 * 512, 4096 * 512, 512 * 2048]  # QKV, proj, fc1, fc2 (181M)
    decay = [131072 * 512, *layer * 12, 131072 * 512]
    assert bench_dispatch.mta_launches(decay, 3, scalar_list=True) == 9
    assert bench_dispatch.mta_launches([512] * 25, 3, scalar_list=True) == 1
    assert bench_dispatch.mta_launches([10] * 75, 3) == 2  # 48 tensors a launch at depth 3
    assert bench_dispatch.mta_launches([10] * 110, 1) == 1
    assert bench_dispatch.mta_launches([320 * chunk, 1], 1) == 2  # 320 chunks fill a launch
    assert bench_dispatch.mta_launches([0, 5, 0], 2) == 1  # empty tensors take no chunk

    def launches(f):
        return bench_dispatch.count(f, gpu=True)[5]

    xs = [torch.zeros(10) for _ in range(75)]
    assert launches(lambda: torch._foreach_addcmul_(xs, xs, xs)) == 2
    assert launches(lambda: torch._foreach_mul_(xs, 2.0)) == 1
    mixed = [torch.zeros(3), torch.zeros(3, dtype=torch.float64)]
    assert launches(lambda: torch._foreach_mul_(mixed, 2.0)) == 2
    assert launches(lambda: torch._foreach_norm(xs)) == 2
    # a compiled MD call: its Triton kernels (one launch without --gpu-launches)
    from megatron.md.engine import compiled, formulas

    args = _phase1_many_args()
    call = lambda: compiled._get("phase1_many", formulas._phase1_many)(*args)  # noqa: E731
    assert launches(call) == 5 and bench_dispatch.count(call)[5] == 1
    with pytest.raises(SystemExit):  # the compiled step's kernels only: --fused-step on
        bench_dispatch.main(["--gpu-launches"])


def test_triton_kernels_match_the_cpu_compile():
    """tools/triton_kernels.py: a compiled MD call's Triton kernels, generated here for an
    H100. Its path (make_fx, then AOT autograd and inductor on fake tensors laid out as the
    real arguments) writes the C++ kernels torch.compile writes for the same call on a CPU,
    names aside (AdamMD's merged phase 1 of two groups: column gains and a Frobenius sphere,
    row gains and a row sphere); for CUDA, the fuse of a stack is one pointwise kernel, the
    phase 1 five (torch 2.15.0): the first group's column sums (one reduction at this size; a
    split reduction, two, at 181M's), its row pass (Adam, the row partials, the norms' row
    partials), those summed per matrix, the second group's row pass, and its row norms added
    into the partials (a pointwise kernel of its own)."""
    import re

    import torch
    import triton_kernels
    from torch._inductor.graph import GraphLowering

    from megatron.md.engine import formulas

    before = [getattr(o, a) for o, a, _ in triton_kernels._seams()]
    inherited = [a for o, a, _ in triton_kernels._seams() if a not in vars(o)]
    args = _phase1_many_args()

    def phase1(*a):  # a code object of its own: dynamo compiles it here, whatever ran before
        return formulas._phase1_many(*a)

    seen = []
    saved = GraphLowering.save_output_code
    GraphLowering.save_output_code = staticmethod(seen.append)
    try:
        # the default stance: CPU mode runs torch.compile'd functions eagerly elsewhere
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch.compiler.set_stance("default"),
        ):
            torch.compile(phase1, dynamic=False, fullgraph=True)(*args)
    finally:
        GraphLowering.save_output_code = saved
    mine = triton_kernels.wrapper_code(formulas._phase1_many, args, "cpu")

    def kernels(code):  # the C++ source, the names of buffers, arguments and kernels aside
        code = code[code.index("cpp_fused") : code.index("async_compile.wait")]
        return re.sub(r"\b(arg|buf|in_ptr|out_ptr|tmp|x|cpp_fused)\w*", "_", code)

    assert seen and kernels(mine) == kernels(seen[-1])
    assert len(triton_kernels.launches(mine)) == 1  # a CPU: one C++ function of loops
    got = triton_kernels.kernels_of(formulas._phase1_many, args)
    assert len(got) == 5 and all(k.startswith("triton_") for k in got), got
    x, row, col, out = (
        torch.ones(2, 8, 16),
        torch.ones(2, 8, 1),
        torch.ones(2, 1, 16),
        torch.empty(2, 8, 16),
    )
    fuse = triton_kernels.kernels_of(formulas._fuse, (x, row, col, out))
    assert len(fuse) == 1 and fuse[0].startswith("triton_poi_"), fuse
    # a constant made in the graph (no row gains: the row partials a 0-d zero) is folded on the
    # CPU, the generated code's still CUDA's: one kernel (Adam, the norms' row partials), one
    # to sum them per matrix, one to fill the zero the call returns
    hp = args[8]
    one_group = (x, x.clone(), x.clone(), x.clone(), torch.ones(()), col, hp, None, False)
    got = triton_kernels.kernels_of(formulas._phase1_frobenius, one_group)
    assert len(got) == 3 and got[2].startswith("triton_poi_fused_new_zeros"), got
    # every seam restored, an inherited attribute deleted again (not left set on the class)
    assert [getattr(o, a) for o, a, _ in triton_kernels._seams()] == before
    assert inherited == [a for o, a, _ in triton_kernels._seams() if a not in vars(o)]


def test_matmul_flops_count_by_dtype():
    """bench_dispatch.count's matrix-product FLOPs: 2·m·n·k per product (batched: times the
    batch; matrix-vector: 2·m·k), keyed by the factors' dtype; an elementwise op adds none."""
    import bench_dispatch
    import torch

    x, y, v = torch.ones(4, 3), torch.ones(3, 5), torch.ones(3)
    assert bench_dispatch.count(lambda: x @ y)[4] == {"float32": 2 * 4 * 3 * 5}
    assert bench_dispatch.count(lambda: x @ v)[4] == {"float32": 2 * 4 * 3}
    assert bench_dispatch.count(lambda: x.add_(1))[4] == {}
    b, c = torch.ones(2, 4, 3, dtype=torch.bfloat16), torch.ones(2, 3, 5, dtype=torch.bfloat16)
    step = lambda: torch.baddbmm(torch.zeros(2, 4, 5, dtype=torch.bfloat16), b, c)  # noqa: E731
    assert bench_dispatch.count(step)[4] == {"bfloat16": 2 * 2 * 4 * 3 * 5}


def test_scaling_law_fit_exclude_plots_but_does_not_fit(tmp_path):
    """Paper, appendix "Scaling-law fitting": the undertrained 810M-active @ 7.5B point is
    plotted but kept out of the envelope and fit (``--fit-exclude``)."""
    rows = synthetic_runs()
    rows.append({"name": "moe-0.81B-6.7B-adamw-7.5B", "method": "adamw", "compute": 5e17,
                 "tail_loss": 10.0, "status": "ok"})  # fmt: skip  # would be a record low
    path = write_csv(tmp_path / "runs.csv", rows)
    args = [str(path), "--target-loss", "8.4", "--bootstrap", "20", "--out", str(tmp_path)]
    assert scaling_law.main(args)["fits"]["adamw"]["n"] == 11  # the odd point bends the fit
    res = scaling_law.main([*args, "--fit-exclude", r"0\.81B.*-7\.5B$"])
    assert res["fits"]["adamw"]["n"] == 10
    assert abs(res["fits"]["adamw"]["alpha"] / 0.05 - 1) < 0.02
    assert res["not_fitted"] == {"adamw": [(5e17, 10.0)]}


def test_interference_figure_shows_the_two_effects(tmp_path):
    """Fig. interference (paper § Magnitude–Direction Interference) on its toy scale-invariant
    loss: the same normalized step turns a weight of norm 0.5 about 4× as far as one of norm 2
    (angular step atan(η/‖w‖)), and every step grows the norm (‖w_{t+1}‖² = ‖w_t‖² + η²) with
    no radial gradient; MD's direction keeps its norm and turns by the LR."""
    sys.path.insert(0, str(ROOT / "examples" / "md_decoupling"))
    import interference

    ps = interference.draw(tmp_path / "i.png", lr=0.1, steps=8)
    small, large, md = ps.values()

    def angle(p):
        return np.unwrap(np.arctan2(p[:, 1], p[:, 0]))

    assert np.diff(angle(small))[0] == pytest.approx(math.atan(0.1 / 0.5), rel=1e-9)
    assert np.diff(angle(large))[0] == pytest.approx(math.atan(0.1 / 2.0), rel=1e-9)
    r = np.linalg.norm(small, axis=1)
    assert np.allclose(r[1:] ** 2, r[:-1] ** 2 + 0.1**2, rtol=1e-12)  # the norm creeps up
    w = small[3]
    assert abs(float(interference.grad(w) @ w)) < 1e-12  # no radial gradient
    assert np.allclose(np.linalg.norm(md, axis=1), 1.0) and np.allclose(np.diff(angle(md)), 0.1)
    assert (tmp_path / "i.png").stat().st_size > 10_000
