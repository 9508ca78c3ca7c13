"""The LR schedule of a run resumed with ``--no-load-optim``: megatron-core 0.19.2 skips the
schedule's state with the optimizer's (training/checkpointing.py:2598, inside ``if not
no_load_optim``), so the resumed run kept the checkpoint's iteration but began its warmup and
decay again at step 0 (measured on CPU, 2026-11-29: AdamW at LR 1e-2 over 20 iterations resumed
at 10 with LR 9.5e-3, the schedule's first step, where the run it continues had 4.5e-3, and
would have ended at iteration 20 half-way down its decay). ``--no-load-optim`` is the way out
this project's refusals name for another optimizer and for a checkpoint saved without one
(``--no-save-optim``), so the schedule continues at the checkpoint's place; ``--finetune``
(iteration 0, a new schedule) is megatron's own."""

from __future__ import annotations


def steps_done(common: dict | None, args) -> int:
    """The schedule's steps (samples) at the loaded checkpoint: its saved scheduler's
    ``num_steps``, else (saved with ``--no-save-optim``, or megatron's torch format) the samples
    it trained on (megatron steps the schedule on every update but the skipped ones)."""
    saved = (common or {}).get("opt_param_scheduler") or {}
    if "num_steps" in saved:
        return int(saved["num_steps"])
    return int(args.consumed_train_samples - getattr(args, "skipped_train_samples", 0))


def continue_after_weights_only(scheduler, common: dict | None, args, iteration: int) -> str | None:
    """After megatron loaded a checkpoint with ``--no-load-optim`` (not ``--finetune``): put
    ``scheduler``, still at step 0, at the checkpoint's step with this run's schedule values.
    Returns the line to print, or None where there was nothing to do."""
    if scheduler is None or args.finetune or not args.no_load_optim or scheduler.num_steps:
        return None
    steps = steps_done(common, args)
    if steps <= 0:
        return None
    scheduler.step(increment=steps)
    return (f"--no-load-optim: the LR schedule continues at the checkpoint's step ({steps} "
            f"samples, iteration {iteration}; megatron would restart it at 0)")  # fmt: skip
