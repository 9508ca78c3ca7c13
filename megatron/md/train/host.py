"""What the host did per iteration, beside megatron's timers (the ``host`` entry of a train row).

A step can be slower for reasons no timer names: more Python work on the thread that launches the
kernels, Python's cyclic garbage collector running inside it, or the CUDA caching allocator going
to the driver (``cudaMalloc``; with a retry, after freeing its whole cache and synchronizing)
because the blocks it caches no longer fit. On one H100 (2026-11-26) AdamMD's forward-backward
took 124 ms against AdamW's 102 on the same model and no timer said why; these counters say which
of the three it is, or that it is none of them (the device itself).

The loop thread's CPU time alone cannot say it on a GPU: CUDA's default schedule spins the
thread that waits for the device (a process with fewer CUDA contexts than CPUs), so the waits
in megatron's timers (each ``Timer.stop`` synchronizes) count as CPU time. Those waits are
counted apart (``timer_stop_wait``): at the end of the forward-backward, the time the device
still needed after the host had issued the phase's last kernel — about 0 where the host is the
bottleneck, the device's excess where it is not.

A device-bound phase can still be slower on one run than another with the same kernels: the card
lowers its clocks at its power or thermal limit. Right after that wait the card's own readings
are taken (``card_*``: SM clock, power, temperature; NVML through torch.cuda's ``clock_rate``,
``power_draw`` and ``temperature``, documented there as over the driver's last sample period,
1/6–1 s), where nvidia-ml-py imports; without it there are none, said once.
"""

from __future__ import annotations

import collections
import functools
import gc
import time

import torch

#: the phases whose end waits are reported (``wait_ms/<phase>``): together they make the step
WAITED = ("forward-backward", "optimizer")
#: seconds spent in each megatron timer's ``stop`` since the last count (its synchronize)
_WAITS: collections.defaultdict[str, float] = collections.defaultdict(float)
#: the phase at whose end the card is read
CARD_AT = "forward-backward"
#: the card's readings at each end of ``CARD_AT`` since the last count; name -> (torch.cuda
#: function, factor to the unit in the name)
CARD = {"card_sm_mhz": ("clock_rate", 1.0), "card_power_w": ("power_draw", 1e-3),
        "card_temp_c": ("temperature", 1.0)}  # fmt: skip
_CARD: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
#: why the card cannot be read, once it failed (empty: not tried yet, or readable)
_CARD_OFF: list[str] = []


def _on_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def read_card() -> None:
    """One reading of each ``CARD`` value into ``_CARD`` (none on a CPU; after the first failure,
    none again: the reason is printed once and kept in ``_CARD_OFF``)."""
    if _CARD_OFF or not _on_cuda():
        return
    try:
        got = {name: getattr(torch.cuda, fn)() * k for name, (fn, k) in CARD.items()}
    except Exception as e:  # nvidia-ml-py missing, or NVML refusing (a MIG slice)
        _CARD_OFF.append(f"{type(e).__name__}: {e}")
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"[megatron-md] the card's clock, power and temperature are not logged: "
                  f"{_CARD_OFF[0]}", flush=True)  # fmt: skip
        return
    for name, value in got.items():
        _CARD[name].append(value)


def timer_stop_wait(orig, run=None):
    """megatron's ``Timer.stop`` synchronizes the device before reading the clock: the time
    spent inside it, per timer, into ``_WAITS`` (0 on a CPU, where the synchronize is none);
    at the end of ``CARD_AT``, after it, the card's readings (``read_card``)."""

    @functools.wraps(orig)
    def stop(self, barrier=False):
        t0 = time.perf_counter()
        try:
            return orig(self, barrier)
        finally:
            _WAITS[self.name] += time.perf_counter() - t0
            if self.name == CARD_AT:
                read_card()

    return stop


def timed(name: str, fn):
    """``fn`` under megatron's timer ``name`` at log level 2 (``--timing-log-level 2``; else a
    no-op timer), where megatron's training has set its timers up (not in a tool that builds the
    optimizers alone). For what megatron-core leaves untimed inside a timed phase: its
    ``ChainedOptimizer.step`` (core/optimizer/optimizer.py:1855) times neither the gradient norm
    nor the clipping."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        from megatron.training.global_vars import get_timers

        try:
            t = get_timers()(name, log_level=2)
        except AssertionError:  # no training set up
            return fn(*args, **kwargs)
        t.start()
        try:
            return fn(*args, **kwargs)
        finally:
            t.stop()

    return call


class HostCounters:
    """Counters since the last :meth:`per_iteration` (or :meth:`reset`), as per-iteration means.

    ``cpu_ms``: CPU time of the thread that calls it (the training loop's, which issues every
    kernel), so against the iteration's wall time it says how host-bound the loop is — on a
    GPU less its waits for the device, which it includes (spun); ``gc_ms``
    and ``gc_runs``: time in and number of Python's cyclic collections (any generation, any
    thread); on CUDA ``cuda_mallocs`` and ``cuda_alloc_retries``: the caching allocator's device
    allocations and failed-then-retried ones (``torch.cuda.memory_stats``: ``num_device_alloc``,
    ``num_alloc_retries``), 0 in a steady state that reuses its cache; ``wait_ms/<phase>`` for
    the ``WAITED`` phases timed (``--timing-log-level`` ≥ 1): the wait for the device at the
    phase's end (``timer_stop_wait``), which ``cpu_ms`` includes on a GPU; ``card_sm_mhz``,
    ``card_power_w`` and ``card_temp_c``: the means of the card's readings at the
    forward-backward's ends (``read_card``)."""

    def __init__(self) -> None:
        self._gc_s, self._gc_runs, self._gc_t0 = 0.0, 0, None
        gc.callbacks.append(self._on_gc)
        self.reset()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self._gc_s += time.perf_counter() - self._gc_t0
            self._gc_runs += 1
            self._gc_t0 = None

    @staticmethod
    def _cuda() -> dict:
        if not _on_cuda():
            return {}
        stats = torch.cuda.memory_stats()
        return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_alloc_retries")}

    def close(self) -> None:
        """Stop counting collections (the callback leaves ``gc.callbacks``)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def reset(self) -> None:
        self._cpu = time.thread_time()
        self._gc_s, self._gc_runs = 0.0, 0
        self._alloc = self._cuda()
        _WAITS.clear()
        _CARD.clear()

    def per_iteration(self, n_iters: int) -> dict:
        """The means over the ``n_iters`` iterations since the last call; starts the next count."""
        n = max(1, n_iters)
        out = {
            "cpu_ms": 1e3 * (time.thread_time() - self._cpu) / n,
            "gc_ms": 1e3 * self._gc_s / n,
            "gc_runs": self._gc_runs / n,
        }
        alloc = self._cuda()
        if alloc and self._alloc:
            out["cuda_mallocs"] = (alloc["num_device_alloc"] - self._alloc["num_device_alloc"]) / n
            retries = alloc["num_alloc_retries"] - self._alloc["num_alloc_retries"]
            out["cuda_alloc_retries"] = retries / n
        for phase in WAITED:
            if phase in _WAITS:
                out[f"wait_ms/{phase}"] = 1e3 * _WAITS[phase] / n
        for name, values in _CARD.items():
            if values:
                out[name] = sum(values) / len(values)
        self.reset()
        return out
