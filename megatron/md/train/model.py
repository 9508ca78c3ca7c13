"""The paper's GPT (recipe §3-4) for ``megatron.training``: megatron-core's GPTModel and layer
specs (local on CPU, Transformer Engine on GPU) plus two additions at narrow seams:

- Sandwich Norm: each block output goes through its own RMSNorm and a fixed scale α before the
  residual add — ``SandwichAdd`` takes the place of the layer's bias-dropout-add submodule
  (``ScaledAdd``: α alone, no norm, with ``--no-sandwich-norm --prenorm-block-scale``);
- embeddings × sqrt(d): a forward hook on the embedding.

Both, and init std 1/sqrt(d) for every matrix (``--init-method-std`` defaults to it; megatron's
scaled σ/sqrt(2L) output-projection init only with ``--scaled-output-init``), come with
``--paper-arch`` (every ``--preset``); without it the model is megatron's own. ``--arch ngpt``
builds the normalized Transformer instead (ngpt.py).

Without them the model is the one megatron-core's own builder makes from the same flags
(``GPT_FLAGS``, the specs' arguments; tests/test_model_provider.py builds both); the flags for
models it does not build are refused at start-up (``NOT_BUILT``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from megatron.md import errors
from megatron.md.train import ngpt

#: GPTModel's arguments set by megatron's flags, passed as megatron's own builder passes them
#: (training/argument_utils.py ``gpt_config_from_args``, training/models/gpt.py
#: ``GPTModelBuilder.build_model``); RoPE scaling and the interpolation factor were ignored.
#: (megatron's builder leaves ``rope_scaling_factor`` at its default 8; the flag reaches it here)
GPT_FLAGS = {
    "fp16_lm_cross_entropy": "fp16_lm_cross_entropy",
    "position_embedding_type": "position_embedding_type",
    "rotary_percent": "rotary_percent",
    "rotary_base": "rotary_base",
    "rope_scaling": "use_rope_scaling",
    "rope_scaling_factor": "rope_scaling_factor",
    "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
}

#: megatron's flags for models this provider does not build, and what each asks for: they
#: were parsed and ignored (or, multi-token prediction, failed in the first forward step);
#: MD's roles (megatron/md/roles.py) know the local and Transformer Engine GPT layers' matrices
NOT_BUILT = {
    "mtp_num_layers": "multi-token prediction layers",
    "multi_latent_attention": "multi-latent attention",
    "experimental_attention_variant": "an experimental attention variant",
    "spec": "a layer spec of its own",
    "heterogeneous_layers_config_path": "heterogeneous layers",
    "is_hybrid_model": "a hybrid (Mamba) model",
    "hybrid_layer_pattern": "a hybrid (Mamba) model",
    "hybrid_override_pattern": "a hybrid (Mamba) model",
    "use_kitchen_attention": "Kitchen attention",
    "use_grouped_gemm_for_dense_mlp": "grouped GEMMs for the dense MLP",
    "use_transformer_engine_op_fuser": "Transformer Engine's fused operations",
}


def check_flags(args) -> None:
    """At start-up: a flag for a model ``model_provider`` does not build (``NOT_BUILT``), or
    one megatron-core 0.19.2 would not honour for the model it builds."""
    if args.transformer_impl not in ("local", "transformer_engine"):
        errors.fail(
            f"--transformer-impl {args.transformer_impl}: pretrain_gpt.py builds the local or "
            "the transformer_engine layer spec (the inference-optimized one is megatron's "
            "inference engine's)"
        )
    if getattr(args, "openai_gelu", False):  # (core/transformer/utils.py has the function;
        # nothing in megatron-core 0.19.2 or its training package reads the flag)
        errors.fail(
            "--openai-gelu is parsed and read nowhere by megatron-core 0.19.2: the MLP would "
            "keep its activation (GELU, or SwiGLU with --swiglu); drop it"
        )
    fsdp = getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False)
    if getattr(args, "init_model_with_meta_device", False) and not fsdp:
        errors.fail(  # (training/training.py:1826: to_empty, never initialized)
            "--init-model-with-meta-device without FSDP: megatron-core 0.19.2 then makes the "
            "model's memory with torch's to_empty and never initializes it: only a loaded "
            "checkpoint fills it, a first launch trains from it (a plain run's gradient norm "
            "was nan at iteration 1, MD's sphere radius nan: seen); drop it"
        )
    if args.sandwich_norm and getattr(args, "prenorm_block_scale", None):
        errors.fail(
            f"--prenorm-block-scale {args.prenorm_block_scale} scales a block output with no "
            "norm after it, and this model has Sandwich Norm (--paper-arch, every --preset): "
            "add --no-sandwich-norm, or give the scale after the norm as --block-output-scale"
        )
    if not args.sandwich_norm and "--block-output-scale" in getattr(args, "given_flags", ()):
        errors.fail(
            f"--block-output-scale {args.block_output_scale} is the scale after each block's "
            "Sandwich norm, which this model does not have (--no-sandwich-norm, or no "
            "--paper-arch): it would be ignored; a scale without the norm is "
            "--prenorm-block-scale"
        )
    for flag, what in NOT_BUILT.items():
        if getattr(args, flag, None):
            errors.fail(
                f"--{flag.replace('_', '-')}: pretrain_gpt.py builds megatron-core's GPT with "
                f"its local or Transformer Engine layer spec (megatron/md/train/model.py), not "
                f"{what}"
            )


class SandwichAdd(torch.nn.Module):
    """residual + α · RMSNorm(x + bias), in place of megatron's bias-dropout-add."""

    def __init__(self, hidden: int, eps: float, alpha: float):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=eps)
        self.alpha = alpha

    def forward(self, training: bool, fused: bool):  # called like get_bias_dropout_add
        def add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            out = self.alpha * self.norm(x)
            return residual + F.dropout(out, p=prob, training=training)

        return add


