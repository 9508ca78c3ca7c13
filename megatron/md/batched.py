"""The MD step of many matrices (whole, or ZeRO-1 slices) with ONE reduction of all their
partials per step (two with tangent projection), and the multi-tensor Adam batches that make
it a handful of kernel launches on a GPU. Per-matrix arithmetic: ``sliced.SliceMD``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron.md import maps
from megatron.md.base_steps import AdamHParams, MuonHParams, adam_multi_
from megatron.md.sliced import SliceMD

#: sums a partial buffer over the ranks: (buffer, its items, each item's segment of it)
ReduceFn = Callable[[torch.Tensor, list, list], None]


def identity_reduce(buf: torch.Tensor, items=(), segs=()) -> None:
    """Reduction for whole matrices: the partials already are the totals."""


class GainBatch:
    """Gain Adam steps of many matrices, run as one multi-tensor Adam per (step, hyper-params),
    with the chain rule's φ′(ĝ) multi-tensor too: on a GPU a handful of kernel launches instead
    of ~10 per gain vector. ``work`` = (raw ĝ, ∂L/∂g partial sums, exp_avg, exp_avg_sq)."""

    def __init__(self):
        self.groups: dict[tuple, list[tuple]] = {}
        self.after: list[tuple[torch.Tensor, str]] = []

    def add(self, work: tuple, step: int, hp: AdamHParams, chain: str, after: str) -> None:
        """``chain``: the map whose φ′ multiplies the sums; ``after``: ``maps.after_step``'s."""
        key = (step, hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay)
        self.groups.setdefault(key, []).append((*work, chain))
        self.after.append((work[0], after))

    def run(self) -> None:
        for (step, *hp), works in self.groups.items():
            raws, sums, avgs, avg_sqs, chains = map(list, zip(*works))
            grads = maps.chain_multi(raws, sums, chains)
            adam_multi_(raws, grads, avgs, avg_sqs, step, AdamHParams(*hp))
        for raw, gain_map in self.after:
            maps.after_step(raw, gain_map)


class DirAdamBatch:
    """Adam steps of many directions Ŵ as one multi-tensor Adam per (step, hyper-params), in
    chunks of about ``cap`` elements (each queued matrix keeps its G_Ŵ until its chunk runs);
    after a chunk, each matrix's ``then`` (its norm partials) runs."""

    def __init__(self, cap: int):
        self.cap, self.size = cap, 0
        self.groups: dict[tuple, list[tuple]] = {}
        self.then: list[Callable[[], None]] = []

    def add(self, work: tuple, step: int, hp: AdamHParams, then: Callable[[], None]) -> None:
        key = (step, hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay)
        self.groups.setdefault(key, []).append(work)
        self.then.append(then)
        self.size += work[0].numel()
        if self.size >= self.cap:
            self.run()

    def run(self) -> None:
        for (step, *hp), works in self.groups.items():
            adam_multi_(*map(list, zip(*works)), step, AdamHParams(*hp))
        for then in self.then:
            then()
        self.groups, self.then, self.size = {}, [], 0


#: Elements of Ŵ per multi-tensor Adam chunk (bounds the G_Ŵ and Adam temporaries held at once).
DIR_BATCH_CAP = 1 << 26


@dataclass
class SliceItem:
    """One matrix (slice) taking part in a batched MD step."""

    md: SliceMD
    direction: torch.Tensor
    grad: torch.Tensor | None
    state: dict
    base_hp: AdamHParams | MuonHParams | None = None
    gain_hp: AdamHParams | None = None
    slot: int | None = None
    """Position in a global layout shared by all ranks (None: the item's own position)."""


def _segments(sizes: list[int]) -> list[slice]:
    offs, out = 0, []
    for n in sizes:
        out.append(slice(offs, offs + n))
        offs += n
    return out


def _layout(items, size_of, layout: list[int] | None):
    """Segments of a partial buffer; with ``layout`` (sizes of every matrix of the optimizer,
    in an order identical on all ranks) ranks owning different matrices still line up."""
    if layout is None:
        segs = _segments([size_of(it) for it in items])
    else:
        every = _segments(layout)
        segs = [every[it.slot] for it in items]
    total = sum(layout) if layout is not None else (segs[-1].stop if segs else 0)
    return segs, total


def _zeros(n, items):
    d = items[0].direction if items else torch.empty(0)
    return torch.zeros(n, dtype=d.dtype, device=d.device)


def _drop_replicas(items, segs, buf) -> None:
    """Zero the partials of replicas that another rank of the reduction group adds."""
    for it, s in zip(items, segs):
        if not it.md.counts:
            buf[s].zero_()


def md_init_batched(items: list[SliceItem], reduce_fn: ReduceFn, layout=None) -> None:
    """Set radii for many matrices with one reduction of their squared norms."""
    segs, total = _layout(items, lambda it: it.md.n_norm, layout)
    buf = _zeros(total, items)
    for it, s in zip(items, segs):
        it.md.norm_partials(it.direction, buf[s])
    _drop_replicas(items, segs, buf)
    if total:  # the same on every rank (global layout), so skipping is collective-safe
        reduce_fn(buf, items, segs)
    for it, s in zip(items, segs):
        it.md.finish_init(it.direction, it.state, buf[s])


def md_step_batched(
    items: list[SliceItem],
    reduce_fn: ReduceFn,
    layout=None,
    pre_layout=None,
    cap=None,
    probe: torch.Tensor | None = None,
) -> None:
    """MD step for many matrices: ONE reduction of all partials (two with tangent projection).

    ``layout``/``pre_layout``: per-matrix partial sizes in a global order (see ``_layout``).
    Ŵ's Adam runs multi-tensor in chunks of ``cap`` elements (default ``DIR_BATCH_CAP``).
    ``probe``: a one-element tensor that turns NaN (and stays so) when a reduced partial or a
    stepped gain is not finite; checked on the device, never read here.
    """
    cap = DIR_BATCH_CAP if cap is None else cap
    pre_segs, pre_total = _layout(items, lambda it: it.md.n_pre_partials(), pre_layout)
    pre = None
    if pre_total:
        pre = _zeros(pre_total, items)
        for it, s in zip(items, pre_segs):
            it.md.pre_partials(it.direction, it.grad, it.state, pre[s])
        _drop_replicas(items, pre_segs, pre)
        reduce_fn(pre, items, pre_segs)
    segs, total = _layout(items, lambda it: it.md.n_partials(), layout)
    buf = _zeros(total, items)
    dirs = DirAdamBatch(cap)
    for it, s, ps in zip(items, segs, pre_segs):
        pre_it = None if pre is None else pre[ps]
        it.md.step_direction(it.direction, it.grad, it.state, it.base_hp, buf[s], pre_it, dirs)
    dirs.run()
    _drop_replicas(items, segs, buf)
    if total:
        reduce_fn(buf, items, segs)
        _mark_nonfinite(probe, buf)
    gains = GainBatch()
    for it, s in zip(items, segs):
        it.md.project_and_step_gains(it.direction, it.state, it.gain_hp, buf[s], gains)
    gains.run()
    if gains.after:
        _mark_nonfinite(probe, torch.stack(torch._foreach_norm([r for r, _ in gains.after])))


def _mark_nonfinite(probe: torch.Tensor | None, x: torch.Tensor) -> None:
    if probe is not None:
        probe.add_(torch.where(torch.isfinite(x).all(), 0.0, float("nan")))
