"""``--no-load-optim`` (or ``--finetune``) in a run's own ``--save``: a fresh optimizer, made
once.

Our refusals give ``--no-load-optim`` as the way to continue a checkpoint with a fresh
optimizer (another optimizer, a checkpoint saved without its state, another layout). A job of
the SLURM launcher passes its flags again at every requeue, and megatron reads the flag at
every load: each requeued attempt dropped the optimizer state this job had saved since, and MD
made its state from the weights again (gains 1, zero moments; MuonMD at 2 ranks, a fresh start
at 2 saved at 4 and requeued: iteration 6's loss 4.909 where the uninterrupted run had 4.837,
2026-11-29). megatron's ``--finetune`` (weights only, iteration 0) restarted every requeued
attempt at iteration 0 besides.

As with a rewind (rewind.py): once a checkpoint has loaded with a fresh optimizer (from the
run's own directory, or from another run's: a branch its requeues continue in ``--save``,
forked.py), rank 0 leaves a note in ``--save`` (``md_fresh_optimizer.json``: at which
iteration, when, in which job). A requeued attempt (``rewind.restarted``) whose tracker names
an iteration after the note's loads that checkpoint's optimizer state (this job saved it) and
says so. A first attempt with the flag in a directory that has saved past the note's
iteration since is refused at start-up, naming both ways out (drop the flag; or delete the
note to start a fresh optimizer again). The note is written for the flags' own fresh starts,
not for ``--init-from`` nor for a ``--pretrained-checkpoint`` start (megatron sets
``--finetune`` there and drops it once ``--load`` holds a checkpoint).
"""

from __future__ import annotations

import os

from megatron.md import errors
from megatron.md.train.ckpt_checks import same_dir, tracked
from megatron.md.train.rewind import read_note, restarted, write_note

#: the note a fresh start leaves in the run's directory
NOTE = "md_fresh_optimizer.json"


def _flags(args) -> list[str]:
    """The flags given that load a checkpoint without its optimizer state: ``--no-load-optim``,
    and megatron's ``--finetune`` (which also restarts the iteration count at 0)."""
    return [f"--{n.replace('_', '-')}" for n in ("no_load_optim", "finetune")
            if getattr(args, n, False)]  # fmt: skip


def fresh(args) -> bool:
    """A load with a fresh optimizer into a run directory ``--save``."""
    return bool(_flags(args)) and bool(args.save and args.load)


def own(args) -> bool:
    """``fresh``, resuming the run's own ``--save`` (a requeued branch's too: forked.py)."""
    return fresh(args) and same_dir(args.load, args.save)


def settle(args) -> str | None:
    """Every rank, before the run starts (after ``rewind.settle``: the iteration it loads): a
    later attempt of a job that started a fresh optimizer resumes what it saved since, its
    optimizer state and iteration (``args.no_load_optim`` and ``args.finetune`` dropped; the
    first kept where the run saves none); the line to print, or None. A first attempt that
    would drop them again is refused."""
    if not own(args):
        return None
    note = read_note(args.save, NOTE)
    step = args.ckpt_step if args.ckpt_step is not None else tracked(args.save)
    if note is None or step is None or step <= note["iteration"]:
        return None
    keep = getattr(args, "no_save_optim", False)  # what it saved since holds no optimizer state
    flags = " and ".join(f for f in _flags(args) if not (keep and f == "--no-load-optim"))
    if not flags:
        return None
    path, start = os.path.join(args.save, NOTE), note["iteration"]
    if not restarted():
        job = f", job {note['job']}" if note.get("job") else ""
        also = " (--finetune restarts at iteration 0)" if args.finetune else ""
        errors.fail(
            f"{flags}: {args.save} started a fresh optimizer at iteration {start} already "
            f"({note.get('time')}{job}) and has saved its state up to iteration {step} since, "
            f"which this launch would drop{also}: drop {flags} to continue it, or delete {path} "
            "to start a fresh optimizer again"
        )
    args.no_load_optim, args.finetune = keep, False
    state = "its optimizer state is loaded" if not keep else "it holds no optimizer state"
    return (f"requeued: iteration {step} was saved by this job after its fresh optimizer at "
            f"{start}: {state}, the iteration goes on ({flags} starts the job's first attempt "
            "only)")  # fmt: skip


def mark(args, iteration: int, rank: int) -> None:
    """Rank 0, once a checkpoint at ``iteration`` has loaded with a fresh optimizer, from the
    run's own ``--save`` or from another run's (a branch, which its requeues continue in
    ``--save``): the note there (written whole)."""
    if rank != 0 or not fresh(args):
        return
    write_note(args.save, NOTE, iteration)
