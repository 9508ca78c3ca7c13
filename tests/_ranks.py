"""Several "ranks" of MD's engine in one process: each rank an ``Engine`` over its slices or
TP pieces, run in its own thread; a reduction sums the ranks' buffers as an all-reduce would
(a barrier before and after). The in-process tests of the engine against the reference use it
(tests/test_engine.py, tests/test_tensor_parallel.py)."""

from __future__ import annotations

import threading

import torch

from megatron.md.base_steps import AdamHParams, MuonHParams
from megatron.md.engine.engine import Domain, Engine, HParams, Member
from megatron.md.engine.graph import DeviceScalars


class Ranks:
    """``pieces[r]``: rank r's members as (SliceMD, its flat starting direction, its global
    index); every rank's one reduction domain has the global ``layout``; ``order``: global
    index -> ``Member.order``."""

    def __init__(self, pieces: list[list[tuple]], dtype, compiled: bool = False,
                 order: dict | None = None, fallback: bool = False):  # fmt: skip
        self.engines, self.n, keys = [], len(pieces), order
        mds = {i: md for rank in pieces for md, _, i in rank}
        order = sorted(mds)
        lay = lambda f: [f(mds[i]) for i in order]  # noqa: E731
        for rank in pieces:
            members = []
            for md, d0, i in rank:
                main = torch.nn.Parameter(d0.clone().to(dtype))
                members.append(Member(md, main, False, {}, {}, 0, "d", order.index(i), seed=0,
                                      order=(keys or {}).get(i, 0)))  # fmt: skip
            dom = Domain(self._reduce, lay(lambda m: m.n_partials()), lay(lambda m: m.n_norm),
                         lay(lambda m: m.n_pre_partials()))  # fmt: skip
            self.engines.append(Engine(members, {"d": dom}, compiled, fallback))
        self._barrier = threading.Barrier(self.n)
        self._acc: list = []
        self._lock = threading.Lock()
        self.reductions: list[int] = []  # buffer sizes, one per reduction of rank 0
        self.scalars: dict[int, DeviceScalars] = {}

    def _reduce(self, buf: torch.Tensor) -> None:
        if self.n == 1:  # one rank: its partials are the totals
            self.reductions.append(buf.numel())
            return
        with self._lock:
            self._acc.append(buf)
        self._barrier.wait()
        total = sum(b.clone() for b in self._acc)
        self._barrier.wait()
        buf.copy_(total)
        if buf is self._acc[0]:
            self.reductions.append(buf.numel())
        self._barrier.wait()
        with self._lock:
            self._acc.clear()
        self._barrier.wait()

    def _each(self, fn) -> None:
        if self.n == 1:  # on this thread (a dispatch mode of the caller's sees its operations)
            fn(0, self.engines[0])
            return
        errors = []

        def run(r):
            try:
                fn(r, self.engines[r])
            except BaseException as e:  # re-raised below, on the test's thread
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def init(self) -> None:
        self._each(lambda r, e: e.init_state(lambda key, buf: self._reduce(buf)))

    def step(self, grads: list[list[torch.Tensor]], base_hp, gain_hp, device=False) -> None:
        """``grads[r]``: rank r's gradient of each member, flat; ``device``: the step count and
        LRs read from the device (``engine/graph.py``: what a CUDA graph replays)."""
        hp = HParams(adam=base_hp, muon=base_hp, gain=gain_hp)
        if isinstance(base_hp, MuonHParams):
            hp.adam = AdamHParams(base_hp.lr)  # (not read: every member's base is Muon)

        def one(r, e):
            for m, g in zip(e.members, grads[r]):
                m.main.grad = g.to(m.main.dtype)
            reduce = lambda key, buf: self._reduce(buf)  # noqa: E731
            if not device:
                e.step({0: hp}, reduce)
                return
            if r not in self.scalars:
                self.scalars[r] = DeviceScalars(e.probe.device, e.groups[0].W.dtype)
            e.advance()
            dev = self.scalars[r].write(e.steps, {0: hp})
            e.run(dev, reduce, self.scalars[r].step)

        self._each(one)

    def fuse(self, outs: list[list[torch.Tensor]]) -> None:
        for e, out in zip(self.engines, outs):
            e.fuse({id(m): o for m, o in zip(e.members, out)})
