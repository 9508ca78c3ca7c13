"""MD state in megatron-core's ``torch_dist`` checkpoints, next to the base optimizer's.

megatron-core saves ``MDInner.state`` (step, Adam moments / Muon momentum: shaped like the
main parameter) through its own code, so those reshard exactly as upstream's. The MD extras
are added by the MD wrapper classes (wrappers.py) under ``optimizer[...]["md"]`` as
ShardedTensors keyed by the model parameter's global checkpoint key:

- raw gains, their Adam moments and the radius: full tensors, replicated over data-parallel
  ranks (replica id = the rank's data-parallel rank, so one copy is written) and, under tensor
  parallelism, over TP ranks (they are the full matrix's: any TP size loads them);
- the fp32 direction (fp32 params only): the rank's part of it — a ZeRO-1 slice or the whole
  matrix, of its tensor-parallel piece — as rectangles of the FULL matrix (``direction_pieces``),
  so any DP and TP size can load it. Checkpoints written before this layout keep the direction
  as one 1-D tensor over the flattened matrix (no TP): ``prepare_md_load`` recognises them and
  loads them as they are.

Loading a checkpoint without MD state (say, trained with AdamW) into an MD run recreates the MD
state from the loaded weights (radius = their norm, gains 1): the model's function is unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.md.config import FROM_MEGATRON_FLAGS, STATE_FIELDS, STATE_FIELDS_BEFORE
from megatron.md.leaves import md_leaves

MD_KEY_PREFIX = "optimizer.md."
#: the saved MD config's format: 2 since ``--md-variant muown`` is the authors' weight-normalized
#: Muown (a format-1 checkpoint's "muown" is what is now called muown-unit)
MD_FORMAT = 2


def _find_md_configs(tree) -> list[dict]:
    """Every saved MD config in a checkpoint's common (non-tensor) state."""
    found = []
    if isinstance(tree, dict):
        md = tree.get("md")
        if isinstance(md, dict) and "config" in md:
            found.append(md["config"])
        for k, v in tree.items():
            if k != "md":
                found += _find_md_configs(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            found += _find_md_configs(v)
    return found


def prepare_md_load(optimizer, keys: dict, common: dict | None) -> bool:
    """Before building the load template of a torch_dist checkpoint (``keys``: its metadata's
    tensor keys with DCP's metadata; ``common``: its common state): refuse MD state made with
    settings that change what the state means (a clear error instead of a missing-key one),
    and tell every MD wrapper whether MD state is there (absent: recreated from the loaded
    weights). Returns whether the checkpoint has MD state."""
    present = any(MD_KEY_PREFIX in k for k in keys)  # ChainedOptimizer adds "chained_i."
    wrappers = md_leaves(optimizer)
    if present and wrappers and common is not None:
        for saved in _find_md_configs(common.get("optimizer", common)):
            check_same_config(saved, wrappers[0].optimizer.md)
    flat = any(k.endswith(".direction") and len(m.size) == 1 for k, m in keys.items())
    for opt in wrappers:
        opt.md_expect_state = present
        opt.md_flat_direction = flat
    return present


def _replicated(key: str, t: torch.Tensor, replica):
    from megatron.core.dist_checkpointing import ShardedTensor

    return ShardedTensor.from_rank_offsets(key, t.reshape(-1), replica_id=replica)


def _flat_slice(key: str, t: torch.Tensor, start: int, numel: int, replica: int):
    from megatron.core.dist_checkpointing import ShardedTensor

    return ShardedTensor(
        key,
        t,
        t.dtype,
        t.shape,
        (numel,),
        (start,),
        axis_fragmentations=None,
        flattened_range=None,
        allow_shape_mismatch=False,
        replica_id=replica,
    )


def row_rects(a: int, b: int, cols: int) -> list[tuple[int, int, int, int]]:
    """The flat range [a, b) of a row-major matrix with ``cols`` columns as rectangles
    (row0, row1, col0, col1): a partial first row, whole rows, a partial last row."""
    (r0, c0), (r1, c1) = divmod(a, cols), divmod(b, cols)
    if r0 == r1:
        return [(r0, r0 + 1, c0, c1)] if c1 > c0 else []
    out = []
    if c0:
        out.append((r0, r0 + 1, c0, cols))
        r0 += 1
    if r1 > r0:
        out.append((r0, r1, 0, cols))
    if c1:
        out.append((r1, r1 + 1, 0, c1))
    return out


def direction_pieces(t: torch.Tensor, start: int, shape: tuple[int, int], tp) -> list:
    """Where the flat slice ``t`` = [start, start + numel) of a rank's matrix piece (local
    ``shape``, row-major; ``tp``: its blocks.TPShard, None when whole) lies in the full matrix:
    a list of (view of ``t``, full-matrix offset (row, col)), the rectangles of ``row_rects``
    cut where megatron's TP chunks end."""
    rows_n, cols_n = shape
    rows = tp.pieces(rows_n) if tp is not None and tp.axis == 0 else [(0, rows_n, 0)]
    cols = tp.pieces(cols_n) if tp is not None and tp.axis == 1 else [(0, cols_n, 0)]
    out = []
    for r0, r1, c0, c1 in row_rects(start, start + t.numel(), cols_n):
        for lr, n, fr in rows:
            a, b = max(r0, lr), min(r1, lr + n)
            for lc, m, fc in cols if a < b else ():
                c, d = max(c0, lc), min(c1, lc + m)
                if c < d:
                    off = t.storage_offset() + a * cols_n + c - start
                    view = t.as_strided((b - a, d - c), (cols_n, 1), off)
                    out.append((view, (fr + a - lr, fc + c - lc)))
    return out


def _direction_entry(self, key: str, t: torch.Tensor, slot) -> list:
    """The fp32 direction's ShardedTensors (rectangles of the full matrix, see module doc)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron.md import tensor_parallel

    tp, local = slot.md.tp, slot.md.local_shape
    if self.md_flat_direction:  # a checkpoint of the earlier 1-D layout
        if tp is not None:
            raise ValueError(f"{slot.name}: the checkpoint's fp32 direction cannot load under TP")
        return _flat_slice(key, t, slot.md.start, local[0] * local[1], slot.dir_replica)
    replica = slot.dir_replica
    if tp is None:  # a matrix every TP rank holds whole (the MoE router): TP rank 0 writes
        expert = not getattr(slot.model_param, "allreduce", True)
        replica = tensor_parallel.replica_id(replica, expert)
    pieces = direction_pieces(t, slot.md.start, local, tp)
    self._md_dir_views[key] = [v for v, _ in pieces]
    return [
        ShardedTensor(
            key,
            v.contiguous(),
            v.dtype,
            tuple(v.shape),
            slot.md.shape,
            offset,
            axis_fragmentations=None,
            flattened_range=None,
            allow_shape_mismatch=False,
            replica_id=replica,
        )  # fmt: skip
        for v, offset in pieces
    ]


def _flag(name: str, value) -> str:
    if name == "split_qkv":
        return "Q/K/V split (the default)" if value else "--muon-no-split-qkv"
    flag = FROM_MEGATRON_FLAGS.get(name, "--md-" + name.replace("_", "-"))
    return flag if isinstance(value, bool) and value else f"{flag} {value}"


def check_same_config(saved: dict | None, md) -> None:
    """MD state only means something under the settings that made it (``STATE_FIELDS``); the
    rates (gain LR, betas, Muon scale) and how the step is executed may change on resume."""
    if saved is None:
        return
    norm = lambda v: list(v) if isinstance(v, (tuple, list)) else v
    now = dataclasses.asdict(md)
    saved = {**STATE_FIELDS_BEFORE, **saved}  # a field newer than the checkpoint: as it trained
    if saved.get("format", 1) < 2 and saved.get("variant") == "muown":
        saved["variant"] = "muown-unit"  # renamed when "muown" became the authors' Muown
    diff = [
        f"the checkpoint's {_flag(k, saved[k])}, this run's {_flag(k, now.get(k))}"
        for k in STATE_FIELDS
        if k in saved and norm(saved[k]) != norm(now.get(k))
    ]
    if diff:
        raise ValueError(
            "the checkpoint's MD state means something else under this run's settings ("
            + "; ".join(diff)
            + "): use the checkpoint's settings, or --no-load-optim to make MD state afresh "
            "from its weights"
        )


def _global_name(ten) -> str:
    """A parameter's global checkpoint name: its ShardedTensor key plus the offsets along the
    prepended axes (stacked layers, experts), which the key alone does not tell apart."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(ten, ShardedTensorFactory):  # e.g. SwiGLU fc1: name it by its first part
        ten = next(t for t in nested_values(ten.build()) if isinstance(t, ShardedTensor))
    return ten.key + "".join(f"@{o}" for o in ten.global_offset[: ten.prepend_axis_num])


def md_entry(self, model_sharded_state_dict) -> dict:
    """{"config": MDConfig as a dict, "state": {param key: {field: ShardedTensor}}}."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    inner = self.optimizer
    mains = list(inner.slots)
    ids = get_param_id_to_sharded_param_map(
        model_sharded_state_dict, [inner.slots[m].model_param for m in mains]
    )
    state, self._md_keys, self._md_dir_views = {}, {}, {}
    for i, main in enumerate(mains):
        slot = inner.slots[main]
        if i not in ids:
            raise RuntimeError(f"no checkpoint key for MD parameter {slot.name}")
        key = _global_name(ids[i])
        if key in self._md_keys:
            raise RuntimeError(f"two MD parameters map to checkpoint key {key}")
        self._md_keys[key] = main
        fields = {}
        for name, t in inner.md_state[main].items():
            if t is None:
                continue
            full = f"{MD_KEY_PREFIX}{key}.{name}"
            if name == "direction":
                fields[name] = _direction_entry(self, full, t, slot)
            else:
                fields[name] = _replicated(full, t, slot.replica)
        state[key] = fields
    return {"config": {**dataclasses.asdict(inner.md), "format": MD_FORMAT}, "state": state}


def load_md(self, md: dict | None) -> None:
    inner = self.optimizer
    if not inner.slots:
        return
    if md is None or not self.md_expect_state:  # a checkpoint without MD state: continual
        # training from its weights (every rank alike: prepare_md_load read the checkpoint's
        # keys; reinit_from_weights is collective)
        inner.reinit_from_weights()
        return
    # a rank whose matrices keep no MD tensors (Muown's or --md-embedding-norm none's
    # embedding) gets no "state" back: it loads nothing, and must not make state afresh
    loaded = md.get("state") or {}
    check_same_config(md.get("config"), inner.md)
    with torch.no_grad():
        for key, main in self._md_keys.items():
            if key not in loaded:
                if all(t is None for t in inner.md_state[main].values()):
                    continue
                raise ValueError(f"the checkpoint has MD state, but none for {key}")
            for name, t in inner.md_state[main].items():
                got = loaded[key][name] if t is not None else None
                if isinstance(got, list):  # the direction's rectangles (direction_pieces)
                    full = f"{MD_KEY_PREFIX}{key}.direction"
                    for view, piece in zip(self._md_dir_views[full], got, strict=True):
                        if piece.data_ptr() != view.data_ptr():  # else loaded in place
                            view.copy_(piece.view(view.shape))
                elif got is not None:
                    t.copy_(got.view(t.shape))
