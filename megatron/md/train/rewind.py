"""``--ckpt-step N`` in a run's own ``--save``: a rewind, made once.

A rewind (``--ckpt-step N`` of an iteration before the one the tracker names, in the run's own
``--save``: the way out our refusals give for a non-finite or damaged latest checkpoint) loads
N, and megatron leaves the tracker naming the abandoned branch's latest until the first save.
Two things followed:

- a job of the SLURM launcher passes its flags again at every requeue, so each requeued attempt
  rewound to N again and trained the same iterations over, throwing away what the attempt
  before it had saved (every attempt, up to the launcher's ``MAX_REQUEUES``);
- megatron's ``--save-retain-interval`` deletes, at a save, the checkpoint the tracker names
  (``checkpointing.py``, ``iter_finalize_fn``): the rewound run's first save deleted the
  abandoned branch's latest (measured, 2026-11-27), not its own previous one.

Here, once checkpoint N has loaded, rank 0 writes N into the tracker: the directory says what
the run is. A requeued attempt (``SLURM_RESTART_COUNT`` > 0; or torchrun's own restart of its
ranks, ``TORCHELASTIC_RESTART_COUNT`` > 0, with the same flags too) whose tracker names an
iteration after N continues from it (this job saved it after its rewind), and says so.

A job submitted again by hand (its script still says ``--ckpt-step N``; no restart count) would
rewind to N again, throwing away what the run trained since. The rewind leaves a note
(``md_rewind.json``: to which iteration, from which, when, in which job); a first attempt with
``--ckpt-step N`` of the iteration the note names, in a directory that has saved past it since,
is refused at start-up, naming both ways out (drop the flag; or delete the note to rewind to N
again).
"""

from __future__ import annotations

import datetime
import json
import os

from megatron.md import errors
from megatron.md.train import files
from megatron.md.train.ckpt_checks import TRACKER, same_dir, tracked


def own(args) -> bool:
    """``--ckpt-step`` in the run's own ``--save`` (a rewind or a jump, not another run's)."""
    return (args.ckpt_step is not None and bool(args.save and args.load)
            and same_dir(args.load, args.save))  # fmt: skip


def restarted() -> bool:
    """A later attempt of the same launch: requeued by SLURM, or its ranks restarted by torchrun."""
    return any(int(os.environ.get(k) or 0) > 0
               for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"))  # fmt: skip


#: the note a rewind leaves in the run's directory
NOTE = "md_rewind.json"


def settle(args) -> str | None:
    """Every rank, before the run starts: a later attempt of a rewound job continues from what
    the job saved since (``args.ckpt_step`` dropped); the line to print, or None. A first
    attempt that would make the run's last rewind again, over what it saved since, is refused."""
    if not own(args):
        return None
    saved, step = tracked(args.save), args.ckpt_step
    if saved is None or saved <= step:
        return None
    if not restarted():
        refuse_again(args.save, step, saved)
        return None
    args.ckpt_step = None
    return (f"requeued: continuing from iteration {saved}, saved by this job after it rewound to "
            f"{step} (--ckpt-step {step} rewinds the job's first attempt only)")  # fmt: skip


def write_note(save: str, name: str, iteration: int, **more) -> None:
    """A first-attempt rule's note in the run directory ``save`` (written whole): the
    iteration, ``more``, the SLURM job and the time."""
    note = {"iteration": iteration, **more, "job": os.environ.get("SLURM_JOB_ID"),
            "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}  # fmt: skip
    files.write_whole(os.path.join(save, name), json.dumps(note))


def read_note(save: str, name: str) -> dict | None:
    """The note ``name`` in ``save`` (None: none, or not one of ours)."""
    try:
        with open(os.path.join(save, name)) as f:
            note = json.load(f)
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) and isinstance(note.get("iteration"), int) else None


def mark(args, rank: int) -> str | None:
    """Rank 0, once checkpoint ``--ckpt-step`` has loaded in the run's own ``--save``: the
    tracker names it (written whole); the line to print, or None."""
    if rank != 0 or not own(args):
        return None
    before, step = tracked(args.save), args.ckpt_step
    if before == step:
        return None
    files.write_whole(os.path.join(args.save, TRACKER), str(step))
    write_note(args.save, NOTE, step, **{"from": before})  # (after: a note, a rewind made)
    named = f"it named {before}" if before is not None else "it named no iteration"
    return (f"rewound to iteration {step}: the tracker names it now ({named}); checkpoints "
            "after it stay until this run saves over them")  # fmt: skip


def refuse_again(save: str, step: int, saved: int) -> None:
    """Refuse ``--ckpt-step step`` where the run's note says it was rewound to ``step`` already
    and the tracker names ``saved``, after it."""
    path, note = os.path.join(save, NOTE), read_note(save, NOTE)
    if note is None or note["iteration"] != step:
        return
    job = f", job {note['job']}" if note.get("job") else ""
    errors.fail(
        f"--ckpt-step {step}: {save} was rewound to iteration {step} already ({note.get('time')}"
        f"{job}) and has saved up to iteration {saved} since, which this launch would train "
        f"over: drop --ckpt-step to continue from {saved}, or delete {path} to rewind to {step} "
        "again"
    )


#: the args attribute that keeps a dropped ``--override-ckpt-iteration`` in later checkpoints
OVERRIDDEN = "md_override_ckpt_iteration"


def settle_override(args) -> str | None:
    """megatron's ``--override-ckpt-iteration N`` sets the loaded checkpoint's iteration (and
    its consumed samples) back to N at every load (training/checkpointing.py:2441): a requeued
    attempt, started with the same flags, went back to N again from what the job had saved
    since and trained those iterations over (seen, 2026-11-29: MuonMD at 2 ranks, loaded 6 as
    2, saved 4, requeued: iterations 3 and 4 again). A checkpoint saved by a run given the same
    N is this job's (or its resubmission's): the flag is dropped there (kept as
    ``md_override_ckpt_iteration``, which the checkpoints it saves carry on), and the line to
    print returned. Every rank, before the run starts (after ``settle``: which checkpoint)."""
    from megatron.core import dist_checkpointing

    from megatron.md.train.ckpt_checks import saved_format

    n = getattr(args, "override_ckpt_iteration", None)
    if n is None or not args.load:
        return None
    step = args.ckpt_step if args.ckpt_step is not None else tracked(args.load)
    path = os.path.join(args.load, f"iter_{step:07d}") if step is not None else None
    if path is None or saved_format(path) != "torch_dist":
        return None
    try:
        saved = dist_checkpointing.load_common_state_dict(path).get("args")
    except Exception:  # the checks at load name an unreadable checkpoint
        return None
    if n not in (getattr(saved, k, None) for k in ("override_ckpt_iteration", OVERRIDDEN)):
        return None
    args.override_ckpt_iteration = None
    setattr(args, OVERRIDDEN, n)
    return (
        f"continuing from iteration {step}, saved after --override-ckpt-iteration {n} set "
        f"the run back (it applies to a checkpoint saved without it only)"
    )
