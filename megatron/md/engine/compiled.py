"""AdamMD's and MuonMD's phases of a whole group as compiled kernels (``torch.compile``;
``--md-fused-step``; on by default at scale, AdamMD's only on a CPU: ``MDConfig.use_fused``).

MuonMD's (``_partials_group`` and the fuse): the gains' partials and G_Ŵ = Γ ⊙ G in one pass
before the base's batched Newton–Schulz, the norms' partials eager after it, and the deferred
rescale with W = Γ ⊙ Ŵ in one pass; Q/K/V-split groups included (their spheres are the
rescale's, their Newton–Schulz blocks the base's).

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

On a CPU the kernels are called once per matrix of a group, on (1, M, N) slices, not once on
the (B, M, N) stack: inductor's CPU loops over a stack are slower where an argument is a
strided view into megatron's buffers and gains broadcast against it (torch 2.15, one thread,
6 x 2048 x 1024, 2026-11-25: the fuse 1.1 ns/element stacked against 0.33 per matrix, phase 1
with row and column gains 1.9 against 1.6); there a call costs microseconds against the
milliseconds of a matrix. On a GPU, where a call's launches are the cost, once on the stack
(``_pieces``), and AdamMD's phase 1 of the groups of a step together in one call
(``phase1_groups``, the partials written into the step's buffer inside it), and the fuse of
the groups whose destinations lie in one buffer (``fuse_groups``: the buffer passed whole, the
destinations' windows static; AOT autograd refuses mutated inputs that alias, torch 2.15.0).
A ZeRO-1 slice cut inside its matrix (AdamMD) joins those merged calls, on a CPU too
(``Kernels.cut``: its window of whole rows, ``_phase1_cut``, ``_fuse_cut``).
On a GPU both AdamMD's and MuonMD's are the default at scale (``MDConfig.use_fused``), after
``tools/gpu_check.py`` checked them against the reference and measured them faster than the
eager group there (H200, 2026-11-26, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from megatron.md import cpu_mode
from megatron.md.base_steps import AdamHParams
from megatron.md.engine.geometry import cut_window

#: gains and spheres the compiled kernels cover (others, the tangent projection and TP pieces:
#: the eager group)
GAINS = ("none", "row", "col", "rowcol")
SPHERES = ("frobenius", "row", "col", "none")
#: compiled variants allowed per function (dynamo's default, 8, is global): ``Checked._compiled``
RECOMPILE_LIMIT = 64


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
    them (``cut``: ``Kernels.cut``): inductor reads them by a masked load, no copy. (As
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
    the 0-d tensor ``at`` (``Kernels.cut_at``). Written with ``pre`` a number, torch 2.15.0's
    inductor split the L elements into L // N whole rows where ``pre`` is a multiple of N and
    dropped the last partial one (its elements read the wrong factor or left unwritten, a CPU,
    2026-12-05; ``Checked`` stopped a 4-rank run on it); a tensor it cannot fold."""
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
    B, L = x.shape
    x2 = x if s is None else x * _at_slice(_cut_scale(s, cut), cut, at, B)
    if s is not None:
        x.copy_(x2)
    val = x2 * _at_slice(_rows(row, cut) * col, cut, at, B)
    if not isinstance(out, tuple):
        out.copy_(val)
        return
    buf, pieces = out
    for b0, n1, r, s1, s0, o in pieces:
        piece = buf.as_strided((n1, r, L), (s1, s0, 1), o)
        piece.copy_(val[b0 : b0 + n1 * r].unflatten(0, (n1, r)))


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
    at ``at``), one (n1, r, M, N) window a piece (``fuse_groups``)."""
    for i in range(0, len(flat), ITEMF):
        x, s, row, col, shape, stride, offset, cut, at = flat[i : i + ITEMF]
        if cut is not None:  # cut slices: their ranges of the buffer (``_fuse_cut``)
            out = (
                (buf, offset)
                if isinstance(offset, tuple)
                else buf.as_strided(shape, stride, offset)
            )
            _fuse_cut(out, x, s, row, col, cut, at)
        elif isinstance(offset, tuple):
            M, N = shape[-2:]
            for b0, n1, r, s1, s0, at in offset:
                one = slice(b0, b0 + n1 * r)
                grid = [_grid(t, one, n1) for t in (x, s, row, col)]
                _fuse_window(buf.as_strided((n1, r, M, N), (s1, s0, N, 1), at), *grid,
                             rescale_fuse)  # fmt: skip
        else:
            _fuse_window(buf.as_strided(shape, stride, offset), x, s, row, col, rescale_fuse)


def _grid(x: torch.Tensor | None, one: slice, n1: int) -> torch.Tensor | None:
    """Matrices ``one`` of a stacked argument as an (n1, r, ...) grid; a 0-d one (an absent
    gain) or None as it is."""
    if x is None or x.ndim == 0:
        return x
    return x[one].unflatten(0, (n1, -1))


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
    (``geometry.regular_pieces``)."""
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
_compiled: dict[str, Callable] = {}


