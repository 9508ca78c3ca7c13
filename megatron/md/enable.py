"""One call turns megatron-core's optimizer into its MD version: ``enable_md``.

    optimizer = get_megatron_optimizer(config, model_chunks)
    optimizer = enable_md(optimizer, model_chunks, MDConfig(...))

Every leaf of the (chained) optimizer keeps its megatron class behaviour — clipping, grad
sync, param gather, checkpoint format — and gets ``MDInner`` as its torch optimizer:
ZeRO-1 ``DistributedOptimizer`` (AdamMD on slices, one all-reduce per step), the children of
``LayerWiseDistributedOptimizer`` (MuonMD on whole matrices, no collective), or the replicated
``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``.
"""

from __future__ import annotations

from megatron.md import compat, compatibility, tensor_parallel
from megatron.md.config import MDConfig
from megatron.md.leaves import is_md_wrapper, leaf_optimizers
from megatron.md.roles import param_role, tag_qkv
from megatron.md.whole import setup_whole
from megatron.md.zero1 import setup_zero1


def check_config(config, ddp_config, md: MDConfig) -> None:
    """Refuse megatron settings MD does not support, before any work (``compatibility``, the
    same check the flag parser makes), and a Muon optimizer sharded other than layer-wise."""
    tp = max(tensor_parallel.tp_size(), tensor_parallel.etp_size()) > 1
    compatibility.check(compatibility.Setup.from_megatron(config, ddp_config, md, tp))
    if "muon" in config.optimizer and config.use_distributed_optimizer:
        if not config.use_layer_wise_distributed_optimizer:
            raise ValueError(
                "MuonMD shards whole matrices: with --optimizer muon use the layer-wise "
                "distributed optimizer (megatron-core turns it on for --use-distributed-optimizer)"
            )


def check_one_matrix_per_parameter(chunk) -> None:
    """MD gives every matrix its own sphere and gains, so each must be its own parameter. TE's
    grouped experts with ``--moe-single-grouped-weight`` hold all local experts in one
    parameter, stacked or concatenated (megatron-core reads TE's ``single_grouped_weight``
    attribute in ``TEGroupedLinear._normalize_grouped_parameter_keys`` and splits either
    layout in ``_split_grouped_checkpoint_tensor``, core/extensions/transformer_engine.py);
    a parameter of more than 2 dimensions would otherwise be stepped as a vector."""
    for name, mod in chunk.named_modules():
        if getattr(mod, "single_grouped_weight", False):
            raise ValueError(compatibility.grouped_weight_refusal(name))
    for name, p in chunk.named_parameters():
        if p.ndim > 2:
            raise ValueError(
                f"{name} stacks {p.shape[0]} matrices in one {p.ndim}-D parameter: MD needs "
                "one parameter per matrix"
            )


def enable_md(optimizer, model_chunks, md: MDConfig):
    """Give every leaf optimizer of ``optimizer`` the MD step; returns ``optimizer``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
        FP32Optimizer,
    )

    md.validate()
    compat.check(layers=("optimizer",))  # a library call: the training loop may be the user's
    tensor_parallel.prepare_groups()  # collective: before any rank-dependent branch
    names, roles = {}, {}
    for i, chunk in enumerate(model_chunks):
        check_one_matrix_per_parameter(chunk)
        if md.split_qkv:  # megatron tags QKV weights for Muon only; Adam's split needs them too
            tag_qkv(chunk)
        for n, p in chunk.named_parameters():
            names[p] = n if len(model_chunks) == 1 else f"chunk{i}.{n}"
            roles[p] = param_role(n, p)

    def layer_wise_children(opt) -> set[int]:
        if isinstance(opt, LayerWiseDistributedOptimizer):
            return set(map(id, opt.chained_optimizers))
        if isinstance(opt, ChainedOptimizer):
            return set().union(*map(layer_wise_children, opt.chained_optimizers))
        return set()

    layer_wise = layer_wise_children(optimizer)
    for opt in leaf_optimizers(optimizer):
        check_config(opt.config, getattr(opt, "ddp_config", None), md)
        if isinstance(opt, DistributedOptimizer):
            compat.check_distributed_optimizer(opt)
            setup_zero1(opt, roles, names, md)
        elif isinstance(opt, Float16OptimizerWithFloat16Params | FP32Optimizer):
            setup_whole(opt, roles, names, md, layer_wise=id(opt) in layer_wise)
        else:
            raise ValueError(f"MD does not support megatron optimizer {type(opt).__name__}")
    plain = [type(o).__name__ for o in leaf_optimizers(optimizer)
             if not (getattr(o, "is_stub_optimizer", False) or is_md_wrapper(o))]  # fmt: skip
    if plain:  # never train on with a leaf MD did not take over
        raise RuntimeError(f"MD did not take over megatron's {', '.join(plain)}")
    return optimizer
