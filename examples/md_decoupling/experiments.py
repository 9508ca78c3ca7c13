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


#: logging as the authors' runs (gainz submit.sh and feat/scaling-sweeps lib/common.sh: every
#: iteration, so the tail loss is the paper's, the mean over the last 25 iterations; their
#: internals every 50, here MD's diagnostics)
LOGGING = ["--log-interval=1", "--md-log-interval=50"]
#: evaluation as the runs: the dense ones every 1000 iterations on 50 batches (gainz
#: ``--eval-every 1000 --eval-iters 50``), the MoE framework's never (``--eval-iters 0``)
DENSE_EVAL = ["--eval-interval=1000", "--eval-iters=50"]
MOE_EVAL = ["--eval-iters=0"]
#: checkpoints kept as the runs kept them: the dense ones every 10,000 iterations (gainz
#: submit.sh ``SAVE_FREQ``), the MoE framework's every 5,722 (feat/scaling-sweeps
#: sizes/*-moe.sh ``SAVE_INTERVAL``). The launcher saves every ``SAVE_INTERVAL`` (1000) and at
#: every stop; megatron's --save-retain-interval deletes, at each save, the one before unless
#: its iteration is a multiple (the latest always stays). The MoE runs save every 2,861 (half
#: of 5,722: the interval must divide it). Without it every save stayed: 50 per dense run.
DENSE_KEEP = ["--save-retain-interval=10000"]
MOE_KEEP = ["--save-interval=2861", "--save-retain-interval=5722"]


def _seq_flags(iters: int, gbs: int = GBS) -> list[str]:
    return [f"--train-iters={iters}", f"--seq-length={SEQ}", f"--max-position-embeddings={SEQ}",
            f"--global-batch-size={gbs}", "--micro-batch-size={mbs}", *LOGGING]  # fmt: skip


def _dense_run(
    size: str, method: str, lr: float, tag: str = "", extra=(), iters=50_000, text=False, **meta
):
    name = f"{size}-{method}-lr{fmt(lr)}" + (f"-{tag}" if tag else "")
    flags = [f"--preset={size}", *_seq_flags(iters), *DENSE_EVAL, *DENSE_KEEP,
             *dense_recipe(method, lr, text), *extra]  # fmt: skip
    return Run(name, flags, {"size": size, "method": method, "matrix_lr": lr, **meta})


#: the width sweep at L = 12, the depth sweep at d = 512, the joint width-depth sweep (paper
#: table "Dense model configurations"; gainz exp2, exp3, exp4)
WIDTHS = ("dense-307M", "dense-457M", "dense-827M", "dense-1.29B")
DEPTHS = ("dense-181M", "dense-205M", "dense-229M", "dense-252M")
JOINT = ("dense-181M", "dense-361M", "dense-646M")
DENSE_SIZES = ("dense-181M", *WIDTHS, *DEPTHS[1:], *JOINT[1:])
WSD = ["--lr-decay-style=WSD", "--lr-wsd-decay-style=minus_sqrt", "--wsd-cooldown-fraction=0.2"]
WARMUP = {"w0": ["--lr-warmup-iters=0"], "w1000": ["--lr-warmup-iters=1000"]}
#: Muon in the joint width-depth sweep (fig. transfer-baselines) as exp4 ran it: 1000 warmup
#: steps (the headline's Muon is warmup-free: its 181M point is also run with them, tagged)
MUON_WARM = "w1000"


def dense_grid(lrs: list[float], methods=None, text: bool = False) -> list[Run]:
    """What the paper sweeps on the dense models (fig. headline left, transfer,
    transfer-dynamics, transfer-baselines; gainz exp1–exp4): the four methods and the sphere
    alone (AdamMD, MuonMD without gains) at 181M; MuonMD across width, depth and both; AdamW
    and Muon across the joint sweep, Muon there with 1000 warmup steps as exp4 (``MUON_WARM``).
    ``methods``: those at every size instead. Every run's meta names its base LR and, MD, its
    gains' LR (the side-LR panels read the recipe's point from here)."""

    def run(size, m, lr, tag="", extra=(), **meta):
        gain = {"gain_lr": lr} if "md" in m else {}
        return _dense_run(size, m, lr, tag, extra, text=text, base_lr=1e-3, **gain, **meta)

    if methods:
        return [run(s, m, lr) for s in DENSE_SIZES for m in methods for lr in lrs]
    plan = [("dense-181M", m) for m in METHODS] + [(s, "muonmd") for s in DENSE_SIZES[1:]]
    plan += [(s, "adamw") for s in JOINT[1:]]
    warm = {"axis": "warmup", "variant": MUON_WARM}
    sphere = {"axis": "sphere", "variant": "frobenius"}
    return (
        [run(s, m, lr) for s, m in plan for lr in lrs]
        + [run(s, "muon", lr, MUON_WARM, WARMUP["w1000"], **warm) for s in JOINT for lr in lrs]
        + [run("dense-181M", m, lr, SPHERE_ARM, SPHERE_ONLY, **sphere)
           for m in ("adammd", "muonmd") for lr in lrs]
    )  # fmt: skip


