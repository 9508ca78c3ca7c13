"""AdamMD inside megatron-core's ZeRO-1 ``DistributedOptimizer``.

Each data-parallel rank's inner optimizer sees a contiguous 1-D slice of every parameter
(``_get_model_param_range_map(param)["param"]``). ``MDInnerAdam`` replaces the inner
``torch.optim.AdamW``: 1-D parameters get the same AdamW arithmetic, MD-managed matrices get the
slice path of ``sliced.py`` with ONE all-reduce of all their partials per step over the
optimizer's data-parallel group (the expert-data-parallel group for the expert instance).

bf16/fp16 params: the fp32 main shard *is* the direction Ŵ; ``MDDistributedOptimizer`` writes
the fused W = Γ ⊙ Ŵ into the model's param buffer instead of copying (no division, no extra copy).
fp32 params: the main shard is a view of the model param, so it holds W and the direction is kept
in the optimizer state (one extra fp32 copy of each MD slice).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.md.base_steps import AdamHParams, adam_step_
from megatron.md.config import MDConfig, spec_for
from megatron.md.optimizer import param_role
from megatron.md.sliced import SliceItem, SliceMD, md_init_batched, md_step_batched


@dataclass
class MDSlot:
    """MD bookkeeping for one main-parameter shard."""

    md: SliceMD
    fp32_mode: bool
    """True when the shard is the fp32 model param itself (direction kept in state)."""
    index: int
    """Position of the matrix in the instance's global partial layout."""


def _reduce_fn(group):
    if group is None or dist.get_world_size(group) == 1:
        return lambda buf: None
    return lambda buf: dist.all_reduce(buf, group=group)


