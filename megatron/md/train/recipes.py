"""Optimizer recipes (recipe §2) and the paper's LR-transfer rules, defined once. The
experiments built from them (the SLURM front-end's catalogue) are in
``examples/md_decoupling/experiments.py``; sizes come from ``presets.PRESETS``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SEQ, GBS = 4096, 128  # the paper's sequence length and global batch (dense and MoE)
METHODS = ("adamw", "muon", "adammd", "muonmd")

#: put in front of the user's flags with ``--md-decoupling`` (theirs win): the MD recipe's
#: settings of megatron's own flags (weight decay 0, Muon momentum 0.95 Nesterov, Adam beta2
#: 0.99; under TP, Muon orthogonalizes each full matrix as at TP = 1)
MD_RECIPE = [
    "--weight-decay=0",
    "--muon-momentum=0.95",
    "--muon-nesterov",
    "--adam-beta2=0.99",
    "--muon-tp-mode=duplicated",
]


#: optimizer names expanded in place (later flags win): the paper's four methods by their
#: names (AdamMD and MuonMD as ``--md-decoupling`` gives them: the radius ``init``, which MD
#: state made from trained weights needs; the paper's runs add ``--md-radius shape``), Muown
#: (``MDConfig.variant``: its weight-normalized rows) and MuonH (the sphere alone, the update
#: at the sphere's norm: emerging-optimizers' MuonHyperball) on MuonMD's machinery, and NorMuon
OPTIMIZER_ALIASES = {
    "adamw": ["--optimizer=adam"],  # megatron's adam: decoupled weight decay (AdamW)
    "adammd": ["--optimizer=adam", "--md-decoupling"],
    "muonmd": ["--optimizer=muon", "--md-decoupling"],
    "muown": ["--optimizer=muon", "--md-decoupling", "--md-variant=muown"],
    "muonh": ["--optimizer=muon", "--md-decoupling", "--md-sphere=frobenius", "--md-radius=init",
              "--md-gains=none", "--muon-scale-mode=hyperball"],
    # NorMuon: megatron-core's adaptive Muon with the per-neuron second moment (not MD's
    # machinery; its scale applied once, patches.normuon_scale_once)
    "normuon": ["--optimizer=adaptive_muon", "--adaptive-muon-moment2-method=normuon"],
}  # fmt: skip


def optimizer_aliases(argv: list[str]) -> list[str]:
    """``--optimizer adamw`` / ``adammd`` / ``muonmd`` / ``muown`` / ``muonh`` / ``normuon``
    replaced by their flags (``OPTIMIZER_ALIASES``)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[1] if a.startswith("--optimizer=") else None
        if a == "--optimizer" and i + 1 < len(argv):
            name = argv[i + 1]
        if name in OPTIMIZER_ALIASES:
            out += OPTIMIZER_ALIASES[name]
            i += 1 if "=" in a else 2
            continue
        out.append(a)
        i += 1
    return out


def lr_grid(n: int = 9, base: float = 1e-3) -> list[float]:
    """The matrix-LR grid 1e-3 · 2^(k/2), k = 0 … n-1 (1e-3 … 1.6e-2 for n = 9)."""
    return [base * 2 ** (k / 2) for k in range(n)]


def fmt(x: float) -> str:
    """Short, exact enough for run names and flags (4 significant digits)."""
    return f"{x:.4g}"


def iters_for(tokens: float, gbs: int = GBS, seq: int = SEQ) -> int:
    return round(tokens / (gbs * seq))


# ---- optimizer recipes ----
def dense_recipe(method: str, matrix_lr: float, text: bool = False) -> list[str]:
    """Recipe §2, dense column: baselines wd 0.1 (AdamW warms up 1000 steps), MD none; linear
    decay to 1e-8; betas (0.9, 0.99); clip 1.0; embedding LR 3e-3, LM head 1e-3, the other
    Adam groups (norm gains) at the base Adam LR 1e-3 (appendix "The different parameter-group
    learning rates": "our 1e-3 choice"). ``text``: the paper's text where it differs from the
    authors' runs (``TEXT_GAINS``; RoPE without the dense presets' scaling)."""
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
        "--lr=1e-3",
    ]
    text_rope = ["--no-rope-scaling"] if text else []
    return common + _method_flags(method, moe=False) + _text_gains(method, text) + text_rope


#: the paper's text, where the authors' runs give the LM head and the router the matrices'
#: gains (fork: ``md_decoupling.py`` ``_resolve_gains_mode``): LM-head rows at unit norm, no gains
TEXT_GAINS = ["--md-output-gains=none", "--md-router-gains=none"]


def _text_gains(method: str, text: bool) -> list[str]:
    return TEXT_GAINS if text and method in ("adammd", "adammd-lw", "muonmd") else []


