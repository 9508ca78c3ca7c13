"""The slice path (what a ZeRO-1 rank runs) against the whole-matrix reference."""

import pytest
import torch

from megatron.md import reference, sliced
from megatron.md.base_steps import AdamHParams, MuonHParams
from megatron.md.config import MatrixSpec

CUTS = {
    1: [],
    2: [37],  # inside row 3 of a 9x11 matrix
    3: [5, 61],
    4: [1, 23, 80],
}


def _run(spec, cuts, base="adam", steps=5, shape=(9, 11), dtype=torch.float64):
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
        md = sliced.SliceMD(shape, lo, hi, spec, base)
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
            md.phase1(d, gf[md.start : md.end], st, hp, b, pre)
            bufs.append(b)
        total = torch.stack(bufs).sum(0)
        for md, d, st in parts:
            md.phase2(d, st, ghp, total)
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
    blocks = sliced.slice_blocks((9, 11), start, end)
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
        items.append(sliced.SliceItem(md, d, None, st))
    sliced.md_init_batched(items, lambda b: calls.append(b.numel()))
    assert calls == [2]
    calls.clear()
    step_items = [
        sliced.SliceItem(
            it.md,
            it.direction,
            torch.randn_like(it.direction),
            it.state,
            AdamHParams(1e-2),
            AdamHParams(1e-2),
        )
        for it in items
    ]
    sliced.md_step_batched(step_items, lambda b: calls.append(b.numel()))
    assert calls == [(6 + 4 + 1) + (3 + 8 + 1)]


def test_multi_tensor_gain_adam_is_bit_identical():
    """md_step_batched runs the gains' Adam as one multi-tensor Adam per (step, hyper-params):
    bit-identical to stepping each matrix on its own, over gain maps, lowrank and two LRs."""
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
        items.append(sliced.SliceItem(md, d, None, md.init_state(d, seed=k)))
    sliced.md_init_batched(items, sliced.identity_reduce)
    twin = copy.deepcopy(items)
    for _ in range(3):
        grads = [torch.randn(it.direction.shape, generator=gen) for it in items]
        batch = [
            sliced.SliceItem(it.md, it.direction, g, it.state, AdamHParams(1e-2),
                             AdamHParams(1e-2 if k % 2 else 3e-2))
            for k, (it, g) in enumerate(zip(items, grads))
        ]  # fmt: skip
        sliced.md_step_batched(batch, sliced.identity_reduce)
        for k, (it, g) in enumerate(zip(twin, grads)):  # one matrix at a time, no batch
            buf = torch.zeros(it.md.n_partials())
            it.md.phase1(it.direction, g, it.state, AdamHParams(1e-2), buf)
            it.md.phase2(it.direction, it.state, AdamHParams(1e-2 if k % 2 else 3e-2), buf)
    for a, b in zip(items, twin):
        assert torch.equal(a.direction, b.direction)
        for key, v in a.state.items():
            if torch.is_tensor(v):
                assert torch.equal(v, b.state[key]), key
