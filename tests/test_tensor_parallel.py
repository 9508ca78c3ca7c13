"""MD's step on tensor-parallel pieces (each cut again into ZeRO-1 slices) against the
whole-matrix reference, in one process: the pieces' partials are summed as the TP × DP
all-reduce sums them (megatron/md/tensor_parallel.py). The distributed runs under megatron's
TP are tests/test_distributed_md.py::test_adam_md_tensor_parallel."""

import dataclasses

import pytest
import torch
from _ranks import Ranks

from megatron.md import reference, sliced
from megatron.md.base_steps import AdamHParams
from megatron.md.blocks import TPShard
from megatron.md.config import MatrixSpec

SHAPE = (16, 12)
SPEC = MatrixSpec("frobenius", "init", "rowcol", "softplus")


def local_piece(full: torch.Tensor, tp: TPShard) -> torch.Tensor:
    """megatron's layout: ``size * stride`` chunks along the axis, rank r holds r, r + size, …"""
    chunks = full.chunk(tp.size * tp.stride, tp.axis)
    return torch.cat([chunks[k * tp.size + tp.rank] for k in range(tp.stride)], tp.axis)


def run(spec, pieces, steps=5, dtype=torch.float64):
    """``pieces``: (tp or None, counts, ZeRO-1 cuts of the local flat matrix) per TP rank; each
    slice a rank of the engine (tests/_ranks.py sums their partials as the TP × DP all-reduce
    does, replicas dropped). Returns the reference's final W and state and each slice's (its
    W, the reference's W there, its MD state)."""
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(SHAPE, generator=gen, dtype=dtype) / SHAPE[1] ** 0.5
    grads = [torch.randn(SHAPE, generator=gen, dtype=dtype) for _ in range(steps)]
    hp, ghp = AdamHParams(2e-2), AdamHParams(1e-2)
    w_ref = w0.clone()
    st_ref = reference.init_state(w_ref, spec, "adam")
    for g in grads:
        reference.md_step(w_ref, g, st_ref, spec, hp, ghp)

    local = lambda t, tp: t if tp is None else local_piece(t, tp)  # noqa: E731
    slices = []  # (SliceMD, its TP piece)
    for tp, counts, cuts in pieces:
        piece = local(w0, tp)
        bounds = [0, *cuts, piece.numel()]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            md = sliced.SliceMD(tuple(piece.shape), lo, hi, spec, "adam", tp=tp, counts=counts)
            slices.append((md, tp, piece.reshape(-1)[lo:hi]))
    ranks = Ranks([[(md, d, 0)] for md, _, d in slices], dtype)
    ranks.init()
    for g in grads:
        ranks.step([[local(g, tp).reshape(-1)[md.start : md.end]] for md, tp, _ in slices],
                   hp, ghp)  # fmt: skip
    outs = [[torch.empty(md.end - md.start, dtype=dtype)] for md, _, _ in slices]
    ranks.fuse(outs)
    out = []
    for (md, tp, _), (w,), e in zip(slices, outs, ranks.engines):
        ref_here = local(w_ref, tp).reshape(-1)[md.start : md.end]
        out.append((w, ref_here, e.members[0].md_state))
    return w_ref, st_ref, out


def split(size: int, axis: int = 0, stride: int = 1, cuts=()):
    return [(TPShard(axis, r, size, stride), True, list(cuts)) for r in range(size)]


LAYOUTS = {
    "column-parallel tp2": split(2),
    "column-parallel tp4, ZeRO-1 cuts inside rows": split(4, cuts=(7, 30)),
    "SwiGLU fc1 (stride 2) tp2, cuts": split(2, stride=2, cuts=(13, 50)),
    "SwiGLU fc1 (stride 2) tp4": split(4, stride=2),
    "row-parallel tp2, cuts": split(2, axis=1, cuts=(5, 41, 70)),
    "row-parallel tp4": split(4, axis=1),
    "TP-replicated (router), tp2": [(None, r == 0, [37]) for r in range(2)],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "sphere,gains", [("frobenius", "rowcol"), ("row", "none"), ("col", "row"), ("row", "col")]
)
def test_tensor_parallel_pieces_equal_whole_matrix(layout, sphere, gains):
    spec = MatrixSpec(sphere, "init", gains, "softplus")
    _, st_ref, out = run(spec, LAYOUTS[layout])
    for w, w_ref, st in out:
        torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-13)
        for name in reference.GAIN_NAMES[gains]:  # full gains on every rank, as the reference's
            torch.testing.assert_close(st[name], st_ref[name], rtol=1e-12, atol=1e-13)