def _one_compile_thread() -> None:
    """Compile in this process, not in inductor's pool of ``min(32, cores)`` worker processes,
    unless ``TORCHINDUCTOR_COMPILE_THREADS`` says otherwise. The pool outlives the compile and
    slowed the whole iteration of a training run: ``dense-181M`` on one H200 (2026-11-26,
    torch 2.11.0+cu130, 16 cores), AdamMD compiled with the pool 71.6k tokens/s (forward-backward
    92.3 ms), in this process 85.0k (79.4 ms; eager AdamMD 81.8k); docs/benchmarks.md. On a
    CPU the workers fork from each rank: two 457M ranks compiling at once ran out of 24 GB.
    Our few kernels compile in seconds either way. Set before the first compile (inductor reads
    it when it starts the pool); an inductor without the setting fails here, loudly."""
    import torch._inductor.config as inductor_config  # here: importing it loads inductor

    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        inductor_config.compile_threads = 1


_PER_FUNCTION_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def _get(name: str, fn, fallback: bool = False):
    """Kernel ``name`` (``fn`` compiled, ``Checked``), called with the group's ``fallback``."""
    if name not in _compiled:  # compiled lazily: importing this module costs nothing
        _one_compile_thread()
        # the per-function limit where torch.compile takes one (2.15; not 2.13): dynamo then
        # logs no "hit config.recompile_limit" warning before Checked's second try
        limit = {"recompile_limit": RECOMPILE_LIMIT} if _PER_FUNCTION_LIMIT else {}
        _compiled[name] = Checked(fn, torch.compile(fn, dynamic=False, fullgraph=True, **limit))
    return functools.partial(_compiled[name], fallback=True) if fallback else _compiled[name]


#: the arguments each kernel writes (by position): the first call of a layout runs the eager
#: formula on copies of them (``COPIES``: a kernel that makes its own)
WRITES = {**dict.fromkeys(_PHASE1.values(), (0, 2, 3, 7)), _partials: (4, 5),
          _partials_pieces: (4, 5), _fuse: (3,),
          _rescale_fuse: (0, 4),
          # the merged call: by the groups it takes
          _phase1_many: lambda a: [*range(1, 1 + a[0]), *(
              i + k for i in range(1 + a[0], len(a), ITEM1) for k in (0, 2, 3))]}  # fmt: skip


def _fuse_many_copies(args: tuple) -> tuple[list, list]:
    """The first-call check's copies for ``_fuse_many``: the windows it writes (a group's, or
    each member's) laid out one after another in a new buffer (a copy of megatron's whole
    param buffer would cost its size again at the first step, its fp32 difference twice
    that), and each Ŵ whose rescale is pending; (the copies' arguments, (name, written
    tensor, its copy) of each)."""
    buf, flat = args[0], args[1:]
    items = [flat[i : i + ITEMF] for i in range(0, len(flat), ITEMF)]
    n_all = sum(item[0].numel() for item in items)  # a window of each group's Ŵ's size
    compact = torch.empty(n_all, dtype=buf.dtype, device=buf.device)
    mine, pairs, at = [compact], [], 0
    for k, (x, s, row, col, shape, stride, offset, cut, pre) in enumerate(items):
        mine_x = x if s is None else x.clone()
        if isinstance(offset, tuple):  # pieces: laid out one after another, as the members
            # a member: an (M, N) matrix, or a cut slice's L elements (``shape`` (B, L))
            one, name = (
                shape[1:] if cut is not None else shape[-2:],
                f"group {k}'s weights, members",
            )
            n, inner = math.prod(one), (1,) if len(one) == 1 else (one[1], 1)  # its strides
            mine_pieces = tuple((b0, n1, r, r * n, n, at + b0 * n)
                                for b0, n1, r, _, _, _ in offset)  # fmt: skip
            mine += [mine_x, s, row, col, shape, stride, mine_pieces, cut, pre]
            for (b0, n1, r, s1, s0, o), (*_, m) in zip(offset, mine_pieces):
                grid = (n1, r, *one)
                pairs.append((f"{name} {b0}-{b0 + n1 * r - 1}",
                              buf.as_strided(grid, (s1, s0, *inner), o),
                              compact.as_strided(grid, (r * n, n, *inner), m)))  # fmt: skip
        else:
            dense = tuple(math.prod(shape[j + 1 :]) for j in range(len(shape)))  # contiguous
            mine += [mine_x, s, row, col, shape, dense, at, cut, pre]
            pairs.append((f"group {k}'s weights", buf.as_strided(shape, stride, offset),
                          compact.as_strided(shape, dense, at)))  # fmt: skip
        if s is not None:
            pairs.append((f"group {k}'s Ŵ", x, mine_x))
        at += x.numel()
    return mine, pairs


#: kernels whose check makes its own copies (instead of copying the arguments ``WRITES`` names)
COPIES = {_fuse_many: _fuse_many_copies}

