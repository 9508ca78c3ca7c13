"""Tiny CPU comparison: a megatron-core GPT trained with AdamW, AdamMD, Muon and MuonMD.

Byte-level language modelling on a built-in public-domain text (no tokenizer, no download).
Each optimizer trains the same model from the same init on the same batches; the script prints
the final train loss, the held-out loss and the time per step. Single process, CPU mode.

    python examples/md_decoupling/cpu_demo.py [--steps 60]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch

from megatron.md import cpu_mode

cpu_mode.maybe_activate()  # CPU mode when there is no GPU, before megatron is imported
from megatron.md.config import MDConfig  # noqa: E402
from megatron.md.optimizer import MDOptimizer, model_param_groups  # noqa: E402
from megatron.md.roles import tag_qkv  # noqa: E402
from megatron.md.testing import tiny_gpt  # noqa: E402

# The Declaration of Independence (1776), public domain.
TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the "
    "political bands which have connected them with another, and to assume among the powers of "
    "the earth, the separate and equal station to which the Laws of Nature and of Nature's God "
    "entitle them, a decent respect to the opinions of mankind requires that they should declare "
    "the causes which impel them to the separation. We hold these truths to be self-evident, that "
    "all men are created equal, that they are endowed by their Creator with certain unalienable "
    "Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure these "
    "rights, Governments are instituted among Men, deriving their just powers from the consent of "
    "the governed, That whenever any Form of Government becomes destructive of these ends, it is "
    "the Right of the People to alter or to abolish it, and to institute new Government, laying "
    "its foundation on such principles and organizing its powers in such form, as to them shall "
    "seem most likely to effect their Safety and Happiness. Prudence, indeed, will dictate that "
    "Governments long established should not be changed for light and transient causes; and "
    "accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils "
    "are sufferable, than to right themselves by abolishing the forms to which they are "
    "accustomed. But when a long train of abuses and usurpations, pursuing invariably the same "
    "Object evinces a design to reduce them under absolute Despotism, it is their right, it is "
    "their duty, to throw off such Government, and to provide new Guards for their future "
    "security."
)

# (name, base optimizer, MD on, matrix LR, weight decay, warmup steps): the paper's recipe.
RUNS = (
    ("AdamW", "adam", False, 3e-3, 0.1, 10),
    ("AdamMD", "adam", True, 3e-2, 0.0, 0),
    ("Muon", "muon", False, 2e-2, 0.1, 0),
    ("MuonMD", "muon", True, 3e-2, 0.0, 0),
)


def batches(data: torch.Tensor, n: int, batch: int, seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        idx = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[i : i + seq + 1] for i in idx])
        yield x[:, :-1], x[:, 1:]


def lm_loss(model, tokens, labels) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
    return model(tokens, pos, attention_mask=None, labels=labels).mean()


def train_one(name, base, md_on, lr, wd, warmup, args, train, val):
    model = tiny_gpt(args.seed, args.hidden, args.layers, args.seq)
    tag_qkv(model)  # Muon splits Q/K/V as megatron's does by default
    groups = model_param_groups(model, lr, embedding_lr=3e-3, output_lr=1e-3)
    opt = MDOptimizer(groups, md=MDConfig() if md_on else None, base=base, weight_decay=wd)
    base_lrs = [g["lr"] for g in opt.param_groups]
    times, losses = [], []
    for step, (x, y) in enumerate(batches(train, args.steps, args.batch, args.seq, args.seed)):
        # linear warmup (baselines) then linear decay to 10% (paper: to min-LR)
        frac = min(1.0, (step + 1) / warmup) if warmup else 1.0
        frac *= 1 - 0.9 * step / args.steps
        for g, lr0 in zip(opt.param_groups, base_lrs):
            g["lr"] = lr0 * frac
        t0 = time.perf_counter()
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    with torch.no_grad():
        vl = [lm_loss(model, x, y).item() for x, y in batches(val, 8, args.batch, args.seq, 7)]
    tail = losses[-5:]
    ms = 1e3 * sorted(times[1:])[len(times[1:]) // 2]
    return sum(tail) / len(tail), sum(vl) / len(vl), ms


def main(argv=None) -> None:
    logging.getLogger("megatron").setLevel(logging.ERROR)  # GPTModel deprecation notice
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="training steps per optimizer")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    cut = int(0.9 * len(data))
    train, val = data[:cut], data[cut:]
    print(
        f"Training a {args.layers}-layer d={args.hidden} megatron-core GPT (byte-level, "
        f"{len(data)} bytes of text) for {args.steps} steps with each optimizer.\n"
    )
    print(f"{'optimizer':<9} {'matrix LR':>9} {'train loss':>10} {'val loss':>9} {'ms/step':>8}")
    for name, base, md_on, lr, wd, warmup in RUNS:
        tr, vl, ms = train_one(name, base, md_on, lr, wd, warmup, args, train, val)
        print(f"{name:<9} {lr:>9.0e} {tr:>10.4f} {vl:>9.4f} {ms:>8.1f}")
    print(
        "\nLosses are nats per byte (uniform = 5.545). MD runs use weight decay 0 and no warmup, "
        "as in the paper; the step time is the median over steps (includes forward/backward)."
    )


if __name__ == "__main__":
    main()
