"""The compiled MD kernels' formulas: plain torch functions over a group's (B, M, N) stack (or
a ZeRO-1 rank's (B, L) cut slices) that ``compiled._get`` hands to ``torch.compile`` and
``checked.Checked`` runs eagerly at a layout's first call to check the compiled one against.

Eager, an AdamMD group costs ~14 elementwise passes (Ŵ⊙G, two mat-vecs, G_Ŵ in two products,
Adam's seven, the norm) where torch's AdamW costs seven. Compiled, phase 1 (gain-gradient
partials, G_Ŵ = Γ ⊙ G, Adam on Ŵ, the sphere's squared-norm partials) is one read of Ŵ, G and
the moments and one write of Ŵ and the moments (with column gains, where a call takes one
matrix, plus Ŵ⊙G written once to a scratch buffer for a batched mat-vec; on a whole stack
the column sums are the call's), for all B matrices of the group; the sphere rescale
waits for the fuse, so rescale and W = Γ ⊙ Ŵ are one read of Ŵ and one write of Ŵ and of W.
Same formulas as the eager group (tested against it and the reference); the rounding differs
by fp32 reassociation only (inductor contracts products and orders sums its own way), so it is
never used where bit-identity is promised (MD off). One compile per group shape (static
shapes; the hyper-parameters travel as a small tensor, so a new step does not recompile).
"""

from __future__ import annotations

from typing import Callable

import torch


def _adam_values(w, g, m, v, hp):
    """torch AdamW's arithmetic (lerp with weight < 0.5, addcmul, sqrt/bc2 + eps, addcdiv);
    hp = [step_size, sqrt(bias_correction2), 1 - beta1, beta2, 1 - beta2, eps]: the new
    (Ŵ, m, v)."""
    m2 = m + hp[2] * (g - m)
    v2 = v * hp[3] + hp[4] * g * g
    return w - hp[0] * (m2 / (v2.sqrt() / hp[1] + hp[5])), m2, v2


def _adam(w, g, m, v, hp):
    """``_adam_values`` written into Ŵ and the moments; returns the new Ŵ."""
    w2, m2, v2 = _adam_values(w, g, m, v, hp)
    m.copy_(m2)
    v.copy_(v2)
    w.copy_(w2)
    return w2


def _gain_terms(w, g, col, scratch, need_row: bool):
    """G in Ŵ's dtype and the row gains' partials Σ_j Ŵ G g_col (a row reduction, in the
    caller's loop); Ŵ⊙G into ``scratch`` (if any) for the column sums (a batched mat-vec
    outside)."""
    gb = g.to(w.dtype)
    gr = w.new_zeros(())
    p = w * gb
    if need_row:
        gr = (p * col).sum(2)
    if scratch is not None:
        scratch.copy_(p)
    return gb, gr


def _phase1(w, g, m, v, row, col, hp, scratch, need_row: bool, sphere):
    """(B, M, N) blocks; ``row`` (B, M, 1), ``col`` (B, 1, N) (0-d ones if absent)."""
    gb, gr = _gain_terms(w, g, col, scratch, need_row)
    w2 = _adam(w, gb * row * col, m, v, hp)
    return gr, _sq_norms(w2, sphere)


