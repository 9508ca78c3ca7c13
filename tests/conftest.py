"""Test set-up: CPU mode (megatron.md.cpu_mode) on machines without CUDA, before megatron; the
session's fork server for local launches (megatron/md/forkserver.py) and its page keeper
(tests/_pagekeep.py)."""

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import _pagekeep
import pytest

from megatron.md import cpu_mode

cpu_mode.maybe_activate()

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
logging.getLogger("megatron").setLevel(logging.ERROR)


def _field_docstrings_once():
    """megatron's argument parser reads the source of every config dataclass (inspect and ast)
    on each parse (megatron/training/argument_utils.py, ArgumentGroupFactory
    ._get_field_docstrings): 0.14 s a parse on CI's machine, 24 of the 34 s of the test that
    parses every experiment's command. A class's field docstrings are its source's: read once
    per test process. A seam that no longer fits fails here, at the session's start."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    read = ArgumentGroupFactory._get_field_docstrings
    seen: dict[type, dict[str, str]] = {}

    def once(self, cls):
        if cls not in seen:
            seen[cls] = read(self, cls)
        return dict(seen[cls])

    ArgumentGroupFactory._get_field_docstrings = once


_field_docstrings_once()


def pytest_collection_modifyitems(items):
    """The quick tier (``bash run.sh test -m quick``): every test without a multi-process launch."""
    for item in items:
        if item.get_closest_marker("distributed") is None:
            item.add_marker(pytest.mark.quick)


def _restore_environment(saved: dict) -> None:
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


_SESSION_ENV: dict = {}


def pytest_collection_finish(session):
    """What the test modules' imports set in ``os.environ`` stays out of the tests' launches:
    lm_eval's import (tests/test_evaluate.py) sets ``HF_XET_HIGH_PERFORMANCE``, which
    huggingface_hub reads at import, so every launch would differ from the fork server's
    environment and start its ranks afresh. The modules imported so far go to the page
    keeper."""
    _restore_environment(_SESSION_ENV)
    if "keeper" in _SERVER:
        files = {getattr(m, a, None) for m in list(sys.modules.values())
                 for a in ("__file__", "__cached__")}  # fmt: skip
        listing = _SERVER["tmp"] / "imported"
        written = listing.with_suffix(".part")  # renamed whole: the keeper never reads a part
        written.write_text(
            "".join(f"{f}\n" for f in sorted(f for f in files if isinstance(f, str)))
        )
        written.replace(listing)


@pytest.fixture(autouse=True)
def _environment_restored():
    """The same for what a test sets."""
    saved = dict(os.environ)
    yield
    _restore_environment(saved)


_SERVER: dict = {}


def pytest_configure(config):
    """Start the fork server: every rank of a local launch (megatron/md/localrun.py) whose
    environment agrees is forked from it, with torch imported (~4 s of CPU per rank saved).
    ``MEGATRON_MD_FORKSERVER=0`` starts every rank afresh."""
    _SESSION_ENV.update(os.environ)
    if os.environ.get("MEGATRON_MD_FORKSERVER") is not None or sys.platform != "linux":
        return  # (it reads /proc and sets PR_SET_PDEATHSIG: Linux only)
    tmp = Path(tempfile.mkdtemp(prefix="md-forkserver-"))
    sock = str(tmp / "sock")
    # the environment of most launches: localrun gives several ranks one thread each (as
    # torchrun does) and the tests' own launches ask for the same
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_MD_FORKSERVER": sock}
    log = open(tmp / "log", "w")
    cmd = [sys.executable, "-m", "megatron.md.forkserver", sock]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    _SERVER.update(proc=proc, tmp=tmp, log=log)
    os.environ["MEGATRON_MD_FORKSERVER"] = sock
    _SESSION_ENV.update(os.environ)
    _start_page_keeper(tmp, [os.getpid(), proc.pid])


def _start_page_keeper(tmp: Path, pids: list[int]) -> None:
    """The files the session's processes read kept in memory (tests/_pagekeep.py: on the VM
    type the suite is timed on, a fresh ``import torch`` after an idle minute otherwise reads
    them back from disk, 37-59 s instead of 5). ``MEGATRON_MD_PAGEKEEP=0`` turns it off."""
    if os.environ.get("MEGATRON_MD_PAGEKEEP") == "0":
        return
    cmd = [sys.executable, _pagekeep.__file__, str(tmp / "kept"),
           str(tmp / "imported"), *map(str, pids)]  # fmt: skip
    _SERVER["keeper"] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


def pytest_report_header(config):
    if "proc" in _SERVER:
        return f"fork server for local launches: {_SERVER['tmp'] / 'log'}"
    given = os.environ.get("MEGATRON_MD_FORKSERVER", "0")
    return f"fork server: {'off' if given == '0' else given}"


def pytest_terminal_summary(terminalreporter):
    """How many ranks the fork server forked, and why the others started afresh; what the page
    keeper kept."""
    if "proc" not in _SERVER:
        return
    log = (_SERVER["tmp"] / "log").read_text().splitlines()
    forked = sum(ln.startswith("[forkserver] forked") for ln in log)
    why = Counter(ln.split(": ", 1)[-1] for ln in log if ln.startswith("[forkserver] refused"))
    if forked or why:
        terminalreporter.write_line(
            f"fork server: {forked} ranks forked, {why.total()} started afresh"
        )
    for reason, n in why.most_common():
        terminalreporter.write_line(f"  {n:4d} x {reason[:150]}")
    if "keeper" in _SERVER and (said := _pagekeep.said(str(_SERVER["tmp"] / "kept"))):
        terminalreporter.write_line(f"page keeper: {said}")


def pytest_unconfigure(config):
    keeper = _SERVER.pop("keeper", None)
    if keeper is not None:
        keeper.terminate()
        keeper.wait(timeout=30)
    proc = _SERVER.pop("proc", None)
    if proc is not None:
        proc.terminate()
        proc.wait(timeout=30)
        _SERVER["log"].close()
        shutil.rmtree(_SERVER["tmp"], ignore_errors=True)
