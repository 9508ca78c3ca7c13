"""``python -m megatron.md.torchrun [torchrun's arguments]``: torchrun, whose wait between
passing on a stop signal and killing the ranks is ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds on
every torch, not only on the releases that read it.

torchrun answers a SIGTERM (preemption, ``scancel``, SLURM's early warning) by passing it on and
SIGKILLing its ranks after a wait: 30 s whatever is set before torch 2.12, which reads the
variable (PyTorch PR 172596). A large model's signal save takes longer, and the NGC containers
of 2025 ship an older torch. There this module gives torchrun the wait after a stop signal, and
only then (a rank's crash still stops the others after torchrun's 30 s, as torch >= 2.12 does),
through its two names in torch/distributed/elastic/multiprocessing/api.py:
``_terminate_process_handler`` (``PContext.start`` installs it for the stop signals; it raises
``SignalException``) and ``PContext.close(death_sig, timeout=30)`` (the agent's shutdown calls
it with the default). Where they are not as read, the launch stops before starting anything.
The ranks see ``MEGATRON_MD_TORCHRUN_GRACE`` (the seconds given), so the start-up banner does
not warn of the 30 s (``train.startup.stop_grace``). Run on torch 2.9.1, 2.11.0 and 2.15.0
(2026-11-27, CPU); the two names read in 2.10.0's source as well.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys

GRACE_ENV = "MEGATRON_MD_TORCHRUN_GRACE"  # the ranks' view: the wait this module gave


def reads_timeout() -> bool:
    """Whether this torch's torchrun reads ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` itself."""
    from torch.distributed.launcher.api import LaunchConfig

    return any(f.name == "shutdown_timeout" for f in dataclasses.fields(LaunchConfig))


def give_grace(seconds: float) -> None:
    """Make torchrun wait ``seconds`` (at least its own timeout) for the ranks after it passes
    on a stop signal. Raises ``RuntimeError`` where torch's names differ from the ones read."""
    from torch.distributed.elastic.multiprocessing import api

    handler = getattr(api, "_terminate_process_handler", None)
    close = getattr(getattr(api, "PContext", None), "close", None)
    params = list(inspect.signature(close).parameters) if callable(close) else []
    if not callable(handler) or params != ["self", "death_sig", "timeout"]:
        raise RuntimeError(
            "torch.distributed.elastic.multiprocessing.api has no _terminate_process_handler "
            "and PContext.close(death_sig, timeout) as megatron/md/torchrun.py reads them: "
            "its wait after a stop signal cannot be set on this torch; unset "
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT to run torchrun as it is (ranks killed 30 s after "
            "a stop signal)"
        )
    signalled: list[int] = []

    def on_signal(signum, frame):
        signalled.append(signum)
        handler(signum, frame)

    def close_after_signal(self, death_sig=None, timeout=30):
        return close(self, death_sig, max(timeout, seconds) if signalled else timeout)

    api._terminate_process_handler = on_signal
    api.PContext.close = close_after_signal


def main() -> None:
    wait = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
    if wait and not reads_timeout():
        try:
            give_grace(float(wait))
        except ValueError:
            sys.exit(f"megatron.md.torchrun: TORCH_ELASTIC_SHUTDOWN_TIMEOUT={wait}: not seconds")
        except RuntimeError as e:
            sys.exit(f"megatron.md.torchrun: TORCH_ELASTIC_SHUTDOWN_TIMEOUT={wait}: {e}")
        os.environ[GRACE_ENV] = wait
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
