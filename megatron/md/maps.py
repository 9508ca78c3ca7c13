"""Gain maps φ (raw gain ĝ → positive gain g), their derivatives, and the raw value giving g = 1."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron.md.config import GAIN_FLOOR


def phi(raw: torch.Tensor, gain_map: str) -> torch.Tensor:
    """g = φ(ĝ)."""
    if gain_map == "softplus":
        return F.softplus(raw)
    if gain_map == "exp":
        return torch.exp(raw)
    return raw  # direct, direct-floor (the floor is applied to ĝ after each step)


def phi_prime(raw: torch.Tensor, gain_map: str) -> torch.Tensor:
    """dφ/dĝ, elementwise."""
    if gain_map == "softplus":
        return torch.sigmoid(raw)
    if gain_map == "exp":
        return torch.exp(raw)
    return torch.ones_like(raw)


#: Maps whose derivative is not 1 (the gain gradient needs the chain rule's φ′(ĝ)).
CHAIN_MAPS = ("softplus", "exp")


def chain_multi(
    raws: list[torch.Tensor], grads: list[torch.Tensor], gain_maps: list[str]
) -> list[torch.Tensor]:
    """``grad * phi_prime(raw)`` for many gains, multi-tensor (``torch._foreach_*``) per map:
    on CPU the same ops as ``phi_prime`` one tensor at a time (bit-identical)."""
    out = list(grads)
    for gain_map, unary in (("softplus", torch._foreach_sigmoid), ("exp", torch._foreach_exp)):
        idx = [i for i, m in enumerate(gain_maps) if m == gain_map]
        if idx:
            prods = torch._foreach_mul([grads[i] for i in idx], unary([raws[i] for i in idx]))
            for i, p in zip(idx, prods):
                out[i] = p
    return out


def raw_for_unit_gain(gain_map: str) -> float:
    """The raw gain ĝ with φ(ĝ) = 1, so the model is unchanged when MD state is created."""
    if gain_map == "softplus":
        return math.log(math.e - 1.0)
    if gain_map == "exp":
        return 0.0
    return 1.0


def raw_for(gain: torch.Tensor, gain_map: str) -> torch.Tensor:
    """The raw gains ĝ with φ(ĝ) = ``gain`` (> 0): φ⁻¹."""
    if gain_map == "softplus":  # log(e^g - 1), without overflow for large g
        return gain + torch.log(-torch.expm1(-gain))
    if gain_map == "exp":
        return torch.log(gain)
    return gain.clamp(min=GAIN_FLOOR) if gain_map == "direct-floor" else gain.clone()


def after_step(raw: torch.Tensor, gain_map: str) -> None:
    """In-place constraint on ĝ after its Adam step (the 1e-5 floor of direct-floor)."""
    if gain_map == "direct-floor":
        raw.clamp_(min=GAIN_FLOOR)
