"""The slice path (what a ZeRO-1 rank runs) against the whole-matrix reference."""

import pytest
import torch

from megatron.md import batched, reference, sliced
from megatron.md.base_steps import AdamHParams, MuonHParams
from megatron.md.blocks import slice_blocks
from megatron.md.config import MatrixSpec

CUTS = {
    1: [],
    2: [37],  # inside row 3 of a 9x11 matrix
    3: [5, 61],
    4: [1, 23, 80],
}


def _run(spec, cuts, base="adam", steps=5, shape=(9, 11), dtype=torch.float64, fused=False):
    """Reference vs. slices whose partials are summed (the all-reduce of a real run)."""
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(shape, generator=gen, dtype=dtype) / shape[1] ** 0.5
    grads = [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(steps)]
    hp = AdamHParams(2e-2) if base == "adam" else MuonHParams(2e-2)
    ghp = AdamHParams(1e-2)

    w_ref = w0.clone()
    st_ref = reference.init_state(w_ref, spec, base)
    for g in grads:
        reference.md_step(w_ref, g, st_ref, spec, hp, ghp)

    n = shape[0] * shape[1]
    bounds = [0, *cuts, n]
    flat = w0.clone().view(-1)
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        md = sliced.SliceMD(shape, lo, hi, spec, base, fused=fused)
        assert md.fused == (fused and (spec.gains, spec.sphere) != ("none", "none"))
        d = flat[lo:hi].clone()
        parts.append((md, d, md.init_state(d)))
    tot = sum(
        _partials(md.n_norm, dtype, lambda b, md=md, d=d: md.norm_partials(d, b))
        for md, d, _ in parts
    )
    for md, d, st in parts:
        md.finish_init(d, st, tot)
    for g in grads:
        gf = g.reshape(-1)
        pre = None
        if parts[0][0].n_pre_partials():
            pres = []
            for md, d, st in parts:
                pres.append(torch.zeros(md.n_pre_partials(), dtype=dtype))
                md.pre_partials(d, gf[md.start : md.end], st, pres[-1])
            pre = torch.stack(pres).sum(0)
        bufs = []
        for md, d, st in parts:
            b = torch.zeros(md.n_partials(), dtype=dtype)
            md.step_direction(d, gf[md.start : md.end], st, hp, b, pre)
            bufs.append(b)
        total = torch.stack(bufs).sum(0)
        for md, d, st in parts:
            md.project_and_step_gains(d, st, ghp, total)
    w = torch.empty(n, dtype=dtype)
    for md, d, st in parts:
        md.fuse(d, st, w[md.start : md.end])
    assert (
        any(blk.nr == 1 and blk.nc < shape[1] for md, _, _ in parts for blk in md.blocks)
        or not cuts
    )
    return w.view(shape), w_ref, parts, st_ref


def _partials(n, dtype, fill):
    b = torch.zeros(n, dtype=dtype)
    fill(b)
    return b


@pytest.mark.parametrize("n_slices", [1, 2, 3, 4])
@pytest.mark.parametrize("sphere", ["frobenius", "row", "col", "none"])
@pytest.mark.parametrize("gains", ["none", "scalar", "row", "col", "rowcol", "lowrank"])
def test_slices_equal_whole_matrix(n_slices, sphere, gains):
    spec = MatrixSpec(sphere, "init", gains, "softplus", gain_rank=2)
    w, w_ref, parts, st_ref = _run(spec, CUTS[n_slices])
    torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-13)
    for name in reference.GAIN_NAMES[gains]:
        for _, _, st in parts:  # replicated gains identical to the reference's
            torch.testing.assert_close(st[name], st_ref[name], rtol=1e-12, atol=1e-13)


# every sphere and every fused gains kind once (each case compiles kernels: ~10 s apiece here);
# row sphere + row/col gains: the kernel leaves its norms to the caller (fused.kernel_sphere)
FUSED_CASES = [
    ("frobenius", "rowcol"), ("row", "none"), ("col", "row"), ("none", "col"), ("row", "rowcol"),
]  # fmt: skip


@pytest.mark.parametrize("sphere,gains", FUSED_CASES)
def test_fused_kernels_equal_whole_matrix(sphere, gains):
    """--md-fused-step (compiled kernels) on 4 slices with cuts inside rows: in fp64 the same
    as the reference to 1e-12 (the formulas), in fp32 (the default matrices) to 1e-6."""
    spec = MatrixSpec(sphere, "init", gains, "softplus")
    w, w_ref, parts, st_ref = _run(spec, CUTS[4], fused=True)
    torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-13)
    for name in reference.GAIN_NAMES[gains]:
        for _, _, st in parts:
            torch.testing.assert_close(st[name], st_ref[name], rtol=1e-12, atol=1e-13)
    if gains == "rowcol":
        w, w_ref, *_ = _run(spec, CUTS[4], dtype=torch.float32, fused=True)
        torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


