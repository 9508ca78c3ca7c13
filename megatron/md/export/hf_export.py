"""A trained model as a Hugging Face folder: ``config.json`` (``auto_map`` to our modeling
file), ``model.safetensors`` (megatron's parameter names, the checkpoint's dtype),
``modeling_megatron_md.py`` (``hf_modeling.py``), the run's tokenizer files where it used a
Hugging Face tokenizer, and ``megatron_md_export.json`` (where it came from).

The paper's dense and MoE architectures (``NEEDS`` names what is refused); the fused weight
tensors of an MD run are ordinary weights, so MD and plain runs export alike.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from megatron.md.train.model import block_scale

MODELING = Path(__file__).with_name("hf_modeling.py")
#: (arg, the value the exported model needs (a frozenset: one of them), what the HF model
#: lacks otherwise)
NEEDS = (
    ("normalization", "RMSNorm", "LayerNorm"),
    ("swiglu", True, "an activation other than SwiGLU"),
    ("add_bias_linear", False, "linear biases"),
    ("add_qkv_bias", False, "QKV biases"),
    ("position_embedding_type", "rope", "position embeddings other than RoPE"),
    ("rotary_percent", 1.0, "partial RoPE"),
    ("rotary_interleaved", False, "interleaved RoPE"),
    ("multi_latent_attention", False, "multi-latent attention"),
    ("layernorm_zero_centered_gamma", False, "zero-centred norm weights"),
    ("attention_output_gate", False, "an attention output gate"),
    ("rotary_seq_len_interpolation_factor", None, "RoPE position interpolation"),
    ("no_rope_freq", None, "layers without RoPE"),
    ("qk_l2_norm", False, "QK L2 normalization"),
    ("window_size", None, "sliding-window attention"),
    ("softmax_type", "vanilla", "a softmax other than the vanilla one"),
    ("apply_residual_connection_post_layernorm", False, "residuals taken after the norm"),
    ("mtp_num_layers", None, "multi-token prediction layers"),
    ("arch", "gpt", "the nGPT architecture"),
    # MoE layers: megatron-core's TopKRouter and MoELayer, without token dropping
    (
        "moe_router_load_balancing_type",
        frozenset({"aux_loss", "seq_aux_loss", "global_aux_loss", "none"}),
        "routing other than top-k",
    ),  # fmt: skip
    ("moe_router_num_groups", None, "group-limited routing"),
    ("moe_expert_capacity_factor", None, "token dropping (an expert capacity)"),
    ("moe_apply_probs_on_input", False, "router probabilities applied to the experts' input"),
    ("moe_latent_size", None, "latent MoE projections"),
    ("moe_input_jitter_eps", None, "router input jitter"),
    ("moe_router_force_load_balancing", False, "random router logits"),
    ("moe_router_force_biased", None, "biased random router logits"),
    ("moe_mlp_glu_interleave_size", None, "interleaved expert GLU weights"),
    ("moe_shared_expert_glu_interleave_size", None, "interleaved shared-expert GLU weights"),
    ("moe_single_grouped_weight", False, "experts' weights in one grouped tensor"),
)
#: Transformer Engine's fused norm weights → the local spec's names (hf_modeling's)
TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
#: Transformer Engine's grouped experts (TEGroupedMLP: ``linear_fc1.weight3``) → the local
#: spec's SequentialMLP (``local_experts.3.linear_fc1.weight``)
TE_GROUPED = (re.compile(r"\.mlp\.experts\.linear_fc([12])\.weight(\d+)$"),
              r".mlp.experts.local_experts.\2.linear_fc\1.weight")  # fmt: skip


def _fits(args, name: str, want) -> bool:
    if not hasattr(args, name):  # an argument this megatron-core does not have
        return True
    value = getattr(args, name)
    return value in want if isinstance(want, frozenset) else value == want


def unsupported(args) -> list[str]:
    """What of the run ``hf_modeling`` cannot compute (empty: it exports)."""
    return [f"{why} ({name}={getattr(args, name)!r})" for name, want, why in NEEDS
            if not _fits(args, name, want)]  # fmt: skip


def moe_layers(args) -> list[int]:
    """1 for each MoE layer, 0 for a dense one: megatron-core's own reading of
    ``--moe-layer-freq`` (an int k: every k-th layer from the first; a list: the pattern)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_moe_layer_pattern,
    )

    if not getattr(args, "num_experts", None):
        return [0] * args.num_layers
    return list(get_moe_layer_pattern(args))


