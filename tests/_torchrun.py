"""Run a tests/distributed script in local processes (gloo, CPU; megatron/md/localrun.py) and
return its JSON line."""

import json
import os
import subprocess
from pathlib import Path

DIST = Path(__file__).parent / "distributed"


def torchrun(script: str, nproc: int, *args: str, expect_fail: bool = False):
    """The script's last JSON line; with ``expect_fail``, its combined output (it must fail)."""
    return _launch(script, nproc, args, expect_fail, 600, 1)[-1]


def _launch(script, nproc, args, expect_fail, timeout, n_lines):
    from megatron.md.launch import local_ranks

    cmd = local_ranks(DIST / script, nproc, args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if expect_fail:
        assert out.returncode != 0, out.stdout[-3000:]
        return [out.stdout + out.stderr]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith('{"world"')]  # results
    assert out.returncode == 0 and len(lines) >= n_lines, out.stdout[-3000:] + out.stderr[-5000:]
    return [json.loads(ln) for ln in lines[-n_lines:]]


class Batches:
    """The jobs of one script, grouped by world size: the first request at a world size runs
    every job registered for it in ONE launch (jobs joined by ``+``; the script runs them one
    after the other), later requests read the stored result. Importing megatron costs ~15 s of
    CPU per process, so on 2 cores a 4-rank launch spends ~30 s before doing anything.
    A job not registered runs alone."""

    def __init__(self, script: str, jobs):
        self.script = script
        self.jobs: dict[int, list[tuple[str, ...]]] = {}
        for nproc, *args in jobs:
            self.jobs.setdefault(nproc, []).append(tuple(map(str, args)))
        self.results: dict[int, list | BaseException] = {}

    def __call__(self, nproc: int, *args: str) -> dict:
        key = tuple(map(str, args))
        jobs = self.jobs.get(nproc, [])
        if key not in jobs:
            return torchrun(self.script, nproc, *key)
        if nproc not in self.results:
            joined = [a for job in jobs for a in ("+", *job)][1:]
            try:
                timeout = 300 + 120 * len(jobs)
                self.results[nproc] = _launch(self.script, nproc, joined, False, timeout, len(jobs))
            except (AssertionError, subprocess.TimeoutExpired) as e:
                self.results[nproc] = e  # the other jobs of this launch fail with it, not rerun
        got = self.results[nproc]
        if isinstance(got, BaseException):
            raise AssertionError(f"batched launch at {nproc} ranks failed") from got
        return got[jobs.index(key)]
