"""Named model sizes: every row of the paper's dense and MoE tables, plus a tiny CPU preset.

A preset is a list of megatron flags placed *before* the user's own, so any flag given on the
command line overrides it. Architecture conventions shared by all presets (RoPE 5e5, SwiGLU,
RMSNorm 1e-5, GQA, QK-norm, untied embeddings, no biases/dropout) are in ``COMMON``.
"""

from __future__ import annotations

from dataclasses import dataclass

VOCAB = 131072  # the paper's Apertus v1 tokenizer, padded


@dataclass(frozen=True)
class Preset:
    """One model size (recipe §3 dense table / §4 MoE ladder)."""

    hidden: int
    """Model width d."""
    layers: int
    """Number of transformer layers L (MoE: dense + MoE layers)."""
    heads: int
    """Attention heads."""
    kv_groups: int
    """GQA key/value groups."""
    ffn: int
    """SwiGLU hidden size of dense layers (MoE: of the first, dense layer, as the authors' runs:
    2.5d, 4096 at d = 1536; the paper does not give it)."""
    head_dim: int = 128
    """Attention head dimension (dense 128, MoE 64)."""
    experts: int = 0
    """Routed experts (0: dense model)."""
    expert_ffn: int = 0
    """SwiGLU hidden size per routed expert."""
    shared_ffn: int = 0
    """SwiGLU hidden size of the shared expert (half a routed expert)."""
    vocab: int = VOCAB
    """Vocabulary size the paper's parameter counts assume."""
    params: float = 0.0
    """The paper's total parameter count (checked by the tests)."""
    active: float = 0.0
    """The paper's active parameter count (MoE)."""
    sandwich: bool = True
    """Sandwich Norm on block outputs (dense yes, MoE no: the paper's MoE fork had none)."""
    rope_scaling: bool = False
    """Llama 3.x RoPE scaling, factor 8 (``--rope-scaling``): the paper's dense sizes, as the
    authors' dense runs (gainz ``submissions/submit.sh`` passes ``--use-rope-scaling``; the
    paper's text names RoPE with base 5e5 alone); not the MoE ladder nor the 150M re-warming
    model (feat/scaling-sweeps ``lib/common.sh``), nor the laptop presets."""

    def flags(self) -> list[str]:
        f = [
            f"--num-layers={self.layers}",
            f"--hidden-size={self.hidden}",
            f"--num-attention-heads={self.heads}",
            f"--num-query-groups={self.kv_groups}",
            f"--kv-channels={self.head_dim}",
            f"--ffn-hidden-size={self.ffn}",
        ]
        if self.experts:
            dense_first = "[0]+[1]*" + str(self.layers - 1)
            f += [
                f"--num-experts={self.experts}",
                f"--moe-layer-freq={dense_first}",
                f"--moe-ffn-hidden-size={self.expert_ffn}",
                f"--moe-shared-expert-intermediate-size={self.shared_ffn}",
                "--moe-router-topk=2",
                "--moe-router-score-function=sigmoid",
                "--moe-router-enable-expert-bias",
                "--moe-router-bias-update-rate=1e-3",
                "--moe-router-load-balancing-type=seq_aux_loss",
                "--moe-aux-loss-coeff=1e-3",
                "--moe-router-topk-scaling-factor=2.5",
                "--moe-router-dtype=fp32",
                "--moe-token-dispatcher-type=alltoall",
            ]
        if not self.sandwich:
            f.append("--no-sandwich-norm")
        if self.rope_scaling:
            f.append("--rope-scaling")
        return f


