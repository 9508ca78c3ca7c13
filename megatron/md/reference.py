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
from megatron.md.config import MatrixSpec, check_radius

GAIN_NAMES = {
    "none": (),
    "scalar": ("gain_scalar",),
    "row": ("gain_row",),
    "col": ("gain_col",),
    "rowcol": ("gain_row", "gain_col"),
    "lowrank": ("gain_a", "gain_b"),
}


def sq_norms(x: torch.Tensor, sphere: str) -> torch.Tensor:
    """‖x‖² along the sphere axis: scalar (frobenius), per row (d_out,), or per column (d_in,)."""
    if sphere == "frobenius":
        flat = x.reshape(-1)
        return flat @ flat
    return (x * x).sum(1 if sphere == "row" else 0)


def norms(x: torch.Tensor, sphere: str) -> torch.Tensor:
    return sq_norms(x, sphere).sqrt()


def _bcast(v: torch.Tensor, sphere: str) -> torch.Tensor:
    return v[:, None] if sphere == "row" else v  # col vectors broadcast over rows as they are


def init_radius(w: torch.Tensor, spec: MatrixSpec) -> torch.Tensor | None:
    """The sphere radius: current norm (init), shape formula, or 1 per row (unit)."""
    d_out, d_in = w.shape
    if spec.sphere == "none":
        return None
    shape = {"frobenius": (), "row": (d_out,), "col": (d_in,)}[spec.sphere]
    if spec.radius == "init":
        r = norms(w, spec.sphere)
    elif spec.radius == "unit":
        r = torch.ones(shape, dtype=w.dtype, device=w.device)
    else:  # shape: sqrt(max(d_out, d_in)) in Frobenius, split evenly over rows/columns
        n = max(1, math.prod(shape))
        r = torch.full(
            shape, math.sqrt(max(d_out, d_in)) / math.sqrt(n), dtype=w.dtype, device=w.device
        )
    check_radius(float(r.min()), "matrix")
    return r.to(w.dtype)


def init_gain_state(spec: MatrixSpec, shape: tuple[int, int], seed: int = 0, like=None) -> dict:
    """Raw gains giving g = 1 (lowrank: A random, B = 0) and their zero Adam moments."""
    d_out, d_in = shape
    one = maps.raw_for_unit_gain(spec.gain_map)
    shapes = {"gain_scalar": (), "gain_row": (d_out,), "gain_col": (d_in,)}
    st = {}
    for name in GAIN_NAMES[spec.gains]:
        if name == "gain_a":
            gen = torch.Generator().manual_seed(seed)
            raw = torch.randn(d_out, spec.gain_rank, generator=gen) * spec.lowrank_init_std
        elif name == "gain_b":
            raw = torch.zeros(d_in, spec.gain_rank)
        else:
            raw = torch.full(shapes[name], one)
        if like is not None:  # dtype/device of the direction
            raw = raw.to(like.device, like.dtype)
        st[name] = raw
        st[name + "_exp_avg"] = torch.zeros_like(raw)
        st[name + "_exp_avg_sq"] = torch.zeros_like(raw)
    return st


def init_state(w: torch.Tensor, spec: MatrixSpec, base: str, seed: int = 0) -> dict:
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
    if radius is not None and spec.radius != "init":
        direction.mul_(_bcast(radius / norms(direction, spec.sphere), spec.sphere))
    st: dict = {"step": 0, "direction": direction, "radius": radius}
    st.update(init_gain_state(spec, (d_out, d_in), seed, like=direction))
    if base == "adam":
        st["exp_avg"] = torch.zeros_like(direction)
        st["exp_avg_sq"] = torch.zeros_like(direction)
    else:
        st["momentum_buffer"] = torch.zeros_like(direction)
    return st


def apply_gains(x: torch.Tensor, st: dict, spec: MatrixSpec) -> torch.Tensor:
    """Γ ⊙ x for W = Γ ⊙ Ŵ: diag(g_row) · x · diag(g_col), γ·x, or (1 + A Bᵀ) ⊙ x."""
    if spec.gains == "none":
        return x.clone()
    if spec.gains == "lowrank":
        return (1 + st["gain_a"] @ st["gain_b"].T) * x
    if spec.gains == "scalar":
        return maps.phi(st["gain_scalar"], spec.gain_map) * x
    if "gain_row" in st:
        x = maps.phi(st["gain_row"], spec.gain_map)[:, None] * x
    if "gain_col" in st:
        x = x * maps.phi(st["gain_col"], spec.gain_map)[None, :]
    return x


def fused_weight(st: dict, spec: MatrixSpec) -> torch.Tensor:
    """W = Γ ⊙ Ŵ (Algorithm 2, line 10)."""
    return apply_gains(st["direction"], st, spec)


def frobenius_radius(st: dict, spec: MatrixSpec) -> float:
    """Frobenius norm of the sphere (for the sphere_rms Muon scale)."""
    r = st["radius"]
    if r is None:
        return float(norms(st["direction"], "frobenius"))
    return float(r) if spec.sphere == "frobenius" else float((r * r).sum().sqrt())


def split_gradient(g: torch.Tensor, st: dict, spec: MatrixSpec) -> tuple[dict, torch.Tensor]:
    """Algorithm 2, lines 1-6: gradients of the raw gains and of the direction Ŵ."""
    wh = st["direction"]
    # 1. the gains g = φ(ĝ) are materialized where used; 2. Ŵ is the state's direction
    # 3.-5. gain gradients: the chain rule through W = Γ ⊙ Ŵ and g = φ(ĝ)
    p = wh * g
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
        r2 = sq_norms(wh, spec.sphere)
        inner = (
            (g_dir * wh).sum()
            if spec.sphere == "frobenius"
            else (g_dir * wh).sum(1 if spec.sphere == "row" else 0)
        )
        g_dir -= _bcast(inner / r2, spec.sphere) * wh

    return gain_grads, g_dir


def md_step(
    w: torch.Tensor,
    grad: torch.Tensor,
    st: dict,
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
    else:
        d_out, d_in = wh.shape
        scale = muon_scale_factor(spec.muon_scale, d_out, d_in, frobenius_radius(st, spec))
        wh.add_(muon_update(g_dir, st["momentum_buffer"], base_hp, scale), alpha=-base_hp.lr)

    # 8. back onto the sphere of radius c
    if spec.sphere != "none":
        wh.mul_(_bcast(st["radius"] / norms(wh, spec.sphere), spec.sphere))

    # 9. step the raw gains with their own Adam and LR
    for name, gg in gain_grads.items():
        adam_step_(st[name], gg, st[name + "_exp_avg"], st[name + "_exp_avg_sq"], t, gain_hp)
        maps.after_step(st[name], spec.gain_map)

    # 10. reassemble the fused weight for the next forward
    w.copy_(fused_weight(st, spec))
