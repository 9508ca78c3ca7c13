"""MD's engine (megatron/md/engine: the batched step of many matrices) against the
whole-matrix reference, in one process: ZeRO-1 slices with cuts inside rows as ranks
(tests/_ranks.py sums their partials as the all-reduce does), every sphere × gain kind, the
tangent projection, Muon with and without the Q/K/V split, Muown, the compiled kernels; and
what makes it an engine: a fixed number of operations whatever the number of matrices, no
host synchronization."""

import pytest
import torch
from _ranks import Ranks

from megatron.md import reference, sliced
from megatron.md.base_steps import AdamHParams, MuonHParams, hyperball_
from megatron.md.blocks import slice_blocks
from megatron.md.config import MatrixSpec
from megatron.md.engine.checked import MiscompiledKernel

#: inductor miscompiled MD's kernels on a CPU with torch 2.9.1, 2.10.0 and 2.11.0 (2026-12-03,
#: docs/internals.md): there the kernels' first-call check stops these tests, as it must; any
#: other failure still fails
MISCOMPILED_BY_OLD_TORCH = pytest.mark.xfail(
    torch.torch_version.TorchVersion(torch.__version__) < "2.12",
    raises=MiscompiledKernel,
    reason="torch < 2.12's inductor miscompiles MD's kernels on a CPU (MiscompiledKernel)",
    strict=False,
)

CUTS = {
    1: [],
    2: [37],  # inside row 3 of a 9x11 matrix
    3: [5, 61],
    4: [1, 23, 80],
}


