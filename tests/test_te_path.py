"""The Transformer Engine path, structurally (TE cannot be installed on a machine without CUDA):
our spec builders call megatron-core's with arguments its signatures accept, and MD's parameter
roles cover the parameter names TE's modules create."""

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron.md.roles import matrix_class, param_role, qkv_blocks, residual_write, tag_qkv
from megatron.md.train.model import spec_call


def _args(**kw):
    base = dict(num_experts=None, qk_layernorm=True, normalization="RMSNorm", qk_l2_norm=False,
                use_te_activation_func=False)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("use_te", [True, False])
@pytest.mark.parametrize("experts", [None, 8])
def test_spec_builders_get_only_arguments_they_accept(use_te, experts):
    """Every keyword ``layer_spec`` passes binds to the builder that receives it (the TE layer
    builder has no ``normalization``: passing it was a TypeError on every TE run)."""
    fn, target, kw = spec_call(_args(num_experts=experts), SimpleNamespace(), use_te)
    inspect.signature(target).bind(**kw)
    assert ("normalization" in kw) == (not use_te or bool(experts))
    if use_te and not experts:
        with pytest.raises(TypeError):
            inspect.signature(target).bind(**kw, normalization="RMSNorm")


# parameter names of megatron-core's TE modules (core/extensions/transformer_engine.py): fused
# norm + linear (TELayerNormColumnParallelLinear: weight, layer_norm_weight) and grouped experts
# (TEGroupedLinear: weight0 … weight{E-1}); the QK-norm is TENorm (weight)
TE_NAMES = {
    "decoder.layers.0.self_attention.linear_qkv.weight": ("matrix", "qkv", False),
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": ("vector", None, False),
    "decoder.layers.0.self_attention.q_layernorm.weight": ("vector", None, False),
    "decoder.layers.0.self_attention.linear_proj.weight": ("matrix", "proj", True),
    "decoder.layers.0.mlp.linear_fc1.weight": ("matrix", "fc1", False),
    "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": ("vector", None, False),
    "decoder.layers.0.mlp.linear_fc2.weight": ("matrix", "fc2", True),
    "decoder.layers.1.mlp.router.weight": ("router", "router", False),
    "decoder.layers.1.mlp.experts.linear_fc1.weight0": ("matrix", "experts", False),
    "decoder.layers.1.mlp.experts.linear_fc1.weight7": ("matrix", "experts", False),
    "decoder.layers.1.mlp.experts.linear_fc2.weight3": ("matrix", "experts", True),
    "decoder.layers.1.mlp.shared_experts.linear_fc2.weight": ("matrix", "shared", True),
    "embedding.word_embeddings.weight": ("embedding", "embeddings", False),
    "output_layer.weight": ("output", "output", False),
}


@pytest.mark.parametrize("name", TE_NAMES)
def test_md_roles_cover_te_parameter_names(name):
    role, cls, residual = TE_NAMES[name]
    p = torch.empty(8) if role == "vector" else torch.empty(8, 4)
    assert param_role(name, p) == role
    assert residual_write(name) == residual  # σ/sqrt(2L) under scaled init, shape_up follows
    if role != "vector":
        assert matrix_class(name) == cls


def test_te_names_are_megatron_cores():
    """The names above are those megatron-core's TE wrappers use (if an upgrade renames them,
    this fails and the table above must follow)."""
    import megatron.core.extensions.transformer_engine as te_ext

    src = Path(te_ext.__file__).read_text()
    assert "layer_norm_weight" in src and 'f"{prefix}weight{gemm_idx}"' in src


def test_qkv_tag_finds_the_te_fused_qkv_weight():
    """Muon's Q/K/V split (and MuonMD's per-block spheres) key on ``linear_qkv.weight``, which
    TE's fused-norm QKV keeps; its ``layer_norm_weight`` is 1-D and stays with Adam."""

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_qkv = torch.nn.Module()
            self.linear_qkv.weight = torch.nn.Parameter(torch.empty(16, 8))
            self.linear_qkv.layer_norm_weight = torch.nn.Parameter(torch.empty(8))
            self.config = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=2)

    m = Attn()
    tag_qkv(m)
    assert qkv_blocks(m.linear_qkv.weight) == (4, 2, 2)
    assert qkv_blocks(m.linear_qkv.layer_norm_weight) == ()
