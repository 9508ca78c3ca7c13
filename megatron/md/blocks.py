"""Slice geometry: a ZeRO-1 rank owns an arbitrary contiguous range ``[start, end)`` of a
row-major matrix's flattened elements; cuts fall inside rows. The range is covered by at most
three rectangular blocks (a partial first row, full rows, a partial last row), each a 2-D view of
the rank's flat tensor, so every row/column broadcast and sum is an ordinary tensor op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Block:
    """Rows [r0, r0+nr) × columns [c0, c0+nc), stored at local flat offsets [lo, hi)."""

    lo: int
    hi: int
    r0: int
    nr: int
    c0: int
    nc: int

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.lo : self.hi].view(self.nr, self.nc)


def slice_blocks(shape: tuple[int, int], start: int, end: int) -> list[Block]:
    """Cover flat range [start, end) of a row-major (d_out, d_in) matrix by ≤ 3 blocks."""
    d_out, d_in = shape
    if not 0 <= start <= end <= d_out * d_in:
        raise ValueError(f"slice [{start}, {end}) outside a {d_out}x{d_in} matrix")
    blocks, pos = [], start
    while pos < end:
        r, c = divmod(pos, d_in)
        if c > 0 or end - pos < d_in:  # partial row
            n = min(d_in - c, end - pos)
            blocks.append(Block(pos - start, pos - start + n, r, 1, c, n))
        else:  # as many full rows as fit
            nr = (end - pos) // d_in
            blocks.append(Block(pos - start, pos - start + nr * d_in, r, nr, 0, d_in))
            n = nr * d_in
        pos += n
    return blocks
