"""Base optimizer steps applied to the direction Ŵ (Algorithm 2, line 7) and to the gains.

The Adam arithmetic is op-for-op that of ``torch.optim.AdamW`` (what megatron-core runs
without Apex/TE): its single-tensor path (CPU default) in ``adam_step_``, its multi-tensor path
(CUDA default) in ``adam_multi_``, so MD with gains and sphere switched off is bit-identical to
it on both devices. The Muon arithmetic is that of emerging-optimizers'
``OrthogonalizedOptimizer.step``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron.md.config import MUON_SCALES
from megatron.md.norms import sq_sums


@dataclass
class AdamHParams:
    """Hyper-parameters of one Adam step (``lr`` and ``weight_decay``: Python numbers, or 0-d
    device tensors in a step a CUDA graph replays, ``engine/graph.py``)."""

    lr: float | torch.Tensor
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    weight_decay: float | torch.Tensor = 0.0


def adam_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    hp: AdamHParams,
) -> None:
    """One decoupled-weight-decay Adam step in place; ``step`` is the 1-based step count."""
    if hp.weight_decay != 0:
        param.mul_(1 - hp.lr * hp.weight_decay)
    exp_avg.lerp_(grad, 1 - hp.beta1)
    exp_avg_sq.mul_(hp.beta2).addcmul_(grad, grad, value=1 - hp.beta2)
    bias_correction1 = 1 - hp.beta1**step
    bias_correction2 = 1 - hp.beta2**step
    step_size = hp.lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(hp.eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def adam_multi_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    hp: AdamHParams | Sequence[AdamHParams],
) -> None:
    """``adam_step_`` on many tensors with multi-tensor (``torch._foreach_*``) ops, called the
    way torch's ``_multi_tensor_adam`` calls them (what ``torch.optim.AdamW`` runs on CUDA):
    bit-identical to it on CUDA and, since CPU foreach ops decompose per tensor, to the
    single-tensor path on CPU; a few kernel launches in all on GPU. ``hp``: one for all, or
    one per tensor (``merged_hparams``: several parameter groups in one multi-tensor Adam, their
    LRs and weight decays as the scalar lists torch passes a step size in, the same arithmetic
    per tensor)."""
    if not params:
        return
    n = len(params)
    lrs = wds = None  # per tensor, where ``hp`` is a list
    if isinstance(hp, (list, tuple)):
        hp, lrs, wds = _per_tensor(hp, n)
    on_device = isinstance(step, torch.Tensor)  # a step a CUDA graph replays (engine/graph.py)
    if lrs is not None:
        if any(wd != 0 for wd in wds):
            factors = [1 - lr * wd for lr, wd in zip(lrs, wds)]
            torch._foreach_mul_(params, factors[0] if len(set(factors)) == 1 else factors)
    elif isinstance(hp.weight_decay, torch.Tensor) or hp.weight_decay != 0:
        torch._foreach_mul_(params, 1 - hp.lr * hp.weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - hp.beta1)
    torch._foreach_mul_(exp_avg_sqs, hp.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - hp.beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if on_device:
        # the step count and LR (and a changing weight decay) as 0-d device tensors: the same
        # kernels with the same arguments at every step; the bias corrections computed there
        # and folded into the divisor, as torch's capturable Adam does (an fp32 rounding from
        # the Python-number path)
        bias_correction1 = 1 - torch.pow(hp.beta1, step)
        torch._foreach_div_(denom, (1 - torch.pow(hp.beta2, step)).sqrt())
        torch._foreach_add_(denom, hp.eps)
        torch._foreach_div_(denom, -hp.lr / bias_correction1)  # p += m / (denom / -step_size)
        torch._foreach_addcdiv_(params, exp_avgs, denom)
        return
    bias_correction1 = 1 - hp.beta1**step
    bias_correction2 = 1 - hp.beta2**step
    # scalar lists, as torch passes them: on CUDA ``_foreach_div_`` by a list rounds
    # differently from by a scalar (up to 1 ulp, measured on an H100, torch 2.11)
    torch._foreach_div_(denom, [bias_correction2**0.5] * n)
    torch._foreach_add_(denom, hp.eps)
    if lrs is None:
        step_sizes = [(hp.lr / bias_correction1) * -1] * n
    else:  # each tensor's number as its own group's path computes it
        step_sizes = [(lr / bias_correction1) * -1 for lr in lrs]
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_sizes)


def merged_hparams(hp: AdamHParams) -> tuple | None:
    """What Adam steps of several parameter groups must share to run as one
    (``adam_multi_`` with one ``AdamHParams`` a tensor): the betas and epsilon, with the LR and
    weight decay Python numbers; None where they are device tensors (a step a CUDA graph
    replays: each parameter group its own Adam, as before)."""
    if isinstance(hp.lr, torch.Tensor) or isinstance(hp.weight_decay, torch.Tensor):
        return None
    return (hp.beta1, hp.beta2, hp.eps)


def _per_tensor(hps: Sequence[AdamHParams], n: int) -> tuple[AdamHParams, list, list]:
    """``adam_multi_``'s ``hp`` given one a tensor: (one of them for the shared numbers, the
    LRs, the weight decays), checked once per distinct object (a parameter group's tensors
    share one). A decay factor of 1 multiplies exactly, and a scalar list's entry is what a
    foreach op multiplies by: each tensor's arithmetic is its own group's Adam's."""
    distinct = {id(h): h for h in hps}.values()
    shared = {merged_hparams(h) for h in distinct}
    if len(hps) != n or len(shared) != 1 or None in shared:
        raise ValueError("one Adam over several parameter groups needs an AdamHParams a tensor, "
                         "the same betas and eps, Python-number LRs and decays")  # fmt: skip
    return hps[0], [h.lr for h in hps], [h.weight_decay for h in hps]


