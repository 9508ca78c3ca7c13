"""nGPT, the normalized Transformer (Loshchilov et al. 2024), as ``--arch ngpt``: the
architecture of the paper's nGPT comparison (appendix "Comparison to nGPT"), built from
megatron-core's local layer spec with four replaced pieces, written from nGPT's published
description:

- no RMSNorm anywhere (input, pre-MLP, QK and final norms are identities): hidden states live
  on the unit sphere instead. Each block's output is L2-normalized and the residual stream
  moves toward it, h ← Norm(h + |α| ⊙ (Norm(block(h)) − h)) — ``Interpolate`` takes the place
  of the layer's bias-dropout-add (the seam Sandwich Norm uses, model.SandwichAdd);
- attention on unit queries and keys scaled by s_qk, softmax scale sqrt(head dim)
  (``NormedAttention``, megatron's DotProductAttention with q, k normalized after RoPE);
- SwiGLU inputs scaled, u · s_u and ν · s_ν · sqrt(d) (``ScaledFc1``);
- logits scaled by s_z (``NGPTModel``, GPTModel's logit-scaling hook).

Every scaling vector is stored at a base scale and used as stored × (init / scale): Adam's
steps are relative to the stored size, so a small base scale raises the vector's effective LR
(the paper attributes much of nGPT's edge to this). nGPT's values: α init 0.05 at scale
1/sqrt(d), s_qk 1 at 1/sqrt(d), s_u and s_ν 1 at 1, s_z 1 at 1/sqrt(d);
``--ngpt-residual-scale 1`` stores α at scale 1 (the paper's grey ablation line).

The weights' unit norms are the optimizer's: ``--md-decoupling --md-sphere hidden
--md-radius unit --md-gains none`` is nGPT's normalization (every vector along the hidden
dimension at norm 1, embeddings and LM-head rows too) after a plain base step.

GQA (nGPT has none): s_qk is per query head; a score is q̂ᵀ diag(s_qk²) k̂ — what nGPT's
(s_qk ⊙ q̂)ᵀ(s_qk ⊙ k̂) is — so a key shared by several query heads meets each head's s_qk.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F


def check_args(args) -> str | None:
    """What ``--arch ngpt`` is built for, checked with the other flags (args.validate): nGPT's
    weights live on spheres that only the MD step keeps, and its pieces are written for the
    local, dense, unsplit model. Returns the problem, or None."""
    if not args.md_decoupling:
        return (
            "--arch ngpt keeps its weights on spheres through the optimizer: add --md-decoupling "
            "(nGPT as proposed: --md-sphere hidden --md-radius unit --md-gains none)"
        )
    if args.transformer_impl != "local":
        return "--arch ngpt is built on megatron-core's local layer spec: --transformer-impl local"
    for flag, value in (
        ("--tensor-model-parallel-size", args.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
        ("--context-parallel-size", args.context_parallel_size),
    ):
        if value != 1:
            return f"--arch ngpt runs with {flag} 1 (got {value})"
    if args.num_experts:
        return "--arch ngpt is dense: drop --num-experts"
    if not args.swiglu:
        return "--arch ngpt uses SwiGLU (its s_u, s_nu scales): add --swiglu"
    if args.add_bias_linear or args.add_qkv_bias:
        return "--arch ngpt has no biases: add --disable-bias-linear (and no --add-qkv-bias)"
    if args.hidden_dropout or args.attention_dropout:
        return "--arch ngpt has no dropout: --hidden-dropout 0 --attention-dropout 0"
    if not args.untie_embeddings_and_output_weights:
        return "--arch ngpt has its own LM head: add --untie-embeddings-and-output-weights"
    if args.sandwich_norm or args.embedding_scale:
        return "--arch ngpt has no Sandwich Norm or embedding scale: drop those flags"
    if getattr(args, "prenorm_block_scale", None):
        return "--arch ngpt scales its residual steps itself (alpha): drop --prenorm-block-scale"
    if args.mtp_num_layers or args.use_mup or args.apply_query_key_layer_scaling:
        return (
            "--arch ngpt does not combine with --mtp-num-layers, --use-mup or "
            "--apply-query-key-layer-scaling"
        )
    if not (math.isfinite(args.ngpt_alpha_init) and args.ngpt_alpha_init > 0):
        return f"--ngpt-alpha-init={args.ngpt_alpha_init} must be > 0"
    return None


def _unit(x: torch.Tensor) -> torch.Tensor:
    """x / ‖x‖ along the last axis, computed in fp32 (bf16 norms would round every layer)."""
    return F.normalize(x.float(), dim=-1)


class Scaled(torch.nn.Module):
    """A learnable vector stored at ``scale`` and used at ``init`` (nGPT's parametrization)."""

    def __init__(self, size: int, init: float, scale: float):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((size,), float(scale)))
        self.mult = init / scale

    def value(self) -> torch.Tensor:
        return self.scale * self.mult


