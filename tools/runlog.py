"""Run logs for the analysis tools: reading our JSONL metrics files (``pretrain_gpt.py
--metrics-file``; rows described in ``megatron/md/train/metrics.py``), CSV logs with an
``iteration`` and a loss column, and sweep manifests (``examples/md_decoupling/sweep.py``);
and launching ``pretrain_gpt.py`` on local processes for the tools that make their own runs.

A resumed run appends to the same JSONL file, so iterations can repeat: a restart's rows
supersede every row the attempts before it logged from its first logged iteration on (it
resumed from a checkpoint before that: what they logged beyond it is a branch no longer in the
run, also where the restart has not reached it yet, as after a ``--ckpt-step`` rewind). A run
killed mid-write leaves a partial line: at the end of the file, or, once the requeued run
appended to it, before its "run" row (on its own line since the writer ends a partial line
first; on the same line in files written before that): the partial row is skipped, the
restart's rows are read.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

TAIL = 25  # the paper's tail loss: mean LM loss over the last 25 logged iterations


#: how every run row of a metrics file starts (json.dumps of a dict whose first key is "type")
RUN_ROW = '{"type": "run"'


class LogError(ValueError):
    """A log or manifest that is missing or malformed (the message names the file)."""


@dataclass
class RunLog:
    path: Path
    run: dict = field(default_factory=dict)  # the first "run" row (config), {} for CSV logs
    train: dict[int, dict] = field(default_factory=dict)  # iteration -> last train row
    valid: dict[int, dict] = field(default_factory=dict)

    @property
    def args(self) -> dict:
        return self.run.get("args", {})

    def losses(self, key: str = "lm loss") -> list[tuple[int, float]]:
        return [(i, float(r[key])) for i, r in sorted(self.train.items()) if key in r]

    def tail_loss(self, n: int = TAIL) -> float | None:
        """Mean of the last ``n`` logged losses; None if fewer than ``n`` or any is not finite."""
        vals = [v for _, v in self.losses()[-n:]]
        if len(vals) < n or not all(math.isfinite(v) for v in vals):
            return None
        return sum(vals) / n

    def last_iteration(self) -> int:
        return max(self.train, default=0)


def read_log(path: str | Path) -> RunLog:
    """A JSONL metrics file, a CSV log, or a run directory holding ``metrics.jsonl``."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise LogError(f"{path}: no such log file")
    if path.suffix == ".csv":
        return _read_csv(path)
    log = RunLog(path)
    partial = None  # the number of a partial line: skipped if a restart's run row follows
    restarted = False  # a run row after the first, no train row of it yet
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                restart = line.find(RUN_ROW, 1)  # a partial row, then the requeued run's first
                if restart < 0 and partial is None:
                    partial = n
                    continue
                if restart < 0:
                    break  # two partial lines in a row: the first is refused below
                row = json.loads(line[restart:])
            kind = row.get("type") if isinstance(row, dict) else None
            if partial is not None and kind != "run":
                break
            partial = None
            if kind == "run":
                restarted = bool(log.run)
                log.run = log.run or row
            elif kind in ("train", "valid"):
                if not isinstance(row.get("iteration"), int):
                    raise LogError(f"{path}:{n}: {kind} row without an integer 'iteration'")
                if kind == "train" and restarted:
                    restarted = False
                    for rows in (log.train, log.valid):
                        for i in [i for i in rows if i >= row["iteration"]]:
                            del rows[i]
                (log.train if kind == "train" else log.valid)[row["iteration"]] = row
        else:
            return log  # (a partial last line: the run was killed while writing it)
    raise LogError(f"{path}:{partial}: not a JSON line")


def _read_csv(path: Path) -> RunLog:
    log = RunLog(path)
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "iteration" not in rows[0]:
        raise LogError(f"{path}: a CSV log needs an 'iteration' column and at least one row")
    key = next((k for k in ("lm loss", "lm_loss", "loss") if k in rows[0]), None)
    if key is None:
        raise LogError(f"{path}: a CSV log needs a 'loss' (or 'lm loss') column")
    for n, r in enumerate(rows, 2):
        try:
            log.train[int(r["iteration"])] = {"iteration": int(r["iteration"]),
                                              "lm loss": float(r[key])}  # fmt: skip
        except ValueError:
            raise LogError(f"{path}:{n}: iteration/loss are not numbers") from None
    return log


def read_manifest(path: str | Path) -> dict:
    """A sweep manifest: ``{"experiment", "runs": [{"name", "flags", "meta", "run_dir"}]}``."""
    path = Path(path)
    if not path.is_file():
        raise LogError(f"{path}: no such manifest")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LogError(f"{path}: not JSON ({e})") from None
    runs = manifest.get("runs") if isinstance(manifest, dict) else None
    if not isinstance(runs, list) or not all(
        isinstance(r, dict) and {"name", "meta", "run_dir"} <= set(r) for r in runs
    ):
        raise LogError(f"{path}: not a sweep manifest (needs runs[].name/meta/run_dir)")
    return manifest


def flag(flags: list[str], name: str) -> str | None:
    """The value of ``--name=V`` or ``--name V`` in a flag list (last one wins)."""
    from megatron.md.launch import flag_value

    return flag_value(flags, f"--{name}")


def run_pretrain(nproc: int, flags: list[str], log: Path, cwd: Path) -> int:
    """``pretrain_gpt.py FLAGS`` in ``nproc`` local processes on a free port, output to ``log``; the
    CPU threads split between the ranks. Returns the exit status."""
    from megatron.md.launch import local_ranks

    root = Path(__file__).resolve().parents[1]
    cmd = local_ranks(root / "pretrain_gpt.py", nproc, flags)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // nproc)))
    with open(log, "w") as f:
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