def config(args) -> dict:
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    return {
        "model_type": "megatron_md_gpt",
        "architectures": ["MegatronMDForCausalLM"],
        "auto_map": {
            "AutoConfig": "modeling_megatron_md.MegatronMDConfig",
            "AutoModelForCausalLM": "modeling_megatron_md.MegatronMDForCausalLM",
        },
        "vocab_size": args.padded_vocab_size,
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_query_groups": groups,
        "kv_channels": args.kv_channels,
        "ffn_hidden_size": args.ffn_hidden_size,
        "norm_epsilon": args.layernorm_epsilon,
        "rotary_base": float(args.rotary_base),
        "qk_layernorm": bool(args.qk_layernorm),
        "sandwich_norm": bool(args.sandwich_norm),
        "block_output_scale": block_scale(args.block_output_scale, args.num_layers),
        "prenorm_block_scale": (
            block_scale(args.prenorm_block_scale, args.num_layers)
            if getattr(args, "prenorm_block_scale", None)
            else None
        ),
        "embedding_scale": bool(args.embedding_scale),
        "share_embeddings": not args.untie_embeddings_and_output_weights,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_scaling_factor": float(args.rope_scaling_factor) if args.use_rope_scaling else None,
        "moe_layers": moe_layers(args),
        "num_experts": args.num_experts or 0,
        "moe_ffn_hidden_size": args.moe_ffn_hidden_size or 0,
        "moe_shared_ffn_hidden_size": args.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": bool(args.moe_shared_expert_gate),
        "moe_topk": args.moe_router_topk,
        "moe_score_function": args.moe_router_score_function,
        "moe_pre_softmax": bool(args.moe_router_pre_softmax),
        "moe_topk_scaling_factor": args.moe_router_topk_scaling_factor,
        "moe_expert_bias": bool(args.num_experts and args.moe_router_enable_expert_bias),
        "moe_router_dtype": args.moe_router_dtype,
        "torch_dtype": "bfloat16" if args.bf16 else "float32",
    }


def tensors(state: dict) -> dict[str, torch.Tensor]:
    """The model's state dict under hf_modeling's names (Float16Module's ``module.`` prefix
    off, Transformer Engine's fused norm weights and grouped experts renamed, TE's
    ``_extra_state`` dropped)."""
    out = {}
    for name, t in state.items():
        if not torch.is_tensor(t) or name.endswith("_extra_state"):
            continue
        name = name.removeprefix("module.")
        for te, local in TE_NAMES.items():
            name = name.replace(te, local)
        out[TE_GROUPED[0].sub(TE_GROUPED[1], name)] = t.detach().contiguous().cpu()
    return out


def mismatched(cfg: dict, weights: dict) -> list[str]:
    """Names and shapes where the weights and the HF model ``cfg`` builds (on the meta device)
    disagree: a layout the export does not know, named before anything is written."""
    from megatron.md.export import hf_modeling

    with torch.device("meta"):
        model = hf_modeling.MegatronMDForCausalLM(hf_modeling.MegatronMDConfig(**cfg))
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in weights.items()}
    out = [f"{k} missing" for k in sorted(want.keys() - have.keys())]
    out += [f"{k} not in the HF model" for k in sorted(have.keys() - want.keys())]
    return out + [f"{k}: {have[k]} where the HF model has {want[k]}"
                  for k in sorted(want.keys() & have.keys()) if want[k] != have[k]]  # fmt: skip


def write(out: Path, cfg: dict, weights: dict, tokenizer: str | None, source: dict) -> None:
    """The folder, written in a temporary sibling and renamed into place when complete."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(MODELING, tmp / "modeling_megatron_md.py")
    if tokenizer:
        for f in Path(tokenizer).iterdir():
            if f.is_file() and not (tmp / f.name).exists():  # ours win over a same-named file
                shutil.copyfile(f, tmp / f.name)
    (tmp / "megatron_md_export.json").write_text(json.dumps(source, indent=1) + "\n")
    tmp.rename(out)
