"""MD state in megatron-core's ``torch_dist`` checkpoints, next to the base optimizer's.

megatron-core saves ``MDInner.state`` (step, Adam moments / Muon momentum: shaped like the
main parameter) through its own code, so those reshard exactly as upstream's. The MD extras
are added by the MD wrapper classes (wrappers.py) under ``optimizer[...]["md"]`` as
ShardedTensors keyed by the model parameter's global checkpoint key:

- raw gains, their Adam moments and the radius: full tensors, replicated over data-parallel
  ranks (replica id = the rank's data-parallel rank, so one copy is written) and, under tensor
  parallelism, over TP ranks (they are the full matrix's: any TP size loads them);
- the fp32 direction (fp32 params only): a 1-D ShardedTensor over the flattened matrix at the
  rank's offset — a ZeRO-1 slice or the whole matrix — so any DP size can load it.

Loading a checkpoint without MD state (say, trained with AdamW) into an MD run recreates the MD
state from the loaded weights (radius = their norm, gains 1): the model's function is unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.md.config import EXECUTION_FIELDS
from megatron.md.wrappers import is_md_wrapper, leaf_optimizers

MD_KEY_PREFIX = "optimizer.md."


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


def prepare_md_load(optimizer, ckpt_dir: str) -> bool:
    """Before building the load template of a torch_dist checkpoint: refuse MD state made with
    other ``--md-*`` settings (a clear error instead of a missing-key one), and tell every MD
    wrapper whether MD state is there (absent: recreated from the loaded weights).
    Returns whether the checkpoint has MD state."""
    from megatron.core import dist_checkpointing

    # dist_checkpointing.load_tensors_metadata fails on torch 2.15 (TensorProperties gained
    # 'strides': megatron/core/dist_checkpointing/strategies/torch.py:1022); read DCP's own.
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    present = any(MD_KEY_PREFIX in k for k in keys)  # ChainedOptimizer adds "chained_i."
    wrappers = [o for o in leaf_optimizers(optimizer) if is_md_wrapper(o)]
    if present and wrappers:
        common = dist_checkpointing.load_common_state_dict(ckpt_dir)
        for saved in _find_md_configs(common.get("optimizer", common)):
            _check_same_config(saved, wrappers[0].optimizer.md)
    for opt in wrappers:
        opt.md_expect_state = present
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


def _check_same_config(saved: dict | None, md) -> None:
    """MD state only means something under the settings that made it."""
    if saved is None:
        return
    norm = lambda v: list(v) if isinstance(v, (tuple, list)) else v
    now = dataclasses.asdict(md)
    diff = [
        f"{k}: checkpoint {saved[k]!r}, this run {now.get(k)!r}"
        for k in saved
        if k not in EXECUTION_FIELDS and norm(saved[k]) != norm(now.get(k))
    ]
    if diff:
        raise ValueError(
            "the checkpoint's MD state was made with other --md-* settings ("
            + "; ".join(diff)
            + "); use the same settings, or load without optimizer state (--no-load-optim)"
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
    state, self._md_keys = {}, {}
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
                if slot.md.tp is not None:  # refused at start-up (train/args.py)
                    raise ValueError(
                        f"{slot.name}: fp32 MD state under tensor parallelism cannot be saved "
                        "yet; use --bf16"
                    )
                numel = slot.md.shape[0] * slot.md.shape[1]
                fields[name] = _flat_slice(full, t, slot.md.start, numel, slot.dir_replica)
            else:
                fields[name] = _replicated(full, t, slot.replica)
        state[key] = fields
    return {"config": dataclasses.asdict(inner.md), "state": state}


def load_md(self, md: dict | None) -> None:
    inner = self.optimizer
    loaded = (md or {}).get("state") or {}
    if not inner.slots:
        return
    if not loaded:  # checkpoint without MD state: continual training from its weights
        inner.reinit_from_weights()
        return
    _check_same_config(md.get("config"), inner.md)
    with torch.no_grad():
        for key, main in self._md_keys.items():
            if key not in loaded:
                raise ValueError(f"the checkpoint has MD state, but none for {key}")
            for name, t in inner.md_state[main].items():
                if t is not None:
                    t.copy_(loaded[key][name].view(t.shape))