def test_fused_kernel_serves_every_cut():
    """One compiled phase-1 kernel for every row count and one for every one-row block
    (a cut's column count): the long dimension is symbolic, the row length static."""
    from torch._dynamo.utils import counters

    from megatron.md import fused

    hp = fused.adam_hparams(AdamHParams(1e-2), 1, torch.empty(0))
    shapes = [(3, 13), (1, 4), (5, 13), (8, 13), (1, 7), (1, 9)]  # the first two compile
    for i, (nr, nc) in enumerate(shapes):
        if i == 2:
            compiled = counters["stats"]["unique_graphs"]
        w, g = torch.randn(nr, nc), torch.randn(nr, nc)
        m, v = torch.zeros(nr, nc), torch.zeros(nr, nc)
        row, col = torch.rand(nr, 1) + 0.5, torch.rand(1, nc) + 0.5
        p = w * g
        gr, gc, sq = fused.phase1(w, g, m, v, row, col, hp, True, True, "frobenius")
        torch.testing.assert_close(gr, (p * col).sum(1))
        torch.testing.assert_close(gc, (p * row).sum(0))
        torch.testing.assert_close(sq, (w * w).sum())  # of the updated Ŵ
    assert counters["stats"]["unique_graphs"] == compiled


@pytest.mark.parametrize("n_slices", [2, 4])
@pytest.mark.parametrize("sphere", ["frobenius", "row"])
def test_slices_tangent_and_shape_radius(n_slices, sphere):
    spec = MatrixSpec(sphere, "shape", "rowcol", "exp", tangent_grad=True)
    w, w_ref, *_ = _run(spec, CUTS[n_slices])
    torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-13)


def test_whole_matrix_is_bit_identical_fp32():
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus")
    w, w_ref, *_ = _run(spec, [], dtype=torch.float32)
    assert torch.equal(w, w_ref)


def test_muon_whole_matrix_matches_reference():
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus", muon_scale="sphere_rms")
    w, w_ref, *_ = _run(spec, [], base="muon", dtype=torch.float32)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)


def test_muon_refuses_a_slice():
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus")
    with pytest.raises(ValueError, match="whole matrices"):
        sliced.SliceMD((4, 4), 0, 7, spec, "muon")


@pytest.mark.parametrize("start,end", [(0, 99), (3, 4), (10, 22), (0, 11), (5, 98), (11, 33)])
def test_blocks_cover_the_slice_exactly(start, end):
    blocks = slice_blocks((9, 11), start, end)
    assert len(blocks) <= 3
    covered = []
    for b in blocks:
        covered += [(b.r0 + i) * 11 + b.c0 + j for i in range(b.nr) for j in range(b.nc)]
    assert covered == list(range(start, end))


def test_batched_step_uses_one_reduction():
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus")
    calls = []
    items = []
    for shape in [(6, 4), (3, 8)]:
        d = torch.randn(shape).view(-1)
        md = sliced.SliceMD(shape, 0, d.numel(), spec, "adam")
        st = md.init_state(d)
        items.append(batched.SliceItem(md, d, None, st))
    batched.md_init_batched(items, lambda b, items, segs: calls.append(b.numel()))
    assert calls == [2]
    calls.clear()
    step_items = [
        batched.SliceItem(
            it.md,
            it.direction,
            torch.randn_like(it.direction),
            it.state,
            AdamHParams(1e-2),
            AdamHParams(1e-2),
        )
        for it in items
    ]
    batched.md_step_batched(step_items, lambda b, items, segs: calls.append(b.numel()))
    assert calls == [(6 + 4 + 1) + (3 + 8 + 1)]


@pytest.mark.parametrize("cap", [None, 60])
def test_multi_tensor_adam_is_bit_identical(cap):
    """md_step_batched runs the gains' Adam and Ŵ's Adam as multi-tensor Adams per (step,
    hyper-params), Ŵ's in chunks of ``cap`` elements: bit-identical to stepping each matrix on
    its own, over gain maps, lowrank and two LRs each (cap 60: chunks of 1–2 matrices)."""
    import copy

    specs = [
        MatrixSpec("frobenius", "init", "rowcol", "softplus"),
        MatrixSpec("row", "init", "row", "direct-floor"),
        MatrixSpec("col", "shape", "lowrank", "softplus", gain_rank=2),
        MatrixSpec("frobenius", "init", "scalar", "exp"),
    ]
    gen = torch.Generator().manual_seed(3)
    items = []
    for k, spec in enumerate(specs):
        d = torch.randn((5 + k, 7), generator=gen).view(-1)
        md = sliced.SliceMD((5 + k, 7), 0, d.numel(), spec, "adam")
        items.append(batched.SliceItem(md, d, None, md.init_state(d, seed=k)))
    batched.md_init_batched(items, batched.identity_reduce)
    twin = copy.deepcopy(items)
    for _ in range(3):
        grads = [torch.randn(it.direction.shape, generator=gen) for it in items]
        batch = [
            batched.SliceItem(it.md, it.direction, g, it.state,
                              AdamHParams(1e-2 if k < 2 else 2e-2),
                              AdamHParams(1e-2 if k % 2 else 3e-2))
            for k, (it, g) in enumerate(zip(items, grads))
        ]  # fmt: skip
        batched.md_step_batched(batch, batched.identity_reduce, cap=cap)
        for k, (it, g) in enumerate(zip(twin, grads)):  # one matrix at a time, no batch
            buf = torch.zeros(it.md.n_partials())
            it.md.step_direction(
                it.direction, g, it.state, AdamHParams(1e-2 if k < 2 else 2e-2), buf
            )
            it.md.project_and_step_gains(
                it.direction, it.state, AdamHParams(1e-2 if k % 2 else 3e-2), buf
            )
    for a, b in zip(items, twin):
        assert torch.equal(a.direction, b.direction)
        for key, v in a.state.items():
            if torch.is_tensor(v):
                assert torch.equal(v, b.state[key]), key