#: largest difference from the eager formula a compiled kernel may show, relative to the
#: largest magnitude of the tensor compared (inductor reorders sums and contracts products);
#: half precision: one rounding of the largest entry
CHECK_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2**-7, torch.float16: 2**-9}


class MiscompiledKernel(RuntimeError):
    """A compiled kernel gave other numbers than its eager formula."""


class Checked:
    """A compiled kernel whose first call of each argument layout (shapes, strides, dtypes,
    device: what dynamo compiles a variant for) is checked against its eager formula, run on
    copies of the arguments it writes. A difference beyond rounding (``CHECK_TOL``; NaN and
    ±inf where the formula makes them too are none) stops the
    run with ``MiscompiledKernel`` (``--md-fused-step on``) or, called with ``fallback``
    (``auto``: the user did not ask for the compiled step), keeps the eager formula's results,
    runs the eager formula for that layout from then on and says so once on stderr. Inductor can
    write an input before a later loop reads it: torch 2.9.1, 2.10.0 and 2.11.0 on a CPU
    computed ``_rescale_fuse`` on a stack of matrices from the rescaled Ŵ (W = Γ ⊙ s² Ŵ) and
    ``_phase1``'s Ŵ ⊙ G from the updated Ŵ (2026-12-03; torch 2.12.0-2.15.0 right; upstream's
    open reports of the kind: pytorch/pytorch #198131, #198101). The check costs, at the first
    step, one eager run of the kernel's formula, copies of the arguments it writes (transient
    memory: a few copies of the stacks a call takes where it takes them whole, as on a GPU)
    and a host synchronization; none in a CUDA graph's capture (its eager warm-up steps
    check)."""

    def __init__(self, fn: Callable, compiled: Callable):
        self.fn, self.compiled = fn, compiled
        self.checked: set[tuple] = set()
        self.eager: set[tuple] = set()  # layouts found miscompiled, run eager (``fallback``)

    def __call__(self, *args, fallback: bool = False):
        key = tuple(
            (a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a
            for a in args
        )
        if key in self.eager:
            return self.fn(*args)
        check = key not in self.checked and not _capturing()
        if check:
            if self.fn in COPIES:
                mine, written = COPIES[self.fn](args)
            else:
                writes = WRITES.get(self.fn, ())
                writes = writes(args) if callable(writes) else writes
                mine = [a.clone() if i in writes and a is not None else a
                        for i, a in enumerate(args)]  # fmt: skip
                written = [(f"argument {i}", args[i], mine[i]) for i in writes]
            want = self.fn(*mine)
        got = self._compiled(args)
        if not check:
            return got
        outs = got if isinstance(got, tuple) else (got,)
        wants = want if isinstance(want, tuple) else (want,)
        results = [(f"result {i}", a, b) for i, (a, b) in enumerate(zip(outs, wants))]
        for what, a, b in written + results:
            if isinstance(a, torch.Tensor) and a.ndim and a.numel():
                wrong = self._difference(what, a, b)
                if wrong and not fallback:
                    raise MiscompiledKernel(f"{wrong}. Run with --md-fused-step off: the eager MD "
                                            "step, the same results to fp32 rounding")  # fmt: skip
                if wrong:
                    return self._keep_eager(key, wrong, written, want)
        self.checked.add(key)
        return got

    def _compiled(self, args: tuple):
        """The compiled call; past dynamo's recompile limit (global, 8 variants of a function
        unless torch.compile took ``RECOMPILE_LIMIT``; more layouts, or a changed global state
        such as the matmul precision, make more) again with the limit raised: dynamo refuses
        before it runs anything. Not raised around every call: its ``config.patch`` cost
        48-73 us a call, the compiled call 25-30 (torch 2.15.0, 2-core VM, 2026-12-03)."""
        # dynamo's default stance where CPU mode runs torch.compile'd functions eagerly
        # (cpu_mode._eager_torch_compile; ~4 us a call): only there, off the GPU step's host path
        stance = torch.compiler.set_stance("default") if cpu_mode.is_active() else nullcontext()
        with stance:
            try:
                return self.compiled(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    return self.compiled(*args)

    def _keep_eager(self, key: tuple, wrong: str, written: list, want):
        """The eager formula's results in place of the compiled kernel's (``written``: (name,
        what the kernel wrote, the eager formula's copy)), and that layout run eager from now
        on."""
        for _, a, b in written:
            if a is not None:
                a.copy_(b)
        self.eager.add(key)
        print(f"[megatron-md] warning: {wrong}. --md-fused-step auto: this layout of the kernel "
              "now runs its eager formula (slower, the same results to fp32 rounding); "
              "--md-fused-step off runs every kernel eager, on stops instead", file=sys.stderr,
              flush=True)  # fmt: skip
        return want

    def _difference(self, what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
        """What is wrong with ``got``, or None where it equals ``want`` to rounding."""
        wide = torch.promote_types(want.dtype, torch.float32)  # fp32 stays: no copy of a stack
        a, b = got.to(wide), want.to(wide)
        # NaN or ±inf where the formula makes them too is no difference (a first step gone
        # wrong, megatron's NaN check off); one the formula does not make is (diff NaN)
        same = (a == b) | (a.isnan() & b.isnan())
        diff = torch.where(same, 0.0, (a - b).abs()).max().item()
        scale = torch.where(b.isfinite(), b.abs(), 0.0).max().item()
        if diff <= CHECK_TOL.get(want.dtype, 1e-4) * scale + 1e-30:
            return None
        return (
            f"torch {torch.__version__}'s compiled MD kernel {self.fn.__name__} ("
            f"{want.device.type}, shape {tuple(want.shape)}) differs from its eager formula in "
            f"its {what} by {diff:.3g} (largest entry {scale:.3g}): inductor miscompiled it "
            "(seen on a CPU with torch 2.9.1-2.11.0; right from 2.12.0)"
        )


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_hparams: dict[tuple, torch.Tensor] = {}
_tails: dict[tuple, torch.Tensor] = {}


def adam_hparams(hp: AdamHParams, step: int, like: torch.Tensor) -> torch.Tensor:
    """The step's Adam scalars as a tensor of ``like``'s dtype and device, made once per step
    and hyper-parameters; with the step count and LR on the device (a step a CUDA graph
    replays), computed there at every call."""
    if isinstance(step, torch.Tensor):
        bc1, bc2 = 1 - torch.pow(hp.beta1, step), 1 - torch.pow(hp.beta2, step)
        head = torch.stack([hp.lr / bc1, bc2.sqrt()]).to(like.dtype)
        key = (str(like.device), like.dtype, hp.beta1, hp.beta2, hp.eps)
        if key not in _tails:  # made at the first (eager) step: no copy in a capture, and
            # kept for good (a graph reads it by address)
            vals = [1 - hp.beta1, hp.beta2, 1 - hp.beta2, hp.eps]
            _tails[key] = torch.tensor(vals, dtype=like.dtype, device=like.device)
        return torch.cat([head, _tails[key]])
    key = (str(like.device), like.dtype, step, hp.lr, hp.beta1, hp.beta2, hp.eps)
    if key not in _hparams:
        if len(_hparams) > 64:
            _hparams.clear()
        bc1, bc2 = 1 - hp.beta1**step, 1 - hp.beta2**step
        vals = [hp.lr / bc1, bc2**0.5, 1 - hp.beta1, hp.beta2, 1 - hp.beta2, hp.eps]
        # copied without waiting: ``torch.tensor(..., device=cuda)`` synchronizes the stream
        # (a blocking host-to-device copy); pinned, as ``graph.DeviceScalars``' numbers
        host = torch.tensor(vals, dtype=like.dtype, pin_memory=like.device.type == "cuda")
        _hparams[key] = host.to(like.device, non_blocking=True)
    return _hparams[key]


def kernel_sphere(sphere: str, need_row: bool, need_col: bool) -> str:
    """The sphere whose norm partials ``phase1`` computes; "none" where the caller must (one
    more read of Ŵ; the kernel then runs its Frobenius variant, the partial dropped:
    ``_phase1_group``): a column sphere's are a column reduction (slow in inductor's CPU
    loops). A row sphere's next to both gains' partials as ``sq.sum(2)`` trips an inductor bug
    (torch 2.15 CPU: ``KeyError: 'buf5'`` from torch/_inductor/loop_body.py with two row
    reductions and the scratch write), so that variant takes them as squared row norms
    (``row_norm``; the 181M LM head's case: its group's step 215 ms against 220 with the
    Frobenius variant and the eager group's norms, 131072 x 512, one thread, torch 2.15.0,
    2026-12-03)."""
    if sphere == "col":
        return "none"
    if sphere == "row" and need_row and need_col:
        return "row_norm"
    return sphere


@dataclass
class Kernels:
    """A group's compiled phases (None: that phase runs eager). The engine runs ``phase1``
    through ``phase1_groups`` and ``fuse`` through ``fuse_groups`` (several groups a call where
    their stacks are taken whole)."""

    phase1: Callable | None
    """AdamMD: the gains' partials, G_Ŵ, Adam on Ŵ and the norms' partials in one pass."""
    fuse: Callable | None
    """The pending rescale (line 8) and W = Γ ⊙ Ŵ (line 10) in one pass."""
    partials: Callable | None = None
    """MuonMD: the gains' partials and G_Ŵ in one pass (the Newton–Schulz between stays the
    base's batched call, the norms' partials eager)."""
    fallback: bool = False
    """A layout found miscompiled at its first call runs eager, said on stderr (``fused_step``
    auto), instead of stopping the run (on): ``Checked``."""
    cut: tuple | None = None
    """A ZeRO-1 slice cut inside its matrix: its window of whole rows
    (``geometry.cut_window``: a, b, pre, post, N), its sphere and Q/K/V blocks
    (``_cut_scale``). Its phase 1 and fuse join the step's merged calls on a CPU too (one call
    for all the cut slices a rank holds, up to two a bucket, where each slice's eager step took
    ~30 operations)."""
    cut_at: torch.Tensor | None = None
    """The cut's ``pre`` as a 0-d tensor on the device (``_at_slice``)."""


def kernels_for(g, fallback: bool = False) -> Kernels | None:
    """The compiled kernels of group ``g``, where they apply: AdamMD or MuonMD on whole
    matrices held whole (no TP piece; Q/K/V spheres included), or AdamMD on a ZeRO-1 slice
    cut inside its matrix (no TP piece: ``Kernels.cut``), gains none/row/col/rowcol, no
    tangent projection, Ŵ projected back (not Muown), not both off (MD off stays eager: bit for
    bit megatron). ``fallback``: ``Kernels.fallback``."""
    spec = g.spec
    fits = (
        spec.gains in GAINS and spec.sphere in SPHERES and not spec.tangent_grad
        and spec.project and (spec.gains, spec.sphere) != ("none", "none")
    )  # fmt: skip
    if fits and not g.md0.whole and g.md0.tp is None and g.base.name == "adam":
        cut = cut_layout(g.full, g.md0.start, g.md0.end, spec.sphere, spec.row_blocks)
        at = torch.tensor(cut[2], device=g.W.device)  # once: a copy to the device
        return Kernels(_phase1_group, _fuse_group, fallback=fallback, cut=cut, cut_at=at)
    fits = fits and g.md0.whole and g.whole_block
    if fits and g.base.name == "adam":
        return Kernels(_phase1_group, _fuse_group, fallback=fallback)
    if fits and g.base.name == "muon" and not spec.tangent_update and not spec.weight_norm:
        return Kernels(None, _fuse_group, _partials_group, fallback=fallback)
    return None


def cut_layout(shape: tuple[int, int], start: int, end: int, sphere: str, row_blocks) -> tuple:
    """``Kernels.cut`` of the slice ``[start, end)`` of a ``shape`` matrix: its window
    (``geometry.cut_window``), the sphere and the Q/K/V blocks."""
    return (*cut_window(shape, start, end, row_blocks), sphere, tuple(row_blocks))


_ONES: dict[tuple, torch.Tensor] = {}


def _ones(like: torch.Tensor) -> torch.Tensor:
    """A 0-d one of ``like``'s dtype and device, the absent gain's factor: one kept per dtype
    and device (read, never written), not a new one per group and step (a fill kernel each on
    a GPU); made fresh inside a CUDA graph's capture (the eager warm-up steps keep it first)."""
    key = (like.device, like.dtype)
    if key not in _ONES:
        if _capturing():
            return like.new_ones(())
        _ONES[key] = like.new_ones(())
    return _ONES[key]


def _row_col(g, phi: dict):
    B, (M, N) = g.B, g.full
    one = _ones(g.W)
    row = phi["gain_row"].view(B, M, 1) if "gain_row" in phi else one
    col = phi["gain_col"].view(B, 1, N) if "gain_col" in phi else one
    return row, col


@dataclass
class _Phase1:
    """One group's phase-1 arguments, made before its kernel call (``_phase1_prep``)."""

    args: tuple
    """The kernel's arguments: (B, M, N) Ŵ, G, moments, the gains' factors, the Adam scalars,
    the scratch or None, ``need_row``."""
    need_row: bool
    """The group has row gains (the kernel returns their partials)."""
    need_col: bool
    """The group has column gains."""
    variant: str
    """The kernel's sphere variant (``_PHASE1``)."""
    sphere: str | tuple
    """The sphere whose norms the kernel takes ("none": the eager group's, after it;
    ``("blocks", row_blocks)``: a merged call's Q/K/V blocks, ``_sq_norms``)."""
    row: torch.Tensor
    scratch: torch.Tensor | None
    g_pieces: tuple | None = None
    """Where ``args``' G is megatron's gradient buffer whole: the regular pieces the group's
    gradients are in it (``Group.grads(pieces=True)``), read in place by ``_phase1_many``."""


def _phase1_prep(g, G, step, hp: AdamHParams, merged: bool = False):
    """A group's phase-1 arguments; ``merged``: for ``_phase1_many`` (no scratch: the column
    partials are summed inside the call; ``G`` may then be ``Group.grads(pieces=True)``')."""
    g.settle()  # a rescale no fuse took since the last step
    B, (M, N) = g.B, g.full
    phi = g.phi()
    row, col = _row_col(g, phi)
    need_row, need_col = "gain_row" in phi, "gain_col" in phi
    sphere = kernel_sphere(g.spec.sphere, need_row, need_col)
    if g.spec.row_blocks:  # Q/K/V spheres: per-block norms, the eager group's (one more read)
        # except a merged call's Frobenius ones (four eager operations a step after it)
        sphere = ("blocks", g.spec.row_blocks) if merged and sphere == "frobenius" else "none"
    g_pieces = None
    shape = (B, M, N) if g.kernels.cut is None else (B, g.L)  # cut slices: their own elements
    if isinstance(G, tuple):  # megatron's gradient buffer and the pieces of it to read
        g3, g_pieces = G
    else:
        g3 = G.view(shape)
    w3 = g.W.view(shape)
    m3, v3 = g.state["exp_avg"].view(shape), g.state["exp_avg_sq"].view(shape)
    scratch = _scratch(w3) if need_col and not merged else None
    # a group whose norms the eager group takes still runs the Frobenius variant, its partial
    # dropped: without a norm reduction inductor's CPU loops write Ŵ and the moments to
    # temporaries and copy them back, three more passes (one thread, 65536 x 512, torch
    # 2.15.0, 2026-12-03: 6.2 ns/element against 2.1; the Q/K/V and column-sphere groups')
    variant = sphere if sphere in _PHASE1 else "frobenius"
    args = (w3, g3, m3, v3, row, col, adam_hparams(hp, step, g.W), scratch, need_row)
    return _Phase1(args, need_row, need_col, variant, sphere, row, scratch, g_pieces)


def _phase1_rows(g, rows: torch.Tensor, prep: _Phase1, gr, nrm) -> None:
    """A kernel call's row gains' and norms' partials into ``rows`` (its matrices' partials)."""
    if prep.need_row:
        rows[:, : g.full[0]].add_(gr)
    if prep.sphere != "none":
        rows[:, g.n_gain :].add_(nrm.view(rows.shape[0], -1))


def _phase1_finish(g, P: torch.Tensor, prep: _Phase1) -> None:
    """After the kernel: the column gains' partials from the scratch, the eager norms."""
    if prep.scratch is not None:
        _add_col_partials(P, prep.row, prep.scratch, g.full[0] if prep.need_row else 0)
    if prep.sphere == "none" and g.n_norm:  # norm partials the kernel leaves to the eager group
        g.norm_partials(P[:, g.n_gain :])


def _phase1_group(g, G: torch.Tensor, P: torch.Tensor, step: int, hp: AdamHParams) -> None:
    """Phase 1 of the whole group (partials into ``P`` (B, n_partial)), compiled."""
    prep = _phase1_prep(g, G, step, hp)
    kernel = _get(prep.variant, _PHASE1[prep.variant], g.kernels.fallback)
    w, grad, m, v, row, col, hp_t, scratch, need_row = prep.args
    for one in _pieces(g, stackable=True):
        gr, nrm = kernel(_at(w, one), _at(grad, one), _at(m, one), _at(v, one), _at(row, one),
                         _at(col, one), hp_t, _at(scratch, one), need_row)  # fmt: skip
        _phase1_rows(g, _at(P, one), prep, gr, nrm)
    _phase1_finish(g, P, prep)


#: elements of Ŵ one merged call takes at most (its arguments' stacks stay alive until it
#: returns, and with them any temporaries inductor makes)
MERGE_ELEMENTS = 1 << 26


def phase1_groups(items: list, step) -> None:
    """Phase 1 of several groups, ``items`` (group, P, hp): where a group's kernels take
    its whole stack (a GPU; ``STACK_ON_CPU``), groups together in one compiled call up to
    ``MERGE_ELEMENTS`` (``_phase1_many``: one call's host cost for all, where each group's
    call cost its own, and the partials written inside it; gradients that are no strided view
    of megatron's buffer read in place there, ``Group.grads(pieces=True)``, where a stack copied
    them); elsewhere one group a call (``_phase1_group``: on a CPU one matrix a call, into the
    one kept scratch), but the cut slices merged there too (``Kernels.cut``)."""
    batch, size = [], 0
    for g, P, hp in items:
        if not _stacks(g) and g.kernels.cut is None:
            _phase1_group(g, g.grads()[0], P, step, hp)
            continue
        G = g.grads(pieces=True)[0]
        batch.append((g, P, _phase1_prep(g, G, step, hp, merged=True)))
        size += g.B * g.L
        if size >= MERGE_ELEMENTS:
            _phase1_call(batch)
            batch, size = [], 0
    if batch:
        _phase1_call(batch)


def _phase1_call(batch: list) -> None:
    """One ``_phase1_many`` call for ``batch`` (group, its (B, n_partial) partials, its prep):
    each group's partials a window of its buffer (the step's buffer of its domain, or the
    group's own where its partials are not one span of it), the eager norms after."""
    parts, index, flat = [], {}, []
    for g, P, prep in batch:
        root = P if P._base is None else P._base  # the storage's tensor: as_strided's offsets
        k = index.setdefault(root.untyped_storage().data_ptr(), len(parts))
        if k == len(parts):
            parts.append(root)
        w, grad, m, v, row, col, hp_t, _, need_row = prep.args
        flat += [w, grad, m, v, row, col, hp_t, need_row, prep.need_col, prep.sphere, k,
                 P.storage_offset(), P.shape[1], g.n_gain, prep.g_pieces,
                 g.kernels.cut, g.kernels.cut_at]  # fmt: skip
    _get("phase1_many", _phase1_many, batch[0][0].kernels.fallback)(len(parts), *parts, *flat)
    for g, P, prep in batch:
        _phase1_finish(g, P, prep)  # (no scratch here: the eager norms where the kernel took none)


def _partials_group(g, P: torch.Tensor) -> torch.Tensor:
    """MuonMD's lines 1-6 of the whole group, compiled: the gains' partials into ``P``; returns
    G_Ŵ = Γ ⊙ G, a new tensor (megatron's gradients stay as they are; the base step writes
    G_Ŵ). Where the call takes the whole stack (a GPU) and the gradients are no strided view
    of megatron's buffer, read in place by their regular pieces (``_partials_pieces``), not
    stacked."""
    g.settle()  # a rescale no fuse took since the last step
    B, (M, N) = g.B, g.full
    phi = g.phi()
    row, col = _row_col(g, phi)
    need_row, need_col = "gain_row" in phi, "gain_col" in phi
    G = g.grads(pieces=_stacks(g))[0]
    # a new tensor even where G is the step's own stack: the same bytes written, and written
    # over G inductor's CPU loops fail (torch 2.15: KeyError 'buf1' in loop_body.py with the
    # row reduction reading G)
    out = torch.empty(B, g.L, dtype=g.W.dtype, device=g.W.device)
    w3, o3 = g.W.view(B, M, N), out.view(B, M, N)
    scratch = _scratch(w3) if need_col else None
    if isinstance(G, tuple):  # megatron's gradient buffer and the pieces of it to read
        kernel = _get("partials_pieces", _partials_pieces, g.kernels.fallback)
        gr = kernel(w3, G[0], row, col, o3, scratch, need_row, G[1])
        if need_row:
            P[:, :M].add_(gr)
    else:
        g3 = G.view(B, M, N)
        kernel = _get("partials", _partials, g.kernels.fallback)
        for one in _pieces(g, stackable=True):
            gr = kernel(_at(w3, one), _at(g3, one), _at(row, one), _at(col, one),
                        _at(o3, one), _at(scratch, one), need_row)  # fmt: skip
            if need_row:
                _at(P, one)[:, :M].add_(gr)
    if need_col:
        _add_col_partials(P, row, scratch, M if need_row else 0)
    return out


_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(like: torch.Tensor) -> torch.Tensor:
    """Room for a group's Ŵ ⊙ G (uninitialized, contiguous, ``like``'s shape), used until the
    group's column partials are taken: on a CPU a view of one buffer per dtype kept for the
    process, grown to the largest group; a new tensor of a large group was faulted in page by
    page at every step (phase 1 and the mat-vec of the 181M model's LM head,
    131072 x 512, one thread, torch 2.15.0, 2026-12-03: 436 ms fresh against 153 kept, with
    torch's huge-page hint; 538 against 159 without). On a GPU a new tensor: the caching
    allocator reuses its memory, which the forward-backward gets back between steps."""
    if like.device.type != "cpu":
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    buf = _SCRATCH.get(like.dtype)
    if buf is None or buf.numel() < like.numel():
        _SCRATCH.pop(like.dtype, None)  # freed before the larger one is made
        buf = _SCRATCH[like.dtype] = torch.empty(like.numel(), dtype=like.dtype)
    return buf[: like.numel()].view(like.shape)


def _add_col_partials(P: torch.Tensor, row, scratch: torch.Tensor, off: int) -> None:
    """The column gains' partials g_rowᵀ (Ŵ⊙G) of a group (``scratch``: Ŵ⊙G, (B, M, N)) into
    ``P[:, off : off + N]``: one batched mat-vec."""
    B, _, N = scratch.shape
    part = torch.bmm(row.transpose(1, 2), scratch) if row.ndim else scratch.sum(1, True)
    P[:, off : off + N].add_(part.view(B, N))


#: call the kernels once on a CPU group's whole stack too (the tests: the GPU's calls on a CPU)
STACK_ON_CPU = False


def _stacks(g) -> bool:
    """Whether group ``g``'s kernels take its whole stack in one call (a GPU's)."""
    return g.W.device.type != "cpu" or STACK_ON_CPU


def _pieces(g, stackable: bool) -> list[slice]:
    """The matrices of group ``g`` each kernel call takes: the whole stack in one call on a
    GPU (``stackable``: the arguments are views of one stack), one matrix a call on a CPU."""
    if stackable and _stacks(g):
        return [slice(0, g.B)]
    return [slice(b, b + 1) for b in range(g.B)]


def _at(x: torch.Tensor | None, one: slice) -> torch.Tensor | None:
    """Matrices ``one`` of a stacked argument; the whole stack, a 0-d one (an absent gain) or
    None as it is: ``x[0:B]`` is one more operation (``aten::slice``) for the same view, 67 of
    the 330 that AdamMD's inner step dispatched at a GPU's call pattern (12 layers, width 128,
    ``STACK_ON_CPU``, 2026-12-04): host time on a GPU, where the 181M step is host-bound."""
    if x is None or x.ndim == 0 or (one.start == 0 and one.stop == x.shape[0]):
        return x
    return x[one]


def fuse_groups(items: list) -> None:
    """The fuse of several groups, ``items`` (group, its members' destinations): where a
    group's kernels take its whole stack (a GPU; ``STACK_ON_CPU``) and its destinations lie in
    one buffer, the groups of a buffer together in one compiled call up to ``MERGE_ELEMENTS``
    (``_fuse_many``), a group's destinations one window of it where they are one strided view,
    one window a regular piece otherwise (``geometry.regular_pieces``: an MoE model's experts,
    one (layers, experts) grid, where a window a member made a Triton kernel a member on a
    GPU: 83 fuse kernels of a 69-matrix MoE at expert-parallel size 1, 19 by piece,
    ``tools/triton_kernels.py``, 2026-12-05); elsewhere one group a call (``_fuse_group``)."""
    batches: dict[int, tuple[torch.Tensor, list]] = {}
    for g, targets in items:
        if g.kernels.cut is not None:  # their ranges of the buffer, merged on a CPU too
            view, pieces = g.placed("out", targets)
            if view is None and pieces is None:  # (not in one buffer)
                _fuse_eager(g, targets)
                continue
            buf = g.whole(targets[0])
            item = (g, view, ("cut", pieces))
            batches.setdefault(buf.data_ptr(), (buf, []))[1].append(item)
            continue
        view, pieces = g.placed("out", targets) if _stacks(g) else (None, None)
        if view is None and pieces is None:
            _fuse_group(g, targets)
            continue
        buf = g.whole(targets[0] if view is None else view)
        batches.setdefault(buf.data_ptr(), (buf, []))[1].append((g, view, pieces))
    for buf, groups in batches.values():
        flat, size = [], 0
        for k, (g, view, pieces) in enumerate(groups):
            if isinstance(pieces, tuple) and pieces[0] == "cut":
                row, col = _row_col(g, g.phi())
                s, g.pending = g.pending, None  # (B, n_norm): broadcast in the call
                where = (
                    (None, pieces[1]) if view is None else (view.stride(), view.storage_offset())
                )
                flat += [g.W, s, row, col, (g.B, g.L), *where, g.kernels.cut,
                         g.kernels.cut_at]  # fmt: skip
            else:
                w3, s, row, col, o3 = _fuse_operands(g, view)
                if o3 is None:  # a window a regular piece
                    flat += [w3, s, row, col, g.full, None, pieces, None, None]
                else:
                    flat += [w3, s, row, col, tuple(o3.shape), o3.stride(),
                             o3.storage_offset(), None, None]  # fmt: skip
            size += g.B * g.L
            if size >= MERGE_ELEMENTS or k == len(groups) - 1:
                _get("fuse_many", _fuse_many, g.kernels.fallback)(buf, *flat)
                flat, size = [], 0


def _fuse_eager(g, targets: list[torch.Tensor]) -> None:
    """The eager fuse of a cut group whose destinations are no view nor regular pieces of one
    buffer (the engine's own: ``Group.fuse_to``)."""
    g.fuse_to(targets)


def _fuse_group(g, targets: list[torch.Tensor]) -> None:
    """The pending rescale and W = Γ ⊙ Ŵ of the whole group in one pass, compiled."""
    M, N = g.full
    w3, s, row, col, out = _fuse_operands(g, g.rows("out", targets))
    name, fn = ("fuse", _fuse) if s is None else ("rescale_fuse", _rescale_fuse)
    kernel = _get(name, fn, g.kernels.fallback)
    for one in _pieces(g, stackable=out is not None):
        o = _at(out, one) if out is not None else targets[one.start].view(1, M, N)
        if s is None:
            kernel(_at(w3, one), _at(row, one), _at(col, one), o)
        else:
            kernel(_at(w3, one), _at(s, one), _at(row, one), _at(col, one), o)


def _fuse_operands(g, view: torch.Tensor | None) -> tuple:
    """A group's fuse operands, (B, M, N) where stacked: Ŵ, the pending rescale's factors or
    None, the gains' factors, the destination (``view``, the members' rows of one buffer, or
    None: one call a member). Takes the pending rescale off the group (the fuse applies it)."""
    B, (M, N) = g.B, g.full
    row, col = _row_col(g, g.phi())
    s = None if g.pending is None else g.axis_bcast(g.blocks[0], g.pending)
    g.pending = None
    out = view.view(B, M, N) if view is not None else None
    return g.W.view(B, M, N), s, row, col, out
