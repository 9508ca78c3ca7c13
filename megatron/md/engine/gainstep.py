"""The gains' Adam of every group of a step at once (``GainBatch``), with the plain tensors the
step was given: the engine's tail after the partials' reduction (Algorithm 2, line 9, and the
chain rule through the gain map). Its gradients are views of the step's partial buffer, copied
out by one gather (``_dense_copies``) so that torch's multi-tensor fast path takes them."""

from __future__ import annotations

from typing import Sequence

import torch

from megatron.md import maps
from megatron.md.base_steps import adam_multi_, merged_hparams
from megatron.md.config import GAIN_FLOOR


class GainBatch:
    """The gains' Adam of every group at once, with the plain tensors' the step was given
    (``Engine.run``'s ``extra``): the chain rule's φ′(ĝ) one multi-tensor operation and product
    per map, one multi-tensor Adam per set of betas and epsilon (``merged_hparams``: the
    parameter groups' LRs and decays as scalar lists; a set a parameter group where they are
    device tensors), the floor of direct-floor. One Adam where the gains' hyper-parameter sets
    and the 1-D parameters' took one each: 7 fewer launches of AdamMD's step at the 12-layer
    layout (2026-12-05)."""

    def __init__(self):
        #: (tensor, gradient, exp_avg, exp_avg_sq, AdamHParams, chain, gain map)
        self.works: list[tuple] = []
        self.raws: list[torch.Tensor] = []
        #: the works whose gradient is a view of the step's partial buffer (``add``'s)
        self.from_partials: list[int] = []

    def add(self, g, name: str, grad: torch.Tensor, chain: str, gain_map: str, hp) -> None:
        self.from_partials.append(len(self.works))
        self.works.append((g.gains[name], grad, g.moments[name + "_exp_avg"],
                           g.moments[name + "_exp_avg_sq"], hp, chain, gain_map))  # fmt: skip
        self.raws.append(g.gains[name])

    def add_plain(self, works: Sequence[tuple]) -> None:
        """(tensor, gradient, exp_avg, exp_avg_sq, AdamHParams) each: an Adam step, no map."""
        self.works += [(*w, "direct", "direct") for w in works]

    def run(self, step) -> None:
        grads = [w[1] for w in self.works]
        # the gains' gradients are views of the step's partial buffer (a group's rows of
        # n_partial: strides unlike their gains'), which torch's multi-tensor fast path
        # refuses (a kernel a tensor on a GPU, in the chain rule and in Adam): copied out by
        # one gather
        ours = set(self.from_partials)
        for i, gr in zip(self.from_partials, _dense_copies([grads[i] for i in self.from_partials])):
            grads[i] = gr
        by_chain: dict[str, list[int]] = {}
        for i, w in enumerate(self.works):
            if w[5] in maps.CHAIN_MAPS:
                by_chain.setdefault(w[5], []).append(i)
        for chain, idx in by_chain.items():
            unary = torch._foreach_sigmoid if chain == "softplus" else torch._foreach_exp
            raws, chained = [self.works[i][0] for i in idx], [grads[i] for i in idx]
            if ours.issuperset(idx):  # the copies: multiplied in place
                torch._foreach_mul_(chained, unary(raws))
                continue
            for i, gr in zip(idx, torch._foreach_mul(chained, unary(raws))):
                grads[i] = gr
        # a parameter group's tensors share one AdamHParams: its set looked up once a step
        keys: dict[int, tuple] = {}
        sets: dict[tuple, list[int]] = {}
        for i, w in enumerate(self.works):
            key = keys.get(id(w[4]))
            if key is None:
                shared = merged_hparams(w[4])
                key = keys[id(w[4])] = ("device", hp_key(w[4])) if shared is None else shared
            sets.setdefault(key, []).append(i)
        for key, idx in sets.items():
            # an AdamHParams a tensor (where all agree: one group's Adam, the same numbers)
            hps = [self.works[i][4] for i in idx]
            adam_multi_([self.works[i][0] for i in idx], [grads[i] for i in idx],
                        [self.works[i][2] for i in idx], [self.works[i][3] for i in idx],
                        step, hps[0] if key[0] == "device" else hps)  # fmt: skip
        floor = [w[0] for w in self.works if w[6] == "direct-floor"]
        if floor:
            torch._foreach_clamp_min_(floor, GAIN_FLOOR)


#: (layout of the tensors of one storage) -> (their elements' storage index, one past the last)
_GATHER: dict[tuple, tuple[torch.Tensor, int]] = {}


def _dense_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of ``tensors``, those of one storage gathered by one ``index_select``
    (the index made once per layout; ``GainBatch.run``'s strided gain gradients: the chain
    rule's product took one kernel a gain on a GPU, 10 at the 12-layer layout, 2026-12-05,
    ``bench_dispatch.py --gpu-launches``)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_storage: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        by_storage.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append(i)
    for idx in by_storage.values():
        ts = [tensors[i] for i in idx]
        key = (ts[0].device, *((t.storage_offset(), t.shape, t.stride()) for t in ts))
        if key not in _GATHER:  # each element's place in the storage, in the copies' order
            end = max(t.storage_offset() + _extent(t) for t in ts)
            _GATHER[key] = (torch.cat([_places(t) for t in ts]).to(ts[0].device), end)
        where, end = _GATHER[key]
        flat = ts[0].as_strided((end,), (1,), 0).index_select(0, where)
        for i, piece in zip(idx, flat.split([t.numel() for t in ts])):
            out[i] = piece.view(tensors[i].shape)
    return out  # type: ignore[return-value]


def _places(t: torch.Tensor) -> torch.Tensor:
    """The storage index of each element of ``t``, row-major (made on the CPU, once)."""
    at = torch.full(t.shape, t.storage_offset(), dtype=torch.long)
    for d, (n, st) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[d] = n
        at = at + torch.arange(n).view(shape) * st
    return at.reshape(-1)


def _extent(t: torch.Tensor) -> int:
    """One past the last storage element ``t`` covers, from its offset (0 if it is empty)."""
    return 0 if t.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def hp_key(hp) -> tuple:
    return tuple(sorted(vars(hp).items()))
