"""Optimizer recipes (recipe §2), the paper's LR-transfer rules, and the experiments of the
SLURM front-end (``examples/md_decoupling/sweep.py``), defined once.

A *run* is a name plus ``pretrain_gpt.py`` flags; sizes come from ``presets.PRESETS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SEQ, GBS = 4096, 128  # the paper's sequence length and global batch (dense and MoE)
METHODS = ("adamw", "muon", "adammd", "muonmd")


def lr_grid(n: int = 9, base: float = 1e-3) -> list[float]:
    """The matrix-LR grid 1e-3 · 2^(k/2), k = 0 … n-1 (1e-3 … 1.6e-2 for n = 9)."""
    return [base * 2 ** (k / 2) for k in range(n)]


def fmt(x: float) -> str:
    """Short, exact enough for run names and flags (4 significant digits)."""
    return f"{x:.4g}"


def iters_for(tokens: float, gbs: int = GBS, seq: int = SEQ) -> int:
    return round(tokens / (gbs * seq))


# ---- optimizer recipes ----
def dense_recipe(method: str, matrix_lr: float) -> list[str]:
    """Recipe §2, dense column: baselines wd 0.1 (AdamW warms up 1000 steps), MD none; linear
    decay to 1e-8; betas (0.9, 0.99); clip 1.0; embedding LR 3e-3, LM head 1e-3."""
    common = [
        "--lr-decay-style=linear",
        "--min-lr=1e-8",
        "--adam-beta1=0.9",
        "--adam-beta2=0.99",
        "--adam-eps=1e-8",
        "--clip-grad=1.0",
        "--embedding-lr=3e-3",
        "--output-lr=1e-3",
        f"--matrix-lr={fmt(matrix_lr)}",
        "--lr=3e-3",
    ]
    return common + _method_flags(method, moe=False)


def moe_recipe(method: str, matrix_lr: float, lr_scale: float = 1.0, wd: float = 0.1) -> list[str]:
    """Recipe §2 / MoE appendix: betas (0.9, 0.95), linear decay to 1e-5 (absolute, per group),
    embedding/output/gain LR 1e-3 (× the transfer scale), AdamW clips at 1.0, Muon/MuonMD not;
    baselines warm up 1000 steps with weight decay ``wd``; MuonMD scaled output-projection init."""
    side = fmt(1e-3 * lr_scale)
    common = [
        "--lr-decay-style=linear",
        "--min-lr=1e-5",
        "--adam-beta1=0.9",
        "--adam-beta2=0.95",
        "--adam-eps=1e-8",
        f"--embedding-lr={side}",
        f"--output-lr={side}",
        f"--lr={side}",
        f"--matrix-lr={fmt(matrix_lr)}",
        "--clip-grad=1.0" if method == "adamw" else "--clip-grad=0",
    ]
    flags = common + _method_flags(method, moe=True, wd=wd)
    if method == "muonmd":
        flags += ["--scaled-output-init", f"--md-gain-lr={side}"]
    return flags


def _method_flags(method: str, moe: bool, wd: float = 0.1) -> list[str]:
    if method == "adamw":
        return ["--optimizer=adam", f"--weight-decay={fmt(wd)}", "--lr-warmup-iters=1000"]
    if method == "muon":
        scale = "shape_scaling" if moe else "unit_rms_norm"
        warm = ["--lr-warmup-iters=1000"] if moe else []
        return [
            "--optimizer=muon",
            f"--weight-decay={fmt(wd)}",
            "--muon-momentum=0.95",
            "--muon-nesterov",
            f"--muon-scale-mode={scale}",
            *warm,
        ]
    if method == "adammd":
        return ["--optimizer=adam", "--md-decoupling"]
    if method == "muonmd":
        return ["--optimizer=muon", "--md-decoupling", "--muon-scale-mode=shape_up"]
    raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")


# ---- LR transfer (MoE section of the paper) ----
BASE_WIDTH, BASE_TOKENS = 768, 15e9
MOE_BASE_LR = {"adamw": 2.4e-3, "muon": 5e-3, "muonmd": 1e-2}


@dataclass(frozen=True)
class Transfer:
    """Multipliers from the base sweep (d = 768, 15B tokens, batch 128) to a target."""

    lr: float
    """on the matrix LR"""
    side_lr: float
    """on the embedding / output (and gain) LRs"""
    wd: float
    """on the weight decay"""


def transfer(method: str, width: int, tokens: float, batch_mult: float = 1.0) -> Transfer:
    """Complete(d)P for AdamW/Muon (LRs × 1/k in width, × 1/sqrt(l) in length, weight decay
    ∝ k/sqrt(l)); MuonMD: no width factor, LRs × 1/l^0.25, no weight decay; a k_b-fold batch
    multiplies every LR by sqrt(k_b). k = width/768, l = tokens/15B."""
    k, ell = width / BASE_WIDTH, tokens / BASE_TOKENS
    b = math.sqrt(batch_mult)
    if method in ("adamw", "muon"):
        lr = b / (k * math.sqrt(ell))
        return Transfer(lr=lr, side_lr=lr, wd=k / math.sqrt(ell))
    if method == "muonmd":
        lr = b / ell**0.25
        return Transfer(lr=lr, side_lr=lr, wd=0.0)
    raise ValueError(f"no LR transfer rule for {method!r}")


# ---- experiments ----
@dataclass
class Run:
    name: str
    flags: list[str]
    meta: dict = field(default_factory=dict)


def _dense_run(size: str, method: str, lr: float, tag: str = "", extra=(), iters=50_000, **meta):
    name = f"{size}-{method}-lr{fmt(lr)}" + (f"-{tag}" if tag else "")
    flags = [
        f"--preset={size}",
        f"--train-iters={iters}",
        f"--seq-length={SEQ}",
        f"--max-position-embeddings={SEQ}",
        f"--global-batch-size={GBS}",
        "--micro-batch-size={mbs}",
        *dense_recipe(method, lr),
        *extra,
    ]
    return Run(name, flags, {"size": size, "method": method, "matrix_lr": lr, **meta})


DENSE_SIZES = (
    "dense-181M",
    "dense-307M",
    "dense-457M",
    "dense-827M",
    "dense-1.29B",
    "dense-205M",
    "dense-229M",
    "dense-252M",
    "dense-361M",
    "dense-646M",
    "dense-150M",
    "dense-1.54B",
)

#: ablation axis -> (method(s), {variant tag: extra flags}); each on the base 181M × LR grid
ABLATIONS: dict[str, tuple[tuple[str, ...], dict[str, list[str]]]] = {
    "sphere": (
        ("adammd", "muonmd"),
        {a: [f"--md-sphere={a}"] for a in ("frobenius", "row", "col")},
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
    "muon-scale": (
        ("muon", "muonmd"),
        {
            a: [f"--muon-scale-mode={a}"]
            for a in ("unit_rms_norm", "shape_scaling", "rms_match", "shape_up")
        },
    ),
    "schedule": (
        METHODS,
        {
            "linear": [],
            "wsd": [
                "--lr-decay-style=WSD",
                "--lr-wsd-decay-style=minus_sqrt",
                "--wsd-cooldown-fraction=0.2",
            ],
        },
    ),
    "warmup": (METHODS, {"none": ["--lr-warmup-iters=0"], "w1000": ["--lr-warmup-iters=1000"]}),
}


def experiment(name: str, lrs: list[float] | None = None) -> list[Run]:
    """Every run of a named experiment (see ``EXPERIMENTS``)."""
    lrs = lrs or lr_grid()
    if name == "dense-grid":
        return [_dense_run(s, m, lr) for s in DENSE_SIZES for m in METHODS for lr in lrs]
    if name.startswith("ablation-"):
        axis = name[len("ablation-") :]
        if axis == "block-scale":
            return [
                _dense_run(
                    s, m, lr, f"alpha{tag}", [f"--block-output-scale={a}"], axis=axis, variant=tag
                )
                for s in ("dense-181M", "dense-205M", "dense-229M", "dense-252M")
                for m in ("adammd", "muonmd")
                for tag, a in (("1L", "1/L"), ("1sqrt2L", "1/sqrt(2L)"))
                for lr in lrs
            ]
        if axis == "rewarm":
            return rewarm_runs(lrs)
        methods, variants = ABLATIONS[axis]
        return [
            _dense_run("dense-181M", m, lr, f"{axis}-{tag}", extra, axis=axis, variant=tag)
            for m in methods
            for tag, extra in variants.items()
            for lr in lrs
        ]
    if name == "moe-ladder":
        return moe_ladder()
    if name == "throughput":
        return throughput_runs()
    raise ValueError(f"experiment {name!r} is not one of {', '.join(EXPERIMENTS)}")


def rewarm_runs(lrs: list[float]) -> list[Run]:
    """Continual training of the 150M model: an AdamW run, then each method re-warmed from its
    checkpoint (MD creates its state from the loaded weights: radius = their norm, gains 1)."""
    base = _dense_run("dense-150M", "adamw", 3e-3, "rewarm-source", iters=25_000, axis="rewarm")
    runs = [base]
    for m in METHODS:
        for lr in lrs:
            extra = [
                "--load={run_root}/" + base.name,
                "--no-load-optim",
                "--no-load-rng",
                "--finetune",
                "--lr-warmup-iters=1000",
            ]
            runs.append(
                _dense_run(
                    "dense-150M",
                    m,
                    lr,
                    "rewarm",
                    extra,
                    iters=25_000,
                    axis="rewarm",
                    after=base.name,
                )
            )
    return runs


MOE_RUNGS = ("moe-0.27B-1.2B", "moe-0.41B-2.5B", "moe-0.58B-4.1B", "moe-0.81B-6.7B")
MOE_BUDGETS = (7.5e9, 15e9, 23e9, 44e9)


def moe_ladder() -> list[Run]:
    from megatron.md.train.presets import PRESETS

    runs = []
    for size in MOE_RUNGS:
        width = PRESETS[size].hidden
        for method in ("adamw", "muon", "muonmd"):
            for tokens in MOE_BUDGETS:
                t = transfer(method, width, tokens)
                lr = MOE_BASE_LR[method] * t.lr
                flags = [
                    f"--preset={size}",
                    f"--train-iters={iters_for(tokens)}",
                    f"--seq-length={SEQ}",
                    f"--max-position-embeddings={SEQ}",
                    f"--global-batch-size={GBS}",
                    "--micro-batch-size={mbs}",
                    *moe_recipe(method, lr, t.side_lr, 0.1 * t.wd),
                    "--expert-model-parallel-size={ep}",
                ]
                name = f"{size}-{method}-{tokens / 1e9:g}B"
                runs.append(
                    Run(
                        name,
                        flags,
                        {"size": size, "method": method, "matrix_lr": lr, "tokens": tokens},
                    )
                )
    return runs


def throughput_runs() -> list[Run]:
    """The paper's throughput table: 5 sizes (+ the 1.54B at twice the batch) × 4 methods,
    200 iterations with --log-throughput, 2 nodes × 4 GPUs (DP = 8)."""
    runs = []
    for size, gbs in (
        ("dense-181M", GBS),
        ("dense-457M", GBS),
        ("dense-827M", GBS),
        ("dense-1.29B", GBS),
        ("dense-1.54B", GBS),
        ("dense-1.54B", 2 * GBS),
    ):
        for m in METHODS:
            flags = [
                f"--preset={size}",
                "--train-iters=200",
                f"--seq-length={SEQ}",
                f"--max-position-embeddings={SEQ}",
                f"--global-batch-size={gbs}",
                "--micro-batch-size={mbs}",
                *dense_recipe(m, 4e-3),
                "--lr-warmup-iters=0",  # the recipe's 1000 exceed the run; speed is unaffected
                "--log-throughput",
                "--log-interval=10",
            ]
            runs.append(
                Run(
                    f"tput-{size}-gbs{gbs}-{m}",
                    flags,
                    {"size": size, "method": m, "gbs": gbs, "nodes": 2},
                )
            )
    return runs


EXPERIMENTS = (
    "dense-grid",
    *(f"ablation-{a}" for a in (*ABLATIONS, "block-scale", "rewarm")),
    "moe-ladder",
    "throughput",
)
