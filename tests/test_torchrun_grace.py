"""megatron/md/torchrun.py: torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT for the ranks after it
passes on a stop signal, on a torch that does not read the variable (before 2.12).

The torch here reads it, so the tests give the wait with ``give_grace`` on top of a shorter one
set the native way: the patched torchrun must wait longer than torchrun itself would."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a rank that, once signalled, needs SAVE_S seconds before it has "saved" and exits 0
RANK = """
import os, pathlib, signal, sys, time
out, save_s = pathlib.Path(sys.argv[1]), float(sys.argv[2])
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
(out / "ready").write_text(str(os.getpid()))
while not got:
    time.sleep(0.05)
time.sleep(save_s)
(out / "saved").touch()
"""

# torchrun in this process, given ``argv[1]`` seconds by megatron.md.torchrun ("-": as it is)
DRIVER = """
import sys
from megatron.md import torchrun
if sys.argv[1] != "-":
    torchrun.give_grace(float(sys.argv[1]))
sys.argv = ["torchrun", *sys.argv[2:]]
from torch.distributed.run import main
main()
"""


def _stop_after_save(tmp_path: Path, grace: str) -> tuple[bool, float]:
    """A one-rank torchrun whose rank needs 3 s to save after SIGTERM, torchrun's own wait 1 s;
    SIGTERM to torchrun and the rank (as SLURM sends it). Whether it saved; seconds to exit."""
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"}
    cmd = [sys.executable, str(tmp_path / "driver.py"), grace, "--standalone",
           "--nproc-per-node", "1", str(tmp_path / "rank.py"), str(tmp_path), "3"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists() or not (tmp_path / "ready").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    os.kill(int((tmp_path / "ready").read_text()), signal.SIGTERM)
    proc.wait(timeout=60)
    return (tmp_path / "saved").exists(), time.monotonic() - signalled


@pytest.mark.distributed  # two torchrun launches (~3 s each)
def test_a_signalled_rank_gets_the_wait_and_is_not_killed(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    saved, _ = _stop_after_save(tmp_path / "a", "-")
    assert not saved  # torchrun's 1 s: killed mid-save
    saved, took = _stop_after_save(tmp_path / "b", "30")
    assert saved and took < 20  # waited for the rank, not for the whole 30 s


@pytest.fixture
def recorded(monkeypatch):
    """torchrun's two names, restored after the test; ``close`` records its timeouts."""
    from torch.distributed.elastic.multiprocessing import api

    timeouts = []

    def close(self, death_sig=None, timeout=30):
        timeouts.append(timeout)

    monkeypatch.setattr(api.PContext, "close", close)
    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    return api, timeouts


def test_only_a_stop_signal_lengthens_the_wait(recorded):
    """A rank's crash still stops the others after torchrun's own 30 s (as torch >= 2.12)."""
    from megatron.md import torchrun

    api, timeouts = recorded
    torchrun.give_grace(600)
    api.PContext.close(None, signal.SIGTERM)  # the agent stopping the ranks after a failure
    with pytest.raises(api.SignalException):
        api._terminate_process_handler(signal.SIGTERM, None)  # what PContext.start installs
    api.PContext.close(None, signal.SIGTERM)
    assert timeouts == [30, 600]


def test_a_torch_whose_names_differ_stops_the_launch(recorded, monkeypatch, capsys):
    from megatron.md import torchrun

    api, _ = recorded
    monkeypatch.setattr(api.PContext, "close", lambda self, death_sig=None: None)
    monkeypatch.setattr(torchrun, "reads_timeout", lambda: False)
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "1800")
    with pytest.raises(SystemExit) as stop:
        torchrun.main()
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1800" in str(stop.value.code)
    assert "PContext.close(death_sig, timeout)" in str(stop.value.code)
    assert torchrun.GRACE_ENV not in os.environ