def _scattered(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``parts`` in one buffer at uneven gaps (megatron's buckets: a rank's slices of
    same-shape matrices in one buffer, not evenly spaced)."""
    offs, at = [], 0
    for i, p in enumerate(parts):
        offs.append(at)
        at += p.numel() + 3 + 5 * i
    buf = torch.zeros(at, dtype=parts[0].dtype)
    out = [buf[o : o + p.numel()] for o, p in zip(offs, parts)]
    for o, p in zip(out, parts):
        o.copy_(p)
    return out


def _run(spec, cuts, base="adam", steps=5, shape=(9, 11), dtype=torch.float64, n=2,
         compiled=False, one_buffer=False, device=False, fallback=False,
         scattered=False):  # fmt: skip
    """``n`` matrices stepped by the reference and by the engine on ``len(cuts) + 1`` ranks,
    each owning one slice of every matrix (``one_buffer``: the fused weights are rows of one
    buffer, as megatron's are; ``scattered``: a rank's gradients and fused weights each in one
    buffer at uneven gaps; ``device``: the engine's step count and LRs read from the
    device, the LRs decaying step by step). Returns (the engine's fused W per matrix, the
    reference's, the ranks, the reference's states)."""
    gen = torch.Generator().manual_seed(3)
    w0 = [torch.randn(shape, generator=gen, dtype=dtype) / shape[1] ** 0.5 for _ in range(n)]
    grads = [[torch.randn(shape, generator=gen, dtype=dtype) for _ in range(n)]
             for _ in range(steps)]  # fmt: skip
    decay = [1 - k / (2 * steps) if device else 1.0 for k in range(steps)]
    hps = [AdamHParams(2e-2 * f) if base == "adam" else MuonHParams(2e-2 * f) for f in decay]
    ghps = [AdamHParams(1e-2 * f) for f in decay]
    ref = []
    for w in w0:
        w = w.clone()
        ref.append((w, reference.init_state(w, spec, base)))
    for gs, hp, ghp in zip(grads, hps, ghps):
        for (w, st), g in zip(ref, gs):
            reference.md_step(w, g, st, spec, hp, ghp)
    numel = shape[0] * shape[1]
    bounds = [0, *cuts, numel]
    pieces = [[(sliced.SliceMD(shape, lo, hi, spec, base), w.reshape(-1)[lo:hi], i)
               for i, w in enumerate(w0)] for lo, hi in zip(bounds[:-1], bounds[1:])]  # fmt: skip
    ranks = Ranks(pieces, dtype, compiled, fallback=fallback)
    ranks.init()
    spread = _scattered if scattered else lambda parts: parts
    for gs, hp, ghp in zip(grads, hps, ghps):
        parts = [spread([g.reshape(-1)[lo:hi] for g in gs])
                 for lo, hi in zip(bounds[:-1], bounds[1:])]  # fmt: skip
        ranks.step(parts, hp, ghp, device=device)
    if one_buffer:
        out = list(torch.empty(n, numel, dtype=dtype))
    else:
        out = [torch.empty(numel, dtype=dtype) for _ in range(n)]
    dests = [spread([o[lo:hi] for o in out]) for lo, hi in zip(bounds[:-1], bounds[1:])]
    ranks.fuse(dests)
    for (lo, hi), ds in zip(zip(bounds[:-1], bounds[1:]), dests):
        for o, d in zip(out, ds):
            o[lo:hi] = d
    if cuts:  # a cut inside a row: a partial-row block
        assert any(b.nr == 1 and b.nc < shape[1] for rank in pieces for md, _, _ in rank
                   for b in md.blocks)  # fmt: skip
    return [o.view(shape) for o in out], [w for w, _ in ref], ranks, [st for _, st in ref]


def _same_gains(ranks, ref_states, names, **tol) -> None:
    for e in ranks.engines:  # replicated gains, identical to the reference's on every rank
        for m, st in zip(e.members, ref_states):
            for name in names:
                torch.testing.assert_close(m.md_state[name], st[name], **tol)


@pytest.mark.parametrize("n_slices", [1, 2, 3, 4])
@pytest.mark.parametrize("sphere", ["frobenius", "row", "col", "none"])
@pytest.mark.parametrize("gains", ["none", "scalar", "row", "col", "rowcol", "lowrank"])
def test_slices_equal_whole_matrix(n_slices, sphere, gains):
    """Two matrices (stacked when whole), each cut into 1–4 uneven slices: fp64, 1e-12."""
    spec = MatrixSpec(sphere, "init", gains, "softplus", gain_rank=2)
    w, w_ref, ranks, st_ref = _run(spec, CUTS[n_slices])
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    _same_gains(ranks, st_ref, reference.GAIN_NAMES[gains], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("n_slices", [2, 4])
@pytest.mark.parametrize("sphere", ["frobenius", "row"])
def test_slices_tangent_and_shape_radius(n_slices, sphere):
    """The shape radius of a residual-write projection under a scaled init (init_scale)."""
    spec = MatrixSpec(sphere, "shape", "rowcol", "exp", tangent_grad=True, init_scale=0.5)
    w, w_ref, *_ = _run(spec, CUTS[n_slices])
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_fp32_whole_matrices():
    """fp32, whole matrices stacked: within fp32 rounding of the reference (the batched dot
    products sum in another order than the reference's per-matrix ones)."""
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus")
    w, w_ref, *_ = _run(spec, [], dtype=torch.float32, n=3, shape=(64, 32))
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# every sphere and every compiled gains kind once (each case compiles kernels: ~10 s apiece);
# row sphere + row/col gains: the kernel's squared row norms variant (kernel_sphere)
COMPILED_CASES = [
    ("frobenius", "rowcol"), ("row", "none"), ("col", "row"), ("none", "col"), ("row", "rowcol"),
]  # fmt: skip


@MISCOMPILED_BY_OLD_TORCH
@pytest.mark.parametrize("sphere,gains", COMPILED_CASES)
def test_compiled_kernels_equal_whole_matrix(sphere, gains):
    """--md-fused-step (compiled kernels) on stacked whole matrices: in fp64 the reference to
    1e-12 (the formulas), in fp32 to 1e-6."""
    spec = MatrixSpec(sphere, "init", gains, "softplus")
    w, w_ref, ranks, st_ref = _run(spec, [], compiled=True)
    assert all(g.kernels is not None for e in ranks.engines for g in e.groups)
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    _same_gains(ranks, st_ref, reference.GAIN_NAMES[gains], rtol=1e-12, atol=1e-13)
    if gains == "rowcol":
        w, w_ref, *_ = _run(spec, [], dtype=torch.float32, compiled=True)
        for a, b in zip(w, w_ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@MISCOMPILED_BY_OLD_TORCH
def test_compiled_phase1_keeps_its_scratch_and_one_loop(monkeypatch):
    """On a CPU the kernels' room for Ŵ ⊙ G is one buffer kept for the process: a new one at
    every step was faulted in page by page. A row sphere with row and column gains (the LM
    head's) runs phase 1 with its norms as squared row norms (``row_norm``), never the variant
    without a norm reduction, whose inductor CPU loops copy Ŵ and the moments back from
    temporaries; the eager group reads none of its norms. The scratch and the variant cost the
    181M AdamMD step 1.5x Adam's where 0.86-0.95x is measured now (docs/benchmarks.md). Still
    the reference to 1e-12 (fp64)."""
    from megatron.md.engine import compiled
    from megatron.md.engine.group import Group

    names, rooms, eager = [], [], []
    get, scratch = compiled._get, compiled._scratch
    monkeypatch.setattr(compiled, "_get", lambda name, *a: names.append(name) or get(name, *a))
    monkeypatch.setattr(compiled, "_scratch", lambda like: rooms.append(scratch(like)) or rooms[-1])
    norms = Group.norm_partials
    monkeypatch.setattr(Group, "norm_partials", lambda *a: eager.append(1) or norms(*a))
    spec = MatrixSpec("row", "init", "rowcol", "softplus")
    w, w_ref, ranks, st_ref = _run(spec, [], compiled=True)
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    assert "row_norm" in names and {"frobenius", "row"}.isdisjoint(names)
    assert len(eager) == 1  # the norms read eager once, for the radius (init), in no step
    assert len(rooms) == 5 and len({r.untyped_storage().data_ptr() for r in rooms}) == 1
    assert rooms[0].is_contiguous()


@MISCOMPILED_BY_OLD_TORCH
def test_compiled_kernels_take_the_whole_stack_in_one_call(monkeypatch):
    """On a GPU the kernels take a group's whole (B, M, N) stack in one call (on a CPU one
    matrix a call; phase 1 of the groups of a step together, ``phase1_groups``): the same
    numbers, fp64 to 1e-12 of the reference."""
    from megatron.md.engine import compiled

    calls = []
    get = compiled._get

    def spy(name, fn, fallback=False):
        kernel = get(name, fn, fallback)

        def call(*a):  # the first stack: after the fuse's buffer, phase 1's partial buffers
            stack = a[1] if name == "fuse_many" else a[1 + a[0]]
            calls.append((name, stack.shape[0], len(a)))
            return kernel(*a)

        return call

    monkeypatch.setattr(compiled, "STACK_ON_CPU", True)
    monkeypatch.setattr(compiled, "_get", spy)
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus")
    w, w_ref, ranks, st_ref = _run(spec, [], compiled=True, n=3, one_buffer=True)
    # phase 1 and the fuse, each the whole stack of 3 (one group of 3 per rank here)
    assert {c[0] for c in calls} == {"phase1_many", "fuse_many"}
    assert all(c[1] == 3 for c in calls), calls
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    _same_gains(ranks, st_ref, reference.GAIN_NAMES["rowcol"], rtol=1e-12, atol=1e-13)


@MISCOMPILED_BY_OLD_TORCH
@pytest.mark.parametrize("own_partials", [False, True])
def test_compiled_groups_of_a_step_share_one_phase1_call(monkeypatch, own_partials):
    """At a GPU's call pattern AdamMD's phase 1 of every group of a step is one compiled call
    (``phase1_groups``): two groups of different shapes, sphere variants and gains, fp64 to
    1e-12 of the reference, one phase-1 call a step (a call's host code, dynamo's and AOT's,
    costs ~70 µs on a 2-core VM, 2026-12-04), the partials written inside it into the step's
    buffer, or (``own_partials``) into a group's own where its partials are not one span of
    the buffer; the fuse of both groups one call where their destinations share a buffer
    (megatron's param buffer), a group's members apart in it or not, one call per buffer
    otherwise."""
    from megatron.md.engine import compiled, formulas
    from megatron.md.engine.engine import Engine

    if own_partials:  # the last group's partials its own (B, n) zeros, added in after
        view = Engine._view

        def own_last(self, kind, g, bufs, n):
            got, inplace = view(self, kind, g, bufs, n)
            return (torch.zeros_like(got), False) if g is self.groups[-1] else (got, inplace)

        monkeypatch.setattr(Engine, "_view", own_last)
    calls, get = [], compiled._get

    def spy(name, fn, fallback=False):
        kernel = get(name, fn, fallback)
        return lambda *a: calls.append((name, len(a), a[0])) or kernel(*a)

    monkeypatch.setattr(compiled, "STACK_ON_CPU", True)
    monkeypatch.setattr(compiled, "_get", spy)
    specs = [MatrixSpec("frobenius", "init", "rowcol", "softplus")] * 2 + [
        MatrixSpec("row", "init", "row", "softplus")] * 2  # fmt: skip
    shapes = [(9, 11)] * 2 + [(6, 5)] * 2
    gen = torch.Generator().manual_seed(5)
    w0 = [torch.randn(sh, generator=gen, dtype=torch.float64) / sh[1] ** 0.5 for sh in shapes]
    steps = 4
    grads = [[torch.randn(sh, generator=gen, dtype=torch.float64) for sh in shapes]
             for _ in range(steps)]  # fmt: skip
    hp, ghp = AdamHParams(2e-2), AdamHParams(1e-2)
    ref = [(w.clone(), reference.init_state(w, sp, "adam")) for w, sp in zip(w0, specs)]
    for gs in grads:
        for (w, st), g, sp in zip(ref, gs, specs):
            reference.md_step(w, g, st, sp, hp, ghp)
    pieces = [[(sliced.SliceMD(sh, 0, sh[0] * sh[1], sp, "adam"), w.reshape(-1), i)
               for i, (sh, sp, w) in enumerate(zip(shapes, specs, w0))]]  # fmt: skip
    ranks = Ranks(pieces, torch.float64, compiled=True)
    ranks.init()
    for gs in grads:
        ranks.step([[g.reshape(-1) for g in gs]], hp, ghp)
    assert len({id(g) for g in ranks.engines[0].groups}) == 2
    phase1 = [c for c in calls if c[0] == "phase1_many"]
    # both groups' partials in one buffer (the step's, passed whole), written inside the call
    parts = 1 + own_partials
    assert len(phase1) == steps and all(n == 1 + parts + 2 * formulas.ITEM1 and k == parts
                                        for _, n, k in phase1), calls  # fmt: skip
    for layout in ("one buffer", "apart", "two buffers"):
        buf = torch.full((2 * 99 + 2 * 30 + 7,), 3.0, dtype=torch.float64)
        if layout != "two buffers":  # a gap between the groups' rows: the rest stays as it is
            a, b = buf[:198].view(2, 99), buf[205:].view(2, 30)
        else:
            a, b = torch.empty(2, 99, dtype=torch.float64), torch.empty(2, 30, dtype=torch.float64)
        # apart: the first group's members at descending addresses, no strided view of them
        targets = [a[1], a[0], b[0], b[1]] if layout == "apart" else [a[0], a[1], b[0], b[1]]
        calls.clear()
        ranks.fuse([targets])
        assert [c[:2] for c in calls] == [
            ("fuse_many", 1 + (1 if layout == "two buffers" else 2) * formulas.ITEMF)
        ] * (2 if layout == "two buffers" else 1), calls
        for got, (want, _) in zip(targets, ref):
            torch.testing.assert_close(got.view(want.shape), want, rtol=1e-12, atol=1e-13)
        assert torch.equal(buf[198:205], torch.full((7,), 3.0, dtype=torch.float64))


def test_the_merged_fuse_check_copies_its_windows_not_the_buffer():
    """The first-call check of the merged fuse runs the eager formula into a buffer of the
    windows it writes (a copy of megatron's whole param buffer would cost its size again at
    the first step): here 2 x 3 x 4 + 5 x 2 elements of a 1000-element buffer, each window's
    copy its window's values once the eager formula ran, a pending rescale's Ŵ copied."""
    from megatron.md.engine import checked, formulas

    buf = torch.zeros(1000, dtype=torch.float64)
    x1, x2 = torch.rand(2, 3, 4, dtype=torch.float64), torch.rand(1, 5, 2, dtype=torch.float64)
    one = torch.ones((), dtype=torch.float64)
    s2 = torch.full((1, 1, 1), 2.0, dtype=torch.float64)
    args = (buf, x1, None, one, one, (2, 3, 4), (100, 4, 1), 7, None, None,
            x2, s2, one, one, (1, 5, 2), (10, 2, 1), 500, None, None)  # fmt: skip
    x2_0 = x2.clone()
    mine, written = checked._fuse_many_copies(args)
    assert mine[0].numel() == 2 * 3 * 4 + 5 * 2 and mine[1] is x1
    assert mine[1 + formulas.ITEMF] is not x2
    formulas._fuse_many(*mine)
    formulas._fuse_many(*args)
    assert [w[0] for w in written] == ["group 0's weights", "group 1's weights", "group 1's Ŵ"]
    for _, got, want in written:
        assert torch.equal(got, want)
    assert torch.equal(x2, 2 * x2_0) and torch.equal(buf[500:510].view(1, 5, 2), 2 * x2_0)
    assert buf[:7].eq(0).all() and buf[510:].eq(0).all()  # nothing outside the windows


def test_regular_pieces_cover_an_moe_layout():
    """Same-shape matrices of an MoE model as megatron lays them out: the experts of a layer
    evenly spaced, the layers evenly spaced (one (layers, experts) grid), a dense first layer
    apart, members that descend one piece each."""
    from megatron.md.engine.geometry import regular_pieces

    experts = [40 + 150 * layer + 35 * j for layer in range(3) for j in range(4)]
    assert regular_pieces(experts, 30) == ((0, 3, 4, 150, 35, 40),)
    # a dense first layer, then five MoE layers: two pieces (two windows), not six
    qkv = [0] + [50 + 30 * k for k in range(5)]
    assert len(regular_pieces(qkv, 10)) == 2
    assert regular_pieces([30, 0], 10) == ((0, 1, 1, 10, 10, 30), (1, 1, 1, 10, 10, 0))
    # two experts a layer (64 experts over 32 expert-parallel ranks): one grid of pairs
    assert regular_pieces([0, 12, 100, 112, 200, 212], 10) == ((0, 3, 2, 100, 12, 0),)


@MISCOMPILED_BY_OLD_TORCH
@pytest.mark.parametrize("base", ["adam", "muon"])
def test_compiled_moe_groups_read_and_write_megatrons_buffers_by_piece(monkeypatch, base):
    """An MoE model's experts are no one strided view of megatron's buffers (expert-parallel
    size 1: a layer's experts evenly spaced, then the attention's weights): at a GPU's call
    pattern AdamMD's merged phase 1 and MuonMD's partials read their gradients in place from
    the gradient buffer (no stack: a copy of every expert gradient a step) and the merged fuse
    writes their weights by the index their regular pieces compute (a window a member was a
    kernel a member on a GPU, a window a piece one a piece): AdamMD fp64 to 1e-12 of the
    reference, MuonMD fp32 to 1e-6 (as its other compiled tests); a dense first layer apart
    makes two pieces."""
    from megatron.md.engine import compiled, formulas

    calls, get = [], compiled._get

    def spy(name, fn, fallback=False):
        kernel = get(name, fn, fallback)
        return lambda *a: calls.append((name, a)) or kernel(*a)

    monkeypatch.setattr(compiled, "STACK_ON_CPU", True)
    monkeypatch.setattr(compiled, "_get", spy)
    adam = base == "adam"
    dtype = torch.float64 if adam else torch.float32
    scale = {} if adam else {"muon_scale": "sphere_rms"}
    spec, shape, L = MatrixSpec("frobenius", "init", "rowcol", "softplus", **scale), (6, 5), 30
    # 7 matrices: a first layer's, then 2 layers x 3 experts (35 apart, layers 150 apart)
    offsets = [0] + [40 + 150 * layer + 35 * j for layer in range(2) for j in range(3)]
    size = offsets[-1] + L + 9
    gen = torch.Generator().manual_seed(7)
    w0 = [torch.randn(shape, generator=gen, dtype=dtype) / 5**0.5 for _ in offsets]
    steps = 3
    grads = [[torch.randn(shape, generator=gen, dtype=dtype) for _ in offsets]
             for _ in range(steps)]  # fmt: skip
    hp, ghp = (AdamHParams if adam else MuonHParams)(2e-2), AdamHParams(1e-2)
    ref = [(w.clone(), reference.init_state(w, spec, base)) for w in w0]
    for gs in grads:
        for (w, st), g in zip(ref, gs):
            reference.md_step(w, g, st, spec, hp, ghp)
    pieces = [[(sliced.SliceMD(shape, 0, L, spec, base), w.reshape(-1), i)
               for i, w in enumerate(w0)]]  # fmt: skip
    ranks = Ranks(pieces, dtype, compiled=True)
    ranks.init()
    gbuf = torch.full((size,), float("nan"), dtype=dtype)  # read only where laid out
    for gs in grads:
        for o, g in zip(offsets, gs):
            gbuf[o : o + L] = g.reshape(-1)
        ranks.step([[gbuf[o : o + L] for o in offsets]], hp, ghp)
    if adam:
        phase1 = [a for name, a in calls if name == "phase1_many"]
        n_parts = phase1[0][0]
        item = phase1[0][1 + n_parts : 1 + n_parts + formulas.ITEM1]
    else:  # (w, the gradient buffer, the gains' factors, G_Ŵ, scratch, need_row, pieces)
        phase1 = [a for name, a in calls if name == "partials_pieces"]
        item = phase1[0]
    pieces = item[14] if adam else item[-1]  # (phase 1's item ends with the cut: None here)
    assert len(phase1) == steps
    assert item[1].numel() == size and len(pieces) == 2, pieces
    pbuf = torch.full((size,), 3.0, dtype=dtype)
    targets = [pbuf[o : o + L] for o in offsets]
    calls.clear()
    ranks.fuse([targets])
    (name, args), = calls  # fmt: skip
    assert name == "fuse_many" and args[0] is not None and len(args[7]) == 2  # its pieces
    tol = {"rtol": 1e-12, "atol": 1e-13} if adam else {"rtol": 1e-6, "atol": 1e-7}
    for got, (want, _) in zip(targets, ref):
        torch.testing.assert_close(got.view(shape), want, **tol)
    laid = torch.zeros(size, dtype=torch.bool)
    for o in offsets:
        laid[o : o + L] = True
    assert pbuf[~laid].eq(3.0).all()  # the gaps stay as they are


def test_compiled_groups_pass_the_whole_stack_as_it_is():
    """At a GPU's call pattern a kernel takes the group's stack itself, not a slice of all of
    it (``x[0:B]``: one more dispatched operation for the same view), and an absent gain's 0-d
    one is kept per dtype and device, not made per group and step: AdamMD's inner step 330 ->
    251 dispatched operations, MuonMD's 722 -> 646 (12 layers, width 128, ``STACK_ON_CPU``,
    2026-12-04)."""
    from megatron.md.engine import compiled

    x = torch.zeros(3, 2, 2)
    assert compiled._at(x, slice(0, 3)) is x
    part = compiled._at(x, slice(1, 2))
    assert part.shape == (1, 2, 2) and part.data_ptr() == x[1].data_ptr()
    one = torch.ones(())
    assert compiled._at(one, slice(1, 2)) is one and compiled._at(None, slice(0, 1)) is None
    w = torch.zeros(2, 2, dtype=torch.float64)
    assert compiled._ones(w) is compiled._ones(w.clone()) and compiled._ones(w).item() == 1.0
    assert compiled._ones(w.float()).dtype == torch.float32 and compiled._ones(w).ndim == 0


def test_compiled_kernels_compile_in_this_process(monkeypatch):
    """The kernels compile with one inductor compile thread (no worker pool: on an H200 the
    pool cost a training run 16 % of its tokens/s, docs/benchmarks.md) unless the user set
    ``TORCHINDUCTOR_COMPILE_THREADS``. torch.compile is lazy: nothing compiles here."""
    import torch._inductor.config as inductor_config

    from megatron.md.engine import compiled, formulas

    monkeypatch.setattr(compiled, "_compiled", {})
    # restored by hand: monkeypatch's undo deletes the setting from inductor's config module
    # (it then reads "compile_threads does not exist" at the next compile)
    threads = inductor_config.compile_threads
    try:
        inductor_config.compile_threads = 8
        monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
        compiled._get("probe", formulas._fuse)
        assert inductor_config.compile_threads == 1
        inductor_config.compile_threads = 8
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "8")
        compiled._get("probe2", formulas._fuse)
        assert inductor_config.compile_threads == 8
    finally:
        inductor_config.compile_threads = threads


def _miscompiled_rescale_fuse(x, s, row, col, out):
    """``_rescale_fuse`` as torch 2.9.1-2.11.0's inductor compiled it on a CPU for a stack of
    matrices: W = Γ ⊙ Ŵ computed after Ŵ was rescaled, so from s² Ŵ."""
    x.mul_(s)
    out.copy_(x * s * row * col)


def _miscompiled_fuse_many(buf, *flat):
    """``_fuse_many`` with the same miscompilation for each group whose rescale is pending."""
    from megatron.md.engine import formulas

    formulas._fuse_windows(buf, flat, _miscompiled_rescale_fuse)


def test_a_miscompiled_kernel_stops_the_run_at_its_first_call(capsys):
    """A compiled kernel's first call of each argument layout is checked against its eager
    formula; one that computes other numbers stops the run naming the kernel and
    ``--md-fused-step off`` (``on``), or (``fallback``: ``auto``) gives the eager formula's
    numbers, says so once and runs that layout eager from then on. A second call of a checked
    layout runs no eager formula; a new layout is checked again."""
    from megatron.md.engine import checked, formulas

    evals, bad_calls = [], []

    def eager(*args):
        evals.append(args[0].shape)
        return formulas._rescale_fuse(*args)

    def miscompiled(*args):
        bad_calls.append(args[0].shape)
        return _miscompiled_rescale_fuse(*args)

    checked.WRITES[eager] = checked.WRITES[formulas._rescale_fuse]
    try:
        ok = checked.Checked(eager, formulas._rescale_fuse)
        bad = checked.Checked(eager, miscompiled)
        x, row, col = torch.randn(3, 9, 11), torch.rand(3, 9, 1) + 0.5, torch.rand(3, 1, 11)
        s, out = torch.full((3, 1, 1), 0.99), torch.empty(3, 9, 11)
        ok(x.clone(), s, row, col, out)
        ok(x.clone(), s, row, col, out)
        assert evals == [(3, 9, 11)]  # checked once per layout
        ok(x[:1].clone(), s[:1], row[:1], col[:1], out[:1])
        assert len(evals) == 2
        with pytest.raises(checked.MiscompiledKernel, match=r"eager formula in its argument 4 "
                           r"by .*--md-fused-step off"):  # fmt: skip
            bad(x.clone(), s, row, col, out)
        assert "warning" not in capsys.readouterr().err
        want_x, want_out = x * s, x * s * row * col
        for _ in range(3):  # fallback: the eager numbers, the compiled kernel called once
            mine, out = x.clone(), torch.empty(3, 9, 11)
            bad(mine, s, row, col, out, fallback=True)
            torch.testing.assert_close(mine, want_x, rtol=0, atol=0)
            torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-7)
        assert bad_calls == [(3, 9, 11)] * 2  # the stopped call and the first fallback call
        err = capsys.readouterr().err
        assert err.count("[megatron-md] warning:") == 1
        assert "compiled MD kernel eager (cpu, shape (3, 9, 11))" in err and "argument 4" in err
    finally:
        del checked.WRITES[eager]


def test_the_first_call_check_takes_non_finite_numbers_the_formula_makes_too():
    """A first call whose arguments hold NaN and ±inf (a step gone wrong with megatron's NaN
    check off) is no miscompiled kernel where the kernel makes them where the eager formula
    does (the difference was NaN, which no bound passes); a NaN the formula does not make, or
    a number off beyond rounding, still stops the run."""
    from megatron.md.engine import checked, formulas

    def poisoned(*args):  # the formula, then one NaN it does not make
        formulas._rescale_fuse(*args)
        args[4].view(-1)[11] = float("nan")

    def off(*args):
        formulas._rescale_fuse(*args)
        args[4].view(-1)[11] += 1.0

    x, row, col = torch.randn(2, 4, 5), torch.rand(2, 4, 1) + 0.5, torch.rand(2, 1, 5)
    x[0, 1, 2], x[1, 3, 0], x[1, 0, 4] = float("nan"), float("inf"), -float("inf")
    s, out = torch.full((2, 1, 1), 0.5), torch.empty(2, 4, 5)
    checked.Checked(formulas._rescale_fuse, formulas._rescale_fuse)(x.clone(), s, row, col, out)
    assert out.isnan().sum() == 1 and out.isinf().sum() == 2
    for bad in (poisoned, off):
        with pytest.raises(checked.MiscompiledKernel, match="argument 4 by"):
            checked.Checked(formulas._rescale_fuse, bad)(x.clone(), s, row, col, out)


def test_a_kernel_past_dynamos_recompile_limit_compiles_again():
    """Past dynamo's global recompile limit (here 1) a kernel compiled with ``fullgraph`` (as
    torch.compile takes no limit of its own up to torch 2.13) raises ``FailOnRecompileLimitHit``;
    ``Checked`` calls it again with the limit raised, for a new layout as for a changed global
    state (the matmul precision: every known layout recompiles). Real dynamo and inductor; the
    numbers are the kernel's."""
    from megatron.md.engine import checked

    def scale(x, row, col, out):  # its own code object: dynamo's variants are counted per code
        out.copy_(x * row * col)

    kernel = checked.Checked(scale, torch.compile(scale, dynamic=False, fullgraph=True))
    bare = torch.compile(scale, dynamic=False, fullgraph=True)
    precision = torch.get_float32_matmul_precision()
    try:
        # dynamo's own patch: monkeypatch's undo would delete the setting from its config module
        with torch._dynamo.config.patch(recompile_limit=1):
            for flip in ("highest", "high"):
                torch.set_float32_matmul_precision(flip)  # part of dynamo's guards: all recompile
                for n in (3, 4):
                    x, row, col = torch.randn(1, n, 2), torch.rand(1, n, 1), torch.rand(1, 1, 2)
                    out = torch.empty(1, n, 2)
                    kernel(x, row, col, out)
                    torch.testing.assert_close(out, x * row * col, rtol=1e-6, atol=1e-7)
            # without the 2nd try (and compiled: CPU mode runs torch.compile eagerly)
            with (
                torch.compiler.set_stance("default"),
                pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit),
            ):
                bare(torch.randn(1, 5, 2), torch.ones(1, 5, 1), torch.ones(1, 1, 2),
                     torch.empty(1, 5, 2))  # fmt: skip
    finally:
        torch.set_float32_matmul_precision(precision)


