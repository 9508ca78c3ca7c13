"""The paper's dense and MoE GPTs as a Hugging Face model (``trust_remote_code``): written into
every folder ``tools/export_hf.py`` makes, as ``modeling_megatron_md.py``. Self-contained (torch and
transformers only). Module and parameter names are megatron-core's (local layer spec), so a
checkpoint's weights load by name.

The computation is megatron-core's: RMSNorm; fused QKV laid out per query group (the group's
query heads, then its key and its value head); Q/K RMSNorm per head before RoPE
(non-interleaved, ``rotary_base``, full head dimension; Llama 3.x scaling of its
frequencies where ``rope_scaling_factor`` is set); causal softmax(QKᵀ/√d_head) V;
SwiGLU (the first half of fc1 gated by SiLU); Sandwich Norm (``α · RMSNorm(block output)``
added to the residual); embeddings × √d; an untied or tied LM head over the padded vocabulary.
MoE layers (the layers ``moe_layers`` marks) as megatron-core's ``MoELayer`` without token
dropping: the router's logits in ``moe_router_dtype``, its score function, top-k (the expert
bias moving the choice only), the scores of the chosen experts normalized and scaled as
``topk_routing_with_score_function``; each chosen expert's SwiGLU output weighted by its
probability before fc2 (``MLP.forward``'s ``per_token_scale``); the shared expert added.
``attention_mask`` (1 = token, 0 = padding, left or right) keeps padding out of every token's
attention and numbers each sequence's positions from its first token, as an unpadded
sequence's (``position_ids`` given are used as they are): a padded batch gives each sequence
its own logits. ``generate()`` keeps the keys and values of the tokens read in a transformers
``DynamicCache`` (``cache``; ``past_key_values`` before transformers 5) and reads only the new
token at each step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers import PreTrainedConfig as _Config
except ImportError:  # transformers < 5
    from transformers import PretrainedConfig as _Config


class MegatronMDConfig(_Config):
    model_type = "megatron_md_gpt"

    def __init__(
        self,
        vocab_size: int = 1024,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_attention_heads: int = 2,
        num_query_groups: int = 1,
        kv_channels: int = 64,
        ffn_hidden_size: int = 512,
        norm_epsilon: float = 1e-5,
        rotary_base: float = 10000.0,
        qk_layernorm: bool = True,
        sandwich_norm: bool = True,
        block_output_scale: float = 1.0,
        prenorm_block_scale: float | None = None,
        embedding_scale: bool = True,
        share_embeddings: bool = False,
        max_position_embeddings: int = 4096,
        rope_scaling_factor: float | None = None,
        moe_layers: list[int] | None = None,
        num_experts: int = 0,
        moe_ffn_hidden_size: int = 0,
        moe_shared_ffn_hidden_size: int | None = None,
        moe_shared_expert_gate: bool = False,
        moe_topk: int = 2,
        moe_score_function: str = "softmax",
        moe_pre_softmax: bool = False,
        moe_topk_scaling_factor: float | None = None,
        moe_expert_bias: bool = False,
        moe_router_dtype: str | None = None,
        **kwargs,
    ):
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden_size, num_layers
        self.num_attention_heads, self.num_query_groups = num_attention_heads, num_query_groups
        self.kv_channels, self.ffn_hidden_size = kv_channels, ffn_hidden_size
        self.norm_epsilon, self.rotary_base, self.qk_layernorm = (
            norm_epsilon,
            rotary_base,
            qk_layernorm,
        )
        self.sandwich_norm, self.block_output_scale = sandwich_norm, block_output_scale
        self.prenorm_block_scale = prenorm_block_scale  # without Sandwich Norm: x + α · out
        self.embedding_scale, self.share_embeddings = embedding_scale, share_embeddings
        self.max_position_embeddings = max_position_embeddings
        self.rope_scaling_factor = rope_scaling_factor
        self.moe_layers = list(moe_layers or [0] * num_layers)
        self.num_experts, self.moe_ffn_hidden_size = num_experts, moe_ffn_hidden_size
        self.moe_shared_ffn_hidden_size = moe_shared_ffn_hidden_size
        self.moe_shared_expert_gate, self.moe_topk = moe_shared_expert_gate, moe_topk
        self.moe_score_function, self.moe_pre_softmax = moe_score_function, moe_pre_softmax
        self.moe_topk_scaling_factor = moe_topk_scaling_factor
        self.moe_expert_bias, self.moe_router_dtype = moe_expert_bias, moe_router_dtype
        kwargs["tie_word_embeddings"] = False  # a tied head reads the embedding (forward)
        super().__init__(**kwargs)


def llama3_scaled(inv_freq: torch.Tensor, factor: float, low: float = 1.0, high: float = 4.0,
                  context: float = 8192.0) -> torch.Tensor:  # fmt: skip
    """Llama 3.x RoPE scaling with megatron-core's constants (rotary_pos_embedding.py
    ``_apply_scaling``): frequencies of wavelength under ``context / high`` kept, over
    ``context / low`` divided by ``factor``, in between blended linearly in context/wavelength."""
    wavelen = 2 * math.pi / inv_freq
    s = (context / wavelen - low) / (high - low)
    blended = (1 - s) * inv_freq / factor + s * inv_freq
    divided = torch.where(wavelen > context / low, inv_freq / factor, blended)
    return torch.where(wavelen < context / high, inv_freq, divided)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Weight(nn.Module):
    """A module holding one ``weight`` (megatron's parameter names)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _Sandwich(nn.Module):
    """megatron-md's ``SandwichAdd``: residual + α · RMSNorm(x)."""

    def __init__(self, c: MegatronMDConfig):
        super().__init__()
        self.norm, self.alpha = _Norm(c.hidden_size, c.norm_epsilon), c.block_output_scale

    def forward(self, x, residual):
        return residual + self.alpha * self.norm(x)


class _Attention(nn.Module):
    def __init__(self, c: MegatronMDConfig):
        super().__init__()
        self.np, self.ng, self.hn = c.num_attention_heads, c.num_query_groups, c.kv_channels
        self.linear_qkv = _Weight((self.np + 2 * self.ng) * self.hn, c.hidden_size)
        self.linear_proj = _Weight(c.hidden_size, self.np * self.hn)
        if c.qk_layernorm:
            self.q_layernorm = _Norm(self.hn, c.norm_epsilon)
            self.k_layernorm = _Norm(self.hn, c.norm_epsilon)
        self.qk_norm = c.qk_layernorm

    def forward(self, x, cos, sin, mask=None, cache=None, idx=0):
        b, s, _ = x.shape
        per = self.np // self.ng
        qkv = F.linear(x, self.linear_qkv.weight).view(b, s, self.ng, (per + 2) * self.hn)
        q, k, v = qkv.split([per * self.hn, self.hn, self.hn], dim=-1)
        q = q.reshape(b, s, self.np, self.hn)
        if self.qk_norm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hn]
        if cache is not None:  # the keys and values of every token read so far
            k, v = cache.update(k, v, idx)
        k, v = k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.linear(out.transpose(1, 2).reshape(b, s, -1), self.linear_proj.weight)


