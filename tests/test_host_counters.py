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


def test_the_wait_at_a_phase_end_is_counted_apart(monkeypatch):
    """megatron's own ``Timer``, its stop wrapped as the seam does (``host.timer_stop_wait``):
    the time its synchronize takes (a device 30 ms behind the host, stood for by a sleep) is the
    phase's ``wait_ms``, per iteration, for the forward-backward and the optimizer only; the
    timer still measures the whole phase."""
    import torch
    from megatron.core import timers

    from megatron.md.train import host

    monkeypatch.setattr(timers.Timer, "stop", host.timer_stop_wait(timers.Timer.stop))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # the start's: no wait
    h = HostCounters()
    try:
        fb, opt, other = (timers.Timer(n) for n in ("forward-backward", "optimizer", "md-step"))
        for _ in range(2):  # two iterations
            for t, wait in ((fb, 0.03), (other, 0.02), (opt, 0.0)):
                t.start()
                monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, w=wait: time.sleep(w))
                t.stop()
                monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        got = h.per_iteration(2)
        assert 30 <= got["wait_ms/forward-backward"] < 45, got
        assert got["wait_ms/optimizer"] < 5 and "wait_ms/md-step" not in got, got
        assert fb.elapsed(reset=False) >= 0.06  # the timer's own reading: the sleeps included
        assert "wait_ms/forward-backward" not in h.per_iteration(1)  # restarted: none since
    finally:
        h.close()


def test_the_card_is_read_at_the_forward_backwards_end(monkeypatch, capsys):
    """On a GPU the card's SM clock, power and temperature (torch.cuda's NVML readers, stood for
    here: no GPU on this machine) are read right after the forward-backward's timer stops, and
    reported as per-count means; another timer reads nothing. Where NVML cannot be read (no
    nvidia-ml-py) the run goes on without them, said once, and stops trying."""
    import torch
    from megatron.core import timers

    from megatron.md.train import host

    monkeypatch.setattr(timers.Timer, "stop", host.timer_stop_wait(timers.Timer.stop))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: {})
    monkeypatch.setattr(host, "_on_cuda", lambda: True)
    monkeypatch.setattr(host, "_CARD_OFF", [])
    clocks = iter([1980, 1800])
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda *a: next(clocks))
    monkeypatch.setattr(torch.cuda, "power_draw", lambda *a: 500_000)  # mW
    monkeypatch.setattr(torch.cuda, "temperature", lambda *a: 61)
    h = HostCounters()
    try:
        fb, opt = timers.Timer("forward-backward"), timers.Timer("optimizer")
        for t in (fb, opt, fb, opt):  # two iterations
            t.start()
            t.stop()
        got = h.per_iteration(2)
        assert got["card_sm_mhz"] == 1890 and got["card_power_w"] == 500, got
        assert got["card_temp_c"] == 61, got
        assert "card_sm_mhz" not in h.per_iteration(1)  # restarted: none since

        calls = []

        def no_nvml(*a):
            calls.append(1)
            raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed")

        monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
        for _ in range(3):
            fb.start()
            fb.stop()
        got = h.per_iteration(3)
        assert not any(k.startswith("card_") for k in got) and len(calls) == 1, got
        said = capsys.readouterr().out
        assert said.count("not logged: ModuleNotFoundError: nvidia-ml-py") == 1, said
    finally:
        h.close()