class ScaledAdd(torch.nn.Module):
    """residual + α · x + bias, no norm (``--prenorm-block-scale``), in place of megatron's
    bias-dropout-add: the authors' ``FixedLayerScale`` on a block output without
    ``--post-norm`` (gainz core/transformer/transformer_layer.py, the scale before the
    bias-dropout-add)."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, training: bool, fused: bool):  # called like get_bias_dropout_add
        def add(x_with_bias, residual, prob):
            x, bias = x_with_bias
            out = self.alpha * x
            if bias is not None:
                out = out + bias
            return residual + F.dropout(out, p=prob, training=training)

        return add


def block_scale(name: str, layers: int) -> float:
    return {"1/L": 1 / layers, "1/sqrt(2L)": 1 / math.sqrt(2 * layers), "1": 1.0}[name]


def block_add(args, cfg):
    """The ModuleSpec that takes the place of each block's bias-dropout-add: Sandwich Norm's
    (``--sandwich-norm``), the scale alone (``--prenorm-block-scale``), or None (megatron's)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if args.sandwich_norm:
        alpha = block_scale(args.block_output_scale, cfg.num_layers)
        params = {"hidden": cfg.hidden_size, "eps": cfg.layernorm_epsilon, "alpha": alpha}
        return ModuleSpec(module=SandwichAdd, params=params)
    if getattr(args, "prenorm_block_scale", None):
        alpha = block_scale(args.prenorm_block_scale, cfg.num_layers)
        return ModuleSpec(module=ScaledAdd, params={"alpha": alpha})
    return None


def _with_add(spec, add):
    sub = dataclasses.replace(spec.submodules, self_attn_bda=add, mlp_bda=add)
    return dataclasses.replace(spec, submodules=sub)


def spec_call(args, cfg, use_te: bool, vp_stage=None):
    """(megatron-core spec builder, the one it delegates to, kwargs): what ``layer_spec``
    calls. The Transformer Engine layer builder takes no ``normalization`` (TENorm reads it
    from the config), the local one does (core/models/gpt/gpt_layer_specs.py:
    ``get_gpt_layer_with_transformer_engine_submodules``, ``get_gpt_layer_local_submodules``);
    MoE goes through the decoder-block builder for either (``get_gpt_decoder_block_spec``),
    which picks TE grouped experts for --moe-grouped-gemm from the config."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if args.num_experts:
        fn = specs.get_gpt_decoder_block_spec
        kw = dict(config=cfg, use_transformer_engine=use_te, normalization=args.normalization,
                  qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)  # fmt: skip
        return fn, fn, kw
    if use_te:
        return (
            specs.get_gpt_layer_with_transformer_engine_spec,
            specs.get_gpt_layer_with_transformer_engine_submodules,
            dict(
                qk_layernorm=args.qk_layernorm,
                qk_l2_norm=args.qk_l2_norm,
                use_te_activation_func=args.use_te_activation_func,
            ),
        )
    return (
        specs.get_gpt_layer_local_spec,
        specs.get_gpt_layer_local_submodules,
        dict(
            qk_layernorm=args.qk_layernorm,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
        ),
    )


def layer_spec(args, cfg, use_te: bool, vp_stage=None):
    """Layer (dense) or block (MoE) spec, with Sandwich Norm or a block-output scale when
    asked (``block_add``)."""
    add = block_add(args, cfg)
    fn, _, kw = spec_call(args, cfg, use_te, vp_stage)
    spec = fn(**kw)
    if args.num_experts:
        if getattr(args, "te_names", False):
            spec.layer_specs = _te_moe_names(spec.layer_specs)
        if add is not None:
            spec.layer_specs = [_with_add(s, add) for s in spec.layer_specs]
        return spec
    local_attention(spec, args)
    return _with_add(spec, add) if add is not None else spec


def _te_moe_names(layer_specs: list) -> list:
    """Local MoE layers whose pre-MLP norm has the sharded key Transformer Engine's MoE layer
    saves (``pre_mlp_layernorm.weight``; TE's spec maps no name of it,
    core/models/gpt/gpt_layer_specs.py:336), where the local spec names it as a dense layer's
    fused norm (``mlp.linear_fc1.layer_norm_weight``, gpt_layer_specs.py:459): set only to
    load a TE run's checkpoint into the local spec (``evaluation/restore.local_for_te``)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    def moe(mlp) -> bool:  # a ModuleSpec, or (megatron-core 0.19.2) a functools.partial
        cls = getattr(mlp, "module", None) or getattr(mlp, "func", None)
        return isinstance(cls, type) and issubclass(cls, MoELayer)

    out, changed = [], 0
    for spec in layer_specs:
        keys = dict(spec.submodules.sharded_state_dict_keys_map)
        if moe(spec.submodules.mlp) and keys.pop("pre_mlp_layernorm.", None):
            sub = dataclasses.replace(spec.submodules, sharded_state_dict_keys_map=keys)
            spec, changed = dataclasses.replace(spec, submodules=sub), changed + 1
        out.append(spec)
    if not changed:
        raise RuntimeError(
            "megatron-core's local MoE layer spec no longer maps its pre-MLP norm's name "
            "(gpt_layer_specs.py:459): a Transformer Engine checkpoint's MoE layers would not "
            "load as written for it (evaluation/restore.py, local_for_te)"
        )
    return out


def local_attention(spec, args) -> None:
    """``--attention-backend local``: megatron-core's own dot-product attention in a layer spec
    (the TE spec's is TE's), as megatron's builder does (training/models/gpt.py:296)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    if args.attention_backend == AttnBackend.local:
        spec.submodules.self_attention.submodules.core_attention = DotProductAttention


def model_provider(
    pre_process=True, post_process=True, config=None, pg_collection=None, vp_stage=None, **_
):
    """Called by megatron.training's get_model (training.py, get_model)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    cfg = config if config is not None else core_transformer_config_from_args(args)
    if args.paper_arch and not args.scaled_output_init:  # the paper: every matrix at 1/sqrt(d)
        cfg.output_layer_init_method = cfg.init_method
    use_te = args.transformer_impl == "transformer_engine"
    if args.arch == "ngpt":
        cls, spec = ngpt.ngpt_model_class(), ngpt.block_spec(args, cfg)
    else:
        cls, spec = GPTModel, layer_spec(args, cfg, use_te, vp_stage)
    model = cls(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
        **{arg: getattr(args, flag) for arg, flag in GPT_FLAGS.items()},
    )
    if args.embedding_scale and pre_process:
        scale = math.sqrt(cfg.hidden_size)
        model.embedding.register_forward_hook(lambda m, i, out: out * scale)
    return model
