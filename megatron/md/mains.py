"""The fp32 main parameters of megatron-core's optimizers, paired with the model's.

megatron keeps them in different attributes per optimizer class; this is the one place that
reads them (``DistributedOptimizer``: core/optimizer/distrib_optimizer.py, the shard groups
and ``_get_model_param_range_map``; ``Float16OptimizerWithFloat16Params`` and
``FP32Optimizer``: core/optimizer/optimizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MainParam:
    """One main parameter of a leaf optimizer: a whole matrix, or a ZeRO-1 rank's slice."""

    main: torch.Tensor
    """What the inner torch optimizer steps (fp32)."""
    model: torch.Tensor
    """The model's parameter it belongs to."""
    start: int
    """Offset of ``main`` in the flattened model parameter."""
    is_model_weight: bool
    """True when ``main`` is (a view of) the fp32 model weight itself; False: an fp32 copy of
    a bf16/fp16 model weight."""


def main_params(opt) -> list[MainParam]:
    """Every main parameter of one non-chained megatron optimizer ([] for a stub)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    if getattr(opt, "is_stub_optimizer", False):
        return []
    out = []
    if isinstance(opt, DistributedOptimizer):
        for shard_groups, model_groups, is_model in (
            (opt.shard_fp32_from_float16_groups, opt.model_float16_groups, False),
            (opt.shard_fp32_groups, opt.model_fp32_groups, True),
        ):
            for shards, models in zip(shard_groups, model_groups):
                for shard, model in zip(shards, models):
                    start = opt._get_model_param_range_map(model)["param"].start
                    out.append(MainParam(shard, model, start, is_model))
    elif isinstance(opt, Float16OptimizerWithFloat16Params):
        for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            out += [MainParam(main, model, 0, False) for model, main in zip(models, mains)]
        out += [MainParam(p, p, 0, True) for g in opt.fp32_from_fp32_groups for p in g]
    else:  # FP32Optimizer: the model params themselves
        out += [MainParam(p, p, 0, True) for g in opt.optimizer.param_groups for p in g["params"]]
    return out


def fp32_weight(opt, mp: MainParam) -> torch.Tensor:
    """The fp32 model weight W of ``mp`` (flat): the main param itself, or under MD with bf16
    params, where the main param is the direction Ŵ, the fused Γ ⊙ Ŵ in a new fp32 tensor."""
    inner = opt.optimizer
    fuse = getattr(inner, "fuse_into", None)
    if fuse is not None:
        out = torch.empty(mp.main.numel(), dtype=torch.float32, device=mp.main.device)
        if fuse(mp.main, out):
            return out
    return mp.main.detach().reshape(-1)