@pytest.mark.parametrize("gains", ["scalar", "row", "col", "rowcol", "lowrank"])
def test_fuse_into_bf16_rounds_once(gains):
    """fuse writes W = Γ ⊙ Ŵ into a bf16 param with ONE rounding of the fp32 product, for a
    slice with cuts inside rows (3 blocks), whatever the number of passes it takes."""
    spec = MatrixSpec("frobenius", "init", gains, "softplus", gain_rank=2)
    gen = torch.Generator().manual_seed(5)
    d = torch.randn(6 * 7, generator=gen)
    md = sliced.SliceMD((6, 7), 3, 38, spec, "adam")
    assert len(md.blocks) == 3
    st = md.init_state(d[3:38], seed=1)
    for name in md.gain_names:  # gains away from 1
        st[name] += torch.randn(st[name].shape, generator=gen)
    g = md._gains(st)
    if gains == "lowrank":
        gamma = 1 + g["gain_a"] @ g["gain_b"].T
    else:
        gamma = torch.ones(6, 7)
        gamma = gamma * g["gain_scalar"] if gains == "scalar" else gamma
        gamma = gamma * g["gain_row"][:, None] if "gain_row" in g else gamma
        gamma = gamma * g["gain_col"][None, :] if "gain_col" in g else gamma
    want = (d.view(6, 7) * gamma).view(-1)[3:38].to(torch.bfloat16)
    out = torch.zeros(35, dtype=torch.bfloat16)
    md.fuse(d[3:38], st, out)
    if gains in ("scalar", "row", "col", "lowrank"):  # one product: identical to the reference's
        assert torch.equal(out, want)
    else:  # (Ŵ·g_row)·g_col, as the reference's apply_gains multiplies, rounded once
        fp32 = d.view(6, 7) * g["gain_row"][:, None] * g["gain_col"]
        assert torch.equal(out, fp32.view(-1)[3:38].to(torch.bfloat16))


@pytest.mark.parametrize("sphere", ["frobenius", "row", "col", "none"])
@pytest.mark.parametrize("radius,tangent", [("init", False), ("shape", True)])
def test_muon_qkv_split_matches_reference(sphere, radius, tangent):
    """A split fused QKV matrix (2 query groups of 4 q, 2 k, 2 v rows) stepped whole, as the
    layer-wise optimizer does: per-block spheres, tangent projection and Muon calls equal the
    reference's (fp32, Newton–Schulz's dtype: 1e-6 as for unsplit Muon)."""
    tangent = tangent and sphere != "none"
    spec = MatrixSpec(sphere, radius, "rowcol", "softplus", tangent_grad=tangent,
                      muon_scale="sphere_rms", row_blocks=(4, 2, 2))  # fmt: skip
    w, w_ref, parts, st_ref = _run(spec, [], base="muon", shape=(16, 11), dtype=torch.float32)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    if sphere != "none":
        torch.testing.assert_close(parts[0][2]["radius"], st_ref["radius"], rtol=1e-6, atol=0)


def test_qkv_split_refuses_a_slice():
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus", row_blocks=(4, 2, 2))
    with pytest.raises(ValueError, match="whole matrix"):
        sliced.SliceMD((16, 11), 0, 100, spec, "adam")


@pytest.mark.parametrize("variant", ["muown", "muown-angular"])
def test_muown_whole_matrix_matches_reference(variant):
    from megatron.md.config import MDConfig, spec_for

    spec = spec_for("matrix", MDConfig(variant=variant, muon_scale="shape_scaling"))
    w, w_ref, parts, st_ref = _run(spec, [], base="muon", dtype=torch.float32)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(parts[0][2]["gain_row"], st_ref["gain_row"], rtol=1e-6, atol=1e-7)
