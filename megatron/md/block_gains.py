"""The gains on one rectangular block (``blocks.Block``) of a matrix: Γ ⊙ x, the block's row
and column gains, and its contribution to the gain gradients. ``g``: materialized gains (φ(ĝ),
or A/B for lowrank), indexed by the block's rows/columns of the (full) matrix.
"""

from __future__ import annotations

import torch

from megatron.md.blocks import Block


def apply_into(gains: str, blk: Block, x: torch.Tensor, g: dict, out: torch.Tensor) -> None:
    """``out`` = Γ ⊙ x on one block, the same products as reference.apply_gains
    (x·a == a·x exactly), with no temporaries for scalar/row/col gains. ``out`` may have a
    lower precision than ``x`` (bf16 model param): one rounding of the fp32 product."""
    if gains == "none":
        out.copy_(x)
    elif gains == "lowrank":
        a = g["gain_a"][blk.r0 : blk.r0 + blk.nr]
        b = g["gain_b"][blk.c0 : blk.c0 + blk.nc]
        torch.mul(1 + a @ b.T, x, out=out)
    elif gains == "scalar":
        torch.mul(x, g["gain_scalar"], out=out)
    elif "gain_row" in g:
        row = g["gain_row"][blk.r0 : blk.r0 + blk.nr, None]
        if "gain_col" not in g:
            torch.mul(x, row, out=out)
        elif out.dtype == x.dtype:
            torch.mul(x, row, out=out)
            out.mul_(g["gain_col"][None, blk.c0 : blk.c0 + blk.nc])
        else:  # round once, from the fp32 product, with no extra pass
            torch.mul(x * row, g["gain_col"][None, blk.c0 : blk.c0 + blk.nc], out=out)
    else:
        torch.mul(x, g["gain_col"][None, blk.c0 : blk.c0 + blk.nc], out=out)


def row_col(blk: Block, g: dict, like: torch.Tensor):
    """This block's row gains (nr, 1) and column gains (1, nc); a 0-d one if absent."""
    one = like.new_ones(())
    row = g["gain_row"][blk.r0 : blk.r0 + blk.nr, None] if "gain_row" in g else one
    col = g["gain_col"][None, blk.c0 : blk.c0 + blk.nc] if "gain_col" in g else one
    return row, col


def add_gain_partials(
    gains: str, rank: int, blk: Block, p: torch.Tensor, g: dict, views: dict
) -> None:
    """Add the block's ∂L/∂Γ sums (``p`` = Ŵ ⊙ G on the block) into the partial ``views``.
    ``view[r].add_(x)``, not ``view[r] += x``: the latter also copies the slice onto itself."""
    r, c = slice(blk.r0, blk.r0 + blk.nr), slice(blk.c0, blk.c0 + blk.nc)
    if gains == "lowrank":
        views["gain_a"].view(-1, rank)[r].add_(p @ g["gain_b"][c])
        views["gain_b"].view(-1, rank)[c].add_(p.T @ g["gain_a"][r])
    elif gains == "scalar":
        views["gain_scalar"] += p.sum()
    else:
        if "gain_row" in views:  # mat-vecs: no temporaries of the block's size
            views["gain_row"][r].add_(p @ g["gain_col"][c] if "gain_col" in g else p.sum(1))
        if "gain_col" in views:
            views["gain_col"][c].add_(g["gain_row"][r] @ p if "gain_row" in g else p.sum(0))