def _dense(d, layers, heads, params):
    return Preset(d, layers, heads, heads // 2, 4 * d, params=params, rope_scaling=True)


def _moe(d, dense, moe, heads, kv, expert_ffn, active, total, ffn=None):
    return Preset(
        d,
        dense + moe,
        heads,
        kv,
        ffn or 5 * d // 2,
        head_dim=64,
        experts=64,
        expert_ffn=expert_ffn,
        shared_ffn=expert_ffn // 2,
        params=total,
        active=active,
        sandwich=False,
    )


PRESETS: dict[str, Preset] = {
    # dense (recipe §3): base, width, depth, width+depth
    "dense-181M": _dense(512, 12, 4, 181e6),
    "dense-307M": _dense(768, 12, 6, 307e6),
    "dense-457M": _dense(1024, 12, 8, 457e6),
    "dense-827M": _dense(1536, 12, 12, 827e6),
    "dense-1.29B": _dense(2048, 12, 16, 1.29e9),
    "dense-1.54B": _dense(2048, 16, 16, 1.54e9),
    "dense-205M": _dense(512, 18, 4, 205e6),
    "dense-229M": _dense(512, 24, 4, 229e6),
    "dense-252M": _dense(512, 30, 4, 252e6),
    "dense-361M": _dense(768, 18, 6, 361e6),
    "dense-646M": _dense(1024, 24, 8, 646e6),
    # the continual/re-warming model ("150M": d=512, L=8, head dim 64 in the paper; the rest
    # as the authors' runs, feat/scaling-sweeps _research/launch/framework/sizes/150m.sh: 8
    # heads, 2 KV groups, d_ff 2.5d, the MoE ladder's conventions, so no Sandwich Norm): 155.2M
    # with the 131k vocabulary, a rounded "150M" the count test does not check (params=0)
    "dense-150M": Preset(512, 8, 8, 2, 1280, head_dim=64, sandwich=False),
    # MoE ladder (recipe §4): active / total; the dense first layer's d_ff as the authors'
    # runs (feat/scaling-sweeps _research/launch/framework/sizes/*-moe.sh FFN_HIDDEN)
    "moe-0.27B-1.2B": _moe(768, 1, 13, 12, 4, 512, 0.27e9, 1.2e9),
    "moe-0.41B-2.5B": _moe(1024, 1, 19, 16, 4, 576, 0.41e9, 2.5e9),
    "moe-0.58B-4.1B": _moe(1280, 1, 21, 20, 4, 704, 0.58e9, 4.1e9),
    "moe-0.81B-6.7B": _moe(1536, 1, 23, 24, 8, 896, 0.81e9, 6.7e9, ffn=4096),
    # laptop scale (no paper counterpart): 4 layers, d=128, head dim 64, vocab of the demo corpus
    "tiny": Preset(128, 4, 2, 1, 512, head_dim=64, vocab=8192),
    "tiny-moe": Preset(
        128,
        4,
        2,
        1,
        512,
        head_dim=64,
        experts=8,
        expert_ffn=128,
        shared_ffn=64,
        vocab=8192,
        sandwich=False,
    ),
}

#: Conventions of every preset (recipe §3): passed before the preset's own flags.
COMMON = [
    "--paper-arch",
    "--position-embedding-type=rope",
    "--rotary-base=500000",
    "--swiglu",
    "--normalization=RMSNorm",
    "--norm-epsilon=1e-5",
    "--group-query-attention",
    "--qk-layernorm",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--attention-dropout=0",
    "--hidden-dropout=0",
]


def preset_flags(name: str) -> list[str]:
    if name not in PRESETS:
        raise ValueError(f"--preset={name!r} is not one of {', '.join(PRESETS)}")
    return COMMON + PRESETS[name].flags()


def count_params(p: Preset, vocab: int | None = None) -> tuple[int, int]:
    """(total, active) parameters of a preset, counted from its shapes (norm weights included).

    Mirrors what megatron-core builds for these flags; ``tests/test_presets.py`` checks it
    against a model built on the meta device."""
    v = p.vocab if vocab is None else vocab
    d, hd = p.hidden, p.head_dim
    attn = d * (p.heads + 2 * p.kv_groups) * hd + p.heads * hd * d
    norms = 2 * d + 2 * hd + (2 * d if p.sandwich else 0)  # pre-norms, QK-norm, sandwich
    dense_mlp = 3 * d * p.ffn
    total = active = 2 * v * d + d  # embeddings, LM head, final norm
    for i in range(p.layers):
        total += attn + norms
        active += attn + norms
        if p.experts and i > 0:
            expert = 3 * d * p.expert_ffn
            shared = 3 * d * p.shared_ffn
            router = p.experts * d + p.experts  # weight + expert bias (a buffer: not counted)
            total += p.experts * expert + shared + router - p.experts
            active += 2 * expert + shared + router - p.experts
        else:
            total += dense_mlp
            active += dense_mlp
    return total, active