class _MLP(nn.Module):
    def __init__(self, c: MegatronMDConfig, ffn: int, gate: bool = False):
        super().__init__()
        self.linear_fc1 = _Weight(2 * ffn, c.hidden_size)
        self.linear_fc2 = _Weight(c.hidden_size, ffn)
        if gate:  # SharedExpertMLP's sigmoid gate
            self.gate_weight = nn.Parameter(torch.zeros(1, c.hidden_size))
        self.gated = gate

    def forward(self, x, prob=None):
        gate, up = F.linear(x, self.linear_fc1.weight).chunk(2, dim=-1)
        h = F.silu(gate) * up
        if prob is not None:  # in the probability's dtype, back to the activation's (MLP.forward)
            h = (h * prob.unsqueeze(-1)).to(x.dtype)
        out = F.linear(h, self.linear_fc2.weight)
        return out * torch.sigmoid(F.linear(x, self.gate_weight)) if self.gated else out


class _Router(nn.Module):
    def __init__(self, c: MegatronMDConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size))
        if c.moe_expert_bias:  # a float32 buffer in megatron; never trained by gradients
            self.expert_bias = nn.Parameter(torch.zeros(c.num_experts), requires_grad=False)
        self.c = c

    def forward(self, x):
        """(probabilities, expert ids), each [tokens, topk]: topk_routing_with_score_function."""
        c, k = self.c, self.c.moe_topk
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(c.moe_router_dtype, x.dtype)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        if c.moe_score_function == "softmax":
            if c.moe_pre_softmax:
                probs, ids = torch.softmax(logits, -1, dtype=torch.float32).topk(k, dim=-1)
            else:
                top, ids = logits.topk(k, dim=-1)
                probs = torch.softmax(top, -1, dtype=torch.float32)
        else:
            if c.moe_score_function == "sigmoid":
                scores = torch.sigmoid(logits.float())
            else:  # sqrtsoftplus
                scores = F.softplus(logits.float()).sqrt()
            if c.moe_expert_bias:
                ids = (scores + self.expert_bias.float()).topk(k, dim=-1).indices
                scores = scores.gather(-1, ids)
            else:
                scores, ids = scores.topk(k, dim=-1)
            probs = scores / (scores.sum(-1, keepdim=True) + 1e-20) if k > 1 else scores
        if c.moe_topk_scaling_factor:
            probs = probs * c.moe_topk_scaling_factor
        return probs.to(logits.dtype), ids