#: the sphere alone (fig. headline left: "fixing the weights onto a sphere improves the optimal
#: loss, and adding learnable magnitudes gives a further boost"): MD without gains
SPHERE_ONLY = ["--md-sphere=frobenius", "--md-gains=none"]
#: dense-grid's sphere-alone arm (its run names end in it)
SPHERE_ARM = "sphere-frobenius"
#: fig. depth-scaling: α = 1/sqrt(2L) after the Sandwich norm (the text: "after its RMSNorm";
#: gainz exp3-depth-transfer.sh's second loop) and without that norm (its last loop,
#: exp3-depth-prenorm: --fixed-layer-scale without --post-norm); variant -> flags
BLOCK_SCALE_ARMS = {
    "1sqrt2L": ["--block-output-scale=1/sqrt(2L)"],
    "1sqrt2L-prenorm": ["--no-sandwich-norm", "--prenorm-block-scale=1/sqrt(2L)"],
}


def pow2(ks, base: float = 1e-3) -> list[float]:
    """base · 2^(k/2) for k in ``ks`` (the runs' LR grids)."""
    return [base * 2 ** (k / 2) for k in ks]


@dataclass(frozen=True)
class Ablation:
    """One dense ablation on the 181M base × the LR grid as the authors ran it (gainz
    ``submissions/exp*.sh``). The arm that is the paper's default is not run again: it is
    dense-grid's run, which the figure's analysis reads beside the ablation's (``base``)."""

    methods: tuple[str, ...]
    """the methods the runs swept (``sweep.py --methods`` replaces them)"""
    arms: dict[str, list[str]]
    """variant -> its extra flags"""
    base: tuple[str, ...] = ("",)
    """dense-grid's 181M arms drawn beside: "" the method's recipe run, ``SPHERE_ARM`` the
    sphere alone"""
    text_arms: dict[str, list[str]] | None = None
    """the arms as the paper's text reads them, where it differs from the runs (--paper-text)"""
    beside: tuple[tuple[str, str], ...] = ()
    """dense-grid's 181M runs of other methods drawn beside: (method, its recipe run and the
    one whose name ends in this tag)"""
    points: dict[str, list[str]] = field(default_factory=dict)
    """arms the runs ran at one matrix LR, ``SIDE_MATRIX_LR`` (where the LRs include it)"""
    point_arm: str = ""
    """the arm whose flags (the runs' or, with ``--paper-text``, the text's) the one-LR arms
    add to; "" none"""
    past: tuple[int, ...] = ()
    """k of the matrix LRs 1e-3 · 2^(k/2) the runs added past the common grid, for every arm
    (where ``--lrs`` is not given)"""


#: Muon's scale modes × warmup (fig. muon-scale-modes, left) as the runs (gainz exp9 and exp10:
#: every mode with 1000 warmup steps; rms_match, Moonlight's 0.2·sqrt(max) = their
#: ``spectral`` × 0.2, and shape_scaling without); unit_rms_norm without warmup and with 1000
#: steps are dense-grid's Muon (the recipe, ``MUON_WARM``)
_MUON_SCALE = {
    f"{a}-{w}": [f"--muon-scale-mode={a}", *WARMUP[w]]
    for a, w in (("shape_scaling", "w1000"), ("shape_scaling", "w0"), ("rms_match", "w1000"),
                 ("rms_match", "w0"))
}  # fmt: skip
_MUONMD_SCALES = ("unit_rms_norm", "shape_scaling", "rms_match")

