"""AdamMD inside megatron-core's ZeRO-1 ``DistributedOptimizer``.

Each data-parallel rank's inner optimizer sees a contiguous 1-D slice of every parameter
(``_get_model_param_range_map(param)["param"]``); ``MDInner`` steps MD matrices on that slice
with ONE all-reduce of all their partials per step over the optimizer's data-parallel group
(the expert-data-parallel group for the expert instance), times the TP group under tensor
parallelism (the expert-TP group for the expert instance under expert TP; ``tensor_parallel.py``).

bf16 params: the fp32 main shard *is* the direction Ŵ; the subclass writes the fused
W = Γ ⊙ Ŵ into the model's param buffer instead of copying (no division, no extra copy).
fp32 params: the main shard is a view of the model param (W), so the direction is an extra fp32
copy of the slice in ``MDInner.md_state``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron.md import tensor_parallel
from megatron.md.config import MDConfig, spec_for
from megatron.md.inner import MDInner, MDSlot
from megatron.md.mains import main_params
from megatron.md.roles import residual_write, split_blocks
from megatron.md.sliced import SliceMD
from megatron.md.wrappers import md_wrapper, set_states_without_step


def _copy_main_params_to_model_params(self):
    """The fused W = Γ ⊙ Ŵ of every MD matrix (one batched pass, ``MDInner.fuse``), a plain
    copy for the rest, into the model's param buffer."""
    if self.is_stub_optimizer:
        return
    self.optimizer.fuse()
    dsts, srcs = _plain_copies(self)
    if dsts:  # one multi-tensor copy, not one launch per vector (megatron's loop: 25 at 12 layers)
        torch._foreach_copy_(dsts, srcs)


def _plain_copies(opt) -> tuple[list, list]:
    """(destinations, sources) of the plain copies: this rank's range of the param buffer of
    every parameter MD does not step, and its fp32 shard; made again only when megatron
    re-allocates a bucket's param data (as ``_outputs``): looking the ranges up cost 11 us a
    parameter a step on a 2-core VM in CPU mode (284 against 4 us for the 25 vectors of the
    12-layer layout, 2026-12-04): host time of a launch-bound GPU step."""
    groups = (opt.shard_fp32_from_float16_groups, opt.model_float16_groups,
              opt.shard_fp32_groups, opt.model_fp32_groups)  # fmt: skip
    key = (_buckets_key(opt), *map(id, groups))  # (megatron makes the lists once, at init)
    hit = getattr(opt, "_md_plain_copies", None)
    if hit is not None and hit[0] == key:
        return hit[1], hit[2]
    md = opt.optimizer.slots
    dsts, srcs = [], []
    for shard_groups, model_groups in (groups[:2], groups[2:]):
        for shard_group, model_group in zip(shard_groups, model_groups):
            for shard, model_param in zip(shard_group, model_group):
                if shard not in md:
                    dsts.append(_param_buffer_range(opt, model_param).data)
                    srcs.append(shard)
    opt._md_plain_copies = (key, dsts, srcs)
    return dsts, srcs


def _buckets_key(opt) -> tuple:
    """The addresses of megatron's buckets' param data (a re-allocation changes them)."""
    return tuple(b.param_data.data_ptr() if b.param_data is not None else 0
                 for buf in opt.buffers for b in buf.buckets)  # fmt: skip


def _param_buffer_range(opt, model_param) -> torch.Tensor:
    """This rank's range of ``model_param`` in megatron's param buffer (flat)."""
    world = opt._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
    gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
    buf = opt.buffers[gbuf_index].buckets[bucket_id].param_data
    return buf.view(-1)[world.start : world.end]


def _outputs(opt):
    """MD's destinations of W: the fp32 weight itself (fp32 params) or this rank's range of
    the param buffer (bf16), made once and again only when megatron re-allocates a bucket's
    param data (checked by address: no work per step)."""
    inner = opt.optimizer
    cache = {}

    def outputs() -> dict[int, torch.Tensor]:
        key = _buckets_key(opt)
        if cache.get("key") != key:
            out = {}
            for m in inner.engine.members:
                slot = inner.slots[m.main]
                out[id(m)] = m.main if slot.fp32_mode else _param_buffer_range(
                    opt, slot.model_param)  # fmt: skip
            cache.update(key=key, out=out)
        return cache["out"]

    return outputs


@md_wrapper
class MDDistributedOptimizer(DistributedOptimizer):
    """megatron's DistributedOptimizer with the MD step: MD state in its checkpoints and the
    fused W = Γ ⊙ Ŵ as its main→model copy (``enable_md`` sets it as the leaf's class)."""

    _md_fix_step = True  # see wrappers.py
    _copy_main_params_to_model_params = _copy_main_params_to_model_params

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        set_states_without_step(DistributedOptimizer, self, model_param, tensors)


def _first_owner(opt, model_param) -> int:
    """Data-parallel rank owning the first element of ``model_param``."""
    gbuf_index = opt.model_param_gbuf_map[model_param][0]
    return _shards(opt, opt.buffers[gbuf_index], model_param)[1]


