"""Typed configuration of the Magnitude–Direction (MD) optimizer step.

One dataclass for the per-matrix MD choices the paper ablates, validated once; the entry point
exposes each field as a kebab-case ``--md-*`` flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, get_args, get_origin, get_type_hints

Sphere = Literal["frobenius", "row", "col", "hidden", "none"]
Radius = Literal["init", "shape", "unit"]
Gains = Literal["none", "scalar", "row", "col", "rowcol", "lowrank"]
GainMap = Literal["softplus", "exp", "direct", "direct-floor"]
RowNorm = Literal["row", "none"]
SideGains = Literal["matrix", "none"]
MuonScale = Literal[
    "unit_rms_norm", "shape_scaling", "rms_match", "shape_up", "sphere_rms", "hyperball", "none"
]
FusedStep = Literal["auto", "on", "off"]
Variant = Literal["md", "muown", "muown-unit", "muown-angular"]
SPHERES, RADII, GAINS, GAIN_MAPS = (get_args(t) for t in (Sphere, Radius, Gains, GainMap))
ROW_NORMS, MUON_SCALES, FUSED_STEPS = (get_args(t) for t in (RowNorm, MuonScale, FusedStep))
VARIANTS = get_args(Variant)
#: each gain kind's raw tensors (MD's state fields), in partial-buffer order
GAIN_NAMES = {
    "none": (),
    "scalar": ("gain_scalar",),
    "row": ("gain_row",),
    "col": ("gain_col",),
    "rowcol": ("gain_row", "gain_col"),
    "lowrank": ("gain_a", "gain_b"),
}
#: ``fused_step='auto'`` compiles an optimizer instance's MD step from this many elements of
#: MD matrices on the rank up: the paper's 181M model has ~4.7e7 in its hidden matrices, the
#: test suite's models under 1e6 (compiling costs tens of seconds, more than their whole run)
FUSED_MIN_ELEMENTS = 1 << 24
#: MDConfig fields that fix what the saved MD state means (a checkpoint refuses to continue
#: under others); every other field is a rate, a scale or how the step is executed, which a
#: resumed run may change (a re-warming run changes the gains' LR, say)
STATE_FIELDS = (
    "sphere", "radius", "gains", "gain_rank", "gain_map", "embedding_norm", "output_norm",
    "router_norm", "output_gains", "router_gains", "split_qkv", "adam_layer_wise", "variant",
)  # fmt: skip
#: what a checkpoint saved before a STATE_FIELDS entry existed was trained with
STATE_FIELDS_BEFORE = {"output_gains": "none", "router_gains": "none"}

#: Floor applied to raw gains under ``gain_map='direct-floor'``.
GAIN_FLOOR = 1e-5


def _check_choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{flag}={value!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class MDConfig:
    """Magnitude–Direction decoupling choices (defaults: the paper's recipe, except the radius
    and the Muon scale: ``init`` and ``sphere_rms`` are the text's reading, which MD state made
    from trained weights needs to keep the model's function; the paper recipes set the runs'
    ``shape`` and ``shape_up``, equal to ``sphere_rms`` on that sphere). Frozen: a run's choices
    are fixed once validated (``dataclasses.replace`` makes a changed copy)."""

    sphere: Sphere = "frobenius"
    """Axis of the fixed-norm constraint on the direction Ŵ: whole matrix (frobenius), each
    output row, each input column, each vector along the model's hidden dimension (hidden:
    nGPT's axes, rows of the matrices that read the residual stream and columns of the
    attention/MLP output projections that write it), or none (gains only)."""

    radius: Radius = "init"
    """Sphere radius: the matrix's norm when the MD state is created (init), the shape formula
    sqrt(max(d_out, d_in)) per Q/K/V block (shape: the paper's radius, which the paper recipes
    set; × ``residual_init_scale`` for the residual-write projections; per-row/col spheres split
    it evenly over rows/cols), or 1 for every vector of a row/col/hidden sphere (unit: nGPT's
    unit-norm weights)."""

    gains: Gains = "rowcol"
    """Magnitude gains: none, one scalar, per row, per column, per row and column, or a rank-k
    multiplicative gain Γ = 1 + A Bᵀ (lowrank: always the direct map; gain_map is not used)."""

    gain_rank: int = 4
    """Rank k of the lowrank gain."""

    gain_map: GainMap = "softplus"
    """Map φ from raw gain ĝ to gain g = φ(ĝ): softplus, exp, direct, or direct with the raw
    gain floored at 1e-5 after each step (direct-floor). Gains start at g = 1."""

    gain_lr_mult: float = 1.0
    """Gain LR as a multiple of the LR of the matrix's parameter group (1: follow the matrix LR,
    including its schedule). Ignored when ``gain_lr`` is set."""

    gain_lr: float | None = None
    """Peak gain LR (``--md-gain-lr``; the paper's MoE runs fix it at 1e-3), following the shape
    of the group's schedule between the group's own floor and this peak (MoE appendix: "linear
    decay to min-LR 1e-5, absolute floor per group"). None: follow the matrix LR."""

    gain_betas: tuple[float, float] = (0.9, 0.99)
    """Adam (beta1, beta2) of the gains."""

    gain_eps: float = 1e-8
    """Adam epsilon of the gains."""

    tangent_grad: bool = False
    """Project the direction gradient onto the sphere's tangent space before the base step
    (Frobenius and per-row/col spheres)."""

    embedding_norm: RowNorm = "row"
    """Embedding rows (token vectors): held at unit L2 norm (row) or left free (none)."""

    output_norm: RowNorm = "row"
    """Untied LM-head rows: held at unit L2 norm (row) or left free (none)."""

    router_norm: RowNorm = "row"
    """MoE router rows (one per expert): held at their init norm (row) or left free (none)."""

    output_gains: SideGains = "matrix"
    """Gains of the untied LM head: the hidden matrices' gains (matrix: the authors' runs, whose
    LM head takes the matrices' gains mode unless an output mode is set; the fork's
    ``_resolve_gains_mode`` in md_decoupling.py, and its MoE recipe master.sh) or none (the
    paper's text: LM-head rows at unit norm, no gains). Its rows stay on their sphere
    (``output_norm``) either way."""

    router_gains: SideGains = "matrix"
    """Gains of the MoE router: the hidden matrices' gains (matrix: the authors' runs, as for
    the LM head) or none (the paper's text)."""

    muon_scale: MuonScale = "sphere_rms"
    """Muon update scale for MD matrices: unit_rms_norm sqrt(d_out/d_in), shape_scaling
    max(1, sqrt(d_out/d_in)), rms_match 0.2·sqrt(max), shape_up sqrt(max(d_out/d_in,
    d_in/d_out)), sphere_rms c/sqrt(min(d_out, d_in)), hyperball c/‖update‖ (the update
    itself at the sphere's Frobenius norm c: MuonH, emerging-optimizers' MuonHyperball; per
    Q/K/V block when split), or none (factor 1)."""

    lowrank_init_std: float | None = None
    """Std of the random init of the lowrank factor A (B starts at 0, so Γ = 1); unset:
    (1/k)^½ for rank k, as the authors' runs (gainz ``master.py``, ``gains_lowrank_init_std``)."""

    lowrank_min: float = 1e-2
    """Floor of the lowrank multiplier: Γ = max(1 + A Bᵀ, lowrank_min) wherever Γ is applied
    (the factors' gradients are those of the unfloored product), as the authors' runs (gainz
    ``master.py``, ``gains_lowrank_min``): an entry of 1 + A Bᵀ cannot reach 0 or flip sign."""

    residual_init_scale: float = 1.0
    """Init std of the residual-write projections (attention ``linear_proj``, every MLP's
    ``linear_fc2``) relative to the other matrices: 1/sqrt(2L) under ``--scaled-output-init``
    (the paper's MoE MuonMD runs). With ``radius=init`` or ``shape`` their sphere is that much
    smaller, and the ``shape_up`` Muon scale is lowered with it (MoE appendix: "lowers the
    sphere-norm target of those projections (by 1/sqrt(2L)) and adjusts their shape-up factor
    accordingly")."""

    split_qkv: bool = True
    """The fused QKV matrix as megatron's Muon splits it (on by default upstream; off with
    ``--muon-no-split-qkv``): Q, K and V (interleaved per query group) each get their own
    sphere (per-block radius; tangent projection per block) under AdamMD and MuonMD, as the
    authors' optimizer does whatever the base (feat/md-decoupling-optimizer,
    md_decoupling.py ``_normalize``), and under MuonMD their own Newton–Schulz call and Muon
    scale. Gains stay those of the whole matrix. Off: one block."""

    adam_layer_wise: bool = False
    """AdamMD on whole matrices owned layer-wise (``--md-adam-layer-wise``) instead of ZeRO-1
    slices: the optimizer is built as megatron's layer-wise Muon (megatron-core shards
    layer-wise only for emerging optimizers) and the matrices' base step is Adam."""

    variant: Variant = "md"
    """md: the paper's MD step. muown: the Muown baseline as the paper ran it (``--optimizer
    muown``; the authors' feat/scaling-sweeps megatron/core/optimizer/muown.py): weight
    normalization of every Muon matrix, W = g·v/‖v‖ per row, g the row norms (Adam, direct map,
    at the matrix LR unless ``gain_lr``), v's Muon step on the tangent-projected,
    g/‖v‖-scaled gradient, v's row norms free; muown-unit: an earlier reading of its
    description, W = g·v with v at unit rows at the start, the Muon update (not the gradient)
    tangent-projected and the rows left to grow; muown-angular: muown-unit with v put back on
    the unit rows. The embeddings and LM head stay free (plain Adam)."""

    fused_step: FusedStep = "auto"
    """The MD step's per-group passes as compiled kernels (``torch.compile``,
    megatron/md/engine/compiled.py; AdamMD: partials, Adam and norms in one pass, MuonMD: the
    partials around its Newton–Schulz; both: rescale and fused weight in one): on, off, or auto:
    on for an optimizer whose MD matrices hold at least 2^24 elements on the rank, off for
    smaller ones (compiling takes tens of seconds); on a GPU for AdamMD and MuonMD (checked
    against the reference there; H200, 2026-11-26: AdamMD's step 1.03× Adam's at 181M and
    0.79× at 1.29B against the eager 1.58× and 2.75×, MuonMD's 0.34× and 1.34× Muon's against
    0.43× and 1.56×; H200, 2026-12-04: AdamMD 1.33×, 0.79× and 0.77× at 181M, 457M and 1.29B,
    MuonMD 0.33×, 0.44× and 0.97×), on a CPU for AdamMD only (MuonMD's compiled passes
    measured no faster there); docs/benchmarks.md. Execution only: the results agree with the
    eager step to fp32 rounding, it is never used with MD off, checkpoints are interchangeable.
    Each kernel's first call of a layout is checked against its eager formula (torch
    2.9.1-2.11.0's inductor miscompiled two on a CPU; docs/internals.md): a difference stops
    the run under on (``MiscompiledKernel``); under auto that layout runs the eager formula
    from then on, said once on stderr."""

    cuda_graph: bool = False
    """Capture the MD optimizer's inner step (every MD matrix's step with its reductions, the
    1-D parameters' Adam, the fused weights) in a CUDA graph after 3 eager steps and replay it
    (megatron/md/engine/graph.py); the step count and LRs are then read on the device, an fp32
    rounding from the eager step. GPU only; megatron's gradient buffers must stay put (fp32,
    megatron's default with --bf16). Off by default: on one H100, one rank (181M, 2026-11-26)
    it replayed correctly with a moving LR and made AdamMD's step 0.78x Adam's (compiled, not
    captured: 1.02x) and its tokens/s 0.96x AdamW's (0.81x); on one H200 (2026-12-04) 0.77x
    Adam's step (not captured: 1.33x), and a run saved and resumed with it repeated its losses
    bit for bit; never run across ranks (docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the flag and the allowed values for any bad choice."""
        for name, allowed in CHOICES.items():
            _check_choice(flag_of(name), getattr(self, name), allowed)
        if self.gains == "lowrank":
            if not isinstance(self.gain_rank, int) or self.gain_rank < 1:
                raise ValueError(f"--md-gain-rank={self.gain_rank!r} must be an integer >= 1")
            std = self.lowrank_init_std
            if std is not None and not (math.isfinite(std) and std >= 0):
                raise ValueError(f"--md-lowrank-init-std={std!r} must be a number >= 0")
            if not (math.isfinite(self.lowrank_min) and 0 < self.lowrank_min < 1):
                raise ValueError(f"--md-lowrank-min={self.lowrank_min!r} must be in (0, 1)")
            if self.gain_map == "direct-floor":  # the floor would clamp the factors A and B
                raise ValueError(
                    "--md-gain-map direct-floor floors gains at 1e-5; --md-gains lowrank has no "
                    'gains to floor (Γ = 1 + ABᵀ, paper appendix "Higher-Rank Gains"): use '
                    "the default gain map with lowrank"
                )
        if not (math.isfinite(self.gain_lr_mult) and self.gain_lr_mult >= 0):
            raise ValueError(f"gain LR multiplier {self.gain_lr_mult!r} must be >= 0")
        if self.gain_lr is not None and not (math.isfinite(self.gain_lr) and self.gain_lr >= 0):
            raise ValueError(f"--md-gain-lr={self.gain_lr!r} must be a number >= 0")
        b1, b2 = self.gain_betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"gain betas {self.gain_betas!r} must lie in [0, 1)")
        if not (math.isfinite(self.residual_init_scale) and self.residual_init_scale > 0):
            raise ValueError(f"residual init scale {self.residual_init_scale!r} must be > 0")
        if self.radius == "unit" and self.sphere not in ("row", "col", "hidden"):
            raise ValueError(
                f"--md-radius unit puts every row or column at norm 1: it needs --md-sphere "
                f"row, col or hidden (got {self.sphere})"
            )
        if self.sphere == "none" and self.tangent_grad:
            raise ValueError("--md-tangent-grad needs a sphere (--md-sphere frobenius|row|col)")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def docs(cls) -> dict[str, str]:
        """Each field's docstring (the string under it in this class), read from the source:
        the ``--md-*`` flags' help text comes from here."""
        import ast
        import inspect

        body = ast.parse(inspect.getsource(cls)).body[0].body
        out = {}
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
                if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    out[node.target.id] = " ".join(nxt.value.value.split())
        return out

    def use_fused(self, device_type: str, elements: int) -> frozenset[str]:
        """The bases whose MD matrices take the compiled step in an optimizer instance on
        ``device_type`` whose MD matrices hold ``elements`` elements on this rank (the rule of
        ``fused_step``; empty: none). auto compiles both on a GPU and AdamMD only on a CPU,
        where MuonMD's step is Newton–Schulz's matmuls and its compiled passes measured no
        faster (181M, 2 ranks, 2026-11-26: inner step 1.06× Muon's against the eager 0.94×,
        docs/benchmarks.md)."""
        if self.fused_step == "auto":
            if elements < FUSED_MIN_ELEMENTS:
                return frozenset()
            return frozenset({"adam"} if device_type == "cpu" else {"adam", "muon"})
        return frozenset({"adam", "muon"} if self.fused_step == "on" else ())

    def lowrank_init_std_for(self) -> float:
        """The std of A's init: as set, or (1/k)^½ for rank k (the authors' runs)."""
        if self.lowrank_init_std is not None:
            return self.lowrank_init_std
        return (1.0 / self.gain_rank) ** 0.5

    def gain_lr_for(self, group: dict) -> float:
        """The gain LR of a parameter group at its current LR.

        With a fixed ``gain_lr``: the group's schedule mapped affinely from [floor, peak] onto
        [floor, gain_lr] (floor = the group's ``min_lr``, an absolute floor as in the paper's
        MoE runs), so the gains decay to the same floor as every group. Exact for megatron's
        decay shapes (min + (max − min)·f(t)); during a warmup from 0 it is off by at most the
        floor, and never below 0."""
        lr = group["lr"]
        if self.gain_lr is None:
            return lr * self.gain_lr_mult
        peak = group.get("max_lr") or group.get("initial_lr") or lr
        floor = min(group.get("min_lr") or 0.0, self.gain_lr)
        if peak <= floor:
            return self.gain_lr
        return max(0.0, floor + (self.gain_lr - floor) * (lr - floor) / (peak - floor))


#: MDConfig field -> allowed values (its flag's choices), read off the ``Literal`` field types
CHOICES = {
    name: get_args(t) for name, t in get_type_hints(MDConfig).items() if get_origin(t) is Literal
}
#: choice flags that may be given bare: ``--md-fused-step`` alone means on
BARE = {"fused_step": "on"}
#: MDConfig fields set from megatron's own flags, not from an --md-* flag of their own
FROM_MEGATRON_FLAGS = {
    "gain_betas": "--adam-beta1/--adam-beta2",
    "muon_scale": "--muon-scale-mode",
    "residual_init_scale": "--scaled-output-init",
    "split_qkv": "--muon-split-qkv",
}


def flag_of(name: str) -> str:
    """The command-line flag that sets MDConfig field ``name``."""
    return FROM_MEGATRON_FLAGS.get(name, "--md-" + name.replace("_", "-"))


def check_radius(radius: float, name: str = "matrix") -> float:
    """A sphere radius must be a finite positive number."""
    if not (math.isfinite(radius) and radius > 0):
        raise ValueError(f"sphere radius of {name} is {radius!r}; it must be finite and > 0")
    return radius


ROLES = ("matrix", "embedding", "output", "router")


@dataclass(frozen=True)
class MatrixSpec:
    """The MD treatment of one 2-D parameter, resolved from ``MDConfig`` and its role."""

    sphere: str
    """frobenius, row, col or none (MDConfig's hidden resolved to row or col)."""
    radius: str
    """init, shape, or unit (each row at unit L2 norm: embeddings and LM head)."""
    gains: str
    """none, scalar, row, col, rowcol or lowrank."""
    gain_map: str
    """softplus, exp, direct or direct-floor."""
    gain_rank: int = 4
    """Rank of lowrank gains."""
    tangent_grad: bool = False
    """Project the direction gradient onto the sphere's tangent space."""
    muon_scale: str = "sphere_rms"
    """Muon update scale mode (used only when the base step is Muon)."""
    lowrank_init_std: float = 1.0
    """Std of the random init of lowrank factor A."""
    lowrank_min: float = 0.0
    """Floor of the lowrank multiplier 1 + A Bᵀ (0: none)."""
    init_scale: float = 1.0
    """Init std relative to the other matrices (``MDConfig.residual_init_scale`` for
    residual-write projections): the shape radius and the ``shape_up`` Muon scale are
    multiplied by it (with the init radius it is in the init norm already)."""
    row_blocks: tuple[int, ...] = ()
    """Rows of one query group of a fused QKV matrix, per block (q, k, v), when Muon splits it
    (``MDConfig.split_qkv``): each block has its own sphere and Muon call. Empty: one block."""
    gain_init: str = "one"
    """one: gains start at 1 (the direction is the weight); norm (Muown): the row gains start at
    the weight's row norms and the direction at its unit rows (needs row gains, a unit row
    sphere and the direct map), so W is unchanged either way."""
    project: bool = True
    """Put Ŵ back on its sphere after the base step (Algorithm 2, line 8); False (Muown): the
    sphere only defines the tangent projection and the rows grow."""
    tangent_update: bool = False
    """Project the Muon update (not the gradient) onto the sphere's tangent space (muown-unit's
    "tangent-projected Muon step")."""
    weight_norm: bool = False
    """Weight normalization (Muown as the authors ran it): W = Γ ⊙ (Ŵ/‖Ŵ‖ per row), the
    direction's row norms free (``project`` off); the gains' gradients are taken on Ŵ/‖Ŵ‖, the
    direction's is tangent-projected (``tangent_grad``) and divided by ‖Ŵ‖, the exact gradient
    of W with respect to Ŵ. Row sphere only."""


def spec_for(
    role: str, cfg: MDConfig, residual: bool = False, row_blocks: tuple[int, ...] = ()
) -> MatrixSpec:
    """Resolve the per-role treatment of the paper (recipe table "Special parameters").
    ``residual``: a residual-write projection (``residual_write``); ``row_blocks``: the QKV
    split of a Muon-stepped fused QKV matrix (``qkv_blocks``)."""
    if cfg.variant != "md":  # Muown: every Muon matrix (router too); embeddings, LM head free
        if role in ("embedding", "output"):
            return MatrixSpec("none", "unit", "none", "direct", muon_scale="none")
        blocks = tuple(row_blocks) if cfg.split_qkv else ()
        unset = cfg.muon_scale == "sphere_rms"  # MD's default: each variant's own instead
        if cfg.variant == "muown":  # muown.py: v = W at the start, g its row norms; Moonlight's
            # 0.2·sqrt(max(d_out, d_in)) Muon scale per Q/K/V block
            return MatrixSpec("row", "init", "row", "direct", tangent_grad=True,
                              muon_scale="rms_match" if unset else cfg.muon_scale,
                              row_blocks=blocks, gain_init="norm", project=False,
                              weight_norm=True)  # fmt: skip
        return MatrixSpec("row", "unit", "row", "direct",
                          muon_scale="shape_scaling" if unset else cfg.muon_scale,
                          row_blocks=blocks, gain_init="norm",
                          project=cfg.variant == "muown-angular", tangent_update=True)  # fmt: skip
    if role == "matrix":
        sphere = cfg.sphere
        if sphere == "hidden":  # nGPT: normalized along the residual stream's dimension
            sphere = "col" if residual else "row"
        return MatrixSpec(
            sphere,
            cfg.radius,
            cfg.gains,
            cfg.gain_map,
            cfg.gain_rank,
            cfg.tangent_grad,
            cfg.muon_scale,
            cfg.lowrank_init_std_for(),
            lowrank_min=cfg.lowrank_min,
            init_scale=cfg.residual_init_scale if residual else 1.0,
            row_blocks=tuple(row_blocks) if cfg.split_qkv else (),
        )
    if role in ("embedding", "output"):
        norm = cfg.embedding_norm if role == "embedding" else cfg.output_norm
        sphere = "row" if norm == "row" else "none"
        gains = cfg.gains if role == "output" and cfg.output_gains == "matrix" else "none"
        return MatrixSpec(sphere, "unit", gains, cfg.gain_map, cfg.gain_rank,
                          lowrank_init_std=cfg.lowrank_init_std_for(), lowrank_min=cfg.lowrank_min,
                          muon_scale="none")  # fmt: skip
    if role == "router":
        sphere = "row" if cfg.router_norm == "row" else "none"
        gains = cfg.gains if cfg.router_gains == "matrix" else "none"
        return MatrixSpec(sphere, "init", gains, cfg.gain_map, cfg.gain_rank,
                          lowrank_init_std=cfg.lowrank_init_std_for(), lowrank_min=cfg.lowrank_min,
                          muon_scale="none")  # fmt: skip
    raise ValueError(f"MD role {role!r} is not one of {', '.join(ROLES)}")
