"""Progress of long work as whole lines (a SLURM log stays readable: no carriage returns),
with the total, the elapsed time and an ETA, at most one line per ``every`` seconds and one at
the end. Used by the data tools and the laptop reproduction's run loops.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def duration(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


class Progress:
    """``[label] done/total (pct) · elapsed · ETA`` lines; ``unit_fmt`` formats amounts."""

    def __init__(
        self,
        label: str,
        total: float,
        every: float = 30.0,
        out: TextIO | None = None,
        unit_fmt: Callable[[float], str] = lambda x: f"{x:g}",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label, self.total, self.every = label, total, every
        self.out, self.fmt, self.clock = out, unit_fmt, clock
        self.done, self.t0 = 0.0, clock()
        self.last = None  # when the last line was printed (None: none yet)

    def line(self, note: str = "") -> str:
        elapsed = self.clock() - self.t0
        pct = 100.0 * self.done / self.total if self.total else 100.0
        left = elapsed / self.done * (self.total - self.done) if self.done else None
        eta = "ETA ?" if left is None else f"ETA {duration(max(left, 0.0))}"
        text = f"[{self.label}] {self.fmt(self.done)}/{self.fmt(self.total)} ({pct:.0f} %)"
        text += f" · {duration(elapsed)} · {eta}"
        return f"{text} · {note}" if note else text

    def update(self, n: float = 1, note: str = "", force: bool = False) -> None:
        """Add ``n`` done; print a line on the first update, once ``every`` seconds passed
        since the last line, at the end, or with ``force``."""
        self.done += n
        now = self.clock()
        due = self.last is None or now - self.last >= self.every or self.done >= self.total
        if force or due:
            self.last = now
            print(self.line(note), file=self.out or sys.stderr, flush=True)

    def finish(self, note: str = "") -> None:
        """The work is complete (what remains uncounted, say trailing blank lines, is done)."""
        if self.done < self.total:
            self.update(self.total - self.done, note, force=True)