def _shards(opt, buffer, model_param) -> tuple[tuple[int, ...], int]:
    """(the offsets inside ``model_param`` where ZeRO-1's shards cut it, the data-parallel rank
    owning its first element), from ``buffer`` (the param's, one of ``opt.buffers``): megatron
    splits each bucket into equal contiguous shards (distrib_optimizer.py:
    _build_model_gbuf_range), the same on every rank, whichever ranks the param touches."""
    start, end, bucket_id = buffer.param_index_map[model_param]
    bucket = buffer.buckets[bucket_id]
    dp = opt.data_parallel_group
    shard = bucket.grad_data.numel() // (dp.size() if dp is not None else 1)
    first = (start - bucket.offset) // shard
    return tuple(range(bucket.offset + (first + 1) * shard - start, end - start, shard)), first


def setup_zero1(opt, roles: dict, names: dict, md: MDConfig) -> None:
    """Swap the (still stateless) inner AdamW of one DistributedOptimizer for ``MDInner``."""

    if opt.is_stub_optimizer:
        return
    if not isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise ValueError(
            f"MD under --use-distributed-optimizer needs Adam there, got {type(opt.optimizer)}"
        )
    inner = MDInner(opt.optimizer.param_groups, md, None)
    dp_group = opt.data_parallel_group
    expert = any(tensor_parallel.is_expert(p) for buf in opt.buffers for p in buf.params)
    group = tensor_parallel.reduce_group(dp_group, expert)  # under TP: TP × DP, one collective
    summed = group is not None and dist.get_world_size(group) > 1
    inner.reduce_group = group if summed else None
    inner.timers = getattr(opt.config, "timers", None)
    dp_rank, dp_size = (dp_group.rank(), dp_group.size()) if dp_group is not None else (0, 1)
    # --num-distributed-optimizer-instances: each instance (a slice of the DP ranks) holds every
    # matrix, so only instance 0 writes checkpoints, as megatron's own state
    # (distrib_optimizer.py, sharded_param_state_fs_model_space: replica (instance, 0, dp rank))
    instance = opt.distributed_optimizer_instance_id
    # Every rank lays out partials for ALL MD matrices of the instance in one order, so one
    # all-reduce lines up even though ranks own different slices: matrices of one shape and
    # treatment together; within a kind by where the shards cut them (whole first), then by
    # the rank owning their first element, then in param-buffer order — the matrices a rank
    # holds whole of one kind (an engine group, members by buffer address), and its slices
    # cut at one place, are then one contiguous range of each buffer, read and written as
    # views. In buffer order alone, the 12-layer model's four layer groups took an
    # index_add_, an index_select and a zeroed temporary each; by kind and buffer order, a
    # rank whose shards of several buckets hold matrices of a kind still did (181M shapes,
    # 4 ranks, megatron's 40M-element buckets: three groups of rank 1, 15 launches a step).
    index, specs, where = {}, {}, {}
    inner.layout, inner.norm_layout, inner.pre_layout = [], [], []
    for b, buf in enumerate(opt.buffers):
        for p in buf.params:
            if roles[p] != "vector":
                tp, _ = tensor_parallel.placement(p)
                blocks = split_blocks(p, names[p], md.split_qkv)
                specs[p] = spec_for(roles[p], md, residual_write(names[p]), blocks)
                kind = (tuple(p.shape), repr(specs[p]), repr(tp))
                where[p] = (kind, *_shards(opt, buf, p), b, buf.param_index_map[p][0]), tp
    for p in sorted(where, key=lambda p: where[p][0]):
        empty = SliceMD(tuple(p.shape), 0, 0, specs[p], "adam", tp=where[p][1])
        index[p] = len(inner.layout)
        inner.layout.append(empty.n_partials())
        inner.norm_layout.append(empty.n_norm)
        inner.pre_layout.append(empty.n_pre_partials())
    reduce = (lambda buf: dist.all_reduce(buf, group=group)) if summed else None
    inner.add_domain("zero1", reduce, group if summed else None, zero1=True)
    mains = [mp for mp in main_params(opt) if roles[mp.model] != "vector"]
    elements = sum(mp.main.numel() for mp in mains)
    inner.compiled = md.use_fused(mains[0].main.device.type, elements) if mains else frozenset()
    for mp in mains:
        shape = tuple(mp.model.shape)
        end = mp.start + mp.main.numel()
        tp, counts = tensor_parallel.placement(mp.model)
        sm = SliceMD(shape, mp.start, end, specs[mp.model], "adam", tp=tp, counts=counts)
        slot = MDSlot(sm, mp.is_model_weight, index[mp.model], names[mp.model], mp.model)
        # gains/radius are replicated over the ranks owning a slice of this matrix;
        # the first of them in instance 0 writes them to checkpoints (replica 0)
        owner = dp_rank - _first_owner(opt, mp.model)
        slot.replica, slot.dir_replica = instance * dp_size + owner, instance
        slot.replica = tensor_parallel.replica_id(slot.replica, expert)
        slot.domain = "zero1"
        # ordered by its range of the param buffer (and so of the grad buffer, laid out alike)
        slot.order = _param_buffer_range(opt, mp.model).data_ptr()
        inner.bind(mp.main, slot)
    opt.optimizer = inner
    opt.__class__ = MDDistributedOptimizer
    inner.init_state()
    inner.outputs = _outputs(opt)
    if md.cuda_graph:
        inner.use_cuda_graph()
