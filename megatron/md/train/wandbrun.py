"""One wandb run per training run, across requeues and resumes.

megatron calls ``wandb.init`` with a name and no id (``training/global_vars.py``,
``_set_wandb_writer``), so every launch of a run — each requeue after a preemption or a time
limit — opened a new wandb run: a three-day run was a dozen runs of one name, each a piece of
the curves. Here each save notes which wandb run reached it (``<save>/wandb_runs.json``,
written by the last rank, megatron's wandb writer), and a run that resumes its own ``--save``
continues that wandb run (wandb's ``WANDB_RUN_ID`` and ``WANDB_RESUME=allow``, read by
``wandb.init``), its steps going on from the checkpoint's iteration. megatron opens the wandb
run (and the TensorBoard writer) while it parses the flags (``set_global_variables``); here
they are opened after the start-up checks instead (``open_writers``), so a launch refused there
— a second run in a ``--save`` in use, whose id would be the live run's — and a parse that only
checks flags (``tools/from_authors.py --check``, the sweep front-end) open no wandb run and
write nothing.

A new wandb run is what megatron opens otherwise: a first start, ``--load`` of another
directory (``--init-from``), ``--finetune``, and a rewind — ``--ckpt-step N`` of a checkpoint
its wandb run went on from (its later iterations are logged there already; wandb keeps a run's
steps increasing and would drop the new branch's up to them). After a crash the iterations
since the last save are logged again; wandb keeps them as first logged. ``WANDB_RUN_ID`` set by
the user is left alone. Offline (``WANDB_MODE=offline``) each launch writes an ``offline-run-*``
folder with the same id, and ``wandb sync`` of them uploads one run, in order.
"""

from __future__ import annotations

import json
import os

from megatron.md.train import files
from megatron.md.train.ckpt_checks import same_dir, tracked

FILE = "wandb_runs.json"


def resumed_iteration(args) -> int | None:
    """The iteration a run loads from its own ``--save`` (None: it resumes none)."""
    if not (args.save and args.load and same_dir(args.load, args.save)) or args.finetune:
        return None
    if args.ckpt_step is not None:
        return int(args.ckpt_step)
    return tracked(args.save)  # None: a first start ("release": not a run's own)


def read(save: str) -> dict:
    """``{"saves": {iteration: run id}, "last": {run id: its last saved iteration}}``."""
    try:
        with open(os.path.join(save, FILE)) as f:
            got = json.load(f)
        return {"saves": dict(got["saves"]), "last": dict(got["last"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {"saves": {}, "last": {}}


def choose(args) -> tuple[str | None, str]:
    """(the wandb run to continue, or None for a new one; a line for the banner)."""
    it = resumed_iteration(args)
    if it is None:
        return None, "a new wandb run (this run resumes no checkpoint of its --save)"
    runs = read(args.save)
    rid = runs["saves"].get(str(it))
    if rid is None:
        return None, f"a new wandb run (iteration {it} was saved without a wandb run noted)"
    last = runs["last"].get(rid, it)
    if last > it:
        return None, (
            f"a new wandb run: iteration {it} is a rewind of wandb run {rid}, which went on to "
            f"save iteration {last} (its later history stays there)"
        )
    return rid, f"continuing wandb run {rid} (it saved iteration {it})"


def prepare(args) -> str | None:
    """Point ``wandb.init`` at the run to continue (every rank sets the variables; megatron's
    last rank reads them in ``open_writers``). The banner's line, or None without
    ``--wandb-project``."""
    if not args.wandb_project:
        return None
    if os.environ.get("WANDB_RUN_ID"):
        return f"wandb run {os.environ['WANDB_RUN_ID']} (WANDB_RUN_ID, set outside)"
    rid, line = choose(args)
    if rid is not None:
        os.environ["WANDB_RUN_ID"] = rid
        os.environ.setdefault("WANDB_RESUME", "allow")
    return line


def opened_later(orig, run=None):
    """megatron's ``_set_tensorboard_writer`` / ``_set_wandb_writer`` while it parses: nothing
    (``open_writers`` calls them)."""

    def later(args):
        return None

    return later


def open_writers(args) -> None:
    """megatron's own TensorBoard and wandb writers (opened on the last rank only, in
    megatron's order: wandb's history rides on the TensorBoard writer), after the start-up
    checks and ``prepare``."""
    from megatron.training import global_vars

    for setter in (global_vars._set_tensorboard_writer, global_vars._set_wandb_writer):
        getattr(setter, "__md_seam__", setter)(args)
    settle_config()


def settle_config() -> None:
    """The config value megatron sets later without ``allow_val_change``
    (``config.update({'slurm_job_name': ...})`` in ``pretrain``), set first with it: a
    continued run's config holds the earlier launch's value, and wandb raises ``ConfigError`` on
    a changed one (a run started by hand, then requeued under SLURM)."""
    from megatron.training.global_vars import get_wandb_writer

    writer = get_wandb_writer()
    if writer is not None and getattr(writer, "run", None) is not None:
        job = os.getenv("SLURM_JOB_NAME", "N/A")
        writer.config.update({"slurm_job_name": job}, allow_val_change=True)


def record(save: str, iteration: int) -> None:
    """After a save, on the rank that writes wandb (megatron's last rank; none elsewhere):
    note that this wandb run reached ``iteration``."""
    from megatron.training.global_vars import get_wandb_writer

    writer = get_wandb_writer()
    run = getattr(writer, "run", None)
    if run is None or not save:
        return
    runs = read(save)
    runs["saves"][str(iteration)] = run.id
    runs["last"][run.id] = iteration
    files.write_whole(os.path.join(save, FILE), json.dumps(runs, indent=1))