#: dense ablations (paper § "Sweep setups": "For the ablations below, we default to Muon as the
#: matrix optimizer under MD decoupling"; the runs: MuonMD, ``--opt master
#: --master-orthogonalize``): axis -> Ablation
ABLATIONS: dict[str, Ablation] = {
    # "Normalization Axis" (fig. norm-axis): the constraint alone, without gains, every row or
    # column at unit norm (gainz master.py ``_normalize``: radius 1 per row/column,
    # sqrt(max(d_out, d_in)) only for the Frobenius sphere), and the runs' ``embed`` mode
    # (exp6.1-hs-modes.sh: rows, columns for the residual-write projections: ``hidden``); the
    # Frobenius arm is dense-grid's sphere alone
    "sphere": Ablation(
        ("muonmd",),
        {
            a: [f"--md-sphere={a}", "--md-radius=unit", "--md-gains=none"]
            for a in ("row", "col", "hidden")
        },
        base=(SPHERE_ARM,),
    ),  # fmt: skip
    # fig. gain-axis (left): scalar, row, column gains on the Frobenius sphere (exp6.2); row and
    # column (the default) and none are dense-grid's
    "gains": Ablation(
        ("muonmd",), {a: [f"--md-gains={a}"] for a in ("scalar", "row", "col")}, ("", SPHERE_ARM)
    ),
    # fig. gain-axis (center, right), gain-dynamics: direct, exp, direct floored at 1e-5 (exp6.2
    # --gmin 1e-5); softplus (the default) is dense-grid's
    "gain-map": Ablation(
        ("muonmd",), {a: [f"--md-gain-map={a}"] for a in ("exp", "direct", "direct-floor")}
    ),
    # fig. higherrank-gains: rank k = 4 (exp14-lowrank-gains.sh, its loop ending at k = 9,
    # 2.26e-2), beside the row and column gains and the sphere alone
    "rank-k": Ablation(
        ("muonmd",),
        {"k4": ["--md-gains=lowrank", "--md-gain-rank=4"]},
        ("", SPHERE_ARM),
        past=(9,),
    ),
    # fig. embed-norm: free embeddings AND LM head (exp8: without --hs-embed both go to plain
    # Adam), and free at 8e-3 with the embedding LR 1e-3 · 2^(k/2), k = 2…5 (exp8's last loop,
    # exp8-embed-free-elr-grid); the text: the embeddings alone
    "embedding-norm": Ablation(
        ("muonmd",),
        {"none": ["--md-embedding-norm=none", "--md-output-norm=none"]},
        text_arms={"none": ["--md-embedding-norm=none"]},
        points={f"none-elr{fmt(e)}": [f"--embedding-lr={fmt(e)}"] for e in pow2(range(2, 6))},
        point_arm="none",
    ),
    "muon-scale": Ablation(("muon",), _MUON_SCALE, ("", MUON_WARM)),
    # fig. muon-scale-modes (center, right): the runs swept MuonMD's scale modes on the sphere
    # alone (exp9 "master-muon, no gains"), shape_up being dense-grid's sphere alone; the text
    # says MuonMD
    "muonmd-scale": Ablation(
        ("muonmd",),
        {a: [f"--muon-scale-mode={a}", *SPHERE_ONLY] for a in _MUONMD_SCALES},
        base=(SPHERE_ARM,),
        text_arms={a: [f"--muon-scale-mode={a}"] for a in _MUONMD_SCALES},
    ),
    # § Normalization axis (text): the tangent projection ("no measurable difference")
    "tangent": Ablation(("muonmd",), {"on": ["--md-tangent-grad"]}),
    # fig. lr-decay: WSD, 1-sqrt over the last 20 % (exp7-lr-decay.sh); linear is dense-grid's
    "schedule": Ablation(("muonmd",), {"wsd": WSD}),
    # fig. warmup (left): 1000 warmup steps for MuonMD (exp10-lr-warmup.sh), beside dense-grid's
    # MuonMD and Muon without (the recipes) and Muon with (``MUON_WARM``); 5000 steps at 8e-3
    # (the script's first loop: 1000 and 5000 steps at 1e-3 · 2^(6/2))
    "warmup": Ablation(
        ("muonmd",),
        {"w1000": WARMUP["w1000"]},
        beside=(("muon", MUON_WARM),),
        points={"w5000": ["--lr-warmup-iters=5000"]},
    ),
}


def ablation_runs(
    axis: str, lrs: list[float] | None, methods=None, text: bool = False
) -> list[Run]:
    """An ablation's runs: its methods (or ``methods``) × its arms × the matrix LRs (``lrs``, or
    the common grid and the runs' LRs past it, ``Ablation.past``), and its one-LR arms
    (``Ablation.points``) at ``SIDE_MATRIX_LR`` where the LRs include it."""
    ab = ABLATIONS[axis]
    lrs = lrs or lr_grid() + pow2(ab.past)
    arms = ab.text_arms if text and ab.text_arms else ab.arms
    at = [lr for lr in lrs if fmt(lr) == fmt(SIDE_MATRIX_LR)]
    plan = [(tag, extra, lr) for tag, extra in arms.items() for lr in lrs]
    under = arms[ab.point_arm] if ab.point_arm else []
    plan += [(tag, under + extra, lr) for tag, extra in ab.points.items() for lr in at]
    return [
        _dense_run("dense-181M", m, lr, f"{axis}-{tag}", extra, text=text, axis=axis, variant=tag)
        for m in methods or ab.methods
        for tag, extra, lr in plan
    ]


#: the side-LR panels' matrix LR: the runs' "central exp-1 value" 1e-3 · 2^(6/2) (gainz
#: exp1b-lr-supplement.sh; the text: the AdamW optimum; ``--lrs`` replaces it)
SIDE_MATRIX_LR = 8e-3


#: the runs took both α = 1/sqrt(2L) arms one step past the common grid, to 1e-3 · 2^(9/2)
#: (exp3-depth-transfer.sh: Sandwich Norm k = 5…7 then 8, 9; exp3-depth-prenorm k = 4…9); added
#: where ``--lrs`` is not given (``Ablation.past``)
BLOCK_SCALE_PAST = (9,)


def past_grid() -> list[str]:
    """The experiments that add the runs' LRs past the common grid where ``--lrs`` is not
    given, and those LRs' k."""
    past = {"block-scale": BLOCK_SCALE_PAST} | {a: ab.past for a, ab in ABLATIONS.items()}
    return [f"ablation-{a} k={','.join(map(str, ks))}" for a, ks in past.items() if ks]


def one_lr_arms() -> list[str]:
    """The ablations with arms run at ``SIDE_MATRIX_LR`` alone (``Ablation.points``)."""
    return [f"ablation-{a}" for a, ab in ABLATIONS.items() if ab.points]


