"""A save that fails to write (a full disk, a quota, a file-size limit) ends the run in one
line that says why and what is kept, instead of a traceback per rank that hides the cause.

megatron-core 0.19.2's torch_dist writer catches each write error in its worker
(``FileSystemWriterAsync.write_preloaded_data``; the row in ``compat.SEAMS``), logs it and
passes on only its class name ("error: <class 'OSError'>"), so the ``CheckpointException``
every rank then raises no longer holds the errno. ``record_writer_errors`` keeps each rank's
write errors as they happen; ``handle`` (called by ``patches.wrap_save`` when megatron's save
raises) gathers them (``nonfinite.everyone``) — megatron raises the exception on every rank at
the same point, after its own broadcast of the failure, so a collective is safe there — and
rank 0 says which rank could not write which file and why, the free space of ``--save``'s
filesystem, and that the tracker still names the last complete checkpoint (megatron writes it
only after a complete save). Every rank exits with the refusal status (2), which the SLURM
launcher does not requeue: a requeue would train to the same save and fail there again. Nothing
is deleted: the incomplete directory is named, and the next save of that iteration writes over
it.

Before that happens: ``warn_if_no_room`` says, once a checkpoint's size is known (the one a
run resumes from, or its last save), when ``--save``'s filesystem has less free space than one
more checkpoint of that size — hours before the save that would fail. A warning, not a
refusal: other jobs free and take space meanwhile, and quotas are not in the free space.

A failure the writer did not record (anything but a write) keeps megatron's exception.
``--async-save`` (CUDA only) writes in another process and reports later, outside the save:
megatron's exception there too.
"""

from __future__ import annotations

import functools
import os
import shutil

from megatron.md import errors

#: (file, error text) of each write that failed on this rank since the last ``take``
_failed: list[tuple[str, str]] = []


def record_writer_errors(orig, run=None):
    """The writer's per-file worker, keeping the error it returns (it never raises)."""

    @functools.wraps(orig)
    def write_preloaded_data(*args, **kwargs):
        out = orig(*args, **kwargs)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], BaseException):
            bucket = kwargs.get("write_bucket", args[2] if len(args) > 2 else None)
            name = os.path.basename(str(bucket[0])) if bucket else "?"
            _failed.append((name, _text(out[1])))
        return out

    return write_preloaded_data


def _text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    if "unexpected pos" in text:  # torch's zip writer saw fewer bytes land than it wrote
        text += ": a short write"
    return text


def take() -> list[tuple[str, str]]:
    """This rank's recorded write errors, cleared."""
    out = list(_failed)
    _failed.clear()
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def describe(failures: list[tuple[int, str, str]], save: str, iteration: int) -> str:
    """The line rank 0 says from every rank's (rank, file, error): who could not write what,
    the free space, what is kept."""
    from megatron.md.train.ckpt_checks import TRACKER

    failures = sorted(failures, key=lambda x: ("OSError" not in x[2] and "Errno" not in x[2], x[0]))
    said = "; ".join(f"rank {r} could not write {f} ({e})" for r, f, e in failures[:3])
    more = f"; and {len(failures) - 3} more" if len(failures) > 3 else ""
    try:
        free = f"its filesystem has {_mib(shutil.disk_usage(save).free)} free"
    except OSError as e:
        free = f"its free space is unknown ({e})"
    part = os.path.join(save, f"iter_{iteration:07d}")
    tracker = os.path.join(save, TRACKER)
    try:
        latest = open(tracker).read().strip()
    except OSError:
        latest = None
    kept = (f"the latest checkpoint is still iteration {latest} ({TRACKER} unchanged), and "
            f"--load resumes from it" if latest else "no earlier checkpoint is there")  # fmt: skip
    incomplete = (f"; iter_{iteration:07d} is incomplete ({_mib(_size(part))}; nothing points "
                  "at it, and the next save of that iteration writes over it)"
                  if os.path.isdir(part) else "")  # fmt: skip
    return (
        f"--save {save}: saving iteration {iteration} failed: {said}{more}; {free}{incomplete}; "
        f"{kept}. Make room there (or give --save another directory) and resume: a requeue "
        "would stop at this save again"
    )


def handle(exc: BaseException, save: str, iteration: int) -> None:
    """After megatron's save raised ``exc``: the one-line exit when a write failed on some
    rank; returns (the caller re-raises ``exc``) for any other failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    mine = take()
    # every rank raises CheckpointException at the same point (megatron's
    # save_state_dict_async_finalize, after the failure's broadcast; torch's planning
    # collectives): only there may the ranks' errors be gathered
    if not isinstance(exc, CheckpointException):
        return
    from megatron.md.train.nonfinite import everyone

    rank = int(os.environ.get("RANK", "0"))
    failures = everyone([(rank, name, err) for name, err in mine])
    if failures:
        errors.fail(describe(failures, save, iteration))


def warn_if_no_room(save: str, checkpoint: str, when: str) -> str | None:
    """Rank 0: the warning (printed, and returned) when ``save``'s filesystem cannot hold one
    more checkpoint the size of ``checkpoint``; ``when``: which one that is."""
    if int(os.environ.get("RANK", "0")) != 0 or not save:
        return None
    try:
        free = shutil.disk_usage(save if os.path.isdir(save) else os.path.dirname(save) or ".")
    except OSError:
        return None
    size = _size(checkpoint)
    if free.free >= size:
        return None
    msg = (f"[megatron-md] warning: --save {save}: its filesystem has {_mib(free.free)} free and "
           f"{when} takes {_mib(size)}: the next save will fail unless space is made")  # fmt: skip
    print(msg, flush=True)
    return msg
