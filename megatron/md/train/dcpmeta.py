"""A torch_dist checkpoint's tensor metadata read as megatron-core 0.19.2 reads it, on a torch
whose ``TensorProperties`` has a ``strides`` field (torch 2.15 here): megatron makes each
tensor's meta stand-in with ``torch.empty(size, **properties.__dict__)``
(core/dist_checkpointing/strategies/torch.py:1022), which torch refuses (``TypeError: empty()
got an unexpected keyword argument 'strides'``). Every load under ``--dist-ckpt-strictness``
other than the default reads this metadata first, so each of them failed (seen, 2026-11-29:
``log_all`` on the resume of a tiny AdamMD run)."""

from __future__ import annotations

import copy
import dataclasses
import functools


def without_strides(metadata):
    """A copy of DCP ``metadata`` whose tensor properties have no ``strides`` entry (the
    loaded metadata itself, which the load may cache and use, stays as it was)."""
    out = copy.copy(metadata)  # (keeps megatron's ``mcore_data``, set on the instance)
    out.state_dict_metadata = {}
    for key, tp in metadata.state_dict_metadata.items():
        props = getattr(tp, "properties", None)
        if props is not None and "strides" in vars(props):
            props = copy.copy(props)
            del props.__dict__["strides"]  # (the class default, None, is what .strides reads)
            tp = dataclasses.replace(tp, properties=props)
        out.state_dict_metadata[key] = tp
    return out


def tensors_metadata(orig, run=None):
    """``TorchDistLoadShardedStrategy.load_tensors_metadata`` on metadata ``without_strides``
    (read as megatron reads it where the caller passes none)."""

    @functools.wraps(orig)
    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        if metadata is None:
            from megatron.core.dist_checkpointing.strategies.torch import _get_filesystem_reader

            metadata = _get_filesystem_reader(checkpoint_dir).read_metadata()
        return orig(self, checkpoint_dir, without_strides(metadata))

    return load_tensors_metadata
