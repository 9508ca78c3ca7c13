"""The shapes the batched step needs, its own: the Q/K/V row blocks of a split fused matrix and
the ``radius=shape`` sphere. (``reference.py`` states the same things its own readable way: the
fast path never imports it, so a mistake in one is caught by the other.)"""

from __future__ import annotations

import math

import torch


def qkv_slices(row_blocks: tuple[int, ...]) -> list[slice]:
    """Within one query group of ``sum(row_blocks)`` rows, the rows of each block (q, k, v);
    megatron's Muon splits a fused QKV matrix so (emerging_optimizers' QKV split)."""
    out, at = [], 0
    for n in row_blocks:
        out.append(slice(at, at + n))
        at += n
    return out


def row_to_block(rows: int, row_blocks: tuple[int, ...]) -> torch.Tensor:
    """The block of every row of a split matrix of ``rows`` rows (int64, on the CPU)."""
    period = sum(row_blocks)
    if rows % period:
        raise ValueError(f"{rows} rows are not whole query groups of {row_blocks} rows")
    one = torch.cat([torch.full((n,), b, dtype=torch.long) for b, n in enumerate(row_blocks)])
    return one.repeat(rows // period)


def block_dims(shape: tuple[int, int], row_blocks: tuple[int, ...]) -> list[tuple[int, int]]:
    """(rows, columns) of each block a matrix is stepped as: one, or q, k, v when split."""
    d_out, d_in = shape
    if not row_blocks:
        return [(d_out, d_in)]
    groups = d_out // sum(row_blocks)
    return [(groups * n, d_in) for n in row_blocks]


def norm_count(shape: tuple[int, int], sphere: str, row_blocks: tuple[int, ...]) -> int:
    """How many sphere norms a matrix has: one per block (frobenius), per row, per block and
    column (col), none."""
    d_out, d_in = shape
    nb = len(row_blocks) or 1
    return {"frobenius": nb, "row": d_out, "col": nb * d_in, "none": 0}[sphere]


def shape_radius(shape: tuple[int, int], sphere: str, row_blocks: tuple[int, ...]) -> torch.Tensor:
    """The ``radius=shape`` sphere, flat (``norm_count`` values, float64, CPU): sqrt(max(rows,
    d_in)) per block in Frobenius norm, shared evenly by the block's rows (row sphere) or
    columns (col sphere)."""
    d_out, d_in = shape
    per_block = [math.sqrt(max(r, c)) for r, c in block_dims(shape, row_blocks)]
    if sphere == "frobenius":
        return torch.tensor(per_block, dtype=torch.float64)
    if sphere == "col":
        return torch.tensor([f / math.sqrt(d_in) for f in per_block],
                            dtype=torch.float64).repeat_interleave(d_in)  # fmt: skip
    rows = [r for r, _ in block_dims(shape, row_blocks)]
    if not row_blocks:
        return torch.full((d_out,), per_block[0] / math.sqrt(rows[0]), dtype=torch.float64)
    each = torch.tensor([f / math.sqrt(r) for f, r in zip(per_block, rows)], dtype=torch.float64)
    return each[row_to_block(d_out, row_blocks)]


def radius_shape(shape: tuple[int, int], sphere: str, row_blocks: tuple[int, ...]) -> tuple:
    """The radius tensor's shape in a matrix's state (checkpoints keep it): () for one
    Frobenius sphere, (blocks,) split; (d_out,) per row; (d_in,) or (blocks, d_in) per column."""
    d_out, d_in = shape
    nb = len(row_blocks)
    if sphere == "frobenius":
        return (nb,) if nb else ()
    if sphere == "row":
        return (d_out,)
    return (nb, d_in) if nb else (d_in,)


def one_storage(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` (each contiguous, one dtype) all lie in one storage."""
    st = tensors[0].untyped_storage().data_ptr()
    return all(t.is_contiguous() and t.dtype == tensors[0].dtype
               and t.untyped_storage().data_ptr() == st for t in tensors)  # fmt: skip


def strided_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` (same size, dtype and storage, each contiguous, at evenly spaced ascending
    addresses: same-shape parameters of megatron's flat param and grad buffers) as ONE
    (B, L) view of their storage; None where they are not so laid out (then a copy stacks
    them)."""
    t0 = tensors[0]
    L = t0.numel()
    if len(tensors) == 1:
        return t0.view(1, L) if t0.is_contiguous() else None
    storage = t0.untyped_storage().data_ptr()
    offs = []
    for t in tensors:
        if (t.numel() != L or t.dtype != t0.dtype or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage):  # fmt: skip
            return None
        offs.append(t.storage_offset())
    d = offs[1] - offs[0]
    if d < L or any(b - a != d for a, b in zip(offs, offs[1:])):
        return None
    return t0.as_strided((len(tensors), L), (d, 1))


def regular_pieces(offsets: list[int], L: int) -> tuple[tuple[int, ...], ...]:
    """Members of ``L`` elements at storage ``offsets`` (in member order) cut into few regular
    grids (greedy, one member of look-ahead): each piece ``(b0, n1, r, s1, s0, at)`` is members
    ``b0 .. b0 + n1·r - 1``, member ``b0 + i·r + j`` at ``at + i·s1 + j·s0``, so that ONE
    (n1, r, L) view (strides s1, s0, 1) covers it. Same-shape weights of an MoE model lie so in
    megatron's buffers: the experts of a layer evenly spaced, the layers evenly spaced, but
    not the one run ``strided_rows`` takes (a dense first layer; expert-parallel size 1, where
    the experts share the buffer with the attention's weights). Members that overlap or
    descend are a piece each."""
    out, i, B = [], 0, len(offsets)
    while i < B:
        n1, r, s1, s0 = _grid_at(offsets, i, L)
        if i + 1 < B and n1 * r > 1 and math.prod(_grid_at(offsets, i + 1, L)[:2]) > n1 * r:
            n1, r, s1, s0 = 1, 1, L, L  # alone: the grid from the next member covers more
        out.append((i, n1, r, s1, s0, offsets[i]))
        i += n1 * r
    return tuple(out)


def _grid_at(offsets: list[int], i: int, L: int) -> tuple[int, int, int, int]:
    """(n1, r, s1, s0) of the largest grid ``regular_pieces`` finds from member ``i``: its run
    (evenly spaced, ascending), then runs like it after it, evenly spaced."""
    B, at, r, d = len(offsets), offsets[i], 1, L
    if i + 1 < B and offsets[i + 1] - at >= L:
        d, r = offsets[i + 1] - at, 2
        while i + r < B and offsets[i + r] - offsets[i + r - 1] == d:
            r += 1
    n1, s1 = 1, r * d
    if r > 1 and i + r < B and offsets[i + r] - at >= (r - 1) * d + L:
        s1 = offsets[i + r] - at
        while i + (n1 + 1) * r <= B and all(
            offsets[i + n1 * r + j] == at + n1 * s1 + j * d for j in range(r)
        ):
            n1 += 1
    return n1, r, s1, d


def cut_window(shape: tuple[int, int], start: int, end: int, row_blocks: tuple[int, ...] = ()):
    """The whole rows ``[a, b)`` of a row-major ``shape`` matrix that cover its flat range
    ``[start, end)`` (a ZeRO-1 rank's slice cut inside rows), widened to whole query groups
    of ``row_blocks`` where the matrix is split, and the elements before and after the range
    in them: ``(a, b, pre, post, N)``. A compiled call reads the slice padded with
    ``pre``/``post`` zeros as a ``(1, b - a, N)`` matrix: a zero of Ŵ and G adds nothing to a
    partial or norm, and Adam leaves it zero."""
    M, N = shape
    a, b = start // N, -(-end // N)
    if row_blocks:
        S = sum(row_blocks)
        a, b = a // S * S, min(M, -(-b // S) * S)
    return a, b, start - a * N, b * N - end, N