def side_runs(name: str, lrs: list[float] | None, text: bool = False) -> list[Run]:
    """The side-LR panels (appendix "Additional LR Ablations", fig. lr-panels-combined) as the
    authors ran them (gainz exp1b-lr-supplement.sh, exp5-base-matrix-grid.sh):

    - ``side-base-lr`` (left): AdamW at matrix LR 8e-3, the base LR (1-D parameters) × 2^(k/2),
      k = -3…3, the LM head's LR with it (unset in the runs: it follows the base LR), the
      embeddings at 3e-3 (the text: "all Adam-managed groups scaled together": ``text`` scales
      them too); x axis ``base_lr``.
    - ``side-embedding-lr`` (center-left): MuonMD, embedding LR 1e-3 · 2^(k/2), k = 2…5, × the
      matrix-LR grid.
    - ``side-gain-lr`` (center-right): MuonMD at matrix LR 8e-3, the gains' LR 1e-3 · 2^(k/2),
      k = 3…8 (LM head 1e-3); x axis ``gain_lr``.
    - ``side-gain-lr-fixed`` (right): MuonMD, the gains' LR held at 1e-3 × the matrix-LR grid,
      beside dense-grid's MuonMD (gains at the matrix LR), whose 1e-3 run is this panel's 1e-3
      point (the runs: k = 4…8, exp1b ``mlrfix``)."""

    def run(method, lr, tag, extra, **meta):
        return _dense_run("dense-181M", method, lr, tag, extra, text=text, axis=name, variant=tag,
                          **meta)  # fmt: skip

    fixed = lrs or [SIDE_MATRIX_LR]
    if name == "side-base-lr":

        def base(b: float) -> list[str]:
            emb = [f"--embedding-lr={fmt(3 * b)}"] if text else []
            return [f"--lr={fmt(b)}", f"--output-lr={fmt(b)}", *emb]

        return [  # k = 0 is dense-grid's AdamW (base LR 1e-3)
            run("adamw", lr, f"blr{fmt(b)}", base(b), base_lr=b)
            for lr in fixed
            for b in pow2((-3, -2, -1, 1, 2, 3))
        ]
    if name == "side-embedding-lr":
        return [
            run("muonmd", lr, f"elr{fmt(e)}", [f"--embedding-lr={fmt(e)}"])
            for e in pow2(range(2, 6))
            for lr in lrs or lr_grid()
        ]
    if name == "side-gain-lr":
        return [  # the gains at the matrix LR are dense-grid's MuonMD (their default)
            run("muonmd", lr, f"glr{fmt(g)}", [f"--md-gain-lr={fmt(g)}"], gain_lr=g)
            for lr in fixed
            for g in pow2(range(3, 9))
            if fmt(g) != fmt(lr)
        ]
    if name == "side-gain-lr-fixed":
        return [run("muonmd", lr, "glr0.001", ["--md-gain-lr=0.001"]) for lr in lrs or lr_grid()
                if fmt(lr) != "0.001"]  # fmt: skip
    raise ValueError(name)


SIDE_LR = ("side-base-lr", "side-embedding-lr", "side-gain-lr", "side-gain-lr-fixed")

MOE_RUNGS = ("moe-0.27B-1.2B", "moe-0.41B-2.5B", "moe-0.58B-4.1B", "moe-0.81B-6.7B")
#: the ladder's token budgets (paper: {7.5, 15, 23, 44}B) as the authors ran them
#: (feat/scaling-sweeps sweep-scaling-laws.sh: 15B is the base's 3,584,000 samples, 14.68B)
MOE_BUDGETS = (7.5e9, BASE_TOKENS, 23.3e9, 44.15e9)
MOE_METHODS = ("adamw", "muon", "muonmd")
#: the MoE appendix's WSD arm (fig. moe-wsd) as the runs (recipes/wsd/*.sh, lib/common.sh): a
#: 1-sqrt cooldown over 732,422 samples (5,722 steps, 20 % of 15.0B tokens; the paper's text
#: says a 20 % linear cooldown)
MOE_WSD = ["--lr-decay-style=WSD", "--lr-wsd-decay-style=minus_sqrt", "--lr-wsd-decay-iters=5722"]
#: the text's WSD arm: "a 20% linear cooldown"
MOE_WSD_TEXT = ["--lr-decay-style=WSD", "--lr-wsd-decay-style=linear",
                "--wsd-cooldown-fraction=0.2"]  # fmt: skip


def _moe_run(size, method, lr, tokens, t=None, gbs=GBS, extra=(), tag="", text=False, **meta):
    flags = [f"--preset={size}", *_seq_flags(iters_for(tokens, gbs), gbs), *MOE_EVAL, *MOE_KEEP,
             *moe_recipe(method, lr, t, text), "--expert-model-parallel-size={ep}",
             *extra]  # fmt: skip
    name = f"{size}-{method}-" + (tag or f"{tokens / 1e9:.4g}B")
    meta = {"size": size, "method": method, "matrix_lr": lr, "tokens": tokens, "gbs": gbs, **meta}
    return Run(name, flags, meta)


def moe_ladder(text: bool = False) -> list[Run]:
    """Fig. moe (center): every rung × token budget with the base optima transferred, but the
    base rung at the base budget: that point is ``moe-base-sweep``'s optimum (``MOE_OPTIMA``),
    as the runs (feat/scaling-sweeps configs/scaling-laws.yaml: "The 14.68B (=15B) points are
    the original 270m LR-sweep optima"), not trained twice."""
    from megatron.md.train.presets import PRESETS

    runs = []
    for size in MOE_RUNGS:
        for method in MOE_METHODS:
            for tokens in MOE_BUDGETS:
                if (size, tokens) == (MOE_RUNGS[0], BASE_TOKENS):
                    continue
                t = transfer(method, PRESETS[size].hidden, tokens)
                runs.append(_moe_run(size, method, MOE_BASE_LR[method] * t.lr, tokens, t,
                                     text=text))  # fmt: skip
    return runs