def moe_recipe(
    method: str, matrix_lr: float, t: Transfer | None = None, text: bool = False
) -> list[str]:
    """The MoE appendix as the authors ran it (feat/scaling-sweeps
    _research/launch/framework/recipes/{adamw,muon,master,muown}.sh and lib/common.sh): betas
    (0.9, 0.95), linear decay to 1e-5 (absolute, per group), embedding/output/1-D LR 1e-3
    (MuonMD's gains too; × the transfer ``t``), gradients clipped at 1.0 for every method
    (megatron's default, which the runs keep: the paper's text says Muon and MuonMD ran
    unclipped; ``--clip-grad 0`` is that reading), the scaled output-projection init σ/sqrt(2L)
    for every method (megatron's default init there; MuonMD's sphere and shape_up follow it),
    baselines warm up 1000 steps with weight decay 0.1 × ``t.wd``. ``text``: the paper's text
    where it differs from the runs: Muon and MuonMD unclipped, the scaled init for MuonMD only,
    no gains on the LM head and the router (``TEXT_GAINS``)."""
    t = t or Transfer(1.0, 1.0, 1.0, 1.0)
    side, scalar = fmt(1e-3 * t.side_lr), fmt(1e-3 * t.scalar_lr)
    common = [
        "--lr-decay-style=linear",
        "--min-lr=1e-5",
        "--adam-beta1=0.9",
        "--adam-beta2=0.95",
        "--adam-eps=1e-8",
        f"--embedding-lr={side}",
        f"--output-lr={side}",
        f"--lr={scalar}",  # norm gains: the scalar LR, transferred in length only
        f"--matrix-lr={fmt(matrix_lr)}",
        "--clip-grad=" + ("0" if text and method in ("muon", "muonmd") else "1.0"),
    ]
    if not text or method == "muonmd":
        common.append("--scaled-output-init")
    flags = common + _method_flags(method, moe=True, wd=0.1 * t.wd) + _text_gains(method, text)
    if method == "muonmd":  # the runs' --gains-lr is the scalar LR
        flags += [f"--md-gain-lr={scalar}"]
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
    # MD: the paper's radius sqrt(max(d_out, d_in)) per Q/K/V block (§ Normalization axis; the
    # authors' optimizer normalizes every block to it: feat/md-decoupling-optimizer,
    # megatron/core/optimizer/md_decoupling.py, _normalize_single)
    if method in ("adammd", "adammd-lw"):  # -lw: layer-wise, as the paper's throughput table
        lw = ["--md-adam-layer-wise"] if method == "adammd-lw" else []
        return ["--optimizer=adam", "--md-decoupling", "--md-radius=shape", *lw]
    if method == "muown":  # the MoE figure's baseline as the runs (recipes/muown.sh): no
        # warmup, no weight decay, the magnitudes at the matrix LR (the optimizer's one LR),
        # Moonlight's 0.2·sqrt(max(d_out, d_in)) Muon scale
        return ["--optimizer=muown", "--muon-momentum=0.95", "--muon-nesterov",
                "--muon-scale-mode=rms_match"]  # fmt: skip
    if method == "muonmd":
        return ["--optimizer=muon", "--md-decoupling", "--md-radius=shape",
                "--muon-scale-mode=shape_up"]  # fmt: skip
    raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")


# ---- LR transfer (MoE section of the paper) ----
BASE_WIDTH = 768
#: the base sweep's length: 3,584,000 samples of 4096 tokens, 28,000 steps at batch 128
#: (paper appendix "Data and batching"; ~15B): the reference of the length rule, as the
#: authors' feat/scaling-sweeps sweep-scaling-laws.sh (REF_TOKENS=14.68)
BASE_TOKENS = 3_584_000 * SEQ
MOE_BASE_LR = {"adamw": 2.4e-3, "muon": 5e-3, "muonmd": 1e-2}


@dataclass(frozen=True)
class Transfer:
    """Multipliers from the base sweep (d = 768, 28,000 steps, batch 128) to a target."""

    lr: float
    """on the matrix LR"""
    side_lr: float
    """on the embedding and output LRs"""
    scalar_lr: float
    """on the scalar LR of the 1-D parameters (and MuonMD's gains)"""
    wd: float
    """on the weight decay"""


def transfer(method: str, width: int, tokens: float, batch_mult: float = 1.0) -> Transfer:
    """The paper's transfer (MoE appendix) as the authors' sweeps apply it (feat/scaling-sweeps
    sweep-scaling-laws.sh, sweep-batchsize.sh). AdamW/Muon, Complete(d)P: matrix, embedding
    and output LRs × 1/k in width, every LR (the scalar LR too) × 1/sqrt(l) in length, weight
    decay ∝ k/sqrt(l); MuonMD: no width factor, every LR × 1/l^0.25, no weight decay. A
    k_b-fold batch multiplies every LR by sqrt(k_b). k = width/768; l = the length in steps
    relative to the base (tokens / (14.68B · k_b)): the batch sweep holds the steps, so its
    LRs get sqrt(k_b) alone and its weight decay stays 0.1, as the authors ran it."""
    k, ell = width / BASE_WIDTH, tokens / (BASE_TOKENS * batch_mult)
    b = math.sqrt(batch_mult)
    if method in ("adamw", "muon"):
        scalar = b / math.sqrt(ell)
        return Transfer(lr=scalar / k, side_lr=scalar / k, scalar_lr=scalar, wd=k / math.sqrt(ell))
    if method == "muonmd":
        lr = b / ell**0.25
        return Transfer(lr=lr, side_lr=lr, scalar_lr=lr, wd=0.0)
    raise ValueError(f"no LR transfer rule for {method!r}")
