"""Which part of the model a parameter is, by its megatron-core name: the one classifier the
optimizer step (its MD treatment), the per-group LRs and the diagnostics all use.

Names are megatron-core's GPT parameter names, local or Transformer Engine layer specs alike
(``tests/test_te_path.py`` checks TE's: ``linear_qkv.layer_norm_weight``, grouped experts'
``weight{i}``), optionally behind wrapper prefixes (``module.``, ``chunk0.``).
"""

from __future__ import annotations

import torch


def param_role(name: str, param: torch.Tensor) -> str:
    """Role of a megatron-core GPT parameter: embedding, output, router, matrix or vector."""
    if param.ndim != 2:
        return "vector"
    if is_embedding(name):
        return "embedding"
    if is_output(name):
        return "output"
    return "router" if ".router." in name else "matrix"


def residual_write(name: str) -> bool:
    """Attention and MLP output projections (dense, shared and routed experts): the matrices
    megatron-core initializes with ``output_layer_init_method`` (σ/sqrt(2L) when scaled)."""
    return ".linear_proj." in name or ".linear_fc2." in name or name.endswith("experts.weight2")


def qkv_split_shapes(config) -> tuple[int, int, int]:
    """Rows of one query group of megatron's fused QKV weight: (q, k, v), as megatron-core's
    Muon splits it (core/optimizer/emerging_optimizers.py, _get_qkv_split_shapes)."""
    q = config.num_attention_heads // config.num_query_groups * config.kv_channels
    return (q, config.kv_channels, config.kv_channels)


def qkv_blocks(param: torch.Tensor) -> tuple[int, ...]:
    """The Q/K/V split of a fused QKV weight, from megatron's own tags (``is_qkv``,
    ``qkv_split_shapes``: set on the model by ``get_megatron_optimizer`` for Muon,
    core/optimizer/__init__.py, _get_megatron_emerging_optimizer, or by ``tag_qkv``); () for any
    other parameter."""
    if not getattr(param, "is_qkv", False):
        return ()
    return tuple(param.qkv_split_shapes)


def split_blocks(param: torch.Tensor, name: str, split: bool) -> tuple[int, ...]:
    """``qkv_blocks`` of a parameter MD steps, refusing a fused QKV weight that the split
    (``split``: ``MDConfig.split_qkv``) cannot reach: one megatron (and ``tag_qkv``) left
    untagged because its rank's piece does not hold whole query groups."""
    blocks = qkv_blocks(param)
    if split and not blocks and "linear_qkv.weight" in name and param.ndim == 2:
        raise ValueError(
            f"{name}: not tagged for the Q/K/V split (its query groups are cut across TP "
            "ranks), so MD would not split it as at TP=1: use a TP size that divides the "
            "query groups, or --muon-no-split-qkv"
        )
    return blocks


def tag_qkv(model: torch.nn.Module) -> None:
    """Tag the fused QKV weights of a model megatron's optimizer factory did not build for."""
    for name, p in model.named_parameters():
        if "linear_qkv.weight" in name and p.ndim == 2:
            shapes = qkv_split_shapes(model.config)
            if p.shape[0] % sum(shapes) == 0:
                p.is_qkv, p.qkv_split_shapes = True, list(shapes)


def is_embedding(name: str) -> bool:
    return name.endswith("embedding.word_embeddings.weight")


def is_output(name: str) -> bool:
    return name.endswith("output_layer.weight")


def matrix_class(name: str) -> str | None:
    """The class of a 2-D parameter for the diagnostics (None: not reported)."""
    if is_embedding(name):
        return "embeddings"
    if is_output(name):
        return "output"
    if ".router." in name:
        return "router"
    if "shared_experts" in name:
        return "shared"
    if ".experts." in name:
        return "experts"
    for key, cls in (("linear_qkv", "qkv"), ("linear_proj", "proj")):
        if key in name:
            return cls
    for key, cls in (("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
        if key in name:
            return cls
    return None
