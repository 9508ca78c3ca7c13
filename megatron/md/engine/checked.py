"""The first-call check of the compiled MD kernels (``Checked``): each layout's first call
run against its eager formula (``formulas.py``) on copies of what it writes, a difference
beyond rounding stopping the run or keeping that layout eager."""

from __future__ import annotations

import math
import sys
import threading
from contextlib import nullcontext
from typing import Callable

import torch

from megatron.md import cpu_mode
from megatron.md.engine import formulas as f

#: compiled variants allowed per function (dynamo's default, 8, is global): ``Checked._compiled``
RECOMPILE_LIMIT = 64


#: the arguments each kernel writes (by position): the first call of a layout runs the eager
#: formula on copies of them (``COPIES``: a kernel that makes its own)
WRITES = {**dict.fromkeys(f._PHASE1.values(), (0, 2, 3, 7)), f._partials: (4, 5),
          f._partials_pieces: (4, 5), f._fuse: (3,),
          f._rescale_fuse: (0, 4),
          # the merged call: by the groups it takes
          f._phase1_many: lambda a: [*range(1, 1 + a[0]), *(
              i + k for i in range(1 + a[0], len(a), f.ITEM1) for k in (0, 2, 3))]}  # fmt: skip


def _fuse_many_copies(args: tuple) -> tuple[list, list]:
    """The first-call check's copies for ``_fuse_many``: the windows it writes (a group's, or
    each member's) laid out one after another in a new buffer (a copy of megatron's whole
    param buffer would cost its size again at the first step, its fp32 difference twice
    that), and each Ŵ whose rescale is pending; (the copies' arguments, (name, written
    tensor, its copy) of each)."""
    buf, flat = args[0], args[1:]
    items = [flat[i : i + f.ITEMF] for i in range(0, len(flat), f.ITEMF)]
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
COPIES = {f._fuse_many: _fuse_many_copies}

#: largest difference from the eager formula a compiled kernel may show, relative to the
#: largest magnitude of the tensor compared (inductor reorders sums and contracts products);
#: half precision: one rounding of the largest entry
CHECK_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2**-7, torch.float16: 2**-9}


class _DefaultStance:
    """dynamo's default stance while any thread is inside a compiled MD call. The stance is one
    global, which ``torch.compiler.set_stance`` saves and restores: two threads (the tests' ranks)
    each saving and restoring it, the first out restored CPU mode's ``force_eager`` and the last
    the ``default`` it had saved, for the rest of the process (megatron's ``torch.compile``'d
    functions then traced by dynamo in every later test, 2026-12-05). Here the first call in sets
    it and the last out restores it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside = 0
        self._set: torch.compiler.set_stance | None = None

    def __enter__(self) -> None:
        with self._lock:
            if not self._inside:
                self._set = torch.compiler.set_stance("default")
            self._inside += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._inside -= 1
            if not self._inside:
                self._set.__exit__(None, None, None)
                self._set = None


_DEFAULT_STANCE = _DefaultStance()


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
        with _DEFAULT_STANCE if cpu_mode.is_active() else nullcontext():
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
