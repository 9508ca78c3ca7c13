"""Non-finite values never reach a checkpoint, and a run whose state went non-finite stops with
the parameter and the tensor named.

- In the step: each MD optimizer keeps a one-element *probe* on the device (``MDInner.probe``:
  0, NaN once a reduced sphere norm, gain-gradient sum or gain went non-finite). It rides in
  megatron's gradient-norm reduction (``wrappers.md_grads_for_grad_norm``), which megatron
  reads on the host anyway: no synchronization of its own. A non-finite gradient norm with a
  bad probe stops the run before the next update lands (``check_grad_norm``).
- Before every save (``check_before_save``): the probes and every model parameter, agreed over
  the ranks; non-finite, the save is refused, so the latest checkpoint stays the last good one
  (this also stops megatron's rerun machinery from saving a NaN state and looping on it).
- After every load (``check_loaded``): every parameter and optimizer state tensor; a damaged
  checkpoint is refused with the earlier iterations to resume from.
- With megatron's NaN check off (``--no-check-for-nan-in-loss-and-grad``) ``guard`` skips steps
  whose gradients are not finite; megatron's loop counts them as skipped iterations.
"""

from __future__ import annotations

import functools
import math

import torch

from megatron.md import errors
from megatron.md.leaves import leaf_optimizers, md_leaves

#: what each state field is, for messages
LABELS = {
    "direction": "direction Ŵ",
    "radius": "sphere radius",
    "exp_avg": "direction's Adam first moment",
    "exp_avg_sq": "direction's Adam second moment",
    "momentum_buffer": "direction's Muon momentum",
    "step": "step count",
}


def label(field: str) -> str:
    if field in LABELS:
        return LABELS[field]
    for gain in ("gain_row", "gain_col", "gain_scalar", "gain_a", "gain_b"):
        if field.startswith(gain):
            what = {"gain_row": "row gains", "gain_col": "column gains",
                    "gain_scalar": "scalar gain", "gain_a": "low-rank gain factor A",
                    "gain_b": "low-rank gain factor B"}[gain]  # fmt: skip
            rest = field[len(gain) :]
            return what + {"": "", "_exp_avg": "' Adam first moment",
                           "_exp_avg_sq": "' Adam second moment"}.get(rest, rest)  # fmt: skip
    return field


def _bad(t) -> bool:
    return torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())


def describe(model_chunks, optimizer) -> list[str]:
    """Every non-finite tensor of this rank (parameter: tensor), host-side (a failure path):
    MD state first, then 1-D parameters' Adam state, then the weights themselves."""
    from megatron.md import maps

    out = []
    for leaf in md_leaves(optimizer) if optimizer is not None else []:
        inner = leaf.optimizer
        for main, slot in inner.slots.items():
            fields = {"direction": inner.direction_of(main), **inner.md_state[main],
                      **inner.state.get(main, {})}  # fmt: skip
            name = slot.name.removeprefix("module.")
            out += [f"{name}: its {label(k)}" for k, t in fields.items() if _bad(t)]
            for g in slot.md.gain_names:  # finite raw gains whose gain φ(ĝ) overflows
                raw = inner.md_state[main][g]
                if not _bad(raw) and _bad(maps.phi(raw, slot.md.spec.gain_map)):
                    out.append(f"{name}: its {label(g)} (φ(ĝ) overflows)")
    for leaf in leaf_optimizers(optimizer) if optimizer is not None else []:
        inner = getattr(leaf, "optimizer", None)
        slots = getattr(inner, "slots", {})
        for group in getattr(inner, "param_groups", []):
            for p in group["params"]:
                if p in slots:
                    continue
                state = getattr(inner, "state", {}).get(p, {})
                out += [f"a 1-D parameter of shape {tuple(p.shape)}: its Adam {k}"
                        for k, t in state.items() if _bad(t)]  # fmt: skip
    for chunk in model_chunks or []:
        for name, p in chunk.named_parameters():
            if _bad(p.data):
                out.append(f"{name.removeprefix('module.')}: the weight itself")
    return out


def everyone(items: list, group=None) -> list:
    """``items`` of every rank of ``group``, in one list (alone: this rank's)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return items
    world = dist.get_world_size(group)
    got: list = [None] * world
    dist.all_gather_object(got, items, group=group)
    return [x for part in got for x in part]


def _any(flag: bool, device) -> bool:
    """``flag`` or-ed over all ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _probes_bad(optimizer) -> bool:
    return any(not bool(torch.isfinite(o.optimizer.probe).all()) for o in md_leaves(optimizer))


def _params_bad(model_chunks) -> bool:
    ps = [p.data for c in model_chunks or [] for p in c.parameters() if p.is_floating_point()]
    if not ps:
        return False
    return not bool(torch.isfinite(torch.stack(torch._foreach_norm(ps))).all())