#: the base sweep's matrix LRs per method as the runs (feat/scaling-sweeps
#: sweep-optimizers.sh, "Geometric x2 grids centered on each recipe's default", in their last
#: form): ADAMW_LRS for AdamW and Muown, MUON_MLRS (its first form 5e-3…4e-2, 1e-3 added) for
#: Muon and MuonMD; the paper's optima (``MOE_BASE_LR``: 2.4e-3, 5e-3, 1e-2) are points of them
MOE_ADAMW_LRS = (1.5e-4, 3e-4, 6e-4, 1.2e-3, 2.4e-3, 4.8e-3)
MOE_MUON_LRS = (1e-3, 5e-3, 1e-2, 2e-2, 4e-2)
MOE_GRIDS = {"adamw": MOE_ADAMW_LRS, "muown": MOE_ADAMW_LRS, "muon": MOE_MUON_LRS,
             "muonmd": MOE_MUON_LRS}  # fmt: skip
#: the base sweep's runs at the paper's optima, linear decay: the ladder's base-rung 14.68B
#: points and the batch sweep's batch-128 points (read there, not trained again)
MOE_OPTIMA = tuple(f"{MOE_RUNGS[0]}-{m}-lr{fmt(MOE_BASE_LR[m])}-linear" for m in MOE_METHODS)


def moe_base_sweep(lrs: list[float] | None, text: bool = False) -> list[Run]:
    """Fig. moe (left) and moe-wsd: the 270M-active base, 28,000 steps, each method's
    matrix-LR grid (``MOE_GRIDS``, or ``lrs`` for every method), with the paper's linear decay
    and a WSD arm; Muown too (the figure shows it with WSD, its better schedule)."""
    wsd = MOE_WSD_TEXT if text else MOE_WSD
    arms = (("linear", []), ("wsd", wsd))
    return [
        _moe_run(
            MOE_RUNGS[0],
            m,
            lr,
            BASE_TOKENS,
            extra=x,
            tag=f"lr{fmt(lr)}-{arm}",
            text=text,
            variant=arm,
        )
        for m in (*MOE_METHODS, "muown")
        for arm, x in arms
        for lr in lrs or MOE_GRIDS[m]
    ]


