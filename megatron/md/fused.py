"""AdamMD's per-block work compiled into fused kernels (``torch.compile``; ``--md-fused-step``).

Eager, one AdamMD block costs ~14 elementwise passes (Ŵ⊙G, two mat-vecs, G_Ŵ in two products,
Adam's seven, the norm) where torch's AdamW costs seven. Compiled, phase 1 (gain-gradient
partials, G_Ŵ = Γ ⊙ G, Adam on Ŵ, the sphere's squared-norm partials) is one read of Ŵ, G and
the moments and one write of Ŵ and the moments (plus a column-sum kernel); the sphere rescale
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


def _phase1(w, g, m, v, row, col, hp, partials: bool, sphere: str):
    gb = g.to(w.dtype)
    zero = w.new_zeros(())
    gr = gc = zero
    if partials:
        p = w * gb
        gr = (p * col).sum(1)  # ∂L/∂g_row partial: Σ_j Ŵ G g_col (a fused reduction, no mv)
        gc = (p * row).sum(0)
        gb = gb * row * col
    w2 = _adam(w, gb, m, v, hp)
    sq = w2 * w2
    nrm = {"frobenius": lambda: sq.sum(), "row": lambda: sq.sum(1), "col": lambda: sq.sum(0)}
    return gr, gc, nrm[sphere]() if sphere != "none" else zero


# One top-level function per sphere (fewer variants per code object, see RECOMPILE_LIMIT).
def _phase1_frobenius(w, g, m, v, row, col, hp, partials: bool):
    return _phase1(w, g, m, v, row, col, hp, partials, "frobenius")


def _phase1_row(w, g, m, v, row, col, hp, partials: bool):
    return _phase1(w, g, m, v, row, col, hp, partials, "row")


def _phase1_col(w, g, m, v, row, col, hp, partials: bool):
    return _phase1(w, g, m, v, row, col, hp, partials, "col")


def _phase1_none(w, g, m, v, row, col, hp, partials: bool):
    return _phase1(w, g, m, v, row, col, hp, partials, "none")


def _fuse(x, row, col, out):
    out.copy_(x * row * col)


def _rescale_fuse(x, s, row, col, out):
    x2 = x * s
    x.copy_(x2)
    out.copy_(x2 * row * col)


_PHASE1 = {
    "frobenius": _phase1_frobenius,
    "row": _phase1_row,
    "col": _phase1_col,
    "none": _phase1_none,
}
_compiled: dict[str, object] = {}


#: compiled variants allowed per function (dynamo's default, 8, is global; ours can exceed it:
#: dtype × gains present × one-row blocks, and every spec in one test process)
RECOMPILE_LIMIT = 64


def _get(name: str, fn):
    if name not in _compiled:  # compiled lazily: importing this module costs nothing
        compiled = torch.compile(fn, dynamic=True, fullgraph=True)

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


def phase1(w, g, m, v, row, col, hp: torch.Tensor, partials: bool, sphere: str):
    """One block (2-D views): returns (row-gain partial, col-gain partial, norm partial);
    updates ``w``, ``m``, ``v`` in place. ``row``/``col``: (nr, 1)/(1, nc) gains (ones if
    absent)."""
    return _get(sphere, _PHASE1[sphere])(w, g, m, v, row, col, hp, partials)


def fuse(x, s, row, col, out) -> None:
    """``x`` ⊙= s (the sphere rescale, unless None), then ``out`` = x ⊙ row ⊙ col rounded once
    into ``out``'s dtype: one read of x, one write of x and of ``out``."""
    if s is None:
        _get("fuse", _fuse)(x, row, col, out)
    else:
        _get("rescale_fuse", _rescale_fuse)(x, s, row, col, out)
