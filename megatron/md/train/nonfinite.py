"""NaN/Inf gradients are never applied. With megatron's check on (the default,
``--check-for-nan-in-loss-and-grad``) the run stops at the first one; with it off
(``--no-check-for-nan-in-loss-and-grad``) ``guard`` makes the optimizer skip that step, which
megatron's loop counts as a skipped iteration (its LR schedule does not advance)."""

from __future__ import annotations

import functools

import torch


def guard(opt) -> None:
    """Wrap ``opt.prepare_grads`` (megatron's step returns (False, None, None) when it reports
    found-inf: optimizer.py:820, 1309, 1862) with a finiteness check of every main grad, agreed
    across all ranks with one all-reduce."""
    from megatron.md.wrappers import leaf_optimizers

    orig = opt.prepare_grads

    @functools.wraps(orig)
    def prepare_grads() -> bool:
        found = orig()
        grads = [p.grad for o in leaf_optimizers(opt) for p in o.get_parameters()
                 if p.grad is not None]  # fmt: skip
        device = grads[0].device if grads else torch.device("cpu")
        bad = torch.zeros(1, device=device)
        for g in grads:
            bad += (~torch.isfinite(g)).any()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        guard.skipped += int(bad.item() > 0)
        return bool(found) or bad.item() > 0

    opt.prepare_grads = prepare_grads


guard.skipped = 0  # steps skipped in this process (megatron's log counts them per interval)