def moe_batch_sweep(gbs=(192, 256), text: bool = False) -> list[Run]:
    """Fig. moe (right) as the authors ran it (feat/scaling-sweeps sweep-batchsize.sh): the
    base config held at 28,000 steps (so k× the tokens) at global batch 192 and 256, every
    LR (matrix, embedding, output, scalar) × sqrt(k), the baselines' weight decay 0.1 and
    warmup 1000 steps as at the base. Batch 128 is ``moe-base-sweep``'s optimum
    (``MOE_OPTIMA``; the script: "128 = the existing scaling-law/LR-sweep runs")."""
    runs = []
    for m in MOE_METHODS:
        for g in gbs:
            t = transfer(m, 768, BASE_TOKENS * g / GBS, batch_mult=g / GBS)
            runs.append(_moe_run(MOE_RUNGS[0], m, MOE_BASE_LR[m] * t.lr, BASE_TOKENS * g / GBS,
                                 t, g, tag=f"gbs{g}", text=text, variant=f"gbs{g}"))  # fmt: skip
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
        flags = ["--preset=dense-150M", *_seq_flags(iters), *MOE_EVAL, *MOE_KEEP,
                 *moe_recipe("muonmd", lr), *extra]  # fmt: skip
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
    for reference are dense-grid's runs. Extras, labelled: nGPT as proposed with every
    parameter at the swept LR (``-onelr``: nGPT's own training), and the Muon family with 1e-2
    for every Adam-stepped parameter (``-side1e-2``: at 3e-3 nGPT's scaling vectors learned
    slowly in the laptop run, docs/cpu_repro.md). Assumed where the paper is silent: the
    recipe's schedule (linear decay, no warmup) for every arm."""

    def one_lr(lr):  # nGPT trains every parameter at one LR
        return [f"--lr={fmt(lr)}", f"--embedding-lr={fmt(lr)}", f"--output-lr={fmt(lr)}"]

    side = one_lr(1e-2)
    arms = {  # variant -> (methods, extra flags for a matrix LR)
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
    ran it (layer-wise, ``adammd-lw``) and inside ZeRO-1. Measured as tools/throughput.py
    measures: every iteration logged with megatron's timers, no evaluation, MD's diagnostics
    only at iteration 1 (on every 50th they would be in the timed iterations, MD's costing
    more than the baselines'). Their checkpoints hold the weights alone (``--no-save-optim``;
    megatron saves at a run's end whenever ``--save`` is set, which the launcher sets): the
    optimizer states made them 0.4 TB of disk for nothing; a requeued run goes on from its
    weights with a fresh optimizer (``--no-load-optim``), its speed the same."""
    runs = []
    for size, gbs in (
        ("dense-181M", GBS), ("dense-457M", GBS), ("dense-827M", GBS), ("dense-1.29B", GBS),
        ("dense-1.54B", GBS), ("dense-1.54B", 2 * GBS),
    ):  # fmt: skip
        for m in (*METHODS, "adammd-lw"):
            flags = [f"--preset={size}", *_seq_flags(200, gbs), *dense_recipe(m, 4e-3),
                     "--lr-warmup-iters=0",  # the recipe's 1000 exceed the run; speed unaffected
                     "--log-throughput", "--timing-log-level=2", "--eval-iters=0",
                     "--eval-interval=201", "--md-log-interval=201",
                     "--no-save-optim", "--no-load-optim"]  # fmt: skip
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


def _paper_preset(run: Run):
    """The run's preset, None for the tiny CPU ones (no GPU-hours or disk to plan)."""
    from megatron.md.train.presets import PRESETS

    p = PRESETS.get(run.meta.get("size", ""))
    return None if p is None or p.hidden < 256 else p


def gpu_hours(run: Run) -> float:
    """An estimate of the GPU-hours one run takes: training FLOPs (6 × active parameters
    outside the input embedding, plus attention's 12 · L · heads · head dim · sequence, per
    token; megatron's own FLOP count) over ``MFU`` × ``PEAK_FLOPS``. Reported by
    ``sweep.py --list`` for planning; tools/throughput.py measures the real rate."""
    from megatron.md.train.presets import count_params

    p = _paper_preset(run)
    if p is None:
        return 0.0
    _, active = count_params(p)
    seq = int(_flag(run.flags, "--seq-length", SEQ))
    tokens = int(_flag(run.flags, "--train-iters", 0)) * int(
        _flag(run.flags, "--global-batch-size", GBS)
    ) * seq  # fmt: skip
    per_token = 6 * (active - p.vocab * p.hidden) + 12 * p.layers * p.heads * p.head_dim * seq
    return per_token * tokens / (MFU * PEAK_FLOPS) / 3600


#: checkpoint bytes per parameter, bf16 under megatron's distributed optimizer (bf16 weights,
#: fp32 main weights, the moments: Adam's two, Muon's one for the matrices it steps), measured
#: on the tiny preset's torch_dist checkpoints at one rank (2026-12-03, megatron-core 0.19.2):
#: AdamW 14.3, AdamMD 14.6, Muon 11.1, MuonMD 11.4; the MD numbers, the larger, for each family;
#: "weights": --no-save-optim, the bf16 weights alone (AdamMD, 2026-12-04)
CKPT_BYTES = {"adam": 14.6, "muon": 11.4, "weights": 2.15}


def checkpoint_bytes(run: Run) -> float:
    """An estimate of the disk a run's checkpoints hold when it ends: those megatron's
    --save-retain-interval keeps (without it, every one the launcher's 1000-iteration saves
    make) and the last, × parameters × ``CKPT_BYTES`` of its optimizer family (of the weights
    alone under --no-save-optim)."""
    from megatron.md.train.presets import count_params

    p = _paper_preset(run)
    if p is None:
        return 0.0
    iters = int(_flag(run.flags, "--train-iters", 0))
    every = int(_flag(run.flags, "--save-retain-interval", 0) or 1000)
    kept = iters // every + (iters % every > 0)
    family = "muon" if "muo" in run.meta.get("method", "") else "adam"
    if "--no-save-optim" in run.flags:
        family = "weights"
    return kept * count_params(p)[0] * CKPT_BYTES[family]


_NO_HEAD_GAINS = "no gains on the LM head and the router (MD runs)"
_DENSE_TEXT = "RoPE without the dense presets' scaling; " + _NO_HEAD_GAINS
_MOE_TEXT = "Muon and MuonMD unclipped, the scaled init for MuonMD only; " + _NO_HEAD_GAINS
#: what --paper-text changes, per experiment: the paper's text where it differs from the
#: authors' runs (docs/experiments.md, "The paper and the authors' runs vs. these recipes")
TEXT_READINGS = {
    **{e: _DENSE_TEXT for e in ("dense-grid", "ablation-block-scale", *SIDE_LR)},
    **{f"ablation-{a}": _DENSE_TEXT for a in ABLATIONS},
    "ablation-embedding-norm": _DENSE_TEXT + "; the free arm frees the embeddings alone",
    "ablation-muonmd-scale": _DENSE_TEXT + "; the scale modes with gains (the runs: the "
    "sphere alone), beside dense-grid's MuonMD",
    "side-base-lr": _DENSE_TEXT + "; the embeddings' LR scaled with the base LR",
    "moe-base-sweep": _MOE_TEXT + "; the WSD arm a 20 % linear cooldown",
    "moe-batch-sweep": _MOE_TEXT,
    "moe-ladder": _MOE_TEXT,
}


def experiment(
    name: str, lrs: list[float] | None = None, methods=None, text: bool = False
) -> list[Run]:
    """Every run of a named experiment (see ``EXPERIMENTS``). ``methods``: a dense ablation's
    methods in place of the runs' (``Ablation.methods``); ``text``: the paper's text's reading
    where it differs from the authors' runs (``TEXT_READINGS``)."""
    if methods and name != "dense-grid" and name.removeprefix("ablation-") not in ABLATIONS:
        raise ValueError(f"{name} has no methods to choose (--methods: dense-grid and the dense "
                         f"ablations {', '.join('ablation-' + a for a in ABLATIONS)})")  # fmt: skip
    if methods and (bad := [m for m in methods if m not in METHODS]):
        raise ValueError(f"--methods {' '.join(bad)}: not one of {', '.join(METHODS)}")
    if text and name not in TEXT_READINGS:
        raise ValueError(f"{name}: the paper's text and the authors' runs agree (--paper-text "
                         f"changes {', '.join(TEXT_READINGS)})")  # fmt: skip
    given, lrs = lrs, lrs or lr_grid()
    if name == "dense-grid":
        return dense_grid(lrs, methods, text)
    if name == "ablation-block-scale":  # α = 1/L is dense-grid's depth sweep
        meta = {"text": text, "axis": "block-scale"}
        return [
            _dense_run(s, "muonmd", lr, f"alpha{v}", extra, variant=v, **meta)
            for v, extra in BLOCK_SCALE_ARMS.items()
            for s in DEPTHS
            for lr in (lrs if given else lrs + pow2(BLOCK_SCALE_PAST))
        ]
    if name == "ablation-rewarm":
        return rewarm_runs(given or [REWARM_LR])
    if name == "ngpt-comparison":
        return ngpt_runs(lrs)
    if name.startswith("ablation-"):
        return ablation_runs(name[len("ablation-") :], given, methods, text)
    if name in SIDE_LR:
        return side_runs(name, given, text)
    if name == "moe-base-sweep":
        return moe_base_sweep(given, text)
    if name == "moe-batch-sweep":
        return moe_batch_sweep(text=text)
    if name == "moe-ladder":
        return moe_ladder(text)
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
_GRID = "runs/dense-grid/manifest.json"


def _sweep_cmd(e: str, only: str, x: str = "", beside: str = _GRID) -> str:
    """lr_sweep over ``e``'s manifest and ``beside`` (dense-grid's), the runs named by
    ``only``."""
    x = f" --x {x}" if x else ""
    return (f"python tools/lr_sweep.py runs/{e}/manifest.json {beside} --only '{only}'{x} "
            f"--out runs/{e}/analysis")  # fmt: skip


def _runs(methods, tails: list[str], base: bool, lr: str = "[0-9.]+") -> str:
    """Run names (after the size) of ``methods``' recipe runs at ``lr`` (a pattern) where
    ``base``, and of those whose names end in one of ``tails``."""
    return f"({'|'.join(methods)})-lr{lr}({'|'.join(tails)}){'?' if base else ''}"


def _beside(e: str, methods, tails: list[str], base: bool, sizes=("181M",), lr="[0-9.]+",
            x="") -> str:  # fmt: skip
    """lr_sweep over ``e``'s runs and the dense-grid runs drawn beside them (``_runs``);
    ``x``: the figure's x axis (a run meta key) where not the matrix LR."""
    return _sweep_cmd(e, f"^dense-({'|'.join(sizes)})-{_runs(methods, tails, base, lr)}$", x)


def _with_base(axis: str) -> str:
    """An ablation's analysis: its runs beside dense-grid's arms (``Ablation.base``, and
    ``Ablation.beside``'s other methods)."""
    ab = ABLATIONS[axis]
    tails = [f"-{axis}-.+", *(f"-{b}" for b in ab.base if b)]
    runs = [_runs(ab.methods, tails, "" in ab.base), *(_runs([m], [f"-{t}"], True)
                                                       for m, t in ab.beside)]  # fmt: skip
    return _sweep_cmd(f"ablation-{axis}", f"^dense-181M-({'|'.join(runs)})$")


def _diag_with_base(axis: str) -> str:
    """Diagnostics of an ablation's runs and dense-grid's MuonMD recipe runs (names ending in
    the LR)."""
    e = f"ablation-{axis}"
    base = "runs/dense-grid/dense-181M-muonmd-lr*[0-9]/metrics.jsonl"
    return (
        f"python tools/plot_diagnostics.py runs/{e}/*/metrics.jsonl {base} "
        f"--out runs/{e}/diagnostics"
    )


#: the paper's downstream evaluation: the largest MoE at the largest budget, per method, its
#: last third of training (appendix "Downstream Evaluations"), then its table and figure
_EVAL_RUNS = f"{MOE_RUNGS[-1]}-{{{','.join(MOE_METHODS)}}}-{MOE_BUDGETS[-1] / 1e9:.4g}B"
_EVALS = (f"for RUN in {_EVAL_RUNS}; do python tools/evaluate.py --load runs/{{e}}/$RUN "
          "--tasks paper --trajectory 2/3 --out runs/{e}/evals/$RUN; done; python "
          f"tools/downstream.py runs/{{e}}/evals/{_EVAL_RUNS.split('{')[0]}*-"
          f"{MOE_BUDGETS[-1] / 1e9:.4g}B --out runs/{{e}}/evals/report")  # fmt: skip


def _with_optima(e: str, own: str, x: str = "") -> str:
    """lr_sweep over MoE experiment ``e``'s runs (names after ``moe-`` matching ``own``) and
    the base sweep's optima (``MOE_OPTIMA``) they share."""
    names = "|".join([own, *(n.removeprefix("moe-") for n in MOE_OPTIMA)])
    return _sweep_cmd(e, f"^moe-({names})$", x, "runs/moe-base-sweep/manifest.json")


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
    ("Fig. norm-axis", "sphere axis (row, column, the runs' hidden), no gains",
     "ablation-sphere, dense-grid", _with_base("sphere")),
    ("Fig. embed-norm", "unit embedding rows vs free", "ablation-embedding-norm, dense-grid",
     _with_base("embedding-norm") + "; " + _diag_with_base("embedding-norm")),
    ("Fig. gain-axis (left)", "gain axes", "ablation-gains, dense-grid", _with_base("gains")),
    ("Fig. gain-axis (center, right)", "gain maps; gradient norm", "ablation-gain-map, dense-grid",
     _with_base("gain-map") + "; " + _diag_with_base("gain-map")),
    ("Fig. gain-dynamics", "row/column gains per layer", "ablation-gain-map, dense-grid",
     _diag_with_base("gain-map")),
    ("Fig. higherrank-gains", "rank-k multiplicative gains", "ablation-rank-k, dense-grid",
     _with_base("rank-k")),
    ("Fig. lr-decay", "WSD vs linear; relative update (query block: rel_update_block)",
     "ablation-schedule, dense-grid",
     _with_base("schedule") + "; " + _diag_with_base("schedule")),
    ("Fig. warmup (left)", "with and without warmup", "ablation-warmup, dense-grid",
     _with_base("warmup")),
    ("Fig. warmup (center, right)", "re-warming: loss, gradient norm", "ablation-rewarm",
     "python tools/plot_curves.py runs/{e}/*/ --smooth 50 --out runs/{e}/analysis"),
    ("Fig. muon-scale-modes (left)", "Muon scale factors ± warmup",
     "ablation-muon-scale, dense-grid", _with_base("muon-scale")),
    ("Fig. muon-scale-modes (center, right)", "MuonMD scale factors (the runs: on the sphere "
     "alone)", "ablation-muonmd-scale, dense-grid", _with_base("muonmd-scale")),
    ("Sec. normalization axis (text)", "tangent projection", "ablation-tangent, dense-grid",
     _with_base("tangent")),
    ("Fig. depth-scaling", "block-output scale; act. RMS", "ablation-block-scale, dense-grid",
     _beside("ablation-block-scale", ["muonmd"], [f"-alpha{v}" for v in BLOCK_SCALE_ARMS], True,
             [d.removeprefix("dense-") for d in DEPTHS]) + "; " + _DIAG.replace(
         " --out", " runs/dense-grid/dense-252M-muonmd-lr*[0-9]/metrics.jsonl --out")),
    ("Fig. lr-panels-combined (left)", "base Adam LR (AdamW at matrix LR 8e-3)",
     "side-base-lr, dense-grid", _beside("side-base-lr", ["adamw"], ["-blr.+"], True,
                                         lr=fmt(SIDE_MATRIX_LR), x="base_lr")),
    ("Fig. lr-panels-combined (center-left)", "embedding LR × matrix LR",
     "side-embedding-lr, dense-grid", _beside("side-embedding-lr", ["muonmd"], ["-elr.+"], True)),
    ("Fig. lr-panels-combined (center-right)", "gains LR (MuonMD at matrix LR 8e-3)",
     "side-gain-lr, dense-grid", _beside("side-gain-lr", ["muonmd"], ["-glr.+"], True,
                                         lr=fmt(SIDE_MATRIX_LR), x="gain_lr")),
    ("Fig. lr-panels-combined (right)", "matrix LR, gains LR held at 1e-3",
     "side-gain-lr-fixed, dense-grid",
     _beside("side-gain-lr-fixed", ["muonmd"], ["-glr0.001"], True)),
    ("Fig. moe (left), moe-wsd", "MoE 270M base sweep, linear, WSD", "moe-base-sweep", _LR),
    ("Fig. moe (center)", "MoE scaling law, compute savings", "moe-ladder, moe-base-sweep",
     _with_optima("moe-ladder", "[0-9.]+B-.+-[0-9.]+B") + "; " + _LAW),
    ("Fig. moe (right)", "MoE batch size, √k LR rule", "moe-batch-sweep, moe-base-sweep",
     _with_optima("moe-batch-sweep", MOE_RUNGS[0].removeprefix("moe-") + "-.+-gbs[0-9]+",
                  "gbs")),
    ("Tab. throughput", "tokens/s per GPU", "throughput",
     "python tools/throughput.py --manifest runs/throughput/manifest.json"),
    ("Tab. moe-evals, fig. moe-evals", "downstream zero-shot: the largest MoE per method, "
     "the last third of its training", "moe-ladder", _EVALS),
    ("Fig. ngpt", "nGPT as proposed, its architecture with our sphere / MD, residual scale 1",
     "ngpt-comparison, dense-grid",
     _beside("ngpt-comparison", ["adammd", "muonmd"], ["-ngpt.*"], True)),
)  # fmt: skip


def reads_beside(name: str) -> list[str]:
    """The other experiments whose runs ``name``'s figures read (``PAPER``'s experiment column:
    an ablation's dense-grid arms, the MoE base sweep's optima), in order."""
    out: list[str] = []
    for _, _, exps, _ in PAPER:
        names = [e.strip() for e in exps.split(",")]
        if names[0] == name:
            out += [e for e in names[1:] if e not in out and e != "—"]
    return out


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
