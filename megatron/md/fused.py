"""AdamMD's per-block work compiled into fused kernels (``torch.compile``; ``--md-fused-step``).

Eager, one AdamMD block costs ~14 elementwise passes (Ŵ⊙G, two mat-vecs, G_Ŵ in two products,
Adam's seven, the norm) where torch's AdamW costs seven. Compiled, phase 1 (gain-gradient
partials, G_Ŵ = Γ ⊙ G, Adam on Ŵ, the sphere's squared-norm partials) is one read of Ŵ, G and
the moments and one write of Ŵ and the moments (with column gains, plus Ŵ⊙G written once to a
scratch buffer for a mat-vec: see ``phase1``); the sphere rescale
waits for the fuse, so rescale and W = Γ ⊙ Ŵ are one read of Ŵ and one write of Ŵ and of W.
Same formulas as ``sliced.SliceMD`` (tested against it and the reference); the rounding differs
by fp32 reassociation only (inductor contracts products and orders sums its own way), so it is
never used where bit-identity is promised (MD off).

Missing row/column gains are passed as ones (x·1 is exact). Hyper-parameters travel as one
small tensor on the block's device so a new step does not recompile.
"""

from __future__ import annotations

import torch

from megatron.md.base_steps import AdamHParams

#: gains this path covers, with every sphere (scalar/lowrank gains, tangent projection: eager)
FUSED_GAINS = ("none", "row", "col", "rowcol")


def _adam(w, g, m, v, hp):
    """torch AdamW's arithmetic (lerp with weight < 0.5, addcmul, sqrt/bc2 + eps, addcdiv);
    hp = [step_size, sqrt(bias_correction2), 1 - beta1, beta2, 1 - beta2, eps]."""
    m2 = m + hp[2] * (g - m)
    v2 = v * hp[3] + hp[4] * g * g
    w2 = w - hp[0] * (m2 / (v2.sqrt() / hp[1] + hp[5]))
    m.copy_(m2)
    v.copy_(v2)
    w.copy_(w2)
    return w2


def _phase1(w, g, m, v, row, col, hp, scratch, need_row: bool, sphere: str):
    gb = g.to(w.dtype)
    zero = w.new_zeros(())
    gr = nrm = zero
    p = w * gb
    if need_row:  # ∂L/∂g_row partial Σ_j Ŵ G g_col: a row reduction, in the same loop as Adam
        gr = (p * col).sum(1)
    if scratch is not None:  # Ŵ⊙G for the column sums (a mat-vec outside, see phase1)
        scratch.copy_(p)
    w2 = _adam(w, gb * row * col, m, v, hp)
    sq = w2 * w2
    if sphere == "frobenius":
        nrm = sq.sum(1).sum()  # row sums first: stays in the row loop, no second pass
    elif sphere == "row":
        nrm = sq.sum(1)
    return gr, nrm


# One top-level function per sphere (fewer variants per code object, see RECOMPILE_LIMIT).
def _phase1_frobenius(w, g, m, v, row, col, hp, scratch, need_row: bool):
    return _phase1(w, g, m, v, row, col, hp, scratch, need_row, "frobenius")


def _phase1_row(w, g, m, v, row, col, hp, scratch, need_row: bool):
    return _phase1(w, g, m, v, row, col, hp, scratch, need_row, "row")


def _phase1_none(w, g, m, v, row, col, hp, scratch, need_row: bool):
    return _phase1(w, g, m, v, row, col, hp, scratch, need_row, "none")


def _fuse(x, row, col, out):
    out.copy_(x * row * col)


def _rescale_fuse(x, s, row, col, out):
    x2 = x * s
    x.copy_(x2)
    out.copy_(x2 * row * col)


_PHASE1 = {"frobenius": _phase1_frobenius, "row": _phase1_row, "none": _phase1_none}
_compiled: dict[str, object] = {}


#: compiled variants allowed per function (dynamo's default, 8, is global; ours can exceed it:
#: dtype × gains present × one-row blocks, and every spec in one test process)
RECOMPILE_LIMIT = 64


def _get(name: str, fn):
    if name not in _compiled:  # compiled lazily: importing this module costs nothing
        compiled = torch.compile(fn, dynamic=False, fullgraph=True)  # symbolic dims: _mark

        def call(*args, _fn=compiled):
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return _fn(*args)

        _compiled[name] = call
    return _compiled[name]