def _sq_norms(w2, sphere):
    """The squared norms of the updated Ŵ, ``sphere``'s (0-d zero for "none"); ``("blocks",
    row_blocks)``: the Frobenius norms of a split matrix's Q/K/V blocks, (B, blocks): the rows'
    sums, then each block's rows in one masked reduction over the query groups and places (on
    a GPU one kernel with its add into the partials, where a sum a block and their stack took
    four at 181M: ``tools/triton_kernels.py``, 2026-12-05); the eager group's order
    (``Group.axis_add``) differs by fp32 reassociation."""
    if isinstance(sphere, tuple):
        blocks = sphere[1]
        B, M, _ = w2.shape
        rows = (w2 * w2).sum(2).view(B, M // sum(blocks), sum(blocks), 1)
        block = _period_blocks(blocks, sum(blocks), w2.device)
        inside = block.view(-1, 1) == torch.arange(len(blocks), device=w2.device)
        return (rows * inside).sum((1, 2))
    if sphere == "frobenius":
        sq = w2 * w2
        return sq.sum(2).sum(1)  # row sums first: stays in the row loop, no second pass
    if sphere == "row":
        return (w2 * w2).sum(2)
    if sphere == "row_norm":  # the row sphere next to both gains' partials (kernel_sphere)
        return torch.linalg.vector_norm(w2, dim=2).square()
    return w2.new_zeros(())


def _period_blocks(blocks: tuple, rows: int, device) -> torch.Tensor:
    """The Q/K/V block of each of ``rows`` rows from a query group's start (iota arithmetic:
    no constant tensor in the graph)."""
    at = torch.arange(rows, device=device) % sum(blocks)
    return sum((at >= sum(blocks[:b]) for b in range(1, len(blocks))), torch.zeros_like(at))


def _window(x: torch.Tensor, cut: tuple) -> torch.Tensor:
    """Cut slices ``x`` (B, L) as the (B, b - a, N) whole rows that cover them, zeros around
    them (``cut``: ``compiled.Kernels.cut``): inductor reads them by a masked load, no copy. (As
    ``F.pad`` of the (B, L) stack, inductor wrote each padded window to a buffer first: three
    Triton kernels more a group, ``tools/triton_kernels.py``, torch 2.15.0, 2026-12-05.)"""
    a, b, pre, _, N = cut[:5]
    B, L = x.shape
    e = torch.arange((b - a) * N, device=x.device) - pre  # each window element's in the slice
    inside = (e >= 0) & (e < L)
    return torch.where(inside, x[:, e.clamp(0, L - 1)], 0).view(B, b - a, N)


def _rows(f: torch.Tensor, cut: tuple) -> torch.Tensor:
    """A per-row factor of the full matrices (B, M, k) at the window's rows; a 0-d or
    per-column one as it is."""
    return f if f.ndim == 0 or f.shape[1] == 1 else f[:, cut[0] : cut[1]]


def _at_slice(factor: torch.Tensor, cut: tuple, at: torch.Tensor, B: int) -> torch.Tensor:
    """A factor broadcast against B cut slices' windows, read at the slices' own elements
    (B, L): element e at window row (e + pre) // N, column (e + pre) % N, ``pre`` given as
    the 0-d tensor ``at`` (``compiled.Kernels.cut_at``). Written with ``pre`` a number, torch
    2.15.0's inductor split the L elements into L // N whole rows where ``pre`` is a multiple of
    N and dropped the last partial one (its elements read the wrong factor or left unwritten, a
    CPU, 2026-12-05; ``checked.Checked`` stopped a 4-rank run on it); a tensor it cannot
    fold."""
    a, b, _, post, N = cut[:5]
    e = torch.arange((b - a) * N - post - cut[2], device=factor.device) + at
    return factor.expand(B, b - a, N)[:, e // N, e % N]


def _cut_scale(s: torch.Tensor, cut: tuple) -> torch.Tensor:
    """Cut slices' pending rescale ``s`` (B, n_norm) broadcast against their windows: the
    eager group's ``axis_bcast``, its Q/K/V blocks by the rows' place in their query group (the
    window starts at one, ``geometry.cut_window``)."""
    a, b, _, _, N, sphere, blocks = cut
    B = s.shape[0]
    if blocks and sphere != "row":
        return s.view(B, len(blocks), -1)[:, _period_blocks(blocks, b - a, s.device)]
    if sphere == "frobenius":
        return s.view(B, 1, 1)
    if sphere == "row":
        return s[:, a:b].unsqueeze(2)
    return s.view(B, 1, N)


def _phase1_cut(P, w, g, m, v, row, col, hp, need_row: bool, need_col: bool, sphere, n_gain,
                cut: tuple, at: torch.Tensor):  # fmt: skip
    """``_phase1_many``'s work for ZeRO-1 slices cut at one place of B matrices (Ŵ, G and the
    moments their own (B, L) elements): the gains' partials on their windows of whole rows
    (``_window``) into the full matrices' rows and columns of ``P`` (B, n_partial), Adam on
    their own elements (no window-sized temporary: a cut LM head's is hundreds of MB), the
    norms' partials. Four or five Triton kernels on a GPU whatever B (``tools/triton_kernels.py``,
    torch 2.15.0, 2026-12-05: on the window and copied back, six)."""
    a, b, N = cut[0], cut[1], cut[4]
    wp, gp = _window(w, cut), _window(g, cut).to(w.dtype)
    rw = _rows(row, cut)
    p = wp * gp
    if need_col:  # from Ŵ before Adam
        c0 = row.shape[1] if need_row else 0
        P[:, c0 : c0 + N].add_((p * rw).sum(1))
    if need_row:
        P[:, a:b].add_((p * col).sum(2))
    # Adam on the slice's own elements, the gains read at their rows and columns: written in
    # place (on the window, three more kernels copied it back)
    w2 = _adam(w, g.to(w.dtype) * _at_slice(rw * col, cut, at, w.shape[0]), m, v, hp)
    if sphere == "frobenius":
        P[:, n_gain:].add_((w2 * w2).sum(1, keepdim=True))
    elif isinstance(sphere, tuple):  # Q/K/V blocks: the window's whole query groups
        P[:, n_gain:].add_(_sq_norms(_window(w2, cut), sphere))
    elif sphere != "none":
        P[:, n_gain + a : n_gain + b].add_(_sq_norms(_window(w2, cut), sphere))


def _fuse_cut(out, x, s, row, col, cut: tuple, at: torch.Tensor) -> None:
    """``_rescale_fuse`` / ``_fuse`` of B cut slices ``x`` (B, L) into ``out``, their ranges of
    megatron's param buffer: one (B, L) window of it, or (the buffer, the regular pieces the
    ranges form, ``geometry.regular_pieces``); on the slices' own elements, the rescale and
    the gains read at their rows and columns (``_at_slice``)."""
    B = x.shape[0]
    x2 = x if s is None else x * _at_slice(_cut_scale(s, cut), cut, at, B)
    if s is not None:
        x.copy_(x2)
    val = x2 * _at_slice(_rows(row, cut) * col, cut, at, B)
    if not isinstance(out, tuple):
        out.copy_(val)
        return
    _write_pieces(*out, val)


def _phase1_frobenius(w, g, m, v, row, col, hp, scratch, need_row: bool):
    return _phase1(w, g, m, v, row, col, hp, scratch, need_row, "frobenius")


def _phase1_row(w, g, m, v, row, col, hp, scratch, need_row: bool):
    return _phase1(w, g, m, v, row, col, hp, scratch, need_row, "row")


def _phase1_row_norm(w, g, m, v, row, col, hp, scratch, need_row: bool):
    return _phase1(w, g, m, v, row, col, hp, scratch, need_row, "row_norm")


def _partials(w, g, row, col, out, scratch, need_row: bool):
    """MuonMD's lines 1-6 on (B, M, N) blocks in one pass: the row partials, Ŵ⊙G into
    ``scratch`` for the column sums, G_Ŵ = Γ ⊙ G into ``out``."""
    gb, gr = _gain_terms(w, g, col, scratch, need_row)
    out.copy_(gb * row * col)  # the eager group's order: (G ⊙ g_row) ⊙ g_col
    return gr


def _partials_pieces(w, buf, row, col, out, scratch, need_row: bool, pieces: tuple):
    """``_partials`` of a group whose gradients are ``pieces`` of megatron's gradient buffer
    ``buf`` (``geometry.regular_pieces``), read in place (``_gathered``)."""
    return _partials(w, _gathered(buf, pieces, *w.shape[1:]), row, col, out, scratch, need_row)


def _fuse(x, row, col, out):
    out.copy_(x * row * col)


def _rescale_fuse(x, s, row, col, out):
    x2 = x * s
    x.copy_(x2)
    out.copy_(x2 * row * col)


def _fuse_many(buf, *flat):
    """``_fuse`` / ``_rescale_fuse`` of several groups in one call (``ITEMF`` arguments each:
    Ŵ, the pending rescale or None, the gains, the destination's shape, stride and storage
    offset): the destinations are windows of ``buf``, megatron's param buffer passed whole
    (the groups' views of it as separate inputs AOT autograd refuses to mutate, torch 2.15.0);
    inductor writes the windows in place (a CPU: 0.05 ms for two windows of a 2^24-element
    buffer, 13 ms a copy of the buffer)."""
    _fuse_windows(buf, flat, _rescale_fuse)


def _fuse_windows(buf, flat: tuple, rescale_fuse: Callable) -> None:
    """``_fuse_many``'s loop, each group's pending rescale by ``rescale_fuse``; a group's
    destination one window of ``buf`` (its members' rows evenly spaced) or, with a tuple of
    pieces (``geometry.regular_pieces``: members ``b0 ..``, an (n1, r) grid of strides s1, s0
    at ``at``), the group's values written by the index they compute (``_piece_index``: one
    kernel for the group, not one a piece; ``compiled.fuse_groups``)."""
    for i in range(0, len(flat), ITEMF):
        x, s, row, col, shape, stride, offset, cut, at = flat[i : i + ITEMF]
        if cut is not None:  # cut slices: their ranges of the buffer (``_fuse_cut``)
            out = (
                (buf, offset)
                if isinstance(offset, tuple)
                else buf.as_strided(shape, stride, offset)
            )
            _fuse_cut(out, x, s, row, col, cut, at)
        elif isinstance(offset, tuple):  # the values, then one write by computed index
            val = torch.empty(x.shape, dtype=buf.dtype, device=buf.device)
            _fuse_window(val, x, s, row, col, rescale_fuse)
            _write_pieces(buf, offset, val)
        else:
            _fuse_window(buf.as_strided(shape, stride, offset), x, s, row, col, rescale_fuse)


def _write_pieces(buf: torch.Tensor, pieces: tuple, val: torch.Tensor) -> None:
    """B members' values ``val`` (B, ...) into ``buf`` where ``pieces`` lay them out, by the
    index they compute (``_piece_index``), cast to ``buf``'s dtype."""
    B = val.shape[0]
    buf.index_put_((_piece_index(pieces, B, val[0].numel(), buf),), val.reshape(-1).to(buf.dtype))


def _piece_index(pieces: tuple, B: int, L: int, buf: torch.Tensor) -> torch.Tensor:
    """Where in ``buf`` the L elements of each of B members lie, laid out by ``pieces``
    (``geometry.regular_pieces``: members ``b0 ..`` an (n1, r) grid of strides s1, s0 at
    ``at``), flat, member after member: made of aranges, so that compiled it is the index math
    of the one kernel that reads or writes them, no index in memory (a window a piece was a
    Triton kernel a piece, its rescale of Ŵ another: a group of two buckets' matrices four
    fuse kernels, 181M shapes over 4 ranks with 40M-element buckets, 2026-12-05). int64: an
    int32 index passes through torch's indexing as a copy to int64, and inductor does not check
    int32 index math for overflow; eager (a layout's first call, the check) it is 8 bytes an
    element for that call."""
    b = torch.arange(B, device=buf.device)
    base = torch.zeros_like(b)
    for b0, n1, r, s1, s0, at in pieces:
        k = b - b0
        base = torch.where((k >= 0) & (k < n1 * r), at + (k // r) * s1 + (k % r) * s0, base)
    return (base.unsqueeze(1) + torch.arange(L, device=buf.device)).view(-1)


def _fuse_window(out, x, s, row, col, rescale_fuse: Callable) -> None:
    """W = Γ ⊙ Ŵ into ``out``, after the pending rescale ``s`` where there is one."""
    if s is None:
        _fuse(x, row, col, out)
    else:
        rescale_fuse(x, s, row, col, out)


#: arguments of one group in ``_phase1_many`` (after the partial buffers)
ITEM1 = 17
#: arguments of one group in ``_fuse_many`` (after the destination buffer)
ITEMF = 9


def _gathered(buf: torch.Tensor, pieces: tuple, M: int, N: int) -> torch.Tensor:
    """The (B, M, N) stack of the matrices of ``buf`` that ``pieces`` lay out
    (``geometry.regular_pieces``): a view a piece, concatenated (inductor fuses the reads into
    the kernels that use them; read by computed index, as ``_piece_index``, the MoE layout's
    phase 1 made two Triton kernels more, 2026-12-05)."""
    grids = [buf.as_strided((n1, r, M, N), (s1, s0, N, 1), at).reshape(n1 * r, M, N)
             for _, n1, r, s1, s0, at in pieces]  # fmt: skip
    return grids[0] if len(grids) == 1 else torch.cat(grids)


def _phase1_many(n_parts: int, *args):
    """``_phase1`` of several groups in one call (one compiled call where each group took
    one, ~70 µs of dynamo's and AOT's host code a call on a 2-core VM, torch 2.15.0,
    2026-12-04), each group's partials added into the step's partial buffers inside it (where
    an operation a group and kind added them after: 20 launches of AdamMD's step at the
    12-layer layout, 2026-12-04), the column gains' as a column sum of Ŵ ⊙ G ⊙ g_row (no
    scratch of Ŵ's size). ``n_parts`` buffers passed whole (windows of one buffer as separate
    inputs AOT autograd refuses to mutate: ``_fuse_many``), then ``ITEM1`` arguments a group:
    Ŵ, G, the moments, the gains' factors, the Adam scalars (as ``_phase1``'s), ``need_row``,
    ``need_col``, the sphere (``_sq_norms``'), its buffer's index, where its (B, n_partial)
    partials start in its storage, n_partial, n_gain (the norms' partials follow the gains')
    G's pieces (``geometry.regular_pieces``) where G is megatron's gradient buffer whole:
    read in place, inductor fusing the gather into the kernels that read G (the same five
    Triton kernels as from a (B, M, N) G for a toy group in 1 to 4 pieces; from 5 pieces one
    kernel more, inductor's copy of them into one buffer, as the stack was; torch 2.15.0,
    ``tools/triton_kernels.py``, 2026-12-05), and the window of a ZeRO-1 slice cut inside its
    matrix (``_phase1_cut``; None for whole matrices)."""
    parts, flat = args[:n_parts], args[n_parts:]
    for i in range(0, len(flat), ITEM1):
        (w, g, m, v, row, col, hp, need_row, need_col, sphere, k, start, n, n_gain, pieces, cut,
         at) = flat[i : i + ITEM1]  # fmt: skip
        if cut is not None:  # ZeRO-1 slices cut at one place of their matrices
            B, L = w.shape
            if pieces is not None:
                g = _gathered(g, pieces, 1, L).view(B, L)
            P = parts[k].as_strided((B, n), (n, 1), start)
            _phase1_cut(P, w, g, m, v, row, col, hp, need_row, need_col, sphere, n_gain, cut, at)
            continue
        B, M, N = w.shape
        if pieces is not None:
            g = _gathered(g, pieces, M, N)
        P = parts[k].as_strided((B, n), (n, 1), start)
        if need_col:  # from Ŵ before ``_phase1``'s Adam writes it
            c0 = M if need_row else 0
            P[:, c0 : c0 + N].add_((w * g.to(w.dtype) * row).sum(1))
        gr, nrm = _phase1(w, g, m, v, row, col, hp, None, need_row, sphere)
        if need_row:
            P[:, :M].add_(gr)
        if sphere != "none":
            P[:, n_gain:].add_(nrm.view(B, -1))


_PHASE1 = {"frobenius": _phase1_frobenius, "row": _phase1_row, "row_norm": _phase1_row_norm}
