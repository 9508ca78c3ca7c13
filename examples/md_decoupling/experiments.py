"""Every experiment of the paper as a list of runs for the SLURM front-end (``sweep.py``).

A *run* is a name (it encodes size, method, matrix LR and variant: it is also the run's
directory) plus ``pretrain_gpt.py`` flags; recipes and LR-transfer rules come from
``megatron/md/train/recipes.py``, sizes from ``presets.py``. ``PAPER`` maps each figure and
table of the paper to its experiment and the analysis command that draws it
(``docs/experiments.md`` is generated from it: ``python experiments.py --markdown``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.md.train.recipes import (  # noqa: E402
    BASE_TOKENS,
    GBS,
    METHODS,
    MOE_BASE_LR,
    SEQ,
    dense_recipe,
    fmt,
    iters_for,
    lr_grid,
    moe_recipe,
    transfer,
)


@dataclass
class Run:
    name: str
    flags: list[str]
    meta: dict = field(default_factory=dict)


def _seq_flags(iters: int, gbs: int = GBS) -> list[str]:
    return [f"--train-iters={iters}", f"--seq-length={SEQ}", f"--max-position-embeddings={SEQ}",
            f"--global-batch-size={gbs}", "--micro-batch-size={mbs}"]  # fmt: skip


def _dense_run(size: str, method: str, lr: float, tag: str = "", extra=(), iters=50_000, **meta):
    name = f"{size}-{method}-lr{fmt(lr)}" + (f"-{tag}" if tag else "")
    flags = [f"--preset={size}", *_seq_flags(iters), *dense_recipe(method, lr), *extra]
    return Run(name, flags, {"size": size, "method": method, "matrix_lr": lr, **meta})


DENSE_SIZES = (
    "dense-181M", "dense-307M", "dense-457M", "dense-827M", "dense-1.29B", "dense-205M",
    "dense-229M", "dense-252M", "dense-361M", "dense-646M", "dense-150M", "dense-1.54B",
)  # fmt: skip
WSD = ["--lr-decay-style=WSD", "--lr-wsd-decay-style=minus_sqrt", "--wsd-cooldown-fraction=0.2"]
WARMUP = {"w0": ["--lr-warmup-iters=0"], "w1000": ["--lr-warmup-iters=1000"]}

#: the sphere alone (fig. headline left: "fixing the weights onto a sphere improves the optimal
#: loss, and adding learnable magnitudes gives a further boost"): MD without gains
SPHERE_ONLY = ["--md-sphere=frobenius", "--md-gains=none"]

#: dense ablations on the 181M base × the LR grid: axis -> (methods, {variant: extra flags})
ABLATIONS: dict[str, tuple[tuple[str, ...], dict[str, list[str]]]] = {
    # "Normalization Axis" (fig. norm-axis): the constraint alone, without gains, every row or
    # column at unit norm as the authors' runs (gainz master.py ``_normalize``: radius 1 per
    # row/column, sqrt(max(d_out, d_in)) only for the Frobenius sphere); its Frobenius arm is
    # dense-grid's sphere-only runs (the headline figure's), not run twice
    "sphere": (
        ("adammd", "muonmd"),
        {a: [f"--md-sphere={a}", "--md-radius=unit", "--md-gains=none"] for a in ("row", "col")},
    ),
    "gains": (
        ("adammd", "muonmd"),
        {a: [f"--md-gains={a}"] for a in ("none", "scalar", "row", "col", "rowcol")},
    ),
    "gain-map": (
        ("adammd", "muonmd"),
        {a: [f"--md-gain-map={a}"] for a in ("softplus", "exp", "direct", "direct-floor")},
    ),
    "rank-k": (
        ("adammd", "muonmd"),
        {f"k{k}": ["--md-gains=lowrank", f"--md-gain-rank={k}"] for k in (1, 4, 16)},
    ),
    # fig. embed-norm: unit rows, or free embeddings AND LM head (the authors' free arm)
    "embedding-norm": (
        ("adammd", "muonmd"),
        {
            "row": ["--md-embedding-norm=row"],
            "none": ["--md-embedding-norm=none", "--md-output-norm=none"],
        },
    ),
    # appendix "Muon scale factor" (fig. muon-scale-modes): plain Muon with and without warmup
    "muon-scale": (
        ("muon",),
        {
            f"{a}-{w}": [f"--muon-scale-mode={a}", *WARMUP[w]]
            for a in ("unit_rms_norm", "shape_scaling", "rms_match")
            for w in WARMUP
        },
    ),
    "muonmd-scale": (
        ("muonmd",),
        {a: [f"--muon-scale-mode={a}"] for a in ("shape_up", "unit_rms_norm", "rms_match")},
    ),
    "tangent": (("adammd", "muonmd"), {"off": [], "on": ["--md-tangent-grad"]}),
    "schedule": (METHODS, {"linear": [], "wsd": WSD}),
    "warmup": (METHODS, WARMUP),
}

#: side-LR sweeps (appendix "Additional LR Ablations", fig. lr-panels-combined): the paper's
#: fixed LRs of the Adam groups swept, each crossed with the matrix-LR grid (``--lrs``; pass
#: the optimum alone for the base-LR panel): experiment -> (method, {variant: extra flags})
SIDE_LR = {
    # all Adam-managed groups (embeddings, LM head, 1-D params) scaled together, AdamW
    "side-base-lr": (
        "adamw",
        {
            f"x{m:g}": [f"--lr={fmt(1e-3 * m)}", f"--embedding-lr={fmt(3e-3 * m)}",
                        f"--output-lr={fmt(1e-3 * m)}"]  # fmt: skip
            for m in (0.25, 0.5, 1, 2, 4)
        },
    ),
    "side-embedding-lr": ("muonmd", {f"elr{e:g}": [f"--embedding-lr={e:g}"]
                                     for e in (1e-3, 3e-3, 1e-2)}),
    "side-gain-lr": ("muonmd", {f"glr{g:g}": [f"--md-gain-lr={g:g}"]
                                for g in (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)}),
}  # fmt: skip

MOE_RUNGS = ("moe-0.27B-1.2B", "moe-0.41B-2.5B", "moe-0.58B-4.1B", "moe-0.81B-6.7B")
#: the ladder's token budgets (paper: {7.5, 15, 23, 44}B) as the authors ran them
#: (feat/scaling-sweeps sweep-scaling-laws.sh: 15B is the base's 3,584,000 samples, 14.68B)
MOE_BUDGETS = (7.5e9, BASE_TOKENS, 23.3e9, 44.15e9)
MOE_METHODS = ("adamw", "muon", "muonmd")
#: the MoE appendix's WSD arm (fig. moe-wsd) as the runs (recipes/wsd/*.sh, lib/common.sh): a
#: 1-sqrt cooldown over 732,422 samples (5,722 steps, 20 % of 15.0B tokens; the paper's text
#: says a 20 % linear cooldown)
MOE_WSD = ["--lr-decay-style=WSD", "--lr-wsd-decay-style=minus_sqrt", "--lr-wsd-decay-iters=5722"]


def _moe_run(size, method, lr, tokens, t=None, gbs=GBS, extra=(), tag="", **meta):
    flags = [f"--preset={size}", *_seq_flags(iters_for(tokens, gbs), gbs),
             *moe_recipe(method, lr, t), "--expert-model-parallel-size={ep}",
             *extra]  # fmt: skip
    name = f"{size}-{method}-" + (tag or f"{tokens / 1e9:.4g}B")
    meta = {"size": size, "method": method, "matrix_lr": lr, "tokens": tokens, "gbs": gbs, **meta}
    return Run(name, flags, meta)


def moe_ladder() -> list[Run]:
    """Fig. moe (center): every rung × token budget with the base optima transferred."""
    from megatron.md.train.presets import PRESETS

    runs = []
    for size in MOE_RUNGS:
        for method in MOE_METHODS:
            for tokens in MOE_BUDGETS:
                t = transfer(method, PRESETS[size].hidden, tokens)
                runs.append(_moe_run(size, method, MOE_BASE_LR[method] * t.lr, tokens, t))
    return runs


def moe_base_sweep(lrs: list[float]) -> list[Run]:
    """Fig. moe (left) and moe-wsd: the 270M-active base, 28,000 steps, matrix-LR grid, with
    the paper's linear decay and a WSD arm; Muown too (the figure shows it with WSD, its better
    schedule)."""
    return [
        _moe_run(
            MOE_RUNGS[0], m, lr, BASE_TOKENS, extra=extra, tag=f"lr{fmt(lr)}-{arm}", variant=arm
        )  # fmt: skip
        for m in (*MOE_METHODS, "muown")
        for arm, extra in (("linear", []), ("wsd", MOE_WSD))
        for lr in lrs
    ]


def moe_batch_sweep(gbs=(128, 192, 256)) -> list[Run]:
    """Fig. moe (right) as the authors ran it (feat/scaling-sweeps sweep-batchsize.sh): the
    base config held at 28,000 steps (so k× the tokens) at global batch 128, 192 and 256, every
    LR (matrix, embedding, output, scalar) × sqrt(k), the baselines' weight decay 0.1 and
    warmup 1000 steps as at the base."""
    runs = []
    for m in MOE_METHODS:
        for g in gbs:
            t = transfer(m, 768, BASE_TOKENS * g / GBS, batch_mult=g / GBS)
            runs.append(_moe_run(MOE_RUNGS[0], m, MOE_BASE_LR[m] * t.lr, BASE_TOKENS * g / GBS,
                                 t, g, tag=f"gbs{g}", variant=f"gbs{g}"))  # fmt: skip
    return runs


#: the authors' re-warming runs: MuonMD on the 150M model at matrix LR 2e-2 (feat/scaling-sweeps
#: _research/analysis/configs/rewarming.yaml: 150m-master-lr1e-3-mlr2e-2-elr1e-3)
REWARM_LR = 2e-2


def rewarm_runs(lrs: list[float]) -> list[Run]:
    """Fig. warmup (centre, right), the re-warming experiment as the authors ran it
    (feat/scaling-sweeps warm-restart.sh, analysis/configs/rewarming.yaml; paper: the 150M
    model, d=512, L=8, head dim 64): MuonMD with the recipe their 150M runs share with the MoE
    ladder (recipes/master.sh, lib/common.sh: ``moe_recipe``). A source run of 10k steps, the
    target baseline straight to 20k, and four arms from the source's checkpoint, each 10k more
    steps on the source's data stream with a fresh linear decay: the optimizer state reused,
    or its moments zeroed with the gains kept (``--init-fresh-moments``), × no warmup or 500
    warmup steps. ``lrs``: the matrix LRs (default: the authors' 2e-2)."""

    def run(lr, tag, iters, extra=(), **meta):
        name = f"dense-150M-muonmd-lr{fmt(lr)}-rewarm-{tag}"
        flags = ["--preset=dense-150M", *_seq_flags(iters), *moe_recipe("muonmd", lr), *extra]
        meta = {"size": "dense-150M", "method": "muonmd", "matrix_lr": lr, "axis": "rewarm",
                "variant": tag, **meta}  # fmt: skip
        return Run(name, flags, meta)

    runs = []
    for lr in lrs:
        src = run(lr, "source", 10_000)
        runs += [src, run(lr, "target", 20_000)]
        for state in ("reuse", "fresh"):
            for warm in (0, 500):
                extra = ["--init-from={run_root}/" + src.name, "--init-continue-data",
                         f"--lr-warmup-iters={warm}"]  # fmt: skip
                if state == "fresh":
                    extra.append("--init-fresh-moments")
                runs.append(run(lr, f"{state}-w{warm}", 10_000, extra, after=src.name))
    return runs


#: nGPT's normalization: every vector along the hidden dimension at norm 1, no gains
NGPT_SPHERE = ["--md-sphere=hidden", "--md-radius=unit", "--md-gains=none"]
#: nGPT's architecture is built on megatron-core's local layer spec (on GPUs too)
NGPT = ["--arch=ngpt", "--transformer-impl=local"]


def ngpt_runs(lrs: list[float]) -> list[Run]:
    """The nGPT comparison (appendix "Comparison to nGPT", fig. ngpt): the 181M base, 50k
    iterations, every arm over the matrix-LR grid, every arm at the protocol's side LRs (the
    dense recipe's 1e-3 for 1-D vectors, 3e-3 embeddings, 1e-3 LM head: the authors' nGPT runs,
    gainz submissions/exp13-ngpt-matrix-lr.sh) and nGPT's α starting at 1/L (the same runs).
    Adam family: nGPT as proposed (its architecture, unit vectors after a plain Adam step),
    the same with its residual scales stored at 1 (the grey line), nGPT's architecture with our
    Frobenius sphere and no gains, and with AdamMD. Muon family: nGPT's unit vectors under Muon
    (no gains) and nGPT's architecture with MuonMD. Our base AdamMD and MuonMD (Sandwich Norm)
    for reference. Extras, labelled: nGPT as proposed with every parameter at the swept LR
    (``-onelr``: nGPT's own training), and the Muon family with 1e-2 for every Adam-stepped
    parameter (``-side1e-2``: at 3e-3 nGPT's scaling vectors learned slowly in the laptop run,
    docs/cpu_repro.md). Assumed where the paper is silent: the recipe's schedule (linear decay,
    no warmup) for every arm."""

    def one_lr(lr):  # nGPT trains every parameter at one LR
        return [f"--lr={fmt(lr)}", f"--embedding-lr={fmt(lr)}", f"--output-lr={fmt(lr)}"]

    side = one_lr(1e-2)
    arms = {  # variant -> (methods, extra flags for a matrix LR)
        "base": (("adammd", "muonmd"), lambda lr: []),
        "ngpt": (("adammd",), lambda lr: [*NGPT, *NGPT_SPHERE]),
        "ngpt-alpha1": (("adammd",), lambda lr: [*NGPT, *NGPT_SPHERE, "--ngpt-residual-scale=1"]),
        "ngpt-arch-frobenius": (("adammd",), lambda lr: [*NGPT, "--md-gains=none"]),
        "ngpt-arch-md": (("adammd",), lambda lr: NGPT),
        "ngpt-muon": (("muonmd",), lambda lr: [*NGPT, *NGPT_SPHERE]),
        "ngpt-arch-muonmd": (("muonmd",), lambda lr: NGPT),
        "ngpt-onelr": (("adammd",), lambda lr: [*NGPT, *NGPT_SPHERE, *one_lr(lr)]),
        "ngpt-muon-side1e-2": (("muonmd",), lambda lr: [*NGPT, *NGPT_SPHERE, *side]),
        "ngpt-arch-muonmd-side1e-2": (("muonmd",), lambda lr: [*NGPT, *side]),
    }
    return [
        _dense_run("dense-181M", m, lr, tag, extra(lr), axis="ngpt", variant=tag)
        for tag, (methods, extra) in arms.items()
        for m in methods
        for lr in lrs
    ]


def throughput_runs() -> list[Run]:
    """The paper's throughput table: 5 sizes (+ the 1.54B at twice the batch) × 4 methods,
    200 iterations with --log-throughput, 2 nodes × 4 GPUs (DP = 8); AdamMD both as the paper
    ran it (layer-wise, ``adammd-lw``) and inside ZeRO-1."""
    runs = []
    for size, gbs in (
        ("dense-181M", GBS), ("dense-457M", GBS), ("dense-827M", GBS), ("dense-1.29B", GBS),
        ("dense-1.54B", GBS), ("dense-1.54B", 2 * GBS),
    ):  # fmt: skip
        for m in (*METHODS, "adammd-lw"):
            flags = [f"--preset={size}", *_seq_flags(200, gbs), *dense_recipe(m, 4e-3),
                     "--lr-warmup-iters=0",  # the recipe's 1000 exceed the run; speed unaffected
                     "--log-throughput", "--log-interval=10"]  # fmt: skip
            meta = {"size": size, "method": m, "gbs": gbs, "nodes": 2}
            runs.append(Run(f"tput-{size}-gbs{gbs}-{m}", flags, meta))
    return runs


def smoke_runs() -> list[Run]:
    """Two tiny runs on megatron's mock data (AdamW, AdamMD; 6 iterations): the front-end and
    launcher end to end on any SLURM, CPU-only included (the tests' local SLURM)."""
    flags = ["--preset=tiny", "--mock-data", "--tokenizer-type=NullTokenizer",
             "--vocab-size=1024", "--seq-length=64", "--max-position-embeddings=64",
             "--micro-batch-size=2", "--global-batch-size=4", "--train-iters=6",
             "--eval-interval=6", "--eval-iters=1", "--log-interval=1", "--lr=1e-2"]  # fmt: skip
    return [
        Run("smoke-adamw", [*flags, "--optimizer=adam", "--weight-decay=0.1"],
            {"size": "tiny", "method": "adamw", "matrix_lr": 1e-2}),
        Run("smoke-adammd", [*flags, "--optimizer=adam", "--md-decoupling"],
            {"size": "tiny", "method": "adammd", "matrix_lr": 1e-2}),
    ]  # fmt: skip


#: the throughput assumed by ``gpu_hours``: a fraction of one H100's dense bf16 peak
PEAK_FLOPS, MFU = 989e12, 0.40


def _flag(flags: list[str], name: str, default=None):
    for f in reversed(flags):
        if f.startswith(name + "="):
            return f.split("=", 1)[1]
    return default


def gpu_hours(run: Run) -> float:
    """An estimate of the GPU-hours one run takes: training FLOPs (6 × active parameters
    outside the input embedding, plus attention's 12 · L · heads · head dim · sequence, per
    token; megatron's own FLOP count) over ``MFU`` × ``PEAK_FLOPS``. Reported by
    ``sweep.py --list`` for planning; tools/throughput.py measures the real rate."""
    from megatron.md.train.presets import PRESETS, count_params

    p = PRESETS.get(run.meta.get("size", ""))
    if p is None or p.hidden < 256:  # the tiny CPU presets
        return 0.0
    _, active = count_params(p)
    seq = int(_flag(run.flags, "--seq-length", SEQ))
    tokens = int(_flag(run.flags, "--train-iters", 0)) * int(
        _flag(run.flags, "--global-batch-size", GBS)
    ) * seq  # fmt: skip
    per_token = 6 * (active - p.vocab * p.hidden) + 12 * p.layers * p.heads * p.head_dim * seq
    return per_token * tokens / (MFU * PEAK_FLOPS) / 3600


def experiment(name: str, lrs: list[float] | None = None) -> list[Run]:
    """Every run of a named experiment (see ``EXPERIMENTS``)."""
    given, lrs = lrs, lrs or lr_grid()
    if name == "dense-grid":  # + the headline's sphere-only arms (MD without gains) at 181M
        sphere = [
            _dense_run(
                "dense-181M",
                m,
                lr,
                "sphere-frobenius",
                SPHERE_ONLY,
                axis="sphere",
                variant="frobenius",
            )
            for m in ("adammd", "muonmd")
            for lr in lrs
        ]
        return [_dense_run(s, m, lr) for s in DENSE_SIZES for m in METHODS for lr in lrs] + sphere
    if name == "ablation-block-scale":
        return [
            _dense_run(
                s,
                m,
                lr,
                f"alpha{tag}",
                [f"--block-output-scale={a}"],
                axis="block-scale",
                variant=tag,
            )  # fmt: skip
            for s in ("dense-181M", "dense-205M", "dense-229M", "dense-252M")
            for m in ("adammd", "muonmd")
            for tag, a in (("1L", "1/L"), ("1sqrt2L", "1/sqrt(2L)"))
            for lr in lrs
        ]
    if name == "ablation-rewarm":
        return rewarm_runs(given or [REWARM_LR])
    if name == "ngpt-comparison":
        return ngpt_runs(lrs)
    if name.startswith("ablation-"):
        axis = name[len("ablation-") :]
        methods, variants = ABLATIONS[axis]
        return [
            _dense_run("dense-181M", m, lr, f"{axis}-{tag}", extra, axis=axis, variant=tag)
            for m in methods
            for tag, extra in variants.items()
            for lr in lrs
        ]
    if name in SIDE_LR:
        method, variants = SIDE_LR[name]
        return [
            _dense_run("dense-181M", method, lr, tag, extra, axis=name, variant=tag)
            for tag, extra in variants.items()
            for lr in lrs
        ]
    if name == "moe-base-sweep":
        return moe_base_sweep(lrs)
    if name == "moe-batch-sweep":
        return moe_batch_sweep()
    if name == "moe-ladder":
        return moe_ladder()
    if name == "throughput":
        return throughput_runs()
    if name == "smoke":
        return smoke_runs()
    raise ValueError(f"experiment {name!r} is not one of {', '.join(EXPERIMENTS)}")


EXPERIMENTS = (
    "dense-grid",
    *(f"ablation-{a}" for a in (*ABLATIONS, "block-scale", "rewarm")),
    *SIDE_LR,
    "ngpt-comparison",
    "moe-base-sweep",
    "moe-batch-sweep",
    "moe-ladder",
    "throughput",
    "smoke",
)

_LR = "python tools/lr_sweep.py runs/{e}/manifest.json --out runs/{e}/analysis"
_DIAG = "python tools/plot_diagnostics.py runs/{e}/*/metrics.jsonl --out runs/{e}/diagnostics"
_BOTH = _LR + "; " + _DIAG
#: the paper's fit leaves out the undertrained 810M-active @ 7.5B point (plotted, hollow)
_LAW = ("python tools/scaling_law.py runs/{e}/analysis/lr_sweep.csv --target-loss 2.635 "
        "--fit-exclude '0.81B-6.7B-.*-7.5B$'")  # fmt: skip
#: (paper figure or table, what it shows, experiment(s), analysis command)
PAPER = (
    ("Fig. interference", "toy scale-invariant loss: the step turns a small weight more, the "
     "norm grows", "—", "python examples/md_decoupling/interference.py --out interference.png"),
    ("Fig. headline (left)", "LR sweep, 181M, four methods and the sphere alone", "dense-grid",
     _LR),
    ("Fig. headline (right), transfer", "LR transfer across width, depth", "dense-grid", _LR),
    ("Fig. transfer-dynamics", "relative update, output change, act. RMS", "dense-grid", _DIAG),
    ("Fig. transfer-baselines", "AdamW/Muon, joint width-depth", "dense-grid", _LR),
    ("Fig. norm-axis", "sphere axis, no gains", "ablation-sphere, dense-grid",
     "python tools/lr_sweep.py runs/ablation-sphere/manifest.json runs/dense-grid/manifest.json "
     "--only 'sphere-' --out runs/ablation-sphere/analysis"),
    ("Fig. embed-norm", "unit embedding rows vs free", "ablation-embedding-norm", _BOTH),
    ("Fig. gain-axis (left)", "gain axes", "ablation-gains", _LR),
    ("Fig. gain-axis (center, right)", "gain maps; gradient norm", "ablation-gain-map", _BOTH),
    ("Fig. gain-dynamics", "row/column gains per layer", "ablation-gain-map", _DIAG),
    ("Fig. higherrank-gains", "rank-k multiplicative gains", "ablation-rank-k", _LR),
    ("Fig. lr-decay", "WSD vs linear; relative update (query block: rel_update_block)",
     "ablation-schedule", _BOTH),
    ("Fig. warmup (left)", "with and without warmup", "ablation-warmup", _LR),
    ("Fig. warmup (center, right)", "re-warming: loss, gradient norm", "ablation-rewarm",
     "python tools/plot_curves.py runs/{e}/*/ --smooth 50 --out runs/{e}/analysis"),
    ("Fig. muon-scale-modes (left)", "Muon scale factors ± warmup", "ablation-muon-scale", _LR),
    ("Fig. muon-scale-modes (center, right)", "MuonMD scale factors", "ablation-muonmd-scale", _LR),
    ("Sec. normalization axis (text)", "tangent projection", "ablation-tangent", _LR),
    ("Fig. depth-scaling", "block-output scale; act. RMS", "ablation-block-scale", _BOTH),
    ("Fig. lr-panels-combined (left)", "Adam-group LR (--lrs: the optimum)", "side-base-lr", _LR),
    ("Fig. lr-panels-combined (center-left)", "embedding LR", "side-embedding-lr", _LR),
    ("Fig. lr-panels-combined (center-right, right)", "gains LR", "side-gain-lr", _LR),
    ("Fig. moe (left), moe-wsd", "MoE 270M base sweep, linear, WSD", "moe-base-sweep", _LR),
    ("Fig. moe (center)", "MoE scaling law, compute savings", "moe-ladder", _LR + "; " + _LAW),
    ("Fig. moe (right)", "MoE batch size, √k LR rule", "moe-batch-sweep", _LR + " --x gbs"),
    ("Tab. throughput", "tokens/s per GPU", "throughput",
     "python tools/throughput.py --manifest runs/throughput/manifest.json"),
    ("Tab. moe-evals, fig. moe-evals", "downstream zero-shot (largest MoE per method; "
     "--ckpt-step N for the trajectory)", "moe-ladder",
     "python tools/evaluate.py --load runs/moe-ladder/RUN --tasks paper "
     "--out runs/moe-ladder/evals/RUN.json"),
    ("Fig. ngpt", "nGPT as proposed, its architecture with our sphere / MD, residual scale 1",
     "ngpt-comparison", _LR),
)  # fmt: skip


def markdown() -> str:
    """The table of ``docs/experiments.md``."""
    rows = ["| paper | what | experiment (`sweep.py`) | analysis |", "| --- | --- | --- | --- |"]
    for fig, what, exp, cmd in PAPER:
        first = exp.split(",")[0].strip()
        cmd = cmd.replace("{e}", first) if first != "—" else cmd
        exps = ", ".join(f"`{e.strip()}`" if e.strip() != "—" else "—" for e in exp.split(","))
        rows.append(f"| {fig} | {what} | {exps} | `{cmd}` |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(markdown(), end="")
    else:
        for name in EXPERIMENTS:
            runs = experiment(name)
            hours = sum(gpu_hours(r) for r in runs)
            print(f"{name:<26} {len(runs):>4} runs  {hours:>9,.0f} GPU-hours")