def check_before_save(model_chunks, optimizer, iteration: int, save: str) -> None:
    """Refuse a save of non-finite weights or MD state (collective: every rank saves)."""
    device = next((p.device for c in model_chunks or [] for p in c.parameters()), "cpu")
    bad = _params_bad(model_chunks) or (optimizer is not None and _probes_bad(optimizer))
    if not _any(bad, device):
        return
    import os

    from megatron.md.train.ckpt_checks import TRACKER

    what = everyone(describe(model_chunks, optimizer))
    tracker = os.path.join(save, TRACKER)
    latest = open(tracker).read().strip() if os.path.isfile(tracker) else None
    kept = (f"the latest checkpoint in {save} (iteration {latest}) is still the last good "
            "one. Resume from it (a requeue does) with a lower LR or another seed"
            if latest else f"{save} holds no earlier checkpoint")  # fmt: skip
    errors.fail(
        f"the state after iteration {iteration} is not finite ({_names(what)}); it was not "
        f"saved, and {kept}; if it recurs, report the tensor"
    )


def check_loaded(model_chunks, optimizer, path: str, load: str) -> None:
    """Refuse a checkpoint whose weights or optimizer state hold non-finite values."""
    from megatron.md.train.ckpt_checks import iterations

    device = next((p.device for c in model_chunks or [] for p in c.parameters()), "cpu")
    mine = describe(model_chunks, optimizer)
    if not _any(bool(mine), device):
        return
    what = everyone(mine)
    earlier = [i for i in iterations(load) if f"iter_{i:07d}" not in path]
    way = (f"resume an earlier one with --ckpt-step N (this directory holds "
           f"{', '.join(map(str, earlier[-5:]))})" if earlier else "no earlier checkpoint is "
           "in this directory: start from another run's checkpoint")  # fmt: skip
    errors.fail(f"--load: checkpoint {path} holds non-finite values ({_names(what)}); {way}")


def _names(what: list[str], n: int = 3) -> str:
    more = f", and {len(what) - n} more" if len(what) > n else ""
    return "; ".join(what[:n]) + more


def check_grad_norm(norm, grads_for_norm, group) -> None:
    """After megatron's gradient-norm reduction: a non-finite norm (read on the host there)
    with a bad MD probe among the tensors stops the run, naming what went non-finite. Every
    rank of ``group`` saw the same norm, so all of them take part."""
    if not isinstance(norm, float) or math.isfinite(norm):
        return  # (TE/apex keep the norm on the device: the save-time check covers that path)
    probes = [g for g in grads_for_norm if getattr(g, "md_probe_of", None) is not None]
    mine = []
    for probe in probes:
        if not bool(torch.isfinite(probe).all()):
            leaf = probe.md_probe_of
            mine += describe([], leaf) or [f"{type(leaf).__name__}: MD state"]
    what = everyone(mine, group)
    if what:
        errors.fail(
            f"MD state went non-finite in the last step ({_names(what)}); the run stops before "
            "the next update lands, and the latest checkpoint is the last good one. Resume "
            "from it (a requeue does) with a lower LR; if it recurs, report the tensor"
        )


def wrap_grad_norm(orig):
    """megatron's ``get_grad_norm_fp32`` followed by ``check_grad_norm``."""

    @functools.wraps(orig)
    def get_grad_norm_fp32(grads_for_norm, *args, **kwargs):
        norm = orig(grads_for_norm, *args, **kwargs)
        group = kwargs.get("grad_stats_parallel_group", args[1] if len(args) > 1 else None)
        check_grad_norm(norm, list(grads_for_norm) if isinstance(grads_for_norm, list) else [],
                        group)  # fmt: skip
        return norm

    return get_grad_norm_fp32


def guard(opt) -> None:
    """Wrap ``opt.prepare_grads`` (megatron's step returns (False, None, None) when it reports
    found-inf: ``Float16OptimizerWithFloat16Params.step``, ``FP32Optimizer.step``,
    ``ChainedOptimizer.step``) with a finiteness check of every main grad, agreed across all
    ranks with one all-reduce. A step with non-finite gradients is skipped, unless MD's own
    state is what went non-finite: skipping would not mend it, so the run stops naming it."""
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
        skip = bad.item() > 0  # one read on the host (a GPU's synchronize)
        if skip:
            what = everyone(describe([], opt) if md_leaves(opt) else [])
            if what:
                errors.fail(
                    f"MD state is not finite ({_names(what)}), and so are the gradients: "
                    "skipping steps would not mend it; the latest checkpoint is the last good "
                    "one. Resume from it with a lower LR; if it recurs, report the tensor"
                )
        guard.skipped += int(skip)
        return bool(found) or skip

    opt.prepare_grads = prepare_grads


guard.skipped = 0  # steps skipped in this process (megatron's log counts them per interval)
