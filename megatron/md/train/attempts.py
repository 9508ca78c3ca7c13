"""A job's later attempts: the flags that apply to its first attempt only, settled in order.

A job of the SLURM launcher passes its flags again at every requeue (torchrun's restart of its
ranks too), and megatron reads them again at every load. Four of them make sense once, for the
job's first attempt; at a later attempt (``rewind.restarted``) each is dropped where the job
has saved since, and a job submitted again by hand with it is refused where it would train
over what was saved:

1. ``--load A --save B``, a branch of another run (``forked``): later attempts continue from B;
2. ``--ckpt-step N`` in the run's own ``--save``, a rewind (``rewind.settle``);
3. ``--no-load-optim`` / ``--finetune``, a fresh optimizer (``freshoptim``);
4. megatron's ``--override-ckpt-iteration N`` (``rewind.settle_override``).

The order is what each reads: the branch decides which directory is loaded, the rewind which
iteration, and the last two read that checkpoint (its tracker, its saved args). Every rank,
before the run starts and before the wandb run is named (``wandbrun.prepare``: which
checkpoint it continues).
"""

from __future__ import annotations

from megatron.md.train import forked, freshoptim, rewind


def settle(args) -> list[str]:
    """The four rules applied to ``args`` in their order; the lines to print."""
    rules = (forked.settle, rewind.settle, freshoptim.settle, rewind.settle_override)
    return [line for rule in rules if (line := rule(args))]
