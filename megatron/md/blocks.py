"""Slice geometry: a ZeRO-1 rank owns an arbitrary contiguous range ``[start, end)`` of a
row-major matrix's flattened elements; cuts fall inside rows. The range is covered by at most
three rectangular blocks (a partial first row, full rows, a partial last row), each a 2-D view of
the rank's flat tensor, so every row/column broadcast and sum is an ordinary tensor op. Under
tensor parallelism the blocks of a rank's local matrix are addressed in the full matrix's rows
and columns (``TPShard``, ``place_blocks``): gains and norms are indexed globally.
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


@dataclass(frozen=True)
class TPShard:
    """Where a tensor-parallel rank's piece of a matrix lies in the full matrix, as megatron
    lays it out (tensor_parallel/layers.py, ``_initialize_affine_weight_cpu``): the full matrix
    is cut along ``axis`` into ``size * stride`` equal chunks and rank r holds chunks
    r, r + size, ... (stride 2: SwiGLU's fc1 keeps its gate and up halves per rank)."""

    axis: int
    """0: rows split (column-parallel linear, vocab-parallel embedding); 1: columns split
    (row-parallel linear)."""
    rank: int
    """This rank's index in its tensor-parallel group."""
    size: int
    """The tensor-parallel group's size."""
    stride: int = 1
    """megatron's ``partition_stride``."""
    expert: bool = False
    """A routed expert's piece: split over megatron's expert-tensor-parallel group
    (``--expert-tensor-parallel-size``), not the tensor-parallel group."""

    def full_shape(self, local: tuple[int, int]) -> tuple[int, int]:
        out = list(local)
        out[self.axis] *= self.size
        return out[0], out[1]

    def pieces(self, n_local: int) -> list[tuple[int, int, int]]:
        """(local start, length, full start) of each chunk along ``axis``."""
        m = n_local // self.stride
        return [(k * m, m, (k * self.size + self.rank) * m) for k in range(self.stride)]


def place_blocks(blocks: list[Block], local: tuple[int, int], tp: TPShard | None) -> list[Block]:
    """Blocks of a TP rank's local matrix re-addressed in the full matrix's rows/columns (the
    local flat offsets, hence the views, are unchanged); a block spanning two chunks is cut."""
    if tp is None:
        return blocks
    out = []
    for lo_r, m, full in tp.pieces(local[tp.axis]):
        for b in blocks:
            if tp.axis == 1:  # rows stay whole: columns move (stride 1, checked by SliceMD)
                out.append(Block(b.lo, b.hi, b.r0, b.nr, b.c0 + full - lo_r, b.nc))
                continue
            r0, r1 = max(b.r0, lo_r), min(b.r0 + b.nr, lo_r + m)
            if r0 < r1:
                lo = b.lo + (r0 - b.r0) * b.nc
                out.append(Block(lo, lo + (r1 - r0) * b.nc, full + r0 - lo_r, r1 - r0, b.c0, b.nc))
    return sorted(out, key=lambda b: b.lo)
