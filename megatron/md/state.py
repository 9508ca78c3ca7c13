"""The per-matrix MD state: every field, in one declaration.

A ``TypedDict``, not a class: the base optimizer's part (``step`` and the moments) lives in the
torch optimizer's ``state[p]``, which megatron-core reads and writes as a dict when it
checkpoints, reshards and reloads (distrib_optimizer.py ``_set_main_param_and_optimizer_states``,
``get_parameter_state_*``); the MD part lives beside it in ``MDInner.md_state[p]``. The
reference step (``reference.init_state``) keeps both in one dict. Gains are *raw* (ĝ: the
map φ gives g = φ(ĝ)); every gain has its own Adam moments ``<gain>_exp_avg[_sq]``.
"""

from __future__ import annotations

from typing import TypedDict

import torch


class MatrixState(TypedDict, total=False):
    """MD state of one weight matrix (or of one ZeRO-1 slice of it)."""

    step: int | torch.Tensor
    """Steps taken (a tensor in the torch optimizer's state, as torch's Adam keeps it)."""
    direction: torch.Tensor
    """Ŵ: the fp32 direction on its sphere (fp32 params; with bf16 params it is megatron's
    fp32 main param and not stored here)."""
    radius: torch.Tensor | None
    """The sphere radius: a scalar (Frobenius), per row or per column, per Q/K/V block when
    split; None without a sphere."""
    exp_avg: torch.Tensor
    """Adam's first moment of the direction (AdamMD)."""
    exp_avg_sq: torch.Tensor
    """Adam's second moment of the direction (AdamMD)."""
    momentum_buffer: torch.Tensor
    """Muon's momentum of the direction (MuonMD)."""
    gain_scalar: torch.Tensor
    """One raw gain for the matrix (``--md-gains scalar``)."""
    gain_scalar_exp_avg: torch.Tensor
    gain_scalar_exp_avg_sq: torch.Tensor
    gain_row: torch.Tensor
    """Raw gain per output row (d_out,) (``row``, ``rowcol``; Muown's magnitudes)."""
    gain_row_exp_avg: torch.Tensor
    gain_row_exp_avg_sq: torch.Tensor
    gain_col: torch.Tensor
    """Raw gain per input column (d_in,) (``col``, ``rowcol``)."""
    gain_col_exp_avg: torch.Tensor
    gain_col_exp_avg_sq: torch.Tensor
    gain_a: torch.Tensor
    """Factor A (d_out, k) of the rank-k gain Γ = 1 + A Bᵀ (``lowrank``)."""
    gain_a_exp_avg: torch.Tensor
    gain_a_exp_avg_sq: torch.Tensor
    gain_b: torch.Tensor
    """Factor B (d_in, k) of the rank-k gain (zero at the start: Γ = 1)."""
    gain_b_exp_avg: torch.Tensor
    gain_b_exp_avg_sq: torch.Tensor


#: the fields megatron's torch optimizer state holds (the rest is MD's own)
BASE_FIELDS = ("step", "exp_avg", "exp_avg_sq", "momentum_buffer")
