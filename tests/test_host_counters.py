"""The ``host`` entry of a train row (megatron/md/train/host.py): per-iteration means of the loop
thread's CPU time and Python's garbage collection, counted, not estimated."""

import gc
import time

from megatron.md.train.host import HostCounters


def test_counters_are_per_iteration_means_and_restart():
    h = HostCounters()
    try:
        wall = time.perf_counter()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.05:  # 50 ms of this thread's CPU
            pass
        gc.collect()
        gc.collect()
        got = h.per_iteration(2)
        wall_ms = 1e3 * (time.perf_counter() - wall) / 2
        assert 25 <= got["cpu_ms"] <= 1.01 * wall_ms, (got, wall_ms)  # 50 ms + the collections
        assert got["gc_runs"] == 1.0 and 0 < got["gc_ms"] <= wall_ms, got  # two collections / 2
        assert "cuda_mallocs" not in got  # no CUDA here
        time.sleep(0.05)  # wall time, no CPU: the next count starts from here, at ~0
        again = h.per_iteration(1)
        assert again["cpu_ms"] < 10 and again["gc_runs"] == 0, again
    finally:
        h.close()
    n = len(gc.callbacks)
    h.close()  # closing twice is harmless
    assert len(gc.callbacks) == n