def test_a_miscompiled_kernel_under_auto_keeps_the_step_right(monkeypatch, capsys):
    """MuonMD's groups, stacked (the GPU's call), with the rescale-and-fuse kernel miscompiled
    as torch 2.9.1-2.11.0 did on a CPU, a group's own (``rescale_fuse``: destinations apart, one
    matrix a call) and the groups' merged one (``fuse_many``: destinations in one buffer): with
    ``fallback`` (``--md-fused-step auto``) the step equals the reference as the right kernel's
    does (fp32, 1e-6), warned once; without it the first fuse stops the run. The other kernels
    are their eager formulas standing in for compiled ones (no compile time)."""
    from megatron.md.engine import checked, compiled, formulas

    monkeypatch.setattr(compiled, "STACK_ON_CPU", True)
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus", muon_scale="sphere_rms")
    for name, one_buffer in (("rescale_fuse", False), ("fuse_many", True)):
        for fallback in (True, False):
            kernels = {"partials": checked.Checked(formulas._partials, formulas._partials),
                       "fuse": checked.Checked(formulas._fuse, formulas._fuse),
                       "rescale_fuse": checked.Checked(formulas._rescale_fuse,
                                                        _miscompiled_rescale_fuse),
                       "fuse_many": checked.Checked(formulas._fuse_many,
                                                     _miscompiled_fuse_many)}  # fmt: skip
            monkeypatch.setattr(compiled, "_compiled", kernels)
            if not fallback:
                with pytest.raises(checked.MiscompiledKernel, match=f"_{name}"):
                    _run(spec, [], base="muon", dtype=torch.float32, n=3, compiled=True,
                         one_buffer=one_buffer)  # fmt: skip
                continue
            w, w_ref, ranks, st_ref = _run(spec, [], base="muon", dtype=torch.float32, n=3,
                                           compiled=True, one_buffer=one_buffer,
                                           fallback=True)  # fmt: skip
            for a, b in zip(w, w_ref):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            _same_gains(ranks, st_ref, reference.GAIN_NAMES["rowcol"], rtol=1e-5, atol=1e-6)
            assert kernels[name].eager and capsys.readouterr().err.count("warning:") == 1


