"""What a continual run (``--init-from``) takes from its source besides weights and moments:
fresh moments with everything else kept (``--init-fresh-moments``), and the source's place in
the data stream (``--init-continue-data``). Together they are the authors' re-warming arms
(feat/scaling-sweeps ``_research/launch/framework/warm-restart.sh``: every arm continues the
source's data stream and keeps MD's gains; "fresh" zeros the moments, megatron's
``--reset-optimizer-moments`` in their fork)."""

from __future__ import annotations

import torch

#: the optimizer-state fields that are moments (base optimizers and MD's gains: state.py)
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _is_moment(key: str) -> bool:
    return key in MOMENTS or key.endswith(("_exp_avg", "_exp_avg_sq"))


def reset_moments(optimizer) -> int:
    """Zero every moment and step count of ``optimizer`` (megatron's tree: each leaf's torch
    optimizer, MD's own state beside it), in place so that every view of them (the MD engine's
    storage) sees it; weights, MD's directions, radii and gains stay. Returns how many tensors
    were zeroed (0 means the tree holds no state: an error for the caller)."""
    from megatron.md.leaves import leaf_optimizers

    n = 0
    for leaf in leaf_optimizers(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if inner is None:
            continue
        states = list(inner.state.values()) + list(getattr(inner, "md_state", {}).values())
        for st in states:
            for key, v in st.items():
                if _is_moment(key) and torch.is_tensor(v):
                    v.zero_()
                    n += 1
                elif key == "step":
                    if torch.is_tensor(v):
                        v.zero_()
                    else:
                        st[key] = 0
        for group in inner.param_groups:
            if "step" in group:  # megatron keeps Adam's step per group for some optimizers
                group["step"] = 0
        if hasattr(inner, "rebind"):  # MD's inner: its engine counts the steps on the host
            inner.rebind()
    return n


def source_samples(init_from: str) -> int:
    """Training samples the ``--init-from`` checkpoint had consumed (its saved args)."""
    from megatron.core import dist_checkpointing

    from megatron.md import errors
    from megatron.md.train.ckpt_checks import locate

    ckpt = locate(init_from, flag="--init-from")
    if ckpt is None or ckpt.format != "torch_dist":
        errors.fail(f"--init-continue-data: {init_from} holds no torch_dist checkpoint to read")
    saved = dist_checkpointing.load_common_state_dict(ckpt.path).get("args")
    consumed = getattr(saved, "consumed_train_samples", None)
    if not consumed:
        errors.fail(f"--init-continue-data: {ckpt.path} does not say how many samples it consumed")
    return int(consumed)


class OffsetDataset(torch.utils.data.Dataset):
    """Sample ``i`` of this run is sample ``offset + i`` of the dataset (built that much
    longer): the source's data stream goes on, and megatron's sampler counts this run's own
    consumed samples (a requeue resumes where this run stopped)."""

    def __init__(self, dataset, offset: int):
        self.dataset, self.offset = dataset, offset

    def __len__(self) -> int:
        return len(self.dataset) - self.offset

    def __getitem__(self, i):
        return self.dataset[self.offset + i]

    def __getattr__(self, name):  # the GPTDataset's own attributes (config, indices)
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)
