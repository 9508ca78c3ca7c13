"""AdamMD's and MuonMD's phases of a whole group as compiled kernels (``torch.compile``;
``--md-fused-step``; on by default at scale, AdamMD's only on a CPU: ``MDConfig.use_fused``):
which groups they take (``kernels_for``), their arguments, and how a step's groups share
calls. The formulas themselves are ``formulas.py``; each compiled call's first call of a
layout is checked against its formula by ``checked.py``.

MuonMD's (``_partials_group`` and the fuse): the gains' partials and G_Ŵ = Γ ⊙ G in one pass
before the base's batched Newton–Schulz, the norms' partials eager after it, and the deferred
rescale with W = Γ ⊙ Ŵ in one pass; Q/K/V-split groups included (their spheres are the
rescale's, their Newton–Schulz blocks the base's).

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
(``Kernels.cut``: its window of whole rows, ``formulas._phase1_cut``, ``formulas._fuse_cut``).
On a GPU both AdamMD's and MuonMD's are the default at scale (``MDConfig.use_fused``), after
``tools/gpu_check.py`` checked them against the reference and measured them faster than the
eager group there (H200, 2026-11-26, docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Callable

import torch

from megatron.md.base_steps import AdamHParams
from megatron.md.engine.checked import RECOMPILE_LIMIT, Checked, _capturing
from megatron.md.engine.formulas import (
    _PHASE1,
    _fuse,
    _fuse_many,
    _partials,
    _partials_pieces,
    _phase1_many,
    _rescale_fuse,
)
from megatron.md.engine.geometry import cut_window

#: gains and spheres the compiled kernels cover (others, the tangent projection and TP pieces:
#: the eager group)
GAINS = ("none", "row", "col", "rowcol")
SPHERES = ("frobenius", "row", "col", "none")


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
    otherwise written by the index its regular pieces compute (``geometry.regular_pieces``: an
    MoE model's experts, one (layers, experts) grid; ``formulas._piece_index``), where a window
    a member made a Triton kernel a member on a GPU and a window a piece one a piece (a
    69-matrix MoE at expert-parallel size 1: 83 fuse kernels by member, 19 by piece;
    ``bench_dispatch.py``'s 405-matrix MoE: 19 by piece, 15 by index; ``tools/triton_kernels.py``,
    2026-12-05); elsewhere one group a call (``_fuse_group``)."""
    batches: dict[int, tuple[torch.Tensor, list]] = {}
    for g, targets in items:
        cut = g.kernels.cut is not None  # cut slices: their ranges of the buffer, on a CPU too
        view, pieces = g.placed("out", targets) if cut or _stacks(g) else (None, None)
        if view is None and pieces is None:  # (not in one buffer; a CPU's whole matrices)
            (_fuse_eager if cut else _fuse_group)(g, targets)
            continue
        buf = g.whole(targets[0] if view is None else view)
        batches.setdefault(buf.data_ptr(), (buf, []))[1].append((g, view, pieces))
    for buf, groups in batches.values():
        flat, size = [], 0
        for k, (g, view, pieces) in enumerate(groups):
            if g.kernels.cut is not None:
                row, col = _row_col(g, g.phi())
                s, g.pending = g.pending, None  # (B, n_norm): broadcast in the call
                where = (None, pieces) if view is None else (view.stride(), view.storage_offset())
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