def test_a_replica_counted_twice_is_wrong():
    """The replicated matrix's partials must be added once: counted on both ranks, its squared
    row norms double and unit rows end at 1/√2 (what ``counts`` prevents; gain gradients
    doubled alone would hide behind Adam's scale invariance)."""
    spec = MatrixSpec("row", "unit", "none", "softplus")
    _, _, out = run(spec, [(None, True, []), (None, True, [])])
    w, w_ref, _ = out[0]
    rows = w.view(SHAPE).norm(dim=1)
    torch.testing.assert_close(rows, torch.full_like(rows, 0.5**0.5))
    assert w_ref.view(SHAPE).norm(dim=1).sub(1).abs().max() < 1e-12


def test_shard_addresses_the_full_matrix():
    """A rank's blocks are addressed in the full matrix: rows (or columns) of its chunks."""
    md = sliced.SliceMD((8, 12), 0, 96, SPEC, "adam", tp=TPShard(0, 1, 2, stride=2))
    assert md.shape == SHAPE
    assert [(b.r0, b.nr, b.lo) for b in md.blocks] == [(4, 4, 0), (12, 4, 48)]
    md = sliced.SliceMD((16, 3), 5, 40, SPEC, "adam", tp=TPShard(1, 3, 4))
    assert md.shape == SHAPE and {(b.c0, b.nc) for b in md.blocks} == {(11, 1), (9, 3), (9, 1)}


@pytest.mark.parametrize(
    "tp", [None, TPShard(0, 1, 2), TPShard(0, 0, 2, stride=2), TPShard(1, 1, 2), TPShard(1, 2, 4)]
)
def test_fp32_direction_checkpoint_pieces_tile_the_full_matrix(tp):
    """checkpoint.direction_pieces: every ZeRO-1 slice of a rank's TP piece, as rectangles of
    the full matrix, holds exactly the full matrix's values there, and the rank's slices cover
    its piece once (what makes the fp32 direction load at any TP/DP size)."""
    from megatron.md.checkpoint import direction_pieces

    full = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float64).view(SHAPE)
    piece = full if tp is None else local_piece(full, tp)
    seen = torch.zeros(SHAPE, dtype=torch.long)
    bounds = [0, 5, 11, 12, 40, piece.numel() - 1, piece.numel()]  # cuts inside rows too
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        flat = piece.reshape(-1)[lo:hi].clone()
        for view, (r, c) in direction_pieces(flat, lo, tuple(piece.shape), tp):
            h, w = view.shape
            assert torch.equal(view, full[r : r + h, c : c + w])
            seen[r : r + h, c : c + w] += 1
    mine = torch.ones(SHAPE, dtype=torch.long) if tp is None else torch.zeros(SHAPE).long()
    if tp is not None:  # the rank's chunks of the full matrix
        chunks = mine.chunk(tp.size * tp.stride, tp.axis)
        for k in range(tp.stride):
            chunks[k * tp.size + tp.rank].fill_(1)
    assert torch.equal(seen, mine)


def test_unsupported_layouts_are_refused():
    """MuonMD takes whole TP pieces (it gathers them); a QKV split needs whole query groups on
    each rank (rows, stride 1); Muown's per-row step needs whole rows."""
    sliced.SliceMD((8, 12), 0, 96, SPEC, "muon", tp=TPShard(0, 0, 2))  # a whole piece: fine
    with pytest.raises(ValueError, match="Muon needs whole matrices"):
        sliced.SliceMD((8, 12), 0, 50, SPEC, "muon", tp=TPShard(0, 0, 2))
    qkv = dataclasses.replace(SPEC, row_blocks=(2, 1, 1))
    with pytest.raises(ValueError, match="whole query groups"):
        sliced.SliceMD((8, 12), 0, 96, qkv, "muon", tp=TPShard(1, 0, 2))
    muown = dataclasses.replace(SPEC, tangent_update=True)
    with pytest.raises(ValueError, match="Muown"):
        sliced.SliceMD((8, 12), 0, 96, muown, "muon", tp=TPShard(0, 0, 2))
    with pytest.raises(ValueError, match="unsupported tensor-parallel layout"):
        sliced.SliceMD((16, 6), 0, 96, SPEC, "adam", tp=TPShard(1, 0, 2, stride=2))
