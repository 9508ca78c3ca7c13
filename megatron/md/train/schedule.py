"""The LR schedule: its flags checked at start-up (``check_flags``), and its place in a run
resumed with ``--no-load-optim`` (``continue_after_weights_only``).

A run resumed with ``--no-load-optim``: megatron-core 0.19.2 skips the
schedule's state with the optimizer's (training/checkpointing.py:2598, inside ``if not
no_load_optim``), so the resumed run kept the checkpoint's iteration but began its warmup and
decay again at step 0 (measured on CPU, 2026-11-29: AdamW at LR 1e-2 over 20 iterations resumed
at 10 with LR 9.5e-3, the schedule's first step, where the run it continues had 4.5e-3, and
would have ended at iteration 20 half-way down its decay). ``--no-load-optim`` is the way out
this project's refusals name for another optimizer and for a checkpoint saved without one
(``--no-save-optim``), so the schedule continues at the checkpoint's place; ``--finetune``
(iteration 0, a new schedule) is megatron's own."""

from __future__ import annotations


def steps_done(saved: dict, args) -> int:
    """The schedule's steps (samples) at the loaded checkpoint: ``saved`` (its scheduler's
    state) ``num_steps``, else (saved with ``--no-save-optim``, or megatron's torch format) the
    samples it trained on less those of ``--iterations-to-skip`` (an update megatron dropped for
    a non-finite gradient did not step the schedule either, and is not known here: the
    schedule is then that many batches ahead)."""
    if "num_steps" in saved:
        return int(saved["num_steps"])
    return int(args.consumed_train_samples - getattr(args, "skipped_train_samples", 0))


def continue_after_weights_only(scheduler, common: dict | None, args, iteration: int) -> str | None:
    """After megatron loaded a checkpoint with ``--no-load-optim`` (not ``--finetune``): put
    ``scheduler``, still at step 0, at the checkpoint's step with this run's schedule values
    (the checkpoint's with ``--use-checkpoint-opt_param-scheduler``, where it saved them).
    Returns the line to print, or None where there was nothing to do."""
    if scheduler is None or args.finetune or not args.no_load_optim or scheduler.num_steps:
        return None
    saved = (common or {}).get("opt_param_scheduler") or {}
    if saved and getattr(args, "use_checkpoint_opt_param_scheduler", False):
        scheduler.load_state_dict(saved)  # (megatron's own load: its values and step)
        return (f"--no-load-optim --use-checkpoint-opt_param-scheduler: the checkpoint's LR "
                f"schedule, at its step ({scheduler.num_steps} samples, iteration "
                f"{iteration})")  # fmt: skip
    steps = steps_done(saved, args)
    if steps <= 0:
        return None
    scheduler.step(increment=steps)
    return (f"--no-load-optim: the LR schedule continues at the checkpoint's step ({steps} "
            f"samples, iteration {iteration}; megatron would restart it at 0)")  # fmt: skip


def check_flags(args) -> None:
    """Refuse at start-up the schedules megatron-core 0.19.2 asserts on only once the model and
    optimizer are built (training/training.py:1906 ``get_optimizer_param_scheduler``, core/
    optimizer_param_scheduler.py ``__init__``; the assertions named no flag): the same steps,
    computed as megatron computes them, in the unit of the flags that set them."""
    from megatron.md import errors

    def value(flag: str):
        return getattr(args, flag[2:].replace("-", "_"))

    if not (args.train_iters or args.train_samples):
        return  # (megatron's own parser refuses it)
    unit = "iters" if args.train_iters else "samples"  # (steps: iters × the batch, a factor > 0)
    decay_flag = f"--lr-decay-{unit}"
    if value(decay_flag) is None:
        decay_flag = f"--train-{unit}"
    decay = value(decay_flag)
    warmup_flag = f"--lr-warmup-{unit}"
    warmup = value(warmup_flag)
    if args.lr_warmup_fraction is not None:
        warmup_flag, warmup = "--lr-warmup-fraction", args.lr_warmup_fraction * decay
    if decay <= 0:
        errors.fail(f"{decay_flag}={decay}: the learning rate would decay over no step")
    if warmup >= decay:
        errors.fail(
            f"{warmup_flag}={value(warmup_flag)} is not shorter than the decay "
            f"({decay_flag}={decay}): the warmup must end before the schedule does"
        )
    if args.lr_decay_style == "WSD" and value(f"--lr-wsd-decay-{unit}") is None:
        errors.fail(
            f"--lr-decay-style WSD needs its cooldown: --lr-wsd-decay-{unit} N or "
            "--wsd-cooldown-fraction F"
        )
    if args.lr_warmup_init > args.lr:
        errors.fail(f"--lr-warmup-init={args.lr_warmup_init} is above --lr={args.lr}")
