"""The end of a run that finished: close what megatron leaves open, then exit without the
interpreter's teardown.

That teardown (modules cleared, the heap of ~600k objects that megatron.training brings walked
by the collector several times) costs 1.9-2.3 s per process from the end of training to the
process's end (2-core VM, tiny preset, torch 2.15.0 CPU; 0.45-0.5 s with this), on every run and
for nothing: what a run writes is written by then. The test suite starts dozens of runs.
Only a run that returned normally exits this way; an error or an early exit (signal, duration,
``sys.exit``) takes the interpreter's own path, an error after ``children_killed_on_crash``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading


def exit_now(status: int = 0) -> None:
    """Close megatron's TensorBoard writer (megatron never closes it; closing flushes it and
    joins its writer thread), then what a normal exit does first, in its order: threading's
    own exit hooks (a thread pool's idle workers told to end) and a wait for the threads that
    are not daemons, the exit handlers (wandb's, logging's, the multiprocessing children's);
    then finalize all garbage (files in reference cycles are flushed and closed), flush the
    standard streams, and end the process with ``status`` (a refusal's too: errors.one_line)."""
    gv = sys.modules.get("megatron.training.global_vars")
    writer = gv.get_tensorboard_writer() if gv is not None else None
    if writer is not None:
        writer.close()
    # what the interpreter's exit calls first (CPython 3.12, Python/pylifecycle.c
    # wait_for_thread_shutdown); joining the threads without its hooks waits forever on an
    # idle ThreadPoolExecutor worker (a checkpoint's, say)
    threading._shutdown()
    # a forked rank's (forkserver.py): the server's imports stay frozen, out of the collection
    # below (~0.5 s a rank on a 2-core VM), as no finalization follows
    atexit.unregister(gc.unfreeze)
    atexit._run_exitfuncs()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@contextlib.contextmanager
def children_killed_on_crash():
    """An exception (not ``SystemExit``) leaving the run kills the process's multiprocessing
    children (megatron's DataLoader workers) before the interpreter's exit, and goes on.

    Without it a crashed rank never ended: the interpreter keeps an uncaught exception's frames
    (``sys.last_exc``), so the DataLoader iterators in them are not shut down, and its exit
    handler (multiprocessing/util.py, ``_exit_function``) SIGTERMs the workers and joins them.
    Under ``--exit-signal-handler`` (the SLURM launcher's) they were forked after megatron's
    SIGTERM handler, which only notes the signal: the join waited forever, and the rank, noting
    its own SIGTERMs the same way, held its allocation until SIGKILL (CPU, 2026-11-27: a write
    past the file-size limit at iteration 9, the rank still there when killed at 60 s). A
    ``SystemExit`` (a refusal, megatron's signal or duration stop) drops its frames first, and
    its workers end as usual. Noting SIGTERM is what keeps a signal save fed with batches."""
    try:
        yield
    except SystemExit:
        raise
    except BaseException:
        import multiprocessing
        import signal

        # torch's DataLoader raises in this thread on a worker's death (its SIGCHLD handler):
        # the error being raised is the one to report
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in multiprocessing.active_children():
            child.kill()
        for child in multiprocessing.active_children():
            child.join(10)
        raise