class MDInnerAdam(torch.optim.Optimizer):
    """AdamW on 1-D shards, AdamMD on matrix shards; the inner optimizer of a ZeRO-1 instance."""

    def __init__(self, param_groups: list[dict], md: MDConfig, group=None):
        # fp32 shards are non-leaf views, which add_param_group refuses; like megatron-core
        # (distrib_optimizer.py:771) we set param_groups directly.
        super().__init__([torch.zeros(1, requires_grad=True)], dict(lr=1e-3))
        self.param_groups = param_groups
        self.md = md
        self.slots: dict[torch.Tensor, MDSlot] = {}
        self.layout: list[int] = []  # partial sizes of every MD matrix of the instance (all ranks)
        self.norm_layout: list[int] = []
        self.pre_layout: list[int] = []
        self.reduce = _reduce_fn(group)
        self.n_collectives = 0
        self.last_payload = 0

    def bind(self, shard: torch.Tensor, slot: MDSlot) -> None:
        self.slots[shard] = slot

    def direction(self, p: torch.Tensor) -> torch.Tensor:
        return self.state[p]["direction"] if self.slots[p].fp32_mode else p.data

    def init_md_state(self) -> None:
        """Gains at 1, radii from the current weights: one all-reduce for all matrices."""
        items = []
        for p, slot in self.slots.items():
            st = self.state[p]
            if slot.fp32_mode:
                st["direction"] = p.detach().clone()
            st.update(slot.md.init_state(self.direction(p)))
            items.append(SliceItem(slot.md, self.direction(p), None, st, slot=slot.index))
        md_init_batched(items, self.reduce, self.norm_layout)

    def _counting_reduce(self, buf):
        self.n_collectives += 1
        self.last_payload = buf.numel()
        self.reduce(buf)

    @torch.no_grad()
    def step(self, closure=None):
        items, fp32_items = [], []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            hp = AdamHParams(group["lr"], b1, b2, group["eps"], group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                slot = self.slots.get(p)
                if slot is None:  # 1-D params: torch AdamW arithmetic
                    if "step" not in st:
                        st["step"] = torch.zeros((), dtype=torch.float32)
                        st["exp_avg"] = torch.zeros_like(p)
                        st["exp_avg_sq"] = torch.zeros_like(p)
                    st["step"] += 1
                    adam_step_(p, p.grad, st["exp_avg"], st["exp_avg_sq"], int(st["step"]), hp)
                    continue
                g1, g2 = self.md.gain_betas
                gain_hp = AdamHParams(group["lr"] * self.md.gain_lr_mult, g1, g2, self.md.gain_eps)
                base_hp = AdamHParams(group["lr"], b1, b2, group["eps"], 0.0)
                items.append(
                    SliceItem(slot.md, self.direction(p), p.grad, st, base_hp, gain_hp, slot.index)
                )
                if slot.fp32_mode:
                    fp32_items.append((slot.md, st, p))
        md_step_batched(items, self._counting_reduce, self.layout, self.pre_layout)
        for md, st, p in fp32_items:
            md.fuse(st["direction"], st, p.data)
        return None


def _distributed_optimizers(optimizer):
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return list(optimizer.chained_optimizers)
    return [optimizer]


@functools.cache
def _class_md(base_cls):
    """Subclass of megatron-core's DistributedOptimizer whose only change is writing the fused
    weight (instead of copying the main shard) into the model's param buffer."""

    class MDDistributedOptimizer(base_cls):
        def _copy_main_params_to_model_params(self):
            if self.is_stub_optimizer:
                return
            for shard_groups, model_groups in (
                (self.shard_fp32_from_float16_groups, self.model_float16_groups),
                (self.shard_fp32_groups, self.model_fp32_groups),
            ):
                for shard_group, model_group in zip(shard_groups, model_groups):
                    for shard, model_param in zip(shard_group, model_group):
                        world = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                        gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
                        buf = self.buffers[gbuf_index].buckets[bucket_id].param_data
                        out = buf.view(-1)[world.start : world.end]
                        slot = self.optimizer.slots.get(shard)
                        if slot is not None and not slot.fp32_mode:
                            slot.md.fuse(shard, self.optimizer.state[shard], out)
                        else:
                            out.data.copy_(shard)

    return MDDistributedOptimizer


def check_zero1_config(config, ddp_config=None) -> None:
    """Refuse settings this path does not support, before any work."""
    if config.fp16:
        raise ValueError("MD does not support fp16 (use --bf16): loss scaling would hit the gains")
    if getattr(config, "use_precision_aware_optimizer", False):
        raise ValueError(
            "MD needs fp32 main params held by megatron (no precision-aware optimizer)"
        )
    if config.weight_decay:
        raise ValueError("MD keeps matrices on a sphere: use --weight-decay 0 with --md-decoupling")
    if ddp_config is not None and getattr(ddp_config, "use_megatron_fsdp", False):
        raise ValueError("MD does not support Megatron-FSDP; use --use-distributed-optimizer")
    if ddp_config is not None and (ddp_config.fp8_param_gather or ddp_config.fp4_param_gather):
        raise ValueError("MD does not support fp8/fp4 param gather")


def enable_md_zero1(optimizer, model_chunks, md: MDConfig):
    """Turn the ZeRO-1 DistributedOptimizer(s) returned by ``get_megatron_optimizer`` into AdamMD.

    megatron-core builds DistributedOptimizer inside get_megatron_optimizer with no class hook, so
    we retarget each built instance to a one-method subclass and swap its (still stateless)
    inner AdamW for MDInnerAdam over the same parameter groups.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    roles = {p: param_role(n, p) for c in model_chunks for n, p in c.named_parameters()}
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        raise ValueError("MD with tensor parallelism > 1 is not supported yet (use TP=1)")
    for opt in _distributed_optimizers(optimizer):
        if not isinstance(opt, DistributedOptimizer):
            raise ValueError(f"AdamMD under ZeRO-1 needs a DistributedOptimizer, got {type(opt)}")
        check_zero1_config(opt.config, opt.ddp_config)
        if opt.is_stub_optimizer:
            continue
        inner = MDInnerAdam(opt.optimizer.param_groups, md, opt.data_parallel_group)
        opt.optimizer = inner
        opt.__class__ = _class_md(DistributedOptimizer)
        # Every rank lays out partials for ALL MD matrices of the instance in buffer order, so
        # one all-reduce lines up even though ranks own different slices.
        index = {}
        for buf in opt.buffers:
            for p in buf.params:
                if roles[p] != "vector":
                    empty = SliceMD(tuple(p.shape), 0, 0, spec_for(roles[p], md), "adam")
                    index[p] = len(inner.layout)
                    inner.layout.append(empty.n_partials())
                    inner.norm_layout.append(empty.n_norm)
                    inner.pre_layout.append(empty.n_pre_partials())
        for shard_groups, model_groups, fp32_mode in (
            (opt.shard_fp32_from_float16_groups, opt.model_float16_groups, False),
            (opt.shard_fp32_groups, opt.model_fp32_groups, True),
        ):
            for shard_group, model_group in zip(shard_groups, model_groups):
                for shard, model_param in zip(shard_group, model_group):
                    role = roles[model_param]
                    if role == "vector":
                        continue
                    rng = opt._get_model_param_range_map(model_param)["param"]
                    spec = spec_for(role, md)
                    sm = SliceMD(tuple(model_param.shape), rng.start, rng.end, spec, "adam")
                    inner.bind(shard, MDSlot(sm, fp32_mode, index[model_param]))
        inner.init_md_state()
    return optimizer
