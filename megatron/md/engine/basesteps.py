"""The base optimizer of the MD step (Algorithm 2, line 7: Ŵ's own update), behind one small
interface the engine asks, and its registry. Adding a base (Lion, say) is one class here and
one entry in ``BASE_STEPS``; nothing else tests for a base's name.

A base steps many groups of matrices at once: each group's directions, direction gradients
G_Ŵ and state are stacked (``(B, L)``: B matrices of L elements each), so a step is a fixed
number of batched or multi-tensor operations whatever the number of matrices.
"""

from __future__ import annotations

import math

import torch

from megatron.md.base_steps import (
    AdamHParams,
    MuonHParams,
    adam_multi_,
    hyperball_,
    muon_scale_factor,
)

#: on a CPU, matrices (or Q/K/V blocks) from this many elements are orthogonalized one call
#: each: there torch's batched matmul is slower than one matmul per matrix (8 % at 4096×1024,
#: B = 6, torch 2.15, one thread), and such a matrix's step is compute-bound, not launch-bound
NS_ONE_BY_ONE_CPU = 1 << 20


class BaseStep:
    """What the engine needs of a base optimizer."""

    name = ""
    fields: tuple[str, ...] = ()
    """Its state per matrix, shaped like Ŵ (checkpointed by megatron as the base's state)."""
    whole_matrices = False
    """Whether it needs whole matrices (a ZeRO-1 slice will not do)."""
    writes_grads = False
    """Whether its step writes the G_Ŵ it is given (then never megatron's gradients)."""

    def step(self, groups: list, grads: list[torch.Tensor], step, hp) -> None:
        """Update every group's Ŵ in place from its G_Ŵ (``grads``, stacked like Ŵ) at the
        1-based ``step`` with the hyper-parameters ``hp`` shared by the groups. ``step`` and
        ``hp``'s LR are Python numbers, or 0-d device tensors (a step a CUDA graph replays:
        then no value may reach Python)."""
        raise NotImplementedError


class AdamStep(BaseStep):
    """torch AdamW's arithmetic, no weight decay (MD holds Ŵ on a sphere): one multi-tensor
    Adam for all the groups (what megatron runs without TE/apex on a GPU)."""

    name = "adam"
    fields = ("exp_avg", "exp_avg_sq")

    def step(self, groups, grads, step, hp: AdamHParams) -> None:
        adam_multi_(
            [g.W for g in groups], grads,
            [g.state["exp_avg"] for g in groups], [g.state["exp_avg_sq"] for g in groups],
            step, hp,
        )  # fmt: skip