class _Experts(nn.Module):
    def __init__(self, c: MegatronMDConfig):
        super().__init__()
        self.local_experts = nn.ModuleList(
            _MLP(c, c.moe_ffn_hidden_size) for _ in range(c.num_experts)
        )


class _MoE(nn.Module):
    """megatron-core's MoELayer (no token dropping): routed experts plus the shared expert."""

    def __init__(self, c: MegatronMDConfig):
        super().__init__()
        self.router, self.experts = _Router(c), _Experts(c)
        if c.moe_shared_ffn_hidden_size:
            self.shared_experts = _MLP(c, c.moe_shared_ffn_hidden_size, c.moe_shared_expert_gate)
        self.shared = bool(c.moe_shared_ffn_hidden_size)

    def forward(self, x):
        t = x.reshape(-1, x.shape[-1])
        probs, ids = self.router(t)
        out = torch.zeros_like(t)
        for e, expert in enumerate(self.experts.local_experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, expert(t[tok], probs[tok, slot]))
        if self.shared:
            out = out + self.shared_experts(t)
        return out.view_as(x)


class _Layer(nn.Module):
    def __init__(self, c: MegatronMDConfig, moe: bool):
        super().__init__()
        self.input_layernorm = _Norm(c.hidden_size, c.norm_epsilon)
        self.self_attention = _Attention(c)
        self.pre_mlp_layernorm = _Norm(c.hidden_size, c.norm_epsilon)
        self.mlp = _MoE(c) if moe else _MLP(c, c.ffn_hidden_size)
        self.self_attn_bda = self.mlp_bda = None
        if c.sandwich_norm:
            self.self_attn_bda, self.mlp_bda = _Sandwich(c), _Sandwich(c)
        self.alpha = getattr(c, "prenorm_block_scale", None)  # megatron-md's ``ScaledAdd``

    def _add(self, bda, out, x):
        if bda is not None:
            return bda(out, x)
        return x + (out if self.alpha is None else self.alpha * out)

    def forward(self, x, cos, sin, mask=None, cache=None, idx=0):
        out = self.self_attention(self.input_layernorm(x), cos, sin, mask, cache, idx)
        x = self._add(self.self_attn_bda, out, x)
        out = self.mlp(self.pre_mlp_layernorm(x))
        return self._add(self.mlp_bda, out, x)


