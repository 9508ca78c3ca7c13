"""Reference MD step for ONE whole matrix: the paper's Algorithm 2, line by line.

Readable, not fast. The fused weight is W = diag(g_row) · Ŵ · diag(g_col) with g = φ(ĝ); Ŵ is
kept in the state as the master direction, so line 2 ("recover Ŵ") never divides by the gains.
Every sliced, fused or distributed path is tested against this module.
"""

from __future__ import annotations

import math

import torch

from megatron.md import maps
from megatron.md.base_steps import (
    AdamHParams,
    MuonHParams,
    adam_step_,
    muon_scale_factor,
    muon_update,
)
from megatron.md.config import GAIN_NAMES, MatrixSpec, check_radius
from megatron.md.state import MatrixState


def row_block_ids(d_out: int, row_blocks: tuple[int, ...]) -> torch.Tensor | None:
    """Block id of every row of a fused QKV matrix split as megatron's Muon splits it: rows
    come in query groups of ``sum(row_blocks)`` rows, ``row_blocks[b]`` of each belong to
    block b (emerging_optimizers.py, TensorParallelMuon.orthogonalize). None: one block (no
    split)."""
    if not row_blocks:
        return None
    period = sum(row_blocks)
    if d_out % period:
        raise ValueError(f"{d_out} rows are not whole query groups of {row_blocks} rows")
    pattern = torch.repeat_interleave(torch.arange(len(row_blocks)), torch.tensor(row_blocks))
    return pattern.repeat(d_out // period)


def axis_sum(x: torch.Tensor, sphere: str, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of ``x`` along the sphere axis: a scalar (frobenius), per row (d_out,), or per
    column (d_in,); with row blocks (``ids``) each block sums on its own: (blocks,) for
    frobenius, (blocks, d_in) for col."""
    if sphere == "row":
        return x.sum(1)
    if ids is None:
        return x.sum() if sphere == "frobenius" else x.sum(0)
    n = int(ids.max()) + 1
    rows = x.sum(1) if sphere == "frobenius" else x
    return rows.new_zeros((n, *rows.shape[1:])).index_add_(0, ids.to(x.device), rows)


def sq_norms(x: torch.Tensor, sphere: str, ids: torch.Tensor | None = None) -> torch.Tensor:
    """‖x‖² along the sphere axis (see ``axis_sum``)."""
    if sphere == "frobenius" and ids is None:
        flat = x.reshape(-1)
        return flat @ flat
    return axis_sum(x * x, sphere, ids)


def norms(x: torch.Tensor, sphere: str, ids: torch.Tensor | None = None) -> torch.Tensor:
    return sq_norms(x, sphere, ids).sqrt()


def _bcast(v: torch.Tensor, sphere: str, ids: torch.Tensor | None = None) -> torch.Tensor:
    """A per-axis quantity broadcast against the (d_out, d_in) matrix."""
    if sphere == "row":
        return v[:, None]
    if ids is None:
        return v  # a scalar, or col vectors broadcast over rows as they are
    return v[ids][:, None] if sphere == "frobenius" else v[ids]


def block_shapes(shape: tuple[int, int], spec: MatrixSpec) -> list[tuple[int, int]]:
    """(rows, d_in) of each block the matrix is stepped as (one, unless QKV is split)."""
    d_out, d_in = shape
    if not spec.row_blocks:
        return [(d_out, d_in)]
    groups = d_out // sum(spec.row_blocks)
    return [(groups * n, d_in) for n in spec.row_blocks]


def shape_radius(shape: tuple[int, int], spec: MatrixSpec, dtype, device) -> torch.Tensor:
    """The ``radius=shape`` sphere: sqrt(max(rows, d_in)) in Frobenius norm per block, times
    ``spec.init_scale`` (1/sqrt(2L) for the residual-write projections under a scaled output
    init: the authors' ``hypersphere_scale_out_proj_init``, feat/md-decoupling-optimizer
    megatron/core/optimizer/md_decoupling.py), split evenly over the rows (row sphere) or
    columns (col sphere); shaped like ``init_radius``."""
    d_out, d_in = shape
    ids = row_block_ids(d_out, spec.row_blocks)
    blocks = block_shapes(shape, spec)
    full = torch.tensor([math.sqrt(max(n, m)) * spec.init_scale for n, m in blocks],
                        dtype=torch.float64)  # fmt: skip
    if spec.sphere == "frobenius":
        r = full if ids is not None else full[0]
    elif spec.sphere == "row":
        rows = torch.tensor([n for n, _ in blocks], dtype=torch.float64)
        b = ids if ids is not None else torch.zeros(d_out, dtype=torch.long)
        r = full[b] / rows[b].sqrt()
    else:
        r = (full / math.sqrt(d_in))[:, None].expand(-1, d_in)
        r = r if ids is not None else r[0]
    return r.contiguous().to(dtype).to(device)


def init_radius(w: torch.Tensor, spec: MatrixSpec) -> torch.Tensor | None:
    """The sphere radius: current norm (init), shape formula, or 1 per row (unit). With a QKV
    split every block (q, k, v) has its own."""
    d_out, d_in = w.shape
    if spec.sphere == "none":
        return None
    if spec.radius == "init":
        r = norms(w, spec.sphere, row_block_ids(d_out, spec.row_blocks))
    elif spec.radius == "unit":  # each row (or column) at norm 1
        r = torch.ones_like(norms(w, spec.sphere, row_block_ids(d_out, spec.row_blocks)))
    else:
        r = shape_radius((d_out, d_in), spec, w.dtype, w.device)
    check_radius(float(r.min()), "matrix")
    return r.to(w.dtype)


def init_gain_state(
    spec: MatrixSpec, shape: tuple[int, int], seed: int = 0, like=None
) -> MatrixState:
    """Raw gains giving g = 1 (lowrank: A random, B = 0) and their zero Adam moments."""
    d_out, d_in = shape
    one = maps.raw_for_unit_gain(spec.gain_map)
    shapes = {"gain_scalar": (), "gain_row": (d_out,), "gain_col": (d_in,)}
    st: MatrixState = {}
    dtype = torch.float32 if like is None else like.dtype
    for name in GAIN_NAMES[spec.gains]:
        if name == "gain_a":
            gen = torch.Generator().manual_seed(seed)
            raw = torch.randn(d_out, spec.gain_rank, generator=gen) * spec.lowrank_init_std
        elif name == "gain_b":
            raw = torch.zeros(d_in, spec.gain_rank)
        else:  # g = 1 to the precision of the direction
            raw = torch.full(shapes[name], one, dtype=dtype)
        if like is not None:  # dtype/device of the direction
            raw = raw.to(like.device, like.dtype)
        st[name] = raw
        st[name + "_exp_avg"] = torch.zeros_like(raw)
        st[name + "_exp_avg_sq"] = torch.zeros_like(raw)
    return st


def init_state(w: torch.Tensor, spec: MatrixSpec, base: str, seed: int = 0) -> MatrixState:
    """MD state for weight ``w`` with gains 1: the model's function is unchanged (up to the
    projection onto the sphere when the radius is not the current norm)."""
    if w.ndim != 2:
        raise ValueError(f"MD needs a 2-D weight matrix; got a tensor of shape {tuple(w.shape)}")
    if base not in ("adam", "muon"):
        raise ValueError(f"MD base optimizer {base!r} is not one of adam, muon")
    d_out, d_in = w.shape
    direction = w.detach().clone()
    if direction.dtype in (torch.bfloat16, torch.float16):
        direction = direction.float()  # the fp32 master direction
    radius = init_radius(direction, spec)
    ids = row_block_ids(d_out, spec.row_blocks)
    row_norms = norms(direction, "row")  # Muown's magnitudes (gain_init="norm")
    if radius is not None and spec.radius != "init":
        direction.mul_(_bcast(radius / norms(direction, spec.sphere, ids), spec.sphere, ids))
    st: MatrixState = {"step": 0, "direction": direction, "radius": radius}
    st.update(init_gain_state(spec, (d_out, d_in), seed, like=direction))
    if spec.gain_init == "norm":  # W = diag(‖w_i‖) · (unit rows): unchanged
        st["gain_row"] = row_norms.clone()
    if base == "adam":
        st["exp_avg"] = torch.zeros_like(direction)
        st["exp_avg_sq"] = torch.zeros_like(direction)
    else:
        st["momentum_buffer"] = torch.zeros_like(direction)
    return st


def apply_gains(x: torch.Tensor, st: MatrixState, spec: MatrixSpec) -> torch.Tensor:
    """Γ ⊙ x for W = Γ ⊙ Ŵ: diag(g_row) · x · diag(g_col), γ·x, or (1 + A Bᵀ) ⊙ x."""
    if spec.gains == "none":
        return x.clone()
    if spec.gains == "lowrank":  # floored: an entry cannot reach 0 (gainz master.py)
        gamma = 1 + st["gain_a"] @ st["gain_b"].T
        return (gamma.clamp_min(spec.lowrank_min) if spec.lowrank_min > 0 else gamma) * x
    if spec.gains == "scalar":
        return maps.phi(st["gain_scalar"], spec.gain_map) * x
    if "gain_row" in st:
        x = maps.phi(st["gain_row"], spec.gain_map)[:, None] * x
    if "gain_col" in st:
        x = x * maps.phi(st["gain_col"], spec.gain_map)[None, :]
    return x


def unit_direction(st: MatrixState, spec: MatrixSpec) -> torch.Tensor:
    """What the gains multiply: Ŵ, or Ŵ/‖Ŵ‖ per row under weight normalization (Muown)."""
    wh = st["direction"]
    return wh / norms(wh, "row")[:, None] if spec.weight_norm else wh


def fused_weight(st: MatrixState, spec: MatrixSpec) -> torch.Tensor:
    """W = Γ ⊙ Ŵ (Algorithm 2, line 10); Γ ⊙ Ŵ/‖Ŵ‖ under weight normalization."""
    return apply_gains(unit_direction(st, spec), st, spec)


def frobenius_radius(st: MatrixState, spec: MatrixSpec) -> torch.Tensor:
    """Frobenius norm of each block's sphere (for the sphere_rms Muon scale): float64 of shape
    (blocks,); the current norm where there is no sphere."""
    r, wh = st["radius"], st["direction"]
    ids = row_block_ids(wh.shape[0], spec.row_blocks)
    if r is None:
        r = norms(wh, "frobenius", ids)
    elif spec.sphere == "row":
        r = axis_sum((r * r)[:, None], "frobenius", ids).sqrt()
    elif spec.sphere == "col":
        r = (r * r).reshape(-1, wh.shape[1]).sum(1).sqrt()
    return r.reshape(-1).double()


def muon_scales(st: MatrixState, spec: MatrixSpec) -> list:
    """Muon update scale of each block: the spec's mode; ``shape_up`` follows a scaled init
    (``MatrixSpec.init_scale``, MoE appendix) when the radius does (init or shape)."""
    radii = frobenius_radius(st, spec) if spec.muon_scale in ("sphere_rms", "hyperball") else None
    out = []
    for b, (rows, d_in) in enumerate(block_shapes(tuple(st["direction"].shape), spec)):
        s = muon_scale_factor(spec.muon_scale, rows, d_in, None if radii is None else radii[b])
        if spec.muon_scale == "shape_up" and spec.radius != "unit":
            s = s * spec.init_scale
        out.append(s)
    return out


def split_gradient(g: torch.Tensor, st: MatrixState, spec: MatrixSpec) -> tuple[dict, torch.Tensor]:
    """Algorithm 2, lines 1-6: gradients of the raw gains and of the direction Ŵ."""
    wh = st["direction"]
    # 1. the gains g = φ(ĝ) are materialized where used; 2. Ŵ is the state's direction
    # 3.-5. gain gradients: the chain rule through W = Γ ⊙ Ŵ and g = φ(ĝ) (Ŵ/‖Ŵ‖ in place of
    # Ŵ under weight normalization)
    p = unit_direction(st, spec) * g
    gain_grads = {}
    if spec.gains == "lowrank":
        gain_grads["gain_a"] = p @ st["gain_b"]
        gain_grads["gain_b"] = p.T @ st["gain_a"]
    elif spec.gains != "none":
        g_row = maps.phi(st["gain_row"], spec.gain_map) if "gain_row" in st else None
        g_col = maps.phi(st["gain_col"], spec.gain_map) if "gain_col" in st else None
        if spec.gains == "scalar":
            gain_grads["gain_scalar"] = p.sum()
        if g_row is not None:  # rowsum((Ŵ⊙G) diag(g_col)) = (Ŵ⊙G) g_col
            gain_grads["gain_row"] = p.sum(1) if g_col is None else p @ g_col
        if g_col is not None:  # colsum(diag(g_row) (Ŵ⊙G)) = g_row (Ŵ⊙G)
            gain_grads["gain_col"] = p.sum(0) if g_row is None else g_row @ p
        for name in gain_grads:
            gain_grads[name] = gain_grads[name] * maps.phi_prime(st[name], spec.gain_map)

    # 6. direction gradient G_Ŵ = Γ ⊙ G, optionally without its radial component
    g_dir = apply_gains(g, st, spec)
    if spec.tangent_grad and spec.sphere != "none":
        ids = row_block_ids(wh.shape[0], spec.row_blocks)
        r2 = sq_norms(wh, spec.sphere, ids)
        inner = axis_sum(g_dir * wh, spec.sphere, ids)
        g_dir -= _bcast(inner / r2, spec.sphere, ids) * wh
    if spec.weight_norm:  # ∂(v/‖v‖)/∂v = (I − u uᵀ)/‖v‖: the projection above, then 1/‖v‖
        g_dir /= norms(wh, "row")[:, None]

    return gain_grads, g_dir


def md_step(
    w: torch.Tensor,
    grad: torch.Tensor,
    st: MatrixState,
    spec: MatrixSpec,
    base_hp: AdamHParams | MuonHParams,
    gain_hp: AdamHParams,
) -> None:
    """One MD step: updates ``st`` and writes the new fused weight into ``w`` in place."""
    st["step"] += 1
    t = st["step"]
    wh = st["direction"]
    g = grad.to(wh.dtype)

    # 1.-6. split G between the gains and the direction
    gain_grads, g_dir = split_gradient(g, st, spec)

    # 7. base step on the direction (no weight decay under MD)
    if isinstance(base_hp, AdamHParams):
        adam_step_(wh, g_dir, st["exp_avg"], st["exp_avg_sq"], t, base_hp)
    else:  # Muon: one Newton–Schulz call per block (Q, K, V when split)
        upd = muon_update(g_dir, st["momentum_buffer"], base_hp, muon_scales(st, spec),
                          spec.row_blocks, hyperball=spec.muon_scale == "hyperball")  # fmt: skip
        if spec.tangent_update:  # muown-unit: the step itself on the tangent space
            ids = row_block_ids(wh.shape[0], spec.row_blocks)
            inner = axis_sum(upd * wh, spec.sphere, ids) / sq_norms(wh, spec.sphere, ids)
            upd = upd - _bcast(inner, spec.sphere, ids) * wh
        wh.add_(upd, alpha=-base_hp.lr)

    # 8. back onto the sphere of radius c (each block's own); Muown leaves the rows free
    if spec.sphere != "none" and spec.project:
        ids = row_block_ids(wh.shape[0], spec.row_blocks)
        wh.mul_(_bcast(st["radius"] / norms(wh, spec.sphere, ids), spec.sphere, ids))

    # 9. step the raw gains with their own Adam and LR
    for name, gg in gain_grads.items():
        adam_step_(st[name], gg, st[name + "_exp_avg"], st[name + "_exp_avg_sq"], t, gain_hp)
        maps.after_step(st[name], spec.gain_map)

    # 10. reassemble the fused weight for the next forward
    w.copy_(fused_weight(st, spec))
