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

#: dense ablations on the 181M base × the LR grid: axis -> (methods, {variant: extra flags})
ABLATIONS: dict[str, tuple[tuple[str, ...], dict[str, list[str]]]] = {
    # "Normalization Axis" (fig. norm-axis): the constraint alone, without gains
    "sphere": (
        ("adammd", "muonmd"),
        {a: [f"--md-sphere={a}", "--md-gains=none"] for a in ("frobenius", "row", "col")},
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
    "embedding-norm": (
        ("adammd", "muonmd"),
        {a: [f"--md-embedding-norm={a}"] for a in ("row", "none")},
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
MOE_BUDGETS = (7.5e9, 15e9, 23e9, 44e9)
MOE_METHODS = ("adamw", "muon", "muonmd")
#: the MoE appendix's WSD arm (fig. moe-wsd): a 20 % linear cooldown
MOE_WSD = ["--lr-decay-style=WSD", "--lr-wsd-decay-style=linear", "--wsd-cooldown-fraction=0.2"]


def _moe_run(size, method, lr, tokens, side=1.0, wd=0.1, gbs=GBS, extra=(), tag="", **meta):
    flags = [f"--preset={size}", *_seq_flags(iters_for(tokens, gbs), gbs),
             *moe_recipe(method, lr, side, wd), "--expert-model-parallel-size={ep}",
             *extra]  # fmt: skip
    name = f"{size}-{method}-" + (tag or f"{tokens / 1e9:g}B")
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
                lr = MOE_BASE_LR[method] * t.lr
                runs.append(_moe_run(size, method, lr, tokens, t.side_lr, 0.1 * t.wd))
    return runs


def moe_base_sweep(lrs: list[float]) -> list[Run]:
    """Fig. moe (left) and moe-wsd: the 270M-active base, 15B tokens, matrix-LR grid, with the
    paper's linear decay and a WSD arm; Muown too (the figure shows it with WSD, its better
    schedule)."""
    return [
        _moe_run(MOE_RUNGS[0], m, lr, 15e9, extra=extra, tag=f"lr{fmt(lr)}-{arm}", variant=arm)
        for m in (*MOE_METHODS, "muown")
        for arm, extra in (("linear", []), ("wsd", MOE_WSD))
        for lr in lrs
    ]


def moe_batch_sweep(mults=(1, 2, 4, 8)) -> list[Run]:
    """Fig. moe (right): the base config at k× the global batch, every LR × sqrt(k) (√k rule),
    the same 15B tokens (k× fewer iterations)."""
    runs = []
    for m in MOE_METHODS:
        for k in mults:
            t = transfer(m, 768, 15e9, batch_mult=k)
            lr = MOE_BASE_LR[m] * t.lr
            runs.append(_moe_run(MOE_RUNGS[0], m, lr, 15e9, t.side_lr, 0.1 * t.wd, GBS * k,
                                 tag=f"gbs{GBS * k}", variant=f"gbs{GBS * k}"))  # fmt: skip
    return runs


def rewarm_runs(lrs: list[float]) -> list[Run]:
    """The re-warming experiment (paper, "Warmup-Free and Continual Training"; appendix: the
    150M model, d=512, L=8, head dim 64): an AdamW run, then each method trained on from its
    checkpoint (``--init-from``: a new run at iteration 0, its own LR schedule; a requeued job
    resumes its own checkpoint). Arms: reusing the source's optimizer state or not (Adam-based
    methods only: Muon has no state to take from AdamW) × no warmup or 1000 warmup steps.
    MD creates its state from the loaded weights (radius = their norm, gains 1; embedding and
    LM-head rows go to unit norm, the recipe's only function change)."""
    base = _dense_run("dense-150M", "adamw", 3e-3, "rewarm-source", iters=25_000, axis="rewarm")
    runs = [base]
    for m in METHODS:
        for state in ("reuse", "fresh") if m in ("adamw", "adammd") else ("fresh",):
            for warm in (0, 1000):
                extra = ["--init-from={run_root}/" + base.name, f"--lr-warmup-iters={warm}"]
                if state == "fresh":
                    extra.append("--init-weights-only")
                elif m == "adammd":
                    extra.append("--md-from-plain-checkpoint")  # keeps AdamW's moments
                runs += [
                    _dense_run("dense-150M", m, lr, f"rewarm-{state}-w{warm}", extra,
                               iters=25_000, axis="rewarm", variant=f"{state}, warmup {warm}",
                               after=base.name)
                    for lr in lrs
                ]  # fmt: skip
    return runs


#: nGPT's normalization: every vector along the hidden dimension at norm 1, no gains
NGPT_SPHERE = ["--md-sphere=hidden", "--md-radius=unit", "--md-gains=none"]
#: nGPT's architecture is built on megatron-core's local layer spec (on GPUs too)
NGPT = ["--arch=ngpt", "--transformer-impl=local"]


def ngpt_runs(lrs: list[float]) -> list[Run]:
    """The nGPT comparison (appendix "Comparison to nGPT", fig. ngpt): the 181M base, 50k
    iterations, every arm over the matrix-LR grid. Adam family, all at one LR for every
    parameter as nGPT trains (its scaling vectors, embeddings and LM head at the swept LR):
    nGPT as proposed (its architecture, unit vectors after a plain Adam step), the same with its
    residual scales stored at 1 (the grey line), nGPT's architecture with our Frobenius sphere
    and no gains, and with AdamMD. Muon family (Muon's LR is not Adam's: the Adam-stepped
    parameters get a fixed LR): nGPT's unit vectors under Muon (no gains) and nGPT's
    architecture with MuonMD, each with the recipe's side LRs and with 1e-2 for every
    Adam-stepped parameter (at the recipe's 3e-3 nGPT's scaling vectors learned too slowly in
    the laptop run, docs/cpu_repro.md). Our base AdamMD and MuonMD (Sandwich Norm) for
    reference. Assumed where the paper is silent: the recipe's schedule (linear decay, no
    warmup) for every arm, and the Adam-group LRs of the Muon family."""

    def one_lr(lr):  # nGPT trains every parameter at one LR
        return [f"--lr={fmt(lr)}", f"--embedding-lr={fmt(lr)}", f"--output-lr={fmt(lr)}"]

    side = one_lr(1e-2)
    arms = {  # variant -> (methods, extra flags for a matrix LR)
        "base": (("adammd", "muonmd"), lambda lr: []),
        "ngpt": (("adammd",), lambda lr: [*NGPT, *NGPT_SPHERE, *one_lr(lr)]),
        "ngpt-alpha1": (
            ("adammd",),
            lambda lr: [*NGPT, *NGPT_SPHERE, *one_lr(lr), "--ngpt-residual-scale=1"],
        ),  # fmt: skip
        "ngpt-arch-frobenius": (("adammd",), lambda lr: [*NGPT, "--md-gains=none", *one_lr(lr)]),
        "ngpt-arch-md": (("adammd",), lambda lr: [*NGPT, *one_lr(lr)]),
        "ngpt-muon": (("muonmd",), lambda lr: [*NGPT, *NGPT_SPHERE]),
        "ngpt-muon-side1e-2": (("muonmd",), lambda lr: [*NGPT, *NGPT_SPHERE, *side]),
        "ngpt-arch-muonmd": (("muonmd",), lambda lr: NGPT),
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
    200 iterations with --log-throughput, 2 nodes × 4 GPUs (DP = 8)."""
    runs = []
    for size, gbs in (
        ("dense-181M", GBS), ("dense-457M", GBS), ("dense-827M", GBS), ("dense-1.29B", GBS),
        ("dense-1.54B", GBS), ("dense-1.54B", 2 * GBS),
    ):  # fmt: skip
        for m in METHODS:
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
    lrs = lrs or lr_grid()
    if name == "dense-grid":
        return [_dense_run(s, m, lr) for s in DENSE_SIZES for m in METHODS for lr in lrs]
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
        return rewarm_runs(lrs)
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
_LAW = "python tools/scaling_law.py runs/{e}/analysis/lr_sweep.csv --target-loss 2.635"
#: (paper figure or table, what it shows, experiment(s), analysis command)
PAPER = (
    ("Fig. headline (left)", "LR sweep, 181M, four methods", "dense-grid", _LR),
    ("Fig. headline (right), transfer", "LR transfer across width, depth", "dense-grid", _LR),
    ("Fig. transfer-dynamics", "relative update, output change, act. RMS", "dense-grid", _DIAG),
    ("Fig. transfer-baselines", "AdamW/Muon, joint width-depth", "dense-grid", _LR),
    ("Fig. norm-axis", "sphere axis, no gains", "ablation-sphere", _LR),
    ("Fig. embed-norm", "unit embedding rows vs free", "ablation-embedding-norm", _BOTH),
    ("Fig. gain-axis (left)", "gain axes", "ablation-gains", _LR),
    ("Fig. gain-axis (center, right)", "gain maps; gradient norm", "ablation-gain-map", _BOTH),
    ("Fig. gain-dynamics", "row/column gains per layer", "ablation-gain-map", _DIAG),
    ("Fig. higherrank-gains", "rank-k multiplicative gains", "ablation-rank-k", _LR),
    ("Fig. lr-decay", "WSD vs linear; relative update", "ablation-schedule", _BOTH),
    ("Fig. warmup (left)", "with and without warmup", "ablation-warmup", _LR),
    ("Fig. warmup (center, right)", "re-warming: loss, gradient norm", "ablation-rewarm", _BOTH),
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
