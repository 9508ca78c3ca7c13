"""Small file-system helpers shared by the run's checks and notes."""

from __future__ import annotations

import contextlib
import os
import tempfile


def write_whole(path: str, text: str) -> None:
    """``text`` into ``path`` through ``path + ".tmp"`` renamed over it (``os.replace``: atomic
    in one directory): a reader, or a job killed mid-write, meets the old file or the new one,
    never a cut one. A failed write leaves no temporary file and raises."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def read_count(path: str) -> int | None:
    """The number a marker file (``<save>/finished``, ``stopped``) starts with; None where it is
    missing or unreadable."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def unwritable(path: str) -> tuple[str, str | None] | None:
    """Why ``path`` cannot be created and written in: (its nearest existing ancestor, None where
    that is a file, else the probe's error), or None. Probed by making and removing a directory
    in that ancestor: nothing is left behind."""
    where = os.path.abspath(path)
    while not os.path.isdir(where):
        if os.path.lexists(where):  # a file where a directory of the path would be
            return where, None
        where = os.path.dirname(where)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megatron-md-probe-", dir=where))
    except OSError as e:
        return where, e.strerror
    return None