def muon_scale_factor(mode: str, d_out: int, d_in: int, radius=None):
    """Muon update scale for a (d_out, d_in) matrix; ``sphere_rms`` needs the Frobenius radius
    (a float, or a 0-d tensor: the scale is then one too)."""
    # unit_rms_norm, shape_scaling: emerging-optimizers' formulas (muon.py), to the last bit
    if mode == "unit_rms_norm":
        return (d_out / d_in) ** 0.5
    if mode == "shape_scaling":
        return max(1, d_out / d_in) ** 0.5
    if mode == "rms_match":
        return 0.2 * math.sqrt(max(d_out, d_in))
    if mode == "shape_up":
        return math.sqrt(max(d_out / d_in, d_in / d_out))
    if mode == "sphere_rms":
        if radius is None:
            raise ValueError("muon scale 'sphere_rms' needs the sphere radius")
        return radius / math.sqrt(min(d_out, d_in))
    if mode == "hyperball":  # c; the update's own norm divides it (``hyperball_``)
        if radius is None:
            raise ValueError("muon scale 'hyperball' needs the sphere radius")
        return radius
    if mode == "none":
        return 1.0
    raise ValueError(f"--muon-scale-mode={mode!r} is not one of {', '.join(MUON_SCALES)}")


@dataclass
class MuonHParams:
    """Hyper-parameters of one Muon step (paper: momentum 0.95, Nesterov, 5 NS steps; ``lr`` a
    0-d device tensor in a step a CUDA graph replays)."""

    lr: float | torch.Tensor
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    coefficient_type: str = "quintic"
    fp32_matmul_prec: str = "highest"


def orthogonalize(x: torch.Tensor, hp: MuonHParams) -> torch.Tensor:
    """Newton–Schulz orthogonalization from emerging-optimizers (fp32 input)."""
    from emerging_optimizers import utils as eo_utils
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    with eo_utils.fp32_matmul_precision(hp.fp32_matmul_prec):
        return newton_schulz(x, steps=hp.ns_steps, coefficient_type=hp.coefficient_type)


def hyperball_(update: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The orthogonalized update at unit Frobenius norm, in place (the ``hyperball`` scale then
    multiplies by the radius: emerging-optimizers' MuonHyperball,
    ``pre_weight_update_fn_inplace``, ``update.norm()``); over the last two axes of a batch.
    The norm from ``norms.sq_sums``: torch's whole-matrix fp32 norm is 1.8e-3 off on a CPU at
    (16384, 2048) (not measured on a GPU)."""
    nrm = sq_sums(update, frobenius=True).sqrt_()
    return update.div_(nrm.clamp_min_(eps)[..., None, None])


def muon_update(
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    hp: MuonHParams,
    scale,
    row_blocks: tuple[int, ...] = (),
    gather=None,
    hyperball: bool = False,
) -> torch.Tensor:
    """Momentum (optionally Nesterov) then scaled orthogonalization; the caller applies
    ``param -= lr * update``. ``row_blocks``: a fused QKV matrix split as megatron's Muon does
    (emerging_optimizers.py, TensorParallelMuon.orthogonalize: per query group, Q/K/V rows; each
    block orthogonalized on its own and scaled by its entry of ``scale``, a list); empty: ``scale``
    is one number. ``gather`` (a ``tensor_parallel.PieceGather``): the arguments are a TP piece;
    the full matrix is orthogonalized and this piece of it returned (megatron's ``duplicated``
    mode). ``hyperball``: each block's orthogonalized update at unit norm before its scale."""
    momentum_buffer.lerp_(grad, 1 - hp.momentum)
    g = grad.lerp(momentum_buffer, hp.momentum) if hp.nesterov else momentum_buffer
    if gather is not None:
        g = gather.full(g)

    def ortho(x):
        o = orthogonalize(x, hp)
        return hyperball_(o) if hyperball else o

    if not row_blocks:
        out = ortho(g) * (scale[0] if isinstance(scale, list) else scale)
    else:
        d_out, d_in = g.shape
        groups = d_out // sum(row_blocks)
        parts = torch.split(g.view(groups, sum(row_blocks), d_in), list(row_blocks), dim=1)
        outs = [
            (ortho(x.reshape(-1, d_in)) * s).view(groups, -1, d_in) for x, s in zip(parts, scale)
        ]
        out = torch.cat(outs, dim=1).view(d_out, d_in)
    return out if gather is None else gather.own(out)
