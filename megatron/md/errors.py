"""Refusals: a wrong flag, a missing file, a checkpoint that cannot be continued. Each is one
sentence naming the problem and the way out, said once (by rank 0, or by the one rank that
knows it; a refusal about a node's own files also by each node's first rank) as the job's last
line of its own, with no traceback; the other ranks leave with the same exit status, silently,
once rank 0 has said it (``wait_for_rank0``).

Under torchrun the launcher's own summary (``ChildFailedError``) follows the workers' output,
so a run started by ``examples/md_decoupling/launch.sbatch`` gets the sentence repeated as its
last line: rank 0 also writes it to ``$MEGATRON_MD_ERROR_FILE`` when that is set, which the
launcher prints after torchrun returns; ``localrun.py`` (local runs, the tests) does the same
with a file of its own (another rank still importing megatron when rank 0 refuses may print a
warning after the sentence, in the moment before the launcher stops it).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time

PROG = "pretrain_gpt.py"
#: exit status of a refusal (argparse's for a usage error)
STATUS = 2
#: how long a rank that leaves a refusal to rank 0 waits for rank 0 to have said it (its line
#: in ``$MEGATRON_MD_ERROR_FILE``; without that file a fixed ``WAIT_BLIND_S``)
WAIT_S, WAIT_BLIND_S = 30.0, 3.0


class Refusal(SystemExit):
    """A clear stop before (or instead of) expensive work; ``str()`` is the sentence."""

    def __init__(self, msg: str, every_rank: bool = False, node: bool = False):
        super().__init__(f"{PROG}: error: {msg}")
        self.msg = msg
        self.every_rank = every_rank  # said by the rank that raised it, not by rank 0 only
        self.node = node  # about this node's files: also said by each node's first rank


def fail(msg: str, every_rank: bool = False, node: bool = False):
    raise Refusal(msg, every_rank, node)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def say(msg: str, every_rank: bool = False, node: bool = False) -> bool:
    """Rank 0 (or any, ``every_rank``: a refusal only that rank knows; or, ``node``: a refusal
    about the files this node sees, each node's first rank, naming itself) prints the refusal
    and leaves it for the launcher (``MEGATRON_MD_ERROR_FILE``: rank 0's replaces another's,
    the others' never replace one). A node whose copy of the data is missing stopped its ranks
    without a word while rank 0 went on, and the job ended with exit status 2 and no reason."""
    rank = _rank()
    first_here = os.environ.get("LOCAL_RANK", "0") == "0"
    if rank != 0 and not every_rank and not (node and first_here):
        return False
    if rank != 0 and node and not every_rank:
        msg = f"{msg} (on {socket.gethostname()}, rank {rank})"
    line = f"{PROG}: error: {msg}"
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("MEGATRON_MD_ERROR_FILE")
    if path:
        try:
            with open(path, "w" if rank == 0 else "x") as f:
                f.write(line + "\n")
        except OSError:
            pass
    return True


def wait_for_rank0() -> None:
    """A rank that left a refusal to rank 0 (``say`` returned False) waits until rank 0 has
    said it before leaving: a rank leaving first made torchrun stop rank 0 (SIGTERM) before rank
    0, still printing megatron's argument list, said anything, and the job ended with
    torchrun's summary and no reason (CI, 2026-12-04, 2 ranks refusing a flag)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    path = os.environ.get("MEGATRON_MD_ERROR_FILE")
    deadline = time.monotonic() + (WAIT_S if path else WAIT_BLIND_S)
    while time.monotonic() < deadline and not (path and os.path.exists(path)):
        time.sleep(0.05)


def _said(msg: str, every_rank: bool = False, node: bool = False) -> None:
    """``say``, or where this rank leaves the refusal to rank 0, ``wait_for_rank0``."""
    if not say(msg, every_rank, node):
        wait_for_rank0()


def exit_with(msg: str):
    """Say a refusal (``say``) and leave with its status, outside ``one_line``."""
    _said(msg)
    raise SystemExit(STATUS)


@contextlib.contextmanager
def one_line():
    """Turn a ``Refusal`` raised inside into one line from rank 0 and exit status 2."""
    try:
        yield
    except Refusal as e:
        _said(e.msg, e.every_rank, e.node)
        sys.stdout.flush()
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_initialized() and dist.get_world_size() > 1:
            # gloo's teardown in the interpreter's exit, a peer gone, can end the process in
            # std::terminate ("terminate called without an active exception", SIGABRT: not
            # status 2, and a line after the refusal: about 1 in 10 runs of 2 ranks refusing)
            from megatron.md.train.shutdown import exit_now

            exit_now(STATUS)
        raise SystemExit(STATUS) from None
