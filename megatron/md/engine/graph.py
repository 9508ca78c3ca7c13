"""The MD step replayed from a CUDA graph (``--md-cuda-graph``, off by default).

On a GPU a small model's MD step costs the kernels Python issues, not their work; a CUDA graph
issues a whole step's kernels at once. Captured: ``MDInner``'s inner step — the engine's step
of every MD matrix with its reductions, the 1-D parameters' Adam, the fused weights
W = Γ ⊙ Ŵ into megatron's param buffer or fp32 weights. Not megatron's wrapper around it
(gradient copies, clipping, the param all-gather): it reads the gradient norm on the host.

What a replay needs, and how it gets it:

- the numbers that change between steps (the step count; each parameter group's LR, weight
  decay and gains' LR) live in one device tensor (``DeviceScalars``), written before every
  step by one host-to-device copy; the step reads them as 0-d tensors (``adam_multi_``'s
  device path, Muon's ``addcmul_``, the compiled kernels' scalars);
- every tensor the step reads or writes outside the graph's own memory pool stays where it
  was at the capture: megatron's grad and param buffers (``main_param.grad`` is a view of the
  grad buffer when that buffer is fp32, megatron's default with ``--bf16``), the engine's
  storage, the probe. The addresses of the gradients and of the destinations are compared
  before every replay, and one that moved raises: never a replay on stale memory;
- the host's bookkeeping (the step count that checkpoints read, the collective counters) is
  done outside the graph.

The first ``WARMUP`` steps run eagerly on the same device-scalar arithmetic (the compiled
kernels compile, NCCL and cuBLAS set up), on a side stream as torch's capture wants; the next
is captured and then replayed, and so is every later step. A change in the step's structure (a
parameter group's weight decay turning on or off, other betas, another set of 1-D gradients)
captures again; a checkpoint load drops the graph.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

#: eager steps before the capture
WARMUP = 3


class DeviceScalars:
    """The step count and every parameter group's LR, weight decay and gains' LR in one device
    tensor (of Ŵ's dtype, fp32), and the hyper-parameters that read them (made again only when
    what stays fixed between steps changes: ``key``)."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32):
        self.device, self.dtype = torch.device(device), dtype
        self.values: torch.Tensor | None = None
        self.step: torch.Tensor | None = None  # 0-d view: the 1-based step count
        self.key = None
        self.hps: dict | None = None

    def write(self, step: int, hps: dict) -> dict:
        """Put ``step`` and ``hps``' changing numbers on the device (one copy, not waited for);
        returns ``hps`` with those numbers as 0-d views of the device tensor."""
        order = sorted(hps)
        key = tuple((i, _fixed(hps[i])) for i in order)
        if key != self.key:
            self.values = torch.zeros(1 + 3 * len(order), dtype=self.dtype, device=self.device)
            self.step = self.values[0]
            self.hps = {i: _on_device(hps[i], self.values, 1 + 3 * k) for k, i in enumerate(order)}
            self.key = key
        host = [float(step)]
        for i in order:
            hp = hps[i]
            host += [hp.adam.lr, hp.adam.weight_decay, hp.gain.lr]
        src = torch.tensor(host, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        self.values.copy_(src, non_blocking=True)  # the pinned block outlives the copy (torch)
        return self.hps


def _fixed(hp) -> tuple:
    """What a captured step takes as constants: a change means capturing again."""
    a, g = hp.adam, hp.gain
    muon = None if hp.muon is None else dataclasses.astuple(dataclasses.replace(hp.muon, lr=0.0))
    return (a.beta1, a.beta2, a.eps, a.weight_decay != 0, muon, g.beta1, g.beta2, g.eps)


def _on_device(hp, values: torch.Tensor, off: int):
    lr, wd, gain_lr = values[off], values[off + 1], values[off + 2]
    adam = dataclasses.replace(hp.adam, lr=lr, weight_decay=wd if hp.adam.weight_decay else 0.0)
    muon = None if hp.muon is None else dataclasses.replace(hp.muon, lr=lr)
    return dataclasses.replace(
        hp, adam=adam, muon=muon, gain=dataclasses.replace(hp.gain, lr=gain_lr)
    )


class StepGraph:
    """Warm-up, capture and replay of one optimizer's inner step."""

    def __init__(self, warmup: int = WARMUP):
        self.warmup = warmup
        self.left = warmup
        self.graph = None
        self.key = None
        self.addresses: list[int] | None = None
        self.replays = 0  # steps run from a graph (a capture's included)

    def drop(self) -> None:
        """Forget the graph (a load replaced state): eager steps and a capture again."""
        self.graph, self.key, self.addresses, self.left = None, None, None, self.warmup

    def run(
        self, body: Callable[[], None], key, addresses: list[int], name: Callable[[int], str]
    ) -> str:
        """One step: ``body`` run eagerly ("eager"), captured and replayed once ("captured"),
        or the graph replayed ("replayed"); ``key``: the step's structure (a change drops the
        graph); ``addresses``: the data pointers of every tensor outside the graph's pool that
        may move, ``name(k)`` what the k-th is."""
        if key != self.key:
            self.drop()
            self.key = key
        if self.graph is not None:
            if addresses != self.addresses:
                raise RuntimeError(_moved(self.addresses, addresses, name))
            self.graph.replay()
            self.replays += 1
            return "replayed"
        if self.left > 0:
            self.left -= 1
            self._eager(body)
            return "eager"
        try:
            graph = self._capture(body)
        except Exception as e:
            raise RuntimeError(
                f"--md-cuda-graph: the MD step could not be captured ({type(e).__name__}: {e}); "
                "run without --md-cuda-graph"
            ) from e
        self.graph, self.addresses = graph, addresses
        graph.replay()  # a capture records the kernels, it runs none
        self.replays += 1
        return "captured"

    @staticmethod
    def _eager(body: Callable[[], None]) -> None:
        side = torch.cuda.Stream()  # torch's capture wants its warm-up on a side stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)

    @staticmethod
    def _capture(body: Callable[[], None]):
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            body()
        return graph


def _moved(before: list[int], now: list[int], name: Callable[[int], str]) -> str:
    for k, (a, b) in enumerate(zip(before, now)):
        if a != b:
            return (
                f"--md-cuda-graph: {name(k)} moved since the MD step was captured (address {a:#x} "
                f"-> {b:#x}); a replay would read stale memory. The gradients stay in megatron's "
                "grad buffer only when it is fp32 (megatron's default with --bf16; not with "
                "--grad-reduce-in-bf16)"
            )
    return (
        f"--md-cuda-graph: the step's tensors changed since the capture ({len(before)} -> "
        f"{len(now)}); a replay would read stale memory"
    )