class _Decoder(nn.Module):
    def __init__(self, c: MegatronMDConfig):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(c, bool(m)) for m in c.moe_layers)
        self.final_layernorm = _Norm(c.hidden_size, c.norm_epsilon)


class _Embedding(nn.Module):
    def __init__(self, c: MegatronMDConfig):
        super().__init__()
        self.word_embeddings = _Weight(c.vocab_size, c.hidden_size)


#: the output's cache field: ``cache`` from transformers 5.x, ``past_key_values`` before
_CACHE_FIELD = next(
    f for f in ("cache", "past_key_values") if f in CausalLMOutputWithPast.__dataclass_fields__
)


class MegatronMDForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegatronMDConfig
    base_model_prefix = "decoder"

    def __init__(self, config: MegatronMDConfig):
        super().__init__(config)
        self.embedding = _Embedding(config)
        self.decoder = _Decoder(config)
        if not config.share_embeddings:
            self.output_layer = _Weight(config.vocab_size, config.hidden_size)
        self.post_init()

    def _init_weights(self, module):  # every weight comes from the exported checkpoint
        pass

    # generate(): the cache is made here, not by transformers from the config (which it reads
    # for names this config does not have, num_hidden_layers among them)
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """The tokens not yet read (all at the first step), the whole mask, the cache."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None and kwargs.get("use_cache", True) is not False:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        return {"input_ids": input_ids[:, past:], "attention_mask": attention_mask, "cache": cache}

    @staticmethod
    def _padding(input_ids, attention_mask, position_ids, past: int = 0):
        """(positions [b or 1, s], attention mask [b or 1, 1, s, past + s] or None) of the ``s``
        tokens read after ``past`` cached ones: causal attention to the sequence's own tokens
        (a padding position attends to itself alone, so nothing becomes NaN), positions
        counted from each sequence's first token. None: plain causal attention from 0."""
        s, dev = input_ids.shape[1], input_ids.device
        padded = attention_mask is not None and not bool(attention_mask.bool().all())
        if position_ids is None:
            if padded:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
            else:
                position_ids = torch.arange(past, past + s, device=dev)[None]
        if not padded and not past:
            return position_ids, None
        keys, rows = torch.arange(past + s, device=dev), torch.arange(past, past + s, device=dev)
        allowed = (keys[None] <= rows[:, None])[None, None]  # [1, 1, s, past + s]
        if padded:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        return position_ids, allowed | (keys[None] == rows[:, None])

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None, **kwargs):
        """Logits of ``input_ids``; with a ``cache`` (``past_key_values``), of the tokens after
        the ones it holds, which it then holds too."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        c = self.config
        x = F.embedding(input_ids, self.embedding.word_embeddings.weight)
        if c.embedding_scale:
            x = x * math.sqrt(c.hidden_size)
        # RoPE as megatron computes it (fp32); no buffer: from_pretrained may build the model on
        # the meta device and would leave a non-persistent buffer unset
        dev, hn = input_ids.device, c.kv_channels
        inv_freq = 1.0 / (
            c.rotary_base ** (torch.arange(0, hn, 2, dtype=torch.float32, device=dev) / hn)
        )
        if c.rope_scaling_factor:
            inv_freq = llama3_scaled(inv_freq, c.rope_scaling_factor)
        past = cache.get_seq_length() if cache is not None else 0
        pos, mask = self._padding(input_ids, attention_mask, position_ids, past)
        freqs = pos.float()[..., None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [b or 1, s, 1, hn]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for idx, layer in enumerate(self.decoder.layers):
            x = layer(x, cos, sin, mask, cache, idx)
        x = self.decoder.final_layernorm(x)
        head = self.embedding.word_embeddings if c.share_embeddings else self.output_layer
        logits = F.linear(x, head.weight)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
