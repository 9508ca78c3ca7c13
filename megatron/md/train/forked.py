"""``--load`` of another run, ``--save`` of this one: a branch, started once.

A run started from another run's checkpoint (``--load A --save B``: megatron goes on with A's
iteration count in B) was refused at its first requeue: a job of the SLURM launcher passes its
flags again, and B then held checkpoints while ``--load`` named A (``ckpt_checks.
save_over_another_run``; it said "another run's"), so the job stopped at its first preemption
or time limit (seen, 2026-11-29, MuonMD at 2 ranks). Loading A again instead would throw away
what the job saved in B.

A requeued attempt (``rewind.restarted``) whose ``--save`` has a tracker continues from it:
``--load`` becomes ``--save``, and a ``--ckpt-step`` (A's iteration) is dropped. B's tracker
can only be this job's: a first attempt into a ``--save`` holding checkpoints of a run it does
not resume is refused, so it was never requeued. A job submitted again by hand is still
refused, naming ``--load B`` as the way to continue.
"""

from __future__ import annotations

from megatron.md.train.ckpt_checks import same_dir, tracked
from megatron.md.train.rewind import restarted


def continues(args) -> bool:
    """Whether this attempt continues the branch its job started in ``--save``."""
    return (bool(args.save and args.load) and not same_dir(args.load, args.save)
            and restarted() and tracked(args.save) is not None)  # fmt: skip


def settle(args) -> str | None:
    """Every rank, before the run starts (before ``rewind.settle``): a later attempt of a job
    that started from another run's checkpoint resumes its own ``--save``; the line to print,
    or None."""
    if not continues(args):
        return None
    was, saved = args.load, tracked(args.save)
    args.load, args.ckpt_step = args.save, None
    return (f"requeued: continuing from iteration {saved} in --save, saved by this job after it "
            f"started from --load {was} (another run's --load starts the job's first attempt "
            "only)")  # fmt: skip
