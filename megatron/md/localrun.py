"""``python localrun.py NPROC PORT SCRIPT [ARGS...]``: NPROC processes of SCRIPT on this
machine, each with the variables torchrun gives its workers, waited for together.

torchrun's job on one machine without its agent, which imports torch before it starts
anything (~2 s per launch on a 2-core VM, where the test suite is mostly launches).
Like torchrun: the first process that fails stops the others (SIGTERM, then SIGKILL after
``GRACE_S``) and its status is the launch's; SIGTERM and SIGINT sent to the launcher reach
every process. Unlike torchrun's workers, no process outlives a launcher killed outright.
With ``MEGATRON_MD_FORKSERVER`` set (the test suite), ranks are forked by that fork server
where it agrees (megatron/md/forkserver.py). Standard library only (it runs as a script, before
any import of torch). Cluster jobs start torchrun (examples/md_decoupling/launch.sbatch);
``launch.local_ranks`` builds this command.

A rank's start-up refusal (megatron/md/errors.py) is the launch's last line, as
launch.sbatch makes it under torchrun: the ranks leave it in ``$MEGATRON_MD_ERROR_FILE``
(a private one here unless the caller set its own, which it then prints) and a failed launch of
several ranks repeats it after every rank has ended (another rank may have printed a warning
after it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

GRACE_S = 10.0  # a process stopped with SIGTERM gets this long before SIGKILL


def start(nproc: int, port: int, cmd: list[str]) -> list:
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}  # fmt: skip
    if nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several processes
    return [_process([sys.executable, *cmd], {**base, "RANK": str(r), "LOCAL_RANK": str(r)})
            for r in range(nproc)]  # fmt: skip


def _process(argv: list[str], env: dict[str, str]):
    """One rank: forked by the fork server named in ``MEGATRON_MD_FORKSERVER`` where there is
    one and it agrees (megatron/md/forkserver.py: the test suite's), else a fresh process."""
    if env.get("MEGATRON_MD_FORKSERVER", "0") != "0":
        from megatron.md import forkserver

        forked = forkserver.spawn(env["MEGATRON_MD_FORKSERVER"], argv, env)
        if forked is not None:
            return forked
    return subprocess.Popen(argv, env=env, preexec_fn=die_with_parent)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In each process before it starts (Linux): ``sig`` when its parent dies, so a launch
    killed outright (a caller's timeout) leaves no rank running on (the fork server's ranks and
    the server itself call it too)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: as torchrun, the ranks outlive it
        pass


def wait(procs: list) -> int:
    """The first failure's status (``_status``), else 0."""
    status, stopped_at = 0, None
    while True:
        codes = [p.poll() for p in procs]  # every process polled, each time
        failed = [c for c in codes if c not in (None, 0)]
        if failed and status == 0:
            status, stopped_at = _status(failed[0]), time.monotonic()
            _signal(procs, signal.SIGTERM)
        if None not in codes:
            return status
        if stopped_at is not None and time.monotonic() - stopped_at > GRACE_S:
            _signal(procs, signal.SIGKILL)
        time.sleep(0.05)


def _status(code: int) -> int:
    """A process's exit code as a shell reports it: 128 + N for one ended by signal N."""
    return code if code > 0 else 128 - code


def _signal(procs: list, sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    nproc, port, cmd = int(argv[0]), int(argv[1]), argv[2:]
    # one rank's refusal is its output's end already; a caller's own file is the caller's to say
    own = None
    if nproc > 1 and not os.environ.get("MEGATRON_MD_ERROR_FILE"):
        own = tempfile.mkdtemp(".localrun")
        os.environ["MEGATRON_MD_ERROR_FILE"] = os.path.join(own, "error")
    try:
        procs = start(nproc, port, cmd)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _f: _signal(procs, s))
        status = wait(procs)
        if status and own is not None:
            _repeat_refusal(os.environ["MEGATRON_MD_ERROR_FILE"])
        return status
    finally:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


def _repeat_refusal(path: str) -> None:
    try:
        with open(path) as f:
            line = f.read().strip()
    except OSError:  # no rank refused: a crash's own output is its end
        return
    if line:
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