def test_muon_whole_matrix_matches_reference():
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus", muon_scale="sphere_rms")
    w, w_ref, *_ = _run(spec, [], base="muon", dtype=torch.float32, n=3)
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# each case compiles its kernels: the stack (a GPU's call) and per matrix each twice at least
@MISCOMPILED_BY_OLD_TORCH
@pytest.mark.parametrize(
    "sphere,gains,stack",
    [("frobenius", "rowcol", False), ("frobenius", "rowcol", True), ("row", "col", True),
     ("col", "row", False)],
)  # fmt: skip
def test_compiled_muon_kernels_equal_whole_matrix(sphere, gains, stack, monkeypatch):
    """MuonMD's compiled phases (the gains' partials with G_Ŵ, and rescale + fuse) on stacked
    whole matrices, one matrix a call (a CPU's) and the whole stack in one call (a GPU's), with
    and without the Q/K/V split: fp32 to 1e-6 of the reference, as the eager group."""
    from megatron.md.engine import compiled

    monkeypatch.setattr(compiled, "STACK_ON_CPU", stack)
    spec = MatrixSpec(sphere, "init", gains, "softplus", muon_scale="sphere_rms")
    w, w_ref, ranks, st_ref = _run(spec, [], base="muon", dtype=torch.float32, n=3,
                                   compiled=True, one_buffer=stack)  # fmt: skip
    kernels = [g.kernels for e in ranks.engines for g in e.groups]
    assert kernels and all(k.partials is not None and k.phase1 is None for k in kernels)
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    _same_gains(ranks, st_ref, reference.GAIN_NAMES[gains], rtol=1e-5, atol=1e-6)
    if sphere == "frobenius" and not stack:  # Q/K/V: a sphere per block, gains the matrix's
        qkv = MatrixSpec(sphere, "init", gains, "softplus", muon_scale="sphere_rms",
                         row_blocks=(4, 2, 2))  # fmt: skip
        w, w_ref, ranks, _ = _run(qkv, [], base="muon", dtype=torch.float32, shape=(32, 8),
                                  compiled=True, one_buffer=stack)  # fmt: skip
        assert all(g.kernels.partials for e in ranks.engines for g in e.groups)
        for a, b in zip(w, w_ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "sphere,blocks,shape,scale",
    [("frobenius", (4, 2, 2), (32, 8), "sphere_rms"), ("frobenius", (), (32, 8), "sphere_rms"),
     ("row", (), (8, 24), "hyperball"), ("frobenius", (), (24, 8), "shape_scaling"),
     ("none", (), (16, 8), "sphere_rms")],
)  # fmt: skip
def test_muon_one_call_per_matrix_is_the_batched_call(monkeypatch, sphere, blocks, shape, scale):
    """Large matrices on a CPU are orthogonalized one Newton–Schulz call each
    (``NS_ONE_BY_ONE_CPU``), whole matrices (no Q/K/V blocks) each applied as it is made, its
    scale in place: bit for bit what the batched call gives (blocks of 16×8 and 8×8, tall and
    wide matrices, MuonH, the scale of a matrix with no sphere; below 8 rows or columns
    torch's CPU matmul takes another path and the two differ by fp32 rounding)."""
    from megatron.md.engine import basesteps

    spec = MatrixSpec(sphere, "init", "rowcol", "softplus", muon_scale=scale,
                      row_blocks=blocks)  # fmt: skip
    batched, *_ = _run(spec, [], base="muon", dtype=torch.float32, n=3, shape=shape)
    monkeypatch.setattr(basesteps, "NS_ONE_BY_ONE_CPU", 1)
    applied = []
    step = basesteps.MuonStep._step_one_by_one
    monkeypatch.setattr(basesteps.MuonStep, "_step_one_by_one",
                        lambda self, g, *a: applied.append(g.B) or step(self, g, *a))  # fmt: skip
    one_by_one, _, ranks, _ = _run(spec, [], base="muon", dtype=torch.float32, n=3, shape=shape)
    assert bool(applied) == (not blocks) and all(b > 1 for b in applied)
    groups = [g for e in ranks.engines for g in e.groups]
    assert [basesteps.MuonStep.one_by_one(g) for g in groups] == [not blocks] * len(groups)
    for a, b in zip(batched, one_by_one):
        assert torch.equal(a, b)


