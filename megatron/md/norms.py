"""Sums of squares within fp32 rounding of the float64 sums, for every sphere norm of the
engine (``engine/group.py``) and the hyperball scale's update norm (``base_steps.py``).

torch's fp32 ``vector_norm`` over a whole matrix is far off on a CPU, and the further the more
entries it covers (torch 2.15.0, one thread, 2026-12-02, relative error of Σ w²: randn entries
2.9e-7 at (256, 32), 1.6e-4 at (2048, 2048), 3.6e-3 at (16384, 2048); a bf16 model's main
params, whose entries are bf16 values, already 2.1e-6 at (256, 32); rows of 2048: 8e-7).
The reference computes its sphere norms itself (``flat @ flat`` and axis sums: within 9e-8 of
float64 on the tests' matrices); its hyperball scale is ``base_steps.hyperball_``, as the
engine's is.
"""

from __future__ import annotations

import math

import torch

#: the longest run of a row that one fp32 norm covers in ``sq_sums``
RUN = 256


def sq_sums(w: torch.Tensor, frobenius: bool) -> torch.Tensor:
    """Σ w² over the last axis of ``w`` (..., nr, nc), or over its last two (``frobenius``).
    Norms of runs of k = gcd(nc, ``RUN``) entries, then the sum of their squares: ≤ 1.4e-7 of
    the float64 sum per matrix and 2.2e-7 per row (bf16-valued entries up to (16384, 2048)),
    at 1.2x a whole-matrix norm's time; the cascade sum of ``w * w`` is as accurate at 6x the
    time (its temporary) and takes rows with no factor of 32 in their length."""
    nc = w.shape[-1]
    k = math.gcd(nc, RUN)
    if k >= 32:
        runs = torch.linalg.vector_norm(w.unflatten(-1, (nc // k, k)), dim=-1)
        rows = runs.square_().sum(-1)
    else:
        rows = (w * w).sum(-1)
    return rows.sum(-1) if frobenius else rows
