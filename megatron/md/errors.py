"""Refusals: a wrong flag, a missing file, a checkpoint that cannot be continued. Each is one
sentence naming the problem and the way out, said once (by rank 0, or by the one rank that
knows it) as the job's last line of its own, with no traceback; the other ranks leave with the
same exit status, silently.

Under torchrun the launcher's own summary (``ChildFailedError``) follows the workers' output,
so a run started by ``examples/md_decoupling/launch.sbatch`` gets the sentence repeated as its
last line: rank 0 also writes it to ``$MEGATRON_MD_ERROR_FILE`` when that is set, which the
launcher prints after torchrun returns.
"""

from __future__ import annotations

import contextlib
import os
import sys

PROG = "pretrain_gpt.py"
#: exit status of a refusal (argparse's for a usage error)
STATUS = 2


class Refusal(SystemExit):
    """A clear stop before (or instead of) expensive work; ``str()`` is the sentence."""

    def __init__(self, msg: str, every_rank: bool = False):
        super().__init__(f"{PROG}: error: {msg}")
        self.msg = msg
        self.every_rank = every_rank  # said by the rank that raised it, not by rank 0 only


def fail(msg: str, every_rank: bool = False):
    raise Refusal(msg, every_rank)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def say(msg: str, every_rank: bool = False) -> None:
    """Rank 0 (or any, ``every_rank``: a refusal only that rank knows): print the refusal and
    leave it for the launcher (``MEGATRON_MD_ERROR_FILE``)."""
    if _rank() != 0 and not every_rank:
        return
    line = f"{PROG}: error: {msg}"
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("MEGATRON_MD_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                f.write(line + "\n")
        except OSError:
            pass


def exit_with(msg: str):
    """Say a refusal (``say``) and leave with its status, outside ``one_line``."""
    say(msg)
    raise SystemExit(STATUS)


@contextlib.contextmanager
def one_line():
    """Turn a ``Refusal`` raised inside into one line from rank 0 and exit status 2."""
    try:
        yield
    except Refusal as e:
        say(e.msg, e.every_rank)
        sys.stdout.flush()
        raise SystemExit(STATUS) from None
