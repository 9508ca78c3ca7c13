"""oneMKL's vector-math kernels resolved on one thread before any parallel use (CPU mode).

ATen computes a contiguous float32/float64 unary op on the CPU (``cos``, ``sin``, ``exp``,
``sqrt``, ...) by calling oneMKL's VML on each intra-op thread's 2048-element chunk, asking for
high accuracy per call (torch/include/ATen/cpu/vml.h, ``IMPLEMENT_VML_MKL``). oneMKL 2024.2,
the one linked into torch's x86 wheels (torch 2.15.0: "oneAPI Math Kernel Library Version
2024.2-Product Build 20240605" in ``torch.__config__.parallel_info()``), picks a function's
kernel on that function's first call; when the first call runs on two threads at once, one
thread can run a low-accuracy kernel on its whole chunk of that one call, and every later call
is right (pytorch/pytorch#188792, open; its proposed fix, #188791, is this warm-up inside ATen).

Seen here (2026-12-04, 2-core Xeon VM, torch 2.15.0): in a CPU-mode process the first
``torch.cos`` is RoPE's (megatron/core/models/common/embeddings/rope_utils.py,
``_apply_rotary_pos_emb_bshd``) on the query; in 3 of 100 processes with two threads the first
half of its cos table was off by up to 1.5e-4, bit for bit oneMKL's low-accuracy (EP) ``vmsCos``
(3.6e-8 otherwise, and on the key's call just after), and a trained nGPT's logits by 1.37e-5
instead of 5.6e-7 (tests/test_ngpt.py); 0 of 100 with ``warm``. ``warm`` calls each function
once on one element, which runs on the calling thread alone: its kernel is resolved before two
threads can race on it. On builds without oneMKL (aarch64 wheels) it does nothing harmful:
the same ops on one element.
"""

from __future__ import annotations

import torch

#: the functions ATen sends to oneMKL's VML (torch/include/ATen/cpu/vml.h, the
#: ``IMPLEMENT_VML_MKL(op, ...)`` lines; tests/test_cpu_mode_and_demo.py holds it to the header)
VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10",
           "sin", "sqrt", "tan", "tanh", "trunc", "log2")  # fmt: skip

_WARM = False


def warm() -> None:
    """Call every ``VML_OPS`` function once per precision oneMKL has (float32, float64) on one
    element (idempotent). Must run before the process's first parallel unary op."""
    global _WARM
    if _WARM:
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)  # inside every function's domain
        for op in VML_OPS:
            getattr(torch, op)(x)
    _WARM = True