_hparams: dict[tuple, torch.Tensor] = {}


def adam_hparams(hp: AdamHParams, step: int, like: torch.Tensor) -> torch.Tensor:
    """The step's Adam scalars as a tensor of ``like``'s dtype (what eager ops use for a
    Python scalar) and device, made once per step and hyper-parameters (a host-to-device copy
    on a GPU)."""
    key = (str(like.device), like.dtype, step, hp.lr, hp.beta1, hp.beta2, hp.eps)
    if key not in _hparams:
        if len(_hparams) > 64:
            _hparams.clear()
        bc1, bc2 = 1 - hp.beta1**step, 1 - hp.beta2**step
        vals = [hp.lr / bc1, bc2**0.5, 1 - hp.beta1, hp.beta2, 1 - hp.beta2, hp.eps]
        _hparams[key] = torch.tensor(vals, dtype=like.dtype, device=like.device)
    return _hparams[key]


def _mark(block: torch.Tensor, *ts) -> None:
    """Make the block's long dimension symbolic (rows; columns of a one-row block) so one
    compiled kernel serves every cut, and keep the other static: a symbolic inner dimension
    costs inductor's CPU loops a division per vector iteration (its tail mask), measured
    1.2-2.5x slower on these kernels."""
    dim = 0 if block.shape[0] > 1 else 1
    for t in (block, *ts):
        if t is not None and t.ndim == 2 and t.shape[dim] > 1:
            torch._dynamo.maybe_mark_dynamic(t, dim)


_scratch: dict[tuple, torch.Tensor] = {}


def _scratch_like(x: torch.Tensor) -> torch.Tensor:
    """A reused buffer of ``x``'s shape (one per device and dtype, grown as needed): a fresh
    block-sized buffer per call would cost its page faults every step on a CPU."""
    key = (str(x.device), x.dtype)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < x.numel():
        buf = _scratch[key] = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    return buf[: x.numel()].view(x.shape)


def kernel_sphere(sphere: str, need_row: bool, need_col: bool) -> str:
    """The sphere whose norm partials ``phase1`` computes; "none" where the caller must (eagerly,
    one more read of Ŵ): a column sphere's are a column reduction (slow here, see ``phase1``),
    and a row sphere's next to both gains' partials trips an inductor bug (torch 2.15 CPU:
    ``KeyError: 'buf5'`` from torch/_inductor/loop_body.py with two row reductions and the
    scratch write over a symbolic row count; ``tests/test_sliced.py`` covers the case)."""
    if sphere == "col" or (sphere == "row" and need_row and need_col):
        return "none"
    return sphere


def phase1(w, g, m, v, row, col, hp: torch.Tensor, need_row: bool, need_col: bool, sphere: str):
    """One block (2-D views): returns (row-gain partial, col-gain partial, norm partial),
    None/0 where not asked; updates ``w``, ``m``, ``v`` in place. ``row``/``col``: (nr, 1) /
    (1, nc) gains (a 0-d one if absent). Column sums are a mat-vec over Ŵ⊙G written by the
    kernel into a scratch buffer: inductor's CPU code for a column reduction walks the
    columns in the outer loop (strided reads: 15 ms for a 4096×1024 fp32 block, one thread,
    against 6 ms for the whole row-wise kernel and 1.3 ms for the mat-vec)."""
    scratch = _scratch_like(w) if need_col else None
    _mark(w, g, m, v, scratch, row, col)
    gr, nrm = _get(sphere, _PHASE1[sphere])(w, g, m, v, row, col, hp, scratch, need_row)
    gc = None
    if need_col:
        gc = row.view(-1) @ scratch if row.ndim else scratch.sum(0)
    return gr, gc, nrm


def fuse(x, s, row, col, out) -> None:
    """``x`` ⊙= s (the sphere rescale, unless None), then ``out`` = x ⊙ row ⊙ col rounded once
    into ``out``'s dtype: one read of x, one write of x and of ``out``."""
    _mark(x, s, row, col, out)
    if s is None:
        _get("fuse", _fuse)(x, row, col, out)
    else:
        _get("rescale_fuse", _rescale_fuse)(x, s, row, col, out)
