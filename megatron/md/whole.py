"""MD on whole matrices: megatron-core's replicated optimizers (``FP32Optimizer``,
``Float16OptimizerWithFloat16Params``) and the children of ``LayerWiseDistributedOptimizer``
(each rank owns whole matrices, so the MD step needs no collective at all; under tensor
parallelism one all-reduce over the TP group, and over the expert-TP group for expert pieces
under expert TP: one per group when a leaf holds both: ``tensor_parallel.py``).

bf16 params: the fp32 main param is the direction Ŵ and the fused W = Γ ⊙ Ŵ is written into the
bf16 model param. fp32 params: the model param is W; the direction is an extra fp32 copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

from megatron.md import tensor_parallel
from megatron.md.base_steps import MuonHParams
from megatron.md.config import MDConfig, spec_for
from megatron.md.inner import MDInner, MDSlot
from megatron.md.mains import main_params
from megatron.md.roles import residual_write, split_blocks
from megatron.md.sliced import SliceMD
from megatron.md.wrappers import md_wrapper


def _copy_main_params_to_model_params(self):
    """bf16 params: the fused W = Γ ⊙ Ŵ of every MD matrix (one batched pass,
    ``MDInner.fuse``), a plain copy for the rest, into the model params."""
    self.optimizer.fuse()
    md = self.optimizer.slots
    for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
        for model_param, main_param in zip(model_group, main_group):
            if main_param not in md:
                model_param.data.copy_(main_param)


@md_wrapper
class MDFloat16OptimizerWithFloat16Params(Float16OptimizerWithFloat16Params):
    """megatron's bf16-params wrapper with the MD step: MD state in its checkpoints and the
    fused W = Γ ⊙ Ŵ as its main→model copy (``enable_md`` sets it as the leaf's class)."""

    _copy_main_params_to_model_params = _copy_main_params_to_model_params


@md_wrapper
class MDFP32Optimizer(FP32Optimizer):
    """megatron's fp32 wrapper with MD state in its checkpoints (the model param is W; the
    direction is MD's own fp32 copy)."""


#: megatron's whole-matrix wrapper class -> its MD class
MD_CLASSES = {c._md_base: c for c in (MDFloat16OptimizerWithFloat16Params, MDFP32Optimizer)}


def md_class(base_cls):
    """The MD class of a leaf optimizer's megatron class; another class stops the run (MD
    would otherwise be missing from its checkpoints)."""
    if base_cls not in MD_CLASSES:
        raise RuntimeError(
            f"MD has no wrapper for megatron's {base_cls.__name__} (it knows "
            f"{', '.join(c.__name__ for c in MD_CLASSES)}; written against megatron-core 0.19.2)"
        )
    return MD_CLASSES[base_cls]


def muon_hparams(config, md: MDConfig) -> MuonHParams:
    """Muon hyper-parameters from megatron's OptimizerConfig (MD's step uses its own Muon)."""
    if config.muon_split_qkv != md.split_qkv:
        raise ValueError(
            f"megatron's Muon splits QKV ({config.muon_split_qkv}) but the MD config says "
            f"split_qkv={md.split_qkv}: MuonMD follows --muon-split-qkv / --muon-no-split-qkv"
        )
    if config.muon_extra_scale_factor != 1.0:
        raise ValueError(
            "MuonMD sets the update scale with --muon-scale-mode; "
            "--muon-extra-scale-factor must be 1"
        )
    return MuonHParams(
        lr=config.lr,
        momentum=config.muon_momentum,
        nesterov=config.muon_nesterov,
        ns_steps=config.muon_num_ns_steps,
        coefficient_type=config.muon_coefficient_type,
        fp32_matmul_prec=config.muon_fp32_matmul_prec,
    )


def _dp_rank(param) -> int:
    from megatron.core import parallel_state as ps

    if not tensor_parallel.is_expert(param):
        return ps.get_data_parallel_rank()
    return ps.get_expert_data_parallel_rank()


def setup_whole(opt, roles: dict, names: dict, md: MDConfig, layer_wise: bool) -> None:
    """Swap the inner torch optimizer of one Float16/FP32 optimizer for ``MDInner``."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    if opt.is_stub_optimizer:
        return
    if isinstance(opt.optimizer, TensorParallelMuon) and md.adam_layer_wise:
        base, muon = "adam", None  # layer-wise AdamMD: Muon's groups get Adam's constants
        for group in opt.optimizer.param_groups:
            group.update(betas=(opt.config.adam_beta1, opt.config.adam_beta2))
            group.update(eps=opt.config.adam_eps)
    elif isinstance(opt.optimizer, TensorParallelMuon):
        base, muon = "muon", muon_hparams(opt.config, md)
    elif isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW):
        base, muon = "adam", None
    else:
        raise ValueError(f"MD supports --optimizer adam or muon, got {type(opt.optimizer)}")
    inner = MDInner(opt.optimizer.param_groups, md, muon)
    inner.timers = getattr(opt.config, "timers", None)
    mains = [mp for mp in main_params(opt) if roles[mp.model] != "vector"]
    elements = sum(mp.main.numel() for mp in mains)
    inner.compiled = md.use_fused(mains[0].main.device.type, elements) if mains else frozenset()
    outputs = {}
    for mp in mains:
        role = roles[mp.model]
        shape = tuple(mp.model.shape)
        # Embeddings and LM head always use Adam (paper); matrices and router the chosen base;
        # a fused QKV matrix is split as megatron's Muon splits it (its tags, or ``tag_qkv``'s)
        blocks = split_blocks(mp.model, names[mp.model], md.split_qkv)
        spec = spec_for(role, md, residual_write(names[mp.model]), blocks)
        tp, counts = tensor_parallel.placement(mp.model)
        sm = SliceMD(shape, 0, shape[0] * shape[1], spec, base, tp=tp, counts=counts)
        slot = MDSlot(sm, mp.is_model_weight, None, names[mp.model], mp.model)
        # LayerWise: one owner per matrix; replicated: every DP rank holds a copy.
        slot.replica = slot.dir_replica = 0 if layer_wise else _dp_rank(mp.model)
        expert = tensor_parallel.is_expert(mp.model)
        slot.replica = tensor_parallel.replica_id(slot.replica, expert)
        # each matrix's partials sum over its TP group (dense) or expert-TP group (routed
        # experts): a reduction domain per group; none for a matrix whole on the rank
        group = tensor_parallel.reduce_group(None, expert)
        slot.domain = None if group is None else id(group)
        reduce = None if group is None else (lambda buf, g=group: dist.all_reduce(buf, group=g))
        inner.add_domain(slot.domain, reduce, group)
        # ordered by its place in megatron's grad buffer (its gradient's address)
        grad_home = getattr(mp.model, "main_grad", None)
        slot.order = (grad_home if grad_home is not None else mp.model).data_ptr()
        inner.bind(mp.main, slot)
        outputs[mp.main] = mp.model  # W: the model param (bf16), or the fp32 weight itself
    opt.optimizer = inner
    opt.init_state_fn = lambda *a, **k: None  # MDInner creates all its state up front
    opt.__class__ = md_class(type(opt))
    inner.init_state()
    out = {id(m): outputs[m.main] for m in inner.engine.members}
    inner.outputs = lambda: out
    if md.cuda_graph:
        inner.use_cuda_graph()