def test_muon_refuses_a_slice():
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus")
    with pytest.raises(ValueError, match="whole matrices"):
        sliced.SliceMD((4, 4), 0, 7, spec, "muon")


@pytest.mark.parametrize("sphere", ["frobenius", "row", "col", "none"])
@pytest.mark.parametrize("radius,tangent", [("init", False), ("shape", True)])
def test_muon_qkv_split_matches_reference(sphere, radius, tangent):
    """Split fused QKV matrices (2 query groups of 4 q, 2 k, 2 v rows), stacked: per-block
    spheres, tangent projection and batched Newton–Schulz calls (one per block kind for the
    whole group) equal the reference's per-matrix ones (fp32: 1e-6 as for unsplit Muon)."""
    tangent = tangent and sphere != "none"
    spec = MatrixSpec(sphere, radius, "rowcol", "softplus", tangent_grad=tangent,
                      muon_scale="sphere_rms", row_blocks=(4, 2, 2))  # fmt: skip
    w, w_ref, ranks, st_ref = _run(spec, [], base="muon", shape=(16, 11), dtype=torch.float32)
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if sphere != "none":
        _same_gains(ranks, st_ref, ["radius"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("n_slices", [1, 2, 4])
@pytest.mark.parametrize("sphere", ["frobenius", "row", "col"])
def test_adam_qkv_split_on_slices(n_slices, sphere):
    """AdamMD's Q/K/V spheres (the authors' optimizer splits for Adam too: feat/md-decoupling-
    optimizer md_decoupling.py, _normalize) on ZeRO-1 slices cut inside Q/K/V rows: two
    query groups of (4, 2, 2) rows, the paper's per-block radius; fp64, 1e-12."""
    spec = MatrixSpec(sphere, "shape", "rowcol", "softplus", row_blocks=(4, 2, 2))
    w, w_ref, ranks, st_ref = _run(spec, CUTS[n_slices], shape=(16, 11))
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    _same_gains(ranks, st_ref, ["gain_row", "gain_col"], rtol=1e-12, atol=1e-13)
    if sphere == "frobenius":  # each block on its own sphere sqrt(max(rows, d_in)) = sqrt(11)
        ids = reference.row_block_ids(16, (4, 2, 2))
        for st in st_ref:
            got = reference.norms(st["direction"], "frobenius", ids)
            torch.testing.assert_close(got, torch.full((3,), 11**0.5, dtype=got.dtype))


@MISCOMPILED_BY_OLD_TORCH
@pytest.mark.parametrize("sphere,blocks", [("frobenius", ()), ("row", ()), ("frobenius", (4, 2, 2)),
                                           ("col", (4, 2, 2))])  # fmt: skip
def test_compiled_cut_slices_of_a_rank_share_one_call(monkeypatch, sphere, blocks):
    """ZeRO-1 slices cut inside rows (two matrices on three ranks, every slice cut) take the
    compiled kernels too, all of a rank's in one merged phase-1 call and one fuse call a step
    (each slice's eager step took ~30 operations: up to two slices a bucket a rank, so a
    cluster's step grew with its buckets), on a CPU too: fp64 to 1e-12 of the reference; the
    row sphere's squared row norms variant, the Q/K/V blocks' Frobenius norms in the call
    (their windows widened to whole query groups) and the column sphere's eager norms with its
    rescale per block and column in the fuse."""
    from megatron.md.engine import compiled

    calls, get = [], compiled._get

    def spy(name, fn, fallback=False):
        kernel = get(name, fn, fallback)
        return lambda *a: calls.append(name) or kernel(*a)

    monkeypatch.setattr(compiled, "_get", spy)
    shape = (16, 128) if blocks else (9, 128)
    spec = MatrixSpec(sphere, "shape" if blocks else "init", "rowcol", "softplus",
                      row_blocks=blocks)  # fmt: skip
    # a slice that starts a row and ends inside one (the case torch 2.15.0's inductor split
    # wrong with its offset a number: formulas._at_slice), one inside rows at both ends, one
    # that ends a row
    cuts = [1000, 1100]
    w, w_ref, ranks, st_ref = _run(spec, cuts, shape=shape, compiled=True, one_buffer=True)
    cut = [g for e in ranks.engines for g in e.groups]
    # a rank's slices of the two matrices cut at one place: one group of two
    assert len(cut) == 3 and all(g.kernels.cut is not None and g.B == 2 for g in cut)
    assert {g.kernels.cut[2] % 128 == 0 for g in cut} == {True, False}  # (pre: _at_slice)
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    _same_gains(ranks, st_ref, ["gain_row", "gain_col"], rtol=1e-12, atol=1e-13)
    steps = 5  # _run's
    assert calls.count("phase1_many") == 3 * steps and calls.count("fuse_many") == 3, calls


@MISCOMPILED_BY_OLD_TORCH
@pytest.mark.parametrize("sphere,blocks", [("row", ()), ("frobenius", (4, 2, 2))])
def test_compiled_cut_slices_read_and_written_by_pieces(monkeypatch, sphere, blocks):
    """Slices cut at one place of three matrices, their gradients and fused weights in one
    buffer at uneven gaps (a rank's shards of megatron's buckets need not be evenly spaced): one
    group, read and written by regular pieces inside the merged calls (``regular_pieces``;
    never the eager fuse), fp64 to 1e-12 of the reference."""
    from megatron.md.engine import compiled

    def refused(g, targets):
        raise AssertionError("the eager fuse of a compiled cut group")

    monkeypatch.setattr(compiled, "_fuse_eager", refused)
    shape = (16, 128) if blocks else (9, 128)
    spec = MatrixSpec(sphere, "shape" if blocks else "init", "rowcol", "softplus",
                      row_blocks=blocks)  # fmt: skip
    w, w_ref, ranks, st_ref = _run(spec, [1000, 1100], shape=shape, n=3, compiled=True,
                                   scattered=True)  # fmt: skip
    for e in ranks.engines:
        (g,) = e.groups
        assert g.B == 3 and g.kernels.cut is not None
        view, pieces = g.placed("grad", [m.main.grad for m in g.members])
        assert view is None and len(pieces) > 1, pieces
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    _same_gains(ranks, st_ref, ["gain_row", "gain_col"], rtol=1e-12, atol=1e-13)


@MISCOMPILED_BY_OLD_TORCH
def test_compiled_cut_slices_in_two_buffers_fuse_eagerly(monkeypatch):
    """Slices cut at one place of two matrices whose fused weights lie in two buffers (no view,
    no pieces of one): phase 1 in the merged call, the fuse the eager group's
    (``compiled._fuse_eager``, the pending rescale applied there), fp64 to 1e-12."""
    from megatron.md.engine import compiled

    called, real = [], compiled._fuse_eager
    monkeypatch.setattr(compiled, "_fuse_eager", lambda g, t: called.append(g.B) or real(g, t))
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus")
    w, w_ref, ranks, st_ref = _run(spec, [1000, 1100], shape=(9, 128), compiled=True)
    assert called == [2, 2, 2], called  # each rank's group, once (the fuse after the steps)
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@MISCOMPILED_BY_OLD_TORCH
def test_a_cut_slice_that_starts_a_row_compiles_right():
    """A slice that starts a row and ends inside one, 1000 elements of 128 columns: as
    ``_at_slice`` was first written (the factor's window flattened and sliced, the offset a
    number), torch 2.15.0's inductor split its elements' row index e // 128 into 7 whole rows
    on a CPU, the 8th row's elements read the wrong scale or left unwritten (the first-call
    check stopped a 4-rank run, 2026-12-05; that form fails here). The compiled fuse
    (row sphere, no gains: that run's layout) and phase 1 (row gains and sphere) equal their
    eager formulas (``Checked`` raises otherwise) and the arithmetic by hand."""
    from megatron.md.engine import compiled, formulas

    gen = torch.Generator().manual_seed(5)
    L, M, N = 1000, 16, 128
    cut = compiled.cut_layout((M, N), 0, L, "row", ())
    assert cut == (0, 8, 0, 24, 128, "row", ())
    at = torch.tensor(0)
    rows = torch.arange(L) // N  # each element's row
    x, s = torch.randn(1, L, generator=gen), torch.rand(1, M, generator=gen) + 0.5
    one, x0 = torch.ones(()), x.clone()
    buf = torch.zeros(L + 100)
    compiled._get("fuse_many", formulas._fuse_many)(buf, x, s, one, one, (1, L), (L, 1), 50,
                                                    cut, at)  # fmt: skip
    torch.testing.assert_close(x[0], x0[0] * s[0, rows])
    torch.testing.assert_close(buf[50 : 50 + L], x0[0] * s[0, rows])
    assert buf[:50].eq(0).all() and buf[50 + L :].eq(0).all()
    w, g, m = (torch.randn(1, L, generator=gen) for _ in range(3))
    v = torch.rand(1, L, generator=gen)
    row = torch.rand(1, M, 1, generator=gen) + 0.5
    hp = torch.tensor([1e-2, 1.0, 0.1, 0.999, 1e-3, 1e-8])
    P = torch.zeros(M + M)
    w0, m0 = w.clone(), m.clone()
    item = (w, g, m, v, row, one, hp, True, False, "row", 0, 0, 2 * M, M, None, cut, at)
    compiled._get("phase1_many", formulas._phase1_many)(1, P, *item)
    sums = lambda t: torch.zeros(M).index_add_(0, rows, t)  # noqa: E731
    torch.testing.assert_close(P[:M], sums(w0[0] * g[0]))  # the row gains' partials
    torch.testing.assert_close(P[M:], sums(w[0] * w[0]))  # the updated rows' squared norms
    torch.testing.assert_close(m[0], m0[0] + 0.1 * (g[0] * row[0, rows, 0] - m0[0]))


def test_a_cut_window_is_whole_rows_and_query_groups():
    """``geometry.cut_window``: a slice's whole rows, widened to whole query groups where the
    matrix is split, and the elements around the slice in them."""
    from megatron.md.engine.geometry import cut_window

    assert cut_window((9, 11), 5, 61) == (0, 6, 5, 5, 11)
    assert cut_window((9, 11), 61, 99) == (5, 9, 6, 0, 11)
    assert cut_window((9, 11), 22, 33) == (2, 3, 0, 0, 11)
    assert cut_window((16, 11), 61, 99, (4, 2, 2)) == (0, 16, 61, 77, 11)
    assert cut_window((16, 11), 100, 130, (4, 2, 2)) == (8, 16, 12, 46, 11)


@MISCOMPILED_BY_OLD_TORCH
@pytest.mark.parametrize("stack", [False, True])
def test_adam_qkv_split_compiled(monkeypatch, stack):
    """The compiled kernels on a split matrix leave the per-block norms to the eager group
    where a call takes one matrix (a CPU); the merged phase 1 of whole stacks (a GPU's) sums
    the blocks' Frobenius norms itself (``_sq_norms``): fp64 to 1e-12 of the reference."""
    from megatron.md.engine import compiled
    from megatron.md.engine.group import Group

    eager = []
    norm_partials = Group.norm_partials
    monkeypatch.setattr(Group, "norm_partials",
                        lambda self, out: eager.append(1) or norm_partials(self, out))  # fmt: skip
    monkeypatch.setattr(compiled, "STACK_ON_CPU", stack)
    spec = MatrixSpec("frobenius", "shape", "rowcol", "softplus", row_blocks=(4, 2, 2))
    w, w_ref, ranks, st_ref = _run(spec, [], dtype=torch.float64, shape=(16, 11), n=3,
                                   compiled=True, one_buffer=True)  # fmt: skip
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    _same_gains(ranks, st_ref, ["gain_row", "gain_col"], rtol=1e-12, atol=1e-13)
    steps = 5  # _run's; the init reads the norms eager once either way (the radius)
    assert len(eager) == 1 + (0 if stack else steps), len(eager)


@pytest.mark.parametrize("variant", ["muown", "muown-unit", "muown-angular", "muown-qkv"])
def test_muown_whole_matrix_matches_reference(variant):
    """Muown's per-row forms (weight normalization: the authors'; the unit-row readings) in
    the engine equal the reference (fp32: 1e-6 as for MuonMD); muown-qkv: the authors' Muown
    on a split fused QKV matrix (Newton–Schulz and scale per block, magnitudes per row)."""
    from megatron.md.config import MDConfig, spec_for

    qkv = variant.endswith("-qkv")
    spec = spec_for("matrix", MDConfig(variant=variant.removesuffix("-qkv")),
                    row_blocks=(4, 2, 2) if qkv else ())  # fmt: skip
    w, w_ref, ranks, st_ref = _run(spec, [], base="muon", dtype=torch.float32,
                                   shape=(16, 11) if qkv else (9, 11))  # fmt: skip
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    _same_gains(ranks, st_ref, ["gain_row"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("start,end", [(0, 99), (3, 4), (10, 22), (0, 11), (5, 98), (11, 33)])
def test_blocks_cover_the_slice_exactly(start, end):
    blocks = slice_blocks((9, 11), start, end)
    assert len(blocks) <= 3
    covered = []
    for b in blocks:
        covered += [(b.r0 + i) * 11 + b.c0 + j for i in range(b.nr) for j in range(b.nc)]
    assert covered == list(range(start, end))


def test_one_reduction_of_every_partial():
    """Matrices of two shapes on one rank: radii from one reduction of their norms, each step
    one reduction of the formula's partials (row + column gains + one norm per matrix)."""
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus")
    pieces = [[(sliced.SliceMD(s, 0, s[0] * s[1], spec, "adam"), torch.randn(s).view(-1), i)
               for i, s in enumerate([(6, 4), (3, 8), (6, 4)])]]  # fmt: skip
    ranks = Ranks(pieces, torch.float32)
    ranks.init()
    assert ranks.reductions == [3]
    ranks.step([[torch.randn(24), torch.randn(24), torch.randn(24)]], AdamHParams(1e-2),
               AdamHParams(1e-2))  # fmt: skip
    assert ranks.reductions == [3, 2 * (6 + 4 + 1) + (3 + 8 + 1)]


@pytest.mark.parametrize("gains", ["scalar", "row", "col", "rowcol", "lowrank"])
def test_fuse_into_bf16_rounds_once(gains):
    """W = Γ ⊙ Ŵ written into a bf16 param with ONE rounding of the fp32 product, for a slice
    with cuts inside rows (3 blocks), whatever the number of passes it takes."""
    spec = MatrixSpec("frobenius", "init", gains, "softplus", gain_rank=2)
    gen = torch.Generator().manual_seed(5)
    d = torch.randn(6 * 7, generator=gen)
    md = sliced.SliceMD((6, 7), 3, 38, spec, "adam")
    assert len(md.blocks) == 3
    ranks = Ranks([[(md, d[3:38], 0)]], torch.float32)
    ranks.init()
    (m,) = ranks.engines[0].members
    for name in md.gain_names:  # gains away from 1
        m.md_state[name] += torch.randn(m.md_state[name].shape, generator=gen)
    g = {n: m.md_state[n] for n in md.gain_names}
    phi = lambda x: torch.nn.functional.softplus(x)  # noqa: E731
    if gains == "lowrank":
        gamma = 1 + g["gain_a"] @ g["gain_b"].T
    else:
        gamma = torch.ones(6, 7)
        gamma = gamma * phi(g["gain_scalar"]) if gains == "scalar" else gamma
        gamma = gamma * phi(g["gain_row"])[:, None] if "gain_row" in g else gamma
        gamma = gamma * phi(g["gain_col"])[None, :] if "gain_col" in g else gamma
    full = d.view(6, 7) * gamma if gains != "rowcol" else (
        d.view(6, 7) * phi(g["gain_row"])[:, None] * phi(g["gain_col"]))  # fmt: skip
    out = torch.zeros(35, dtype=torch.bfloat16)
    ranks.fuse([[out]])
    assert torch.equal(out, full.view(-1)[3:38].to(torch.bfloat16))


def _count_ops(fn) -> tuple[int, int]:
    """(aten operations dispatched while ``fn`` runs, of which host reads of a tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = syncs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            Count.syncs += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n, Count.syncs


def test_one_adam_for_the_gains_and_vectors_of_every_parameter_group():
    """The step's Adam of tensors outside Ŵ (the gains, the 1-D parameters) in parameter
    groups of other LRs and weight decays: one multi-tensor Adam (one ``_foreach_lerp_``) where
    each group took one, every tensor bit for bit what its group's own Adam makes; groups of
    other betas, and LRs that are device tensors (a step a CUDA graph replays), an Adam each."""
    from megatron.md.base_steps import adam_multi_
    from megatron.md.engine.gainstep import GainBatch

    gen = torch.Generator().manual_seed(5)
    numbers = [AdamHParams(1e-2), AdamHParams(3e-3, weight_decay=0.1), AdamHParams(2e-2),
               AdamHParams(1e-2, beta2=0.95)]  # fmt: skip
    on_device = [AdamHParams(torch.tensor(1e-2)), AdamHParams(torch.tensor(3e-3))]
    for hps, step, lerps in ((numbers, 3, 2), (on_device, torch.tensor(3.0), 2)):
        sets = [[[torch.randn(n, generator=gen) for n in (5, 7)] for _ in range(4)] for _ in hps]

        def work():  # (tensor, gradient, exp_avg, exp_avg_sq, hp) of every tensor: copies
            return [(p.clone(), g, m.clone(), v.abs(), hp) for hp, (ps, gs, ms, vs) in
                    zip(hps, sets) for p, g, m, v in zip(ps, gs, ms, vs)]  # fmt: skip

        alone = work()
        for k, hp in enumerate(hps):  # each group its own Adam, as the step ran them before
            w = alone[2 * k : 2 * k + 2]
            adam_multi_(*[[x[i] for x in w] for i in range(4)], step, hp)
        together, batch = work(), GainBatch()
        batch.add_plain(together)
        # numbers: groups 0-2 one Adam, group 3 (other betas) its own; on the device: each its own
        assert _op_names(lambda: batch.run(step)).count("aten._foreach_lerp_.Scalar") == lerps
        for a, b in zip(alone, together):
            for x, y in zip(a[:4], b[:4]):
                assert torch.equal(x, y)
    with pytest.raises(ValueError, match="same betas"):
        adam_multi_([torch.ones(2)] * 2, [torch.ones(2)] * 2, [torch.zeros(2)] * 2,
                    [torch.zeros(2)] * 2, 1, numbers[2:])  # fmt: skip


def _stepped_once(spec, base, shapes):
    """Whole matrices of ``shapes`` on one rank, stepped once (the first step's one-off work);
    returns their next step, to be observed."""
    pieces = [[(sliced.SliceMD(s, 0, s[0] * s[1], spec, base), torch.randn(s).view(-1), i)
               for i, s in enumerate(shapes)]]  # fmt: skip
    ranks = Ranks(pieces, torch.float32)
    ranks.init()
    grads = [[torch.randn(s).view(-1) for s in shapes]]
    hp = AdamHParams(1e-2) if base == "adam" else MuonHParams(1e-2)
    ranks.step(grads, hp, AdamHParams(1e-2))
    return lambda: ranks.step(grads, hp, AdamHParams(1e-2))


@pytest.mark.parametrize("base", ["adam", "muon"])
def test_the_step_does_not_grow_with_the_number_of_matrices(base):
    """The same treatment on 4 and on 12 matrices of each shape (the engine's groups): one
    step dispatches the same number of operations (a fixed count per group, none per matrix)
    and reads nothing back to the host (no .item(), int(tensor), .tolist())."""
    counts = []
    for n in (4, 12):
        spec = MatrixSpec("frobenius", "init", "rowcol", "softplus", muon_scale="sphere_rms",
                          row_blocks=(4, 2, 2) if base == "muon" else ())  # fmt: skip
        counts.append(_count_ops(_stepped_once(spec, base, [(16, 8), (8, 16)] * n)))
    assert counts[0] == counts[1] and counts[0][1] == 0, counts


@pytest.mark.parametrize(
    "base,sphere,tangent", [("adam", "frobenius", False), ("adam", "row", True),
                            ("muon", "frobenius", False)]
)  # fmt: skip
def test_matrices_in_one_flat_buffer_are_one_view(base, sphere, tangent):
    """Same-shape matrices whose gradients and weights lie in flat buffers, evenly spaced and
    in reverse order (megatron lays its param and grad buffers out backwards, with padding):
    the engine orders its group by address (``Member.order``) and reads the gradients and
    writes W through one strided view of each buffer — no stack, no copy — with the
    reference's result, and megatron's gradients are left as they were."""
    shape, n, pad = (6, 5), 4, 2
    L, stride = shape[0] * shape[1], shape[0] * shape[1] + pad
    dt = torch.float64 if base == "adam" else torch.float32  # (Newton–Schulz: fp32 only)
    tol = dict(rtol=1e-12, atol=1e-13) if base == "adam" else dict(rtol=1e-5, atol=1e-6)
    spec = MatrixSpec(sphere, "init", "rowcol", "softplus", tangent_grad=tangent)
    gen = torch.Generator().manual_seed(8)
    w0 = [torch.randn(shape, generator=gen, dtype=dt) for _ in range(n)]
    hp = AdamHParams(2e-2) if base == "adam" else MuonHParams(2e-2)
    ghp = AdamHParams(1e-2)
    at = lambda buf, i: buf[(n - 1 - i) * stride : (n - 1 - i) * stride + L]  # noqa: E731
    grad_buf = torch.zeros(n * stride, dtype=dt)
    param_buf = torch.zeros(n * stride, dtype=dt)
    pieces = [[(sliced.SliceMD(shape, 0, L, spec, base), w.view(-1), i) for i, w in enumerate(w0)]]
    ranks = Ranks(pieces, dt, order={i: at(grad_buf, i).data_ptr() for i in range(n)})
    ranks.init()
    ref = [(w.clone(), reference.init_state(w, spec, base)) for w in w0]
    for _ in range(3):
        grads = [torch.randn(shape, generator=gen, dtype=dt) for _ in range(n)]
        for i, g in enumerate(grads):
            at(grad_buf, i).copy_(g.view(-1))
            reference.md_step(ref[i][0], g, ref[i][1], spec, hp, ghp)
        before = grad_buf.clone()
        seen = _ops(lambda: ranks.step([[at(grad_buf, i) for i in range(n)]], hp, ghp))
        assert torch.equal(grad_buf, before)  # megatron's gradients: only read
        stacks = {(op, n_out) for op, n_out in seen if op.startswith(("aten.stack", "aten.cat"))}
        assert all(n_out < n * L for _, n_out in stacks), stacks  # (the gains' norms: small)
    seen = _ops(lambda: ranks.fuse([[at(param_buf, i) for i in range(n)]]))
    assert not {op for op, _ in seen} & {"aten._foreach_copy_.default", "aten.copy_.default"}
    for i, (w, _) in enumerate(ref):
        torch.testing.assert_close(at(param_buf, i).view(shape), w, **tol)


def _op_names(fn) -> list[str]:
    """The aten operations ``fn`` dispatches, in order, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Names():
        fn()
    return names


def _ops(fn) -> set[tuple[str, int]]:
    """The aten operations ``fn`` dispatches: (name, elements of the first output)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, list | tuple) and out else out
            seen.add((str(func), first.numel() if isinstance(first, torch.Tensor) else 0))
            return out

    with Names():
        fn()
    return seen


def test_lowrank_floor_and_init_follow_the_runs():
    """Rank-k gains as the authors' runs (gainz master.py: ``gains_lowrank_init_std`` unset ->
    A ~ N(0, 1/k), ``gains_lowrank_min`` 1e-2): the recipe's spec, and the floored multiplier
    max(1 + A Bᵀ, floor) in the engine equal to the reference's, with the floor active."""
    from megatron.md.config import MDConfig, spec_for

    spec = spec_for("matrix", MDConfig(gains="lowrank", gain_rank=4))
    assert spec.lowrank_init_std == 0.5 and spec.lowrank_min == 1e-2
    st = {"gain_a": torch.ones(3, 1), "gain_b": -torch.tensor([[0.5], [1.0], [2.0]])}
    one = torch.ones(3, 3)
    got = reference.apply_gains(one, st, MatrixSpec("none", "init", "lowrank", "softplus",
                                                    gain_rank=1, lowrank_min=1e-2))  # fmt: skip
    assert got[0].tolist() == pytest.approx([0.5, 1e-2, 1e-2])
    floored = MatrixSpec("frobenius", "init", "lowrank", "softplus", gain_rank=2,
                         lowrank_init_std=2.0, lowrank_min=0.999)  # fmt: skip
    w, w_ref, ranks, st_ref = _run(floored, CUTS[2])
    gam = [1 + s["gain_a"] @ s["gain_b"].T for s in st_ref]
    assert any(bool((x < 0.999).any()) for x in gam)  # the floor is active
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("qkv", [False, True])
def test_muonh_matches_reference(qkv):
    """MuonH (the ``hyperball`` Muon scale on the Frobenius sphere, no gains) in the engine's
    batched Newton–Schulz equals the reference, per Q/K/V block when split (fp32: 1e-6)."""
    spec = MatrixSpec("frobenius", "init", "none", "softplus", muon_scale="hyperball",
                      row_blocks=(4, 2, 2) if qkv else ())  # fmt: skip
    w, w_ref, *_ = _run(spec, [], base="muon", dtype=torch.float32,
                        shape=(16, 11) if qkv else (9, 11))  # fmt: skip
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# --md-cuda-graph's arithmetic (megatron/md/engine/graph.py): the step count and LRs read from
# the device, what a replayed CUDA graph runs; the LRs decay step by step, as a schedule's do
DEVICE_CASES = [
    # (base, sphere, gains, cuts, dtype, compiled, row_blocks, tol)
    ("adam", "frobenius", "rowcol", 2, torch.float64, False, (), 1e-12),
    ("adam", "row", "lowrank", 3, torch.float64, False, (), 1e-12),
    ("adam", "frobenius", "rowcol", 1, torch.float64, False, (4, 2, 2), 1e-12),
    ("adam", "frobenius", "rowcol", 1, torch.float32, True, (), 1e-6),
    ("muon", "frobenius", "rowcol", 1, torch.float32, False, (), 1e-6),
    ("muon", "col", "rowcol", 1, torch.float32, False, (4, 2, 2), 1e-6),
    ("muon", "frobenius", "rowcol", 1, torch.float32, True, (), 1e-6),
]


@MISCOMPILED_BY_OLD_TORCH
@pytest.mark.parametrize("base,sphere,gains,n_slices,dtype,compiled,blocks,tol", DEVICE_CASES)
def test_device_scalars_equal_the_reference(base, sphere, gains, n_slices, dtype, compiled,
                                            blocks, tol):  # fmt: skip
    """The step with its step count and LRs as device tensors (a decaying LR) equals the
    reference with the same LRs, to the tolerances of the Python-number step: fp64 1e-12,
    fp32 1e-6 (ZeRO-1 slices, lowrank gains, Q/K/V blocks, Muon, the compiled kernels)."""
    spec = MatrixSpec(sphere, "init", gains, "softplus", gain_rank=2, row_blocks=blocks,
                      muon_scale="sphere_rms")  # fmt: skip
    shape = (16, 11) if blocks else (9, 11)
    w, w_ref, ranks, st_ref = _run(spec, CUTS[n_slices], base=base, dtype=dtype, shape=shape,
                                   compiled=compiled, device=True)  # fmt: skip
    assert ranks.scalars and all(e.steps == 5 for e in ranks.engines)
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol / 10)
    gain_rtol = 1e-5 if dtype == torch.float32 else tol  # fp32 gains: as the Muon tests'
    _same_gains(ranks, st_ref, reference.GAIN_NAMES[gains], rtol=gain_rtol, atol=tol)


def _stream(fn) -> list[tuple]:
    """Every aten operation ``fn`` dispatches with its arguments that are not tensors (what a
    CUDA graph would freeze): [(name, non-tensor arguments)]."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            leaves, _ = tree_flatten((args, kwargs or {}))
            fixed = tuple("nan" if x != x else x for x in leaves if not isinstance(x, torch.Tensor))
            seen.append((str(func), fixed))
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


@pytest.mark.parametrize("base", ["adam", "muon"])
def test_device_scalars_make_every_step_the_same_kernels(base):
    """What lets a CUDA graph replay the step: with the step count and LRs on the device, step
    4 and step 5 (another LR) dispatch the same operations with the same non-tensor arguments,
    and read nothing back to the host; the Python-number step does not (its step count and LR
    are in the arguments: the check can fail). (The compiled kernels refuse to run under the
    dispatch mode that records this; their arguments are tensors.)"""
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus", muon_scale="sphere_rms")
    shapes = [(16, 8), (8, 16)] * 3
    pieces = [[(sliced.SliceMD(s, 0, s[0] * s[1], spec, base), torch.randn(s).view(-1), i)
               for i, s in enumerate(shapes)]]  # fmt: skip
    grads = [[torch.randn(s).view(-1) for s in shapes]]
    hp = lambda lr: AdamHParams(lr) if base == "adam" else MuonHParams(lr)  # noqa: E731
    streams = {}
    for device in (True, False):
        ranks = Ranks(pieces, torch.float32)
        ranks.init()
        for k in range(3):
            ranks.step(grads, hp(1e-2), AdamHParams(1e-2), device=device)
        engine, seen = ranks.engines[0], []
        run = engine.run  # the device's part of the step: what a graph holds
        engine.run = lambda *a: seen.append(_stream(lambda: run(*a)))
        for lr in (9e-3, 8e-3):
            ranks.step(grads, hp(lr), AdamHParams(lr / 2), device=device)
        streams[device] = seen
    four, five = streams[True]
    assert four == five and len(four) > 50
    assert not any(name.startswith("aten._local_scalar_dense") for name, _ in four)
    assert streams[False][0] != streams[False][1]


def test_step_graph_warms_up_captures_replays_and_refuses_moved_memory(monkeypatch):
    """StepGraph's rule (the capture and replay themselves need CUDA: md_check.py --cuda-graph
    in tools/gpu_check.py): 3 eager steps, then a capture (replayed at once: a capture runs
    nothing), then replays that never call the step's Python; a new structure starts over;
    a tensor that moved since the capture stops the run, named, before a replay."""
    from megatron.md.engine import graph

    class Recorded:  # stands in for torch.cuda.CUDAGraph: counts replays
        replays = 0

        def replay(self):
            Recorded.replays += 1

    monkeypatch.setattr(graph.StepGraph, "_eager", staticmethod(lambda body: body()))
    monkeypatch.setattr(
        graph.StepGraph, "_capture", staticmethod(lambda body: (body(), Recorded())[1])
    )
    calls = []
    body = lambda: calls.append(1)  # noqa: E731
    sg = graph.StepGraph()
    where, name = [100, 200], ["the gradient of w", "the gradient of b"].__getitem__
    got = [sg.run(body, "k", where, name) for _ in range(6)]
    assert got == ["eager"] * 3 + ["captured"] + ["replayed"] * 2
    assert len(calls) == 4 and Recorded.replays == 3 and sg.replays == 3
    assert [sg.run(body, "other", where, name) for _ in range(4)] == ["eager"] * 3 + ["captured"]
    with pytest.raises(RuntimeError, match="the gradient of b moved .*0xc8 -> 0x12c"):
        sg.run(body, "other", [100, 300], name)
    sg.drop()
    assert sg.run(body, "other", where, name) == "eager"


def test_device_scalars_follow_the_numbers_that_change():
    """One device tensor holds the step count and each group's LR, weight decay and gains' LR;
    the hyper-parameters read views of it, made once while the rest stays fixed."""
    from megatron.md.engine.engine import HParams
    from megatron.md.engine.graph import DeviceScalars

    sc = DeviceScalars("cpu", torch.float64)

    def hps(lr, wd=0.0, beta1=0.9):
        one = HParams(AdamHParams(lr, beta1), MuonHParams(lr), AdamHParams(lr / 2))
        return {0: one, 3: HParams(AdamHParams(2 * lr, weight_decay=wd), None, AdamHParams(lr))}

    a = sc.write(7, hps(1e-2))
    assert sc.values.tolist() == [7, 1e-2, 0, 5e-3, 2e-2, 0, 1e-2]
    assert a[0].adam.lr.data_ptr() == a[0].muon.lr.data_ptr() == sc.values[1].data_ptr()
    assert a[3].adam.weight_decay == 0.0  # zero: no weight-decay kernel in the step
    b = sc.write(8, hps(5e-3))
    assert b is a and sc.values.tolist() == [8, 5e-3, 0, 2.5e-3, 1e-2, 0, 5e-3]
    c = sc.write(9, hps(5e-3, wd=0.1))  # weight decay turns on: another structure
    assert c is not a and float(c[3].adam.weight_decay) == 0.1
    assert sc.write(9, hps(5e-3, wd=0.1, beta1=0.8)) is not c


@pytest.mark.parametrize("base", ["adam", "muon"])
@pytest.mark.parametrize("sphere", ["frobenius", "row", "col"])
def test_no_matrix_product_makes_one_number_per_matrix(base, sphere):
    """A norm or dot per matrix is a reduction, never a (B, 1, K)·(B, K, 1) product: cuBLAS
    runs that as a mat-vec with one output per matrix, whatever K (one NVIDIA H100, MuonMD at
    1.29B, 2026-11-26: 11 ms a call, 34 of its step's 138 ms; docs/benchmarks.md)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    products = {torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
                torch.ops.aten.mm.default, torch.ops.aten.mv.default}  # fmt: skip
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in products:
                seen.append((str(func), tuple(args[0].shape), tuple(out.shape)))
            return out

    step = _stepped_once(MatrixSpec(sphere, "init", "rowcol", "softplus"), base,
                         [(16, 8), (8, 16), (16, 8)])  # fmt: skip
    with Record():
        step()
    assert seen, "the step multiplies no matrices: the recorder saw nothing"
    dots = [s for s in seen if s[2][-2:] == (1, 1) or s[2] == () or s[2] == (1,)]
    assert not dots, dots


@pytest.mark.parametrize("sphere,shape", [("frobenius", (256, 32)), ("frobenius", (2048, 2048)),
                                         ("frobenius", (9, 11)), ("row", (4, 8192))])  # fmt: skip
def test_radii_of_bf16_valued_directions_are_their_norms(sphere, shape):
    """A bf16 model's fp32 main params hold bf16 values: their radii (and every step's sphere
    norms, the same sums: ``norms.sq_sums``) within fp32 rounding of the float64 norm. torch's
    fp32 ``vector_norm`` over a whole matrix on a CPU was 1.1e-6 off on the (256, 32) matrix
    below and 3.8e-5 on the (2048, 2048) one (torch 2.15.0), which put every bf16 distributed
    check's directions 1e-6 from the reference's (tests/test_distributed_md.py)."""
    spec = MatrixSpec(sphere, "init", "rowcol", "softplus")
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=gen) * 0.177).bfloat16().float()
    n = shape[0] * shape[1]
    ranks = Ranks([[(sliced.SliceMD(shape, 0, n, spec, "adam"), w.view(-1).clone(), 0)]],
                  torch.float32)  # fmt: skip
    ranks.init()
    (m,) = ranks.engines[0].members
    exact = w.double().norm() if sphere == "frobenius" else w.double().norm(dim=1)
    rel = (m.md_state["radius"].double().view(-1) - exact).abs() / exact
    assert float(rel.max()) <= 2e-7, float(rel.max())


@pytest.mark.parametrize("shape", [(2048, 2048), (3, 12, 20)])
def test_hyperball_update_is_at_unit_norm(shape):
    """The hyperball scale's orthogonalized update at unit Frobenius norm per matrix (a batch's
    last two axes) within fp32 rounding of float64: its norm is ``norms.sq_sums``'. torch's
    whole-matrix fp32 ``vector_norm`` left it 8e-5 off at (2048, 2048) on a CPU (torch 2.15.0)."""
    gen = torch.Generator().manual_seed(1)
    u = hyperball_(torch.randn(shape, generator=gen))
    unit = u.double().square().sum((-2, -1)).sqrt()
    assert float((unit - 1).abs().max()) <= 2e-7, float((unit - 1).abs().max())