class Interpolate(torch.nn.Module):
    """h ← Norm(h + |α| ⊙ (Norm(x) − h)) in place of megatron's bias-dropout-add."""

    def __init__(self, hidden: int, alpha_init: float, alpha_scale: float):
        super().__init__()
        self.alpha = Scaled(hidden, alpha_init, alpha_scale)

    def forward(self, training: bool, fused: bool):  # called like get_bias_dropout_add
        def step(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:  # refused at start-up (check_args); kept for the signature
                x = x + bias
            h = _unit(residual)
            h = h + self.alpha.value().abs() * (_unit(x) - h)  # nGPT's eigen learning rates
            return _unit(h).to(residual.dtype)

        return step


def normed_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class NormedAttention(DotProductAttention):
        """Unit q and k (per head, after RoPE) times s_qk; softmax scale sqrt(head dim)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, *a, **kw):
            kw["softmax_scale"] = math.sqrt(config.kv_channels)
            super().__init__(config, layer_number, attn_mask_type, attention_type, *a, **kw)
            d = config.hidden_size
            self.s_qk = Scaled(self.num_attention_heads_per_partition * config.kv_channels,
                               1.0, 1 / math.sqrt(d))  # fmt: skip

        def forward(self, query, key, value, attention_mask, *a, **kw):
            s2 = self.s_qk.value().view(query.shape[-2], query.shape[-1]).square()
            query = (_unit(query) * s2).to(value.dtype)
            return super().forward(query, _unit(key).to(value.dtype), value, attention_mask,
                                   *a, **kw)  # fmt: skip

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """megatron's saves only a learnable softmax offset here
            (dot_product_attention.py, DotProductAttention.sharded_state_dict); s_qk is added,
            replicated."""
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            own = {"s_qk.scale": self.s_qk.scale}
            out.update(make_sharded_tensors_for_checkpoint(
                own, prefix, {}, sharded_offsets, tp_group=self.tp_group,
                dp_cp_group=metadata["dp_cp_group"]))  # fmt: skip
            return out

    return NormedAttention


def scaled_fc1_class():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class ScaledFc1(ColumnParallelLinear):
        """SwiGLU's fc1 with its two halves scaled: ν · s_ν · sqrt(d) (megatron's gate, the
        first half, core/transformer/mlp.py's glu) and u · s_u."""

        def __init__(self, input_size, output_size, *a, config, **kw):
            super().__init__(input_size, output_size, *a, config=config, **kw)
            half = self.output_size_per_partition // 2
            self.s_nu, self.s_u = Scaled(half, 1.0, 1.0), Scaled(half, 1.0, 1.0)
            self.nu_mult = math.sqrt(config.hidden_size)

        def forward(self, input_, *a, **kw):
            out, bias = super().forward(input_, *a, **kw)
            s = torch.cat([self.s_nu.value() * self.nu_mult, self.s_u.value()])
            return out * s.to(out.dtype), bias

    return ScaledFc1


def ngpt_model_class():
    from megatron.core.models.gpt import GPTModel

    class NGPTModel(GPTModel):
        """GPTModel with nGPT's logit scale s_z (after megatron's own logit scaling,
        language_module.py, LanguageModule._scale_logits; called on the LM head's output,
        gpt_model.py, GPTModel._postprocess)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if self.post_process:
                d = self.config.hidden_size
                self.s_z = Scaled(self.output_layer.output_size_per_partition, 1.0,
                                  1 / math.sqrt(d))  # fmt: skip

        def _scale_logits(self, logits):
            logits = super()._scale_logits(logits)
            return logits * self.s_z.value().to(logits.dtype)

    return NGPTModel


def block_spec(args, cfg):
    """nGPT's decoder: megatron's local layer spec with its norms removed and the pieces
    above in place; no final norm (the last layer's output is already on the sphere)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    d = cfg.hidden_size
    alpha_scale = 1 / math.sqrt(d) if args.ngpt_residual_scale == "1/sqrt(d)" else 1.0
    add = ModuleSpec(module=Interpolate, params={"hidden": d, "alpha_init": args.ngpt_alpha_init,
                                                 "alpha_scale": alpha_scale})  # fmt: skip
    layer = specs.get_gpt_layer_local_spec(qk_layernorm=False, normalization="RMSNorm")
    sub = layer.submodules
    attn = sub.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=normed_attention_class())
    mlp = sub.mlp  # functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))
    mlp_sub = dataclasses.replace(mlp.keywords["submodules"], linear_fc1=scaled_fc1_class())
    mlp = type(mlp)(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": mlp_sub})
    sub = dataclasses.replace(
        sub,
        input_layernorm=IdentityOp,
        pre_mlp_layernorm=IdentityOp,
        self_attention=dataclasses.replace(attn, submodules=attn_sub),
        self_attn_bda=add,
        mlp=mlp,
        mlp_bda=add,
        sharded_state_dict_keys_map={},
    )
    layer = dataclasses.replace(layer, submodules=sub)
    blocks = TransformerBlockSubmodules(layer_specs=[layer] * cfg.num_layers, layer_norm=None)
    return ModuleSpec(module=TransformerBlock, submodules=blocks)
