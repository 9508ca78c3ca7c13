"""nGPT as megatron runs it (``--arch ngpt``, megatron/md/train/ngpt.py) against nGPT written
out in plain torch from its published equations, on a trained checkpoint's weights: one
process rebuilds the run's model (as tools/evaluate.py does), feeds it a batch, and prints the
largest logit difference and the logits' scale as JSON.

    python tests/distributed/ngpt_check.py CHECKPOINT_DIR
"""

import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.md import cpu_mode  # noqa: E402

cpu_mode.maybe_activate()  # before megatron: CPU mode on a machine without CUDA
from megatron.md.evaluation import restore  # noqa: E402


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def rope(x, base):
    """megatron's RoPE (rotate-half, not interleaved) on [b, t, heads, hd]."""
    hd, t = x.shape[-1], x.shape[1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(t, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], -1)[None, :, None, :]
    x1, x2 = x.chunk(2, -1)
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


def reference(p, ids, a):
    """nGPT (Loshchilov et al. 2024, section 2) in float64; p: the model's parameters by name."""
    d, hd, heads = a.hidden_size, a.kv_channels, a.num_attention_heads
    groups = a.num_query_groups if a.group_query_attention else heads
    alpha_mult = a.ngpt_alpha_init * (math.sqrt(d) if a.ngpt_residual_scale == "1/sqrt(d)" else 1)
    b, t = ids.shape
    h = p["embedding.word_embeddings.weight"][ids]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(a.num_layers):
        L = f"decoder.layers.{i}."
        qkv = (h @ p[L + "self_attention.linear_qkv.weight"].T).view(b, t, groups, -1)
        per = heads // groups
        q, k, v = qkv.split([per * hd, hd, hd], -1)
        q = rope(q.reshape(b, t, heads, hd), a.rotary_base)
        k, v = rope(k, a.rotary_base), v
        s_qk = (p[L + "self_attention.core_attention.s_qk.scale"] * math.sqrt(d)).view(heads, hd)
        out = []
        for j in range(heads):
            g = j // per
            qj, kj = s_qk[j] * unit(q[:, :, j]), s_qk[j] * unit(k[:, :, g])
            score = qj @ kj.transpose(1, 2) * math.sqrt(hd)
            att = score.masked_fill(~causal, float("-inf")).softmax(-1)
            out.append(att @ v[:, :, g])
        y = torch.cat(out, -1) @ p[L + "self_attention.linear_proj.weight"].T
        alpha = (p[L + "self_attn_bda.alpha.scale"] * alpha_mult).abs()
        h = unit(unit(h) + alpha * (unit(y) - unit(h)))
        gate, up = (h @ p[L + "mlp.linear_fc1.weight"].T).chunk(2, -1)
        nu = gate * p[L + "mlp.linear_fc1.s_nu.scale"] * math.sqrt(d)
        u = up * p[L + "mlp.linear_fc1.s_u.scale"]
        y = (F.silu(nu) * u) @ p[L + "mlp.linear_fc2.weight"].T
        alpha = (p[L + "mlp_bda.alpha.scale"] * alpha_mult).abs()
        h = unit(h + alpha * (unit(y) - h))
    return (h @ p["output_layer.weight"].T) * p["s_z.scale"] * math.sqrt(d)


def main():
    saved, _ = restore.saved_args(sys.argv[1])
    net, args, _ = restore.build(restore.argv_for(saved, sys.argv[1], None, False), saved)
    ids = torch.randint(0, args.padded_vocab_size, (2, args.seq_length),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    pos = torch.arange(args.seq_length).expand_as(ids)
    with torch.no_grad():
        got = net(ids, pos, None).double()
        p = {k.removeprefix("module."): v.double() for k, v in net.named_parameters()}
        want = reference(p, ids, args)
    print(json.dumps({"max_abs": float((got - want).abs().max()),
                      "logit_rms": float(want.square().mean().sqrt()),
                      "params": sorted(p)}))  # fmt: skip


if __name__ == "__main__":
    main()
