"""Export a trained checkpoint to a Hugging Face model folder (safetensors, config, and a
custom modeling file loaded with ``trust_remote_code=True``).

    python tools/export_hf.py --load runs/dense-181M-muonmd --out hf/dense-181M-muonmd
    python -c "from transformers import AutoModelForCausalLM as M; \\
        m = M.from_pretrained('hf/dense-181M-muonmd', trust_remote_code=True)"

The model is rebuilt from the run's saved args and loaded on one process exactly as
``tools/evaluate.py`` does (any saved parallel layout, MD or not), then written with
megatron's parameter names (``megatron/md/export``). The paper's dense and MoE architectures:
anything the HF model cannot compute (biases, LayerNorm, partial RoPE, token dropping, ...) is
refused by name before any weight is read. ``--out`` must not exist (nothing is overwritten);
the folder appears only when complete. ``--check`` loads it back with transformers and
compares its logits with megatron's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="run directory (the run's --save)")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration (default: the latest)")
    p.add_argument("--out", required=True, help="the folder to write (must not exist)")
    p.add_argument("--tokenizer-model", default=None,
                   help="the tokenizer folder, where it moved since training")  # fmt: skip
    p.add_argument(
        "--check", action="store_true", help="load it with transformers; compare the logits"
    )
    a = p.parse_args(argv)
    if Path(a.out).exists():
        p.error(f"--out {a.out} exists: give a new folder (nothing is overwritten)")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    from megatron.md import cpu_mode

    cpu_mode.maybe_activate()  # first: CPU mode on a machine without CUDA, before megatron
    from megatron.md.evaluation import restore
    from megatron.md.export import hf_export

    saved, path = restore.saved_args(a.load, a.ckpt_step)
    missing = hf_export.unsupported(saved)
    if missing:
        raise SystemExit(
            "export_hf: error: the exported model cannot compute: " + "; ".join(missing)
        )
    flags = restore.argv_for(saved, a.load, a.ckpt_step, False, a.tokenizer_model)
    net, args, iteration = restore.build(flags, saved)

    import megatron.core
    import torch

    tok = args.tokenizer_model if args.tokenizer_type == "HuggingFaceTokenizer" else None
    source = {"checkpoint": path, "iteration": iteration, "torch": torch.__version__,
              "megatron_core": megatron.core.__version__}  # fmt: skip
    out, cfg, weights = Path(a.out), hf_export.config(args), hf_export.tensors(net.state_dict())
    wrong = hf_export.mismatched(cfg, weights)
    if wrong:
        raise SystemExit("export_hf: error: the weights do not fit the HF model: "
                         + "; ".join(wrong[:8]) + (" ..." if len(wrong) > 8 else ""))  # fmt: skip
    hf_export.write(out, cfg, weights, tok, source)
    print(f"[export_hf] wrote {out} (iteration {iteration} of {a.load})", flush=True)
    if a.check:
        check(net, out, args)


def check(net, out: Path, args) -> None:
    """The exported folder through ``AutoModelForCausalLM.from_pretrained`` against megatron's
    model on random tokens, relative difference of the logits. A bf16 run first in bf16 (≤ 2e-2;
    for an MoE model only reported: bf16 rounding near a tie of the router's scores sends a
    token to another expert, and the difference grows from there), then both models upcast to
    float32, the checkpoint's weights exact in it: ≤ 1e-4, every run (the weights and the
    computation are megatron's)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    n = min(64, args.seq_length)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.padded_vocab_size, (2, n), generator=g)
    device = next(net.parameters()).device
    tokens, pos = tokens.to(device), torch.arange(n, device=device).expand(2, n)
    hf.to(device)

    def rel() -> float:
        with torch.no_grad():
            ours, theirs = net(tokens, pos, None).float(), hf(tokens).logits.float()
        return float((ours - theirs).norm() / ours.norm())

    if args.bf16:
        r = rel()
        moe = bool(args.num_experts)
        print(f"[export_hf] logits in bf16 vs megatron's: relative difference {r:.2e}"
              + (" (MoE: reported, not checked)" if moe else ""))  # fmt: skip
        if not moe and not r <= 2e-2:
            raise SystemExit(f"export_hf: error: the exported model's bf16 logits differ ({r:.2e})")
        net.float(), hf.float()
    r, both = rel(), " (both in float32)" if args.bf16 else ""
    print(
        f"[export_hf] logits of the exported model vs megatron's{both}: relative difference {r:.2e}"
    )
    if not r <= 1e-4:
        raise SystemExit(f"export_hf: error: the exported model's logits differ ({r:.2e})")


if __name__ == "__main__":
    main()