class MuonStep(BaseStep):
    """emerging-optimizers' Muon (momentum, Nesterov, Newton–Schulz) as megatron runs it per
    matrix, here one batched Newton–Schulz call per group and Q/K/V block: the same
    arithmetic (``newton_schulz`` on a (B, m, n) batch; on a CPU bit for bit the per-matrix
    result for matrices of at least 8 rows and columns, an fp32 rounding apart below; large
    matrices on a CPU one call each, ``NS_ONE_BY_ONE_CPU``). Under tensor parallelism the
    group's pieces are gathered into full matrices first (megatron's ``--muon-tp-mode
    duplicated``)."""

    name = "muon"
    fields = ("momentum_buffer",)
    whole_matrices = True
    writes_grads = True  # Nesterov's blend, in place

    def step(self, groups, grads, step, hp: MuonHParams) -> None:
        from emerging_optimizers import utils as eo_utils

        moms = [g.state["momentum_buffer"] for g in groups]
        torch._foreach_lerp_(moms, grads, 1 - hp.momentum)
        if hp.nesterov:  # the gradient buffers are temporaries: Nesterov's blend in place
            torch._foreach_lerp_(grads, moms, hp.momentum)
        else:
            grads = moms
        with eo_utils.fp32_matmul_precision(hp.fp32_matmul_prec):
            for g, x in zip(groups, grads):
                x = x.view(g.B, *g.local)
                if self.one_by_one(g):
                    self._step_one_by_one(g, x, hp)
                    continue
                upd = self._orthogonalized(g, x, hp)
                if g.tangent_update is not None:  # muown-unit: the step on the tangent space
                    upd = g.tangent_update(upd)
                _descend(g.W, upd, hp.lr)

    @staticmethod
    def one_by_one(g) -> bool:
        """Whether group ``g``'s matrices are orthogonalized and applied one at a time
        (``NS_ONE_BY_ONE_CPU``; whole matrices each its own block, no tangent step)."""
        return (
            _one_call_each(g.W.device, g.B, math.prod(g.local))
            and g.gather is None and not g.spec.row_blocks and g.tangent_update is None
        )  # fmt: skip

    def _step_one_by_one(self, g, x: torch.Tensor, hp: MuonHParams) -> None:
        """Each matrix's update scaled in place and applied as it is made, as megatron's
        per-matrix Muon does: stacking the results first wrote two more B-matrix tensors a step
        (the 457M model's six 8192 x 1024 matrices of a rank: 0.55 s of profiled copies and
        scaling; MuonMD/Muon inner step 1.05 -> 0.99, 2 ranks, torch 2.15.0, 2026-12-03)."""
        scale = g.current_muon_scale()  # (B, 1)
        w3 = g.W.view(x.shape)
        for b in range(g.B):
            _descend(w3[b], _scaled(self._ns(x[b], g, hp), scale[b]), hp.lr)

    @staticmethod
    def _ns(y: torch.Tensor, g, hp: MuonHParams) -> torch.Tensor:
        """Newton–Schulz of ``y`` (one matrix or a batch), a new tensor; MuonH's rescale."""
        from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

        o = newton_schulz(y, steps=hp.ns_steps, coefficient_type=hp.coefficient_type)
        return hyperball_(o) if g.spec.muon_scale == "hyperball" else o

    def _orthogonalized(self, g, x: torch.Tensor, hp: MuonHParams) -> torch.Tensor:
        def ns(y):
            if not _one_call_each(y.device, y.shape[0], y[0].numel()):
                return self._ns(y, g, hp)
            out = torch.empty_like(y)
            for b in range(y.shape[0]):
                out[b] = self._ns(y[b], g, hp)
            return out

        if g.gather is not None:
            x = g.gather.full(x)
        scale = g.current_muon_scale()  # (B, blocks)
        if not g.spec.row_blocks:
            out = _scaled(ns(x), scale.view(g.B, 1, 1))
        else:
            rows, cols = x.shape[1:]
            period = sum(g.spec.row_blocks)
            x4 = x.view(g.B, rows // period, period, cols)
            out = torch.empty_like(x4)
            for b, sl in enumerate(g.qkv_slices):
                part = ns(x4[:, :, sl].reshape(g.B, -1, cols))
                part *= scale[:, b].view(g.B, 1, 1)
                out[:, :, sl] = part.view(g.B, rows // period, -1, cols)
            out = out.view(g.B, rows, cols)
        return out if g.gather is None else g.gather.own(out)


def _one_call_each(device: torch.device, B: int, numel: int) -> bool:
    """Whether B matrices (or blocks) of ``numel`` elements each are orthogonalized one
    Newton–Schulz call each (``NS_ONE_BY_ONE_CPU``) rather than in one batched call."""
    return device.type == "cpu" and B > 1 and numel >= NS_ONE_BY_ONE_CPU


def _scaled(o: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``o * scale`` for a new ``o``: in place where the product keeps ``o``'s dtype (the same
    values; no new tensor to write and fault in), else the promoted product."""
    if torch.result_type(o, scale) == o.dtype:
        return o.mul_(scale)
    return o * scale


def _descend(W: torch.Tensor, upd: torch.Tensor, lr) -> None:
    """Ŵ -= lr · upd, Ŵ viewed at the update's shape: a transposed Newton–Schulz result (tall
    matrices) is read with its strides, as megatron's per-matrix add does, not copied first (a
    reshape would)."""
    w = W.view(upd.shape)
    if isinstance(lr, torch.Tensor):  # a device LR (engine/graph.py)
        w.addcmul_(upd, lr, value=-1)
    else:
        w.add_(upd, alpha=-lr)


#: base name -> its step (MDInner's matrices are stepped by ``BASE_STEPS[md.base]``)
BASE_STEPS: dict[str, BaseStep] = {s.name: s for s in (AdamStep(), MuonStep())}


def muon_scales(spec, shape: tuple[int, int], frobenius_radius) -> list:
    """The Muon update scale of each block of a ``shape`` matrix under ``spec``
    (``frobenius_radius``: each block's Frobenius radius, indexable by block: a number or a
    tensor, for sphere_rms); ``shape_up`` follows a scaled init when the radius does (init or
    shape; MoE appendix)."""
    from megatron.md.engine.geometry import block_dims

    out = []
    for b, (rows, cols) in enumerate(block_dims(shape, spec.row_blocks)):
        r = None if frobenius_radius is None else frobenius_radius[b]
        s = muon_scale_factor(spec.muon_scale, rows, cols, r)
        if spec.muon_scale == "shape_up" and spec.radius != "unit":
            s = s * spec.init_scale
        out.append(s)
    return out
