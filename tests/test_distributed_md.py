"""MD inside megatron-core's distributed optimizers under torchrun/gloo, vs. the single-process
reference optimizer (tests/distributed/md_check.py; every rank feeds the same batch)."""

import pytest
from _torchrun import Batches

pytestmark = pytest.mark.distributed

# fp32: relative error of every parameter after 5 steps (seen ≤ 3.7e-7)
FP32_REL = 1e-6
# bf16: each model weight is one round-to-nearest of the reference's fp32 fused weight, up to
# what fp32 rounding along the two paths adds (seen ≤ 2.5e-7 of max|W|)
BF16_EXCESS = 1e-6


def md_collectives(res: dict, nproc: int) -> list:
    """What MD adds to megatron's own optimizer step, counted by wrapping torch.distributed:
    one all-reduce of exactly the expected payload (none on one rank)."""
    assert res["missing_collectives"] == []  # and nothing of megatron's is dropped
    return [] if nproc == 1 else [["all_reduce", res["expected_payload"]]]


def check(res: dict, nproc: int, dtype: str = "fp32") -> None:
    assert res["world"] == nproc
    assert res["worst_dir_rel"] <= FP32_REL  # the fp32 directions (main params / MD state)
    assert res["sphere_err"] <= 1e-6  # ‖Ŵ‖ = radius after every step
    if dtype == "fp32":
        assert res["worst_rel"] <= FP32_REL
    else:
        assert res["bf16_excess"] <= BF16_EXCESS
        assert res["bf16_same_frac"] >= 0.999  # almost all weights are exactly bf16(reference)


# (ranks, experts): dense at 1/2/4 ranks, MoE at 2/4
RANKS_EXPERTS = [(1, 0), (2, 0), (4, 0), (2, 4), (4, 4)]
MUON_LW = ("--optimizer", "muon", "--dist", "layerwise")
MUON_REPLICATED = ("--optimizer", "muon", "--dist", "replicated")
MD_OFF = {
    "zero1": ("--dist", "zero1"),
    "zero1-bf16-moe": ("--dist", "zero1", "--dtype", "bf16", "--experts", "4"),
    "layerwise-bf16-moe": (*MUON_LW, "--dtype", "bf16", "--experts", "4"),
    # the LR moving step by step in both optimizers (as a schedule moves it)
    "replicated-muon-lr-decay": ("--optimizer", "muon", "--dist", "replicated", "--lr-decay"),
    # every Muon matrix one Newton-Schulz call each, applied as it is made (as from 2^20
    # elements on a CPU): still megatron's per-matrix Muon (replicated: two layers' matrices of
    # a shape in one group; layer-wise they fall to two ranks)
    "replicated-muon-one-by-one": (*MUON_REPLICATED, "--ns-one-by-one"),
}
# --md-fused-step (compiled kernels): fp32 with cuts inside rows (4 ranks), bf16 MoE (2)
FUSED = {4: (), 2: ("--dtype", "bf16", "--experts", "4")}
# and at a GPU's call pattern: bf16 params written by the merged fuse into megatron's buffer
FUSED_STACKED = ("--dist", "zero1", "--fused-step", "--stack", "--dtype", "bf16")
# context parallelism (--cp 2): CP2 with ZeRO-1 AdamMD and layer-wise MuonMD, DP2 × CP2 MoE
CP = {
    "cp2-zero1": (2, "--dist", "zero1"),
    "cp2-muon-layerwise": (2, *MUON_LW),
    "dp2xcp2-zero1": (4, "--dist", "zero1"),
    "dp2xcp2-zero1-moe": (4, "--dist", "zero1", "--experts", "4"),
}
# megatron's partial distributed optimizer at 4 ranks: ZeRO-1 within 2 instances of 2 ranks
INSTANCES = {
    "fp32": ("--dist", "zero1", "--instances", "2"),
    "bf16-moe": ("--dist", "zero1", "--instances", "2", "--dtype", "bf16", "--experts", "4"),
}
# megatron's gradient buckets of ~2000 elements with --overlap-grad-reduce, as a cluster runs:
# ZeRO-1 shards each bucket, so a rank holds slices cut inside matrices bucket after bucket (4
# ranks: the most cuts; each job's merged calls compile ~25-40 s cold on CI's 2 cores)
BUCKETS = {
    "fp32-4": (4, "--dist", "zero1", "--fused-step", "--bucket-size", "2000"),
    "bf16-moe-stacked-4": (4, *FUSED_STACKED, "--experts", "4", "--bucket-size", "2000"),
}
# buckets of several layers each: a rank's shards of two buckets hold matrices of one kind
LAYERED_BUCKETS = (2, "--dist", "zero1", "--fused-step", "--stack", "--bucket-size", "20000",
                   "--layers", "6")  # fmt: skip
# --md-cuda-graph's arithmetic (the step count and LRs read from the device), a decaying LR
DEVICE = {
    "zero1-bf16": ("--dist", "zero1", "--dtype", "bf16"),
    "muon-layerwise-bf16": (*MUON_LW, "--dtype", "bf16"),
}
# Every check below, so that each world size runs as ONE torchrun (tests/_torchrun.py:Batches).
md_check = Batches(
    "md_check.py",
    [
        *[(n, "--dist", "zero1", "--experts", e) for n, e in RANKS_EXPERTS],
        (4, "--dist", "zero1", "--dtype", "bf16"),
        (2, "--dist", "zero1", "--gain-lr-mult", "0.3"),
        *[(4, "--dist", "zero1", "--sphere", s) for s in ("row", "col")],
        *[(n, *MUON_LW, "--experts", e) for n, e in RANKS_EXPERTS],
        (2, *MUON_LW, "--dtype", "bf16"),
        (2, *MUON_LW, "--no-split-qkv"),
        (1, *MUON_LW, "--ns-one-by-one"),
        *[
            (2, "--optimizer", "adam", "--dist", "layerwise", "--dtype", d, "--experts", e)
            for d, e in (("fp32", 0), ("bf16", 4))
        ],
        *[
            (2, "--optimizer", o, "--dist", "replicated", "--dtype", d)
            for o, d in (("adam", "fp32"), ("muon", "bf16"))
        ],
        *[(2, "--vs", "megatron", *args) for args in MD_OFF.values()],
        *[(n, "--dist", "zero1", "--fused-step", *a) for n, a in FUSED.items()],
        *[(2, *FUSED_STACKED, "--experts", e) for e in (0, 4)],
        (2, *MUON_LW, "--fused-step"),
        *[(n, "--cp", "2", *a) for n, *a in CP.values()],
        *[(4, *a) for a in INSTANCES.values()],
        *BUCKETS.values(),
        LAYERED_BUCKETS,
        *[(2, *a, "--device-scalars", "--lr-decay") for a in DEVICE.values()],
    ],
)


@pytest.mark.parametrize("nproc,experts", RANKS_EXPERTS)
def test_adam_md_zero1_fp32(nproc, experts):
    res = md_check(nproc, "--dist", "zero1", "--experts", str(experts))
    check(res, nproc)
    assert res["collectives_per_step"] == 1.0  # one all-reduce for all MD matrices
    assert res["payload"] == res["expected_payload"]  # Σ(d_out + d_in + 1) + one per row
    assert res["extra_collectives"] == md_collectives(res, nproc)
    if nproc == 4 and not experts:
        assert res["cut_inside_row"]  # a rank's slice starts or ends inside a row
    # AdamMD's Q/K/V spheres (each layer's QKV; a matrix cut between ranks counts per slice)
    assert res["split_qkv_matrices"] >= 2


@pytest.mark.parametrize("nproc", [4])
def test_adam_md_zero1_bf16(nproc):
    res = md_check(nproc, "--dist", "zero1", "--dtype", "bf16")
    check(res, nproc, "bf16")
    assert res["collectives_per_step"] == 1.0
    assert res["extra_collectives"] == md_collectives(res, nproc)


def test_adam_md_gains_at_their_own_lr_share_the_vectors_adam():
    """The gains at 0.3x the LR of the 1-D parameters, both in one multi-tensor Adam (the LRs
    per tensor: gainstep.GainBatch, base_steps.adam_multi_): every weight as the reference's,
    which steps each parameter group with its own Adam."""
    res = md_check(2, "--dist", "zero1", "--gain-lr-mult", "0.3")
    check(res, 2)


@pytest.mark.parametrize("sphere", ["row", "col"])
def test_adam_md_zero1_row_col_spheres_cut_inside_rows(sphere):
    res = md_check(4, "--dist", "zero1", "--sphere", sphere)
    check(res, 4)
    assert res["cut_inside_row"]


@pytest.mark.parametrize("nproc,experts", RANKS_EXPERTS)
def test_muon_md_layerwise_fp32(nproc, experts):
    res = md_check(nproc, *MUON_LW, "--experts", str(experts))
    check(res, nproc)
    assert res["split_qkv_matrices"] == 2  # each layer's QKV: Q, K, V spheres and NS calls
    assert "MDFloat16OptimizerWithFloat16Params" in res["classes"]
    # only the Adam-managed embedding/LM-head rows go through the ZeRO-1 all-reduce
    assert res["payload"] == res["expected_payload"]
    assert res["extra_collectives"] == md_collectives(res, nproc)


def test_muon_md_layerwise_one_by_one():
    """Every Muon matrix one Newton-Schulz call each, scaled in place and applied as it is made
    (engine/basesteps.py: a CPU's path from 2^20 elements; the model here is smaller): the
    reference's numbers as the batched calls give them, in groups of more than one matrix
    (one rank: both layers' matrices of a shape in one group)."""
    res = md_check(1, *MUON_LW, "--ns-one-by-one")
    check(res, 1)
    assert res["one_by_one_groups"] > 0


def test_muon_md_layerwise_fused_qkv():
    """--muon-no-split-qkv: the fused QKV matrix as one Muon call and one sphere."""
    res = md_check(2, *MUON_LW, "--no-split-qkv")
    check(res, 2)
    assert res["split_qkv_matrices"] == 0


def test_muon_md_layerwise_bf16():
    res = md_check(2, *MUON_LW, "--dtype", "bf16")
    check(res, 2, "bf16")


@pytest.mark.parametrize("nproc,dtype,experts", [(2, "fp32", 0), (2, "bf16", 4)])
def test_adam_md_layerwise(nproc, dtype, experts):
    """--md-adam-layer-wise: AdamMD on whole matrices owned layer-wise (megatron's layer-wise
    optimizer built as Muon, base step swapped for Adam) vs the Adam reference."""
    res = md_check(nproc, "--optimizer", "adam", "--dist", "layerwise",
                   "--dtype", dtype, "--experts", str(experts))  # fmt: skip
    check(res, nproc, dtype)
    assert "MDFloat16OptimizerWithFloat16Params" in res["classes"]
    assert res["payload"] == res["expected_payload"]  # only embedding/LM-head rows reduced
    assert res["extra_collectives"] == md_collectives(res, nproc)


@pytest.mark.parametrize("optimizer,dtype", [("adam", "fp32"), ("muon", "bf16")])
def test_md_replicated_optimizers(optimizer, dtype):
    res = md_check(2, "--optimizer", optimizer, "--dist", "replicated", "--dtype", dtype)
    check(res, 2, dtype)
    assert res["collectives_per_step"] == 0.0
    assert res["extra_collectives"] == md_collectives(res, 1)  # none: whole replicas


@pytest.mark.parametrize("args", MD_OFF.values(), ids=MD_OFF.keys())
def test_md_off_is_megatron_bit_for_bit(args):
    res = md_check(2, "--vs", "megatron", *args)
    assert res["worst_rel"] == 0.0  # max |Δ| over all params vs megatron's own optimizer
    assert (res["one_by_one_groups"] > 0) == ("--ns-one-by-one" in args)
    assert res["payload"] == 0  # nothing to reduce with MD off
    assert res["extra_collectives"] == md_collectives(res, 1)  # and no collective added


@pytest.mark.parametrize("nproc", FUSED)
def test_adam_md_zero1_fused_kernels(nproc):
    """AdamMD's compiled kernels (engine/compiled.py) inside ZeRO-1 against the eager reference: the
    same tolerances as the eager path, one all-reduce of the same payload; the slices cut inside
    a matrix compiled too."""
    args = FUSED[nproc]
    res = md_check(nproc, "--dist", "zero1", "--fused-step", *args)
    check(res, nproc, "bf16" if "bf16" in args else "fp32")
    assert res["compiled_groups"] > 0
    # the ranks' slices cut inside a matrix in the merged calls too (Kernels.cut)
    assert res["compiled_cut_groups"] == res["cut_groups"] > 0, res["cut_groups"]
    # the LM head's row sphere with both gains: its norms in phase 1's own variant
    assert {"frobenius", "row_norm", "rescale_fuse"} <= set(res["kernels"])
    assert res["cut_inside_row"] or nproc == 2
    assert res["collectives_per_step"] == (1.0 if nproc > 1 else 0.0)
    assert res["payload"] == res["expected_payload"]


@pytest.mark.parametrize("job", BUCKETS)
def test_adam_md_zero1_with_a_clusters_buckets(job):
    """ZeRO-1 AdamMD over megatron's many buckets reduced during the backward pass: every
    rank's slices cut inside matrices (tens of them, up to two a bucket a rank; those cut at
    one place of same-kind matrices one group) in the merged compiled calls, against the
    reference with the eager path's tolerances (the gradient read from a twin with one bucket:
    md_check.py ``local_grads``). Without the twin the check's own capture read buckets
    mid-reduction: 1.7e-2 off (4 ranks, fp32, 2026-12-05)."""
    nproc, *args = BUCKETS[job]
    res = md_check(nproc, *args)
    check(res, nproc, "bf16" if "bf16" in job else "fp32")
    assert res["buckets"] >= 8, res["buckets"]
    assert res["cut_slices"] >= 4 * nproc, res["cut_slices"]
    assert res["compiled_cut_groups"] == res["cut_groups"] < res["cut_slices"], res["cut_groups"]
    assert res["collectives_per_step"] == 1.0
    assert res["payload"] == res["expected_payload"]


def test_adam_md_zero1_partials_of_a_group_one_span_across_buckets():
    """Buckets of several layers each (6 layers, ~20k elements: 5 buckets): each rank's shard
    of each bucket holds whole matrices of every kind, so a rank's group of one kind has
    members from two buckets with the other rank's between them in buffer order. The ZeRO-1
    layout (zero1.py: a kind by where the shards cut its matrices, then by owner) still gives
    each group one span of the step's partial buffer (no ``index_add_``/``index_select`` and
    zeroed temporary a group and step; the kind-then-buffer order left 10 such groups here,
    2026-12-05). At a GPU's call pattern (``--stack``) such a group's weights are two pieces
    of megatron's param buffer, which the merged fuse writes by the index they compute
    (``formulas._piece_index``): against the reference with the eager path's tolerances."""
    res = md_check(*LAYERED_BUCKETS)
    check(res, 2)
    assert res["buckets"] >= 4, res["buckets"]
    assert res["indexed_groups"] == 0, res["indexed_groups"]
    assert res["piece_groups"] > 0, res["piece_groups"]
    assert res["compiled_cut_groups"] == res["cut_groups"] > 0, res["cut_groups"]
    assert res["collectives_per_step"] == 1.0
    assert res["payload"] == res["expected_payload"]


@pytest.mark.parametrize("experts", [0, 4])
def test_adam_md_zero1_stacked_kernels(experts):
    """AdamMD's compiled kernels at a GPU's call pattern (``--stack``: whole stacks) inside
    ZeRO-1, bf16 params: phase 1 of a step's groups one call (``phase1_many``) and their fuse
    one call writing the bf16 weights into megatron's param buffer passed whole
    (``fuse_many``): the reference to one bf16 rounding, the buffer's other weights as
    megatron's step left them (the check compares every weight). With experts (expert-parallel
    size 1) groups whose members are no one strided view of megatron's buffers, read and
    written by regular pieces (``geometry.regular_pieces``)."""
    res = md_check(2, *FUSED_STACKED, "--experts", str(experts))
    check(res, 2, "bf16")
    assert res["compiled_groups"] > 0
    assert {"phase1_many", "fuse_many"} <= set(res["kernels"])  # (this job's alone)
    assert (res["piece_groups"] > 0) == bool(experts), res["piece_groups"]
    # (the dense job's two shards meet between matrices; the MoE job's inside one)
    assert res["compiled_cut_groups"] == res["cut_groups"] == (2 if experts else 0)


def test_muon_md_layerwise_fused_kernels():
    """MuonMD's compiled phases (engine/compiled.py: the gains' partials with G_Ŵ, rescale +
    fuse; Newton–Schulz the base's batched call) layer-wise against the reference: the eager
    path's tolerances, the Q/K/V split included."""
    res = md_check(2, *MUON_LW, "--fused-step")
    check(res, 2)
    assert res["compiled_groups"] > 0 and res["split_qkv_matrices"] == 2


@pytest.mark.parametrize("job", INSTANCES)
def test_adam_md_zero1_in_distributed_optimizer_instances(job):
    """--num-distributed-optimizer-instances 2: megatron all-reduces the gradients between the
    instances and shards the optimizer within each, so MD sums its partials over the 2 ranks of
    its instance (a sum over all 4 counts every matrix twice)."""
    res = md_check(4, *INSTANCES[job])
    check(res, 4, job.split("-")[0])
    assert res["md_group_sizes"] == [2]
    assert res["collectives_per_step"] == 1.0
    assert res["payload"] == res["expected_payload"]
    assert res["extra_collectives"] == md_collectives(res, 4)


@pytest.mark.parametrize("job", DEVICE)
def test_md_step_with_its_numbers_on_the_device(job):
    """What a CUDA graph replays (engine/graph.py), on CPU: the step count and every LR read
    from the device, the LR decaying step by step, inside megatron's ZeRO-1 and layer-wise
    optimizers (bf16: the fused weights written in the step, megatron's main->model copy then
    skips them) against the reference with the same LRs: the tolerances of the eager step."""
    res = md_check(2, *DEVICE[job], "--device-scalars", "--lr-decay")
    check(res, 2, "bf16")
    assert res["device_steps"] >= 5  # (layer-wise: the Muon and the Adam instance, 5 each)
    assert res["payload"] == res["expected_payload"]
    assert res["extra_collectives"] == md_collectives(res, 2)


@pytest.mark.parametrize("job", CP)
def test_md_under_context_parallelism(job):
    """Context parallelism changes nothing in the MD step: each rank's gradient comes from its
    share of the sequence (megatron's get_batch_on_this_cp_rank), megatron's DDP averages over
    DP × CP and its optimizer shards over that group, and MD's one all-reduce goes over the
    optimizer's group, so the result is the reference's fed the DP × CP mean gradient, with the
    DP tolerances. megatron-core runs CP attention only with Transformer Engine
    (core/transformer/dot_product_attention.py, DotProductAttention), so the model here is built
    with CP 1 and run with megatron's CP groups (md_check.py says how). Seen: ≤ 1.0e-7 relative."""
    nproc, *args = CP[job]
    res = md_check(nproc, "--cp", "2", *args)
    assert res["cp"] == 2 and res["grads_differ"] > 1e-2  # the ranks' gradients do differ
    check(res, nproc)
    assert res["md_group_sizes"] == [nproc] and res["md_group_is_dp_cp"]
    assert all(res["md_group_is_dp_cp"])  # megatron's DP × CP group, every ZeRO-1 instance
    assert res["collectives_per_step"] == 1.0 and res["payload"] == res["expected_payload"]
    assert res["extra_collectives"] == md_collectives(res, nproc)
    if job == "dp2xcp2-zero1":
        assert res["cut_inside_row"]  # partials of cut rows must meet over all 4 ranks


# Tensor parallelism (megatron/md/tensor_parallel.py): AdamMD on TP2, TP2 × DP2 and TP4 against
# the reference on the full matrices (tests/distributed/md_tp_check.py). Not on CPU: sequence
# parallelism (core/transformer/torch_norm.py, WrappedTorchNorm.__new__ refuses it with torch
# norms) and so MoE under TP; the arithmetic of SwiGLU's strided fc1 and of the TP-replicated
# router is also tests/test_tensor_parallel.py's.
TP_JOBS = {  # AdamMD's default Q/K/V split under ZeRO-1 (whole query groups per TP rank)
    "zero1": ("--dist", "zero1", "--split-qkv"),
    "zero1-bf16": ("--dist", "zero1", "--dtype", "bf16", "--split-qkv"),
    "layerwise": ("--dist", "layerwise"),
    "replicated": ("--dist", "replicated"),
}
TP_SPHERES = [(2, "--dist", "zero1", "--sphere", s) for s in ("row", "col")]
# MuonMD (layer-wise) at TP2 and TP2×DP2: Q/K/V split as upstream, fp32 and bf16
TP_MUON = {
    "split": (*MUON_LW, "--split-qkv"),
    "split-bf16": (*MUON_LW, "--split-qkv", "--dtype", "bf16"),
    "whole-qkv": MUON_LW,
}
# TP4 (4 ranks): AdamMD ZeRO-1 fp32 and bf16, MuonMD with Q, K and V whole (the test model's 2
# query groups do not split over 4 ranks)
TP4 = {
    "zero1": ("--dist", "zero1"),
    "muon-whole-qkv": MUON_LW,
}
# expert tensor parallelism: routed experts split over megatron's expert-TP group, at TP 1
# (MoE under TP needs sequence parallelism, GPU only); 4 ranks: expert DP 2, or EP 2
ETP_MOE = ("--tp", "1", "--etp", "2", "--experts", "4")
ETP = {
    "etp2-zero1": (2, "--dist", "zero1"),
    "etp2-zero1-bf16": (2, "--dist", "zero1", "--dtype", "bf16"),
    "etp2-layerwise-muon": (2, *MUON_LW),
    "etp2-layerwise-adam": (2, "--dist", "layerwise"),
    "etp2-replicated-muon": (2, "--optimizer", "muon", "--dist", "replicated"),
    "etp2xedp2-zero1": (4, "--dist", "zero1"),
    "ep2xetp2-layerwise-muon": (4, "--ep", "2", *MUON_LW),
}
# MoE under TP 2 (experts whole, or spread over EP 2 at 4 ranks). megatron refuses MoE under TP
# in training without sequence parallelism (core/transformer/moe/moe_layer.py, MoELayer.forward),
# which needs TE's norms, so md_tp_check runs these forwards in eval mode (no router auxiliary
# loss). Layer-wise at EP 1 without clipping: megatron's layer-wise optimizer takes another gradient
# norm than the whole model's in this layout (seen: 9e-5 relative after 5 clipped steps; the
# ZeRO-1 and replicated ones and EP 2 clip as the reference does)
# TP 2 × CP 2 (4 ranks): MD's one all-reduce over megatron's TP × DP × CP group
TP_CP = {"zero1": ("--dist", "zero1"), "muon-split": (*MUON_LW, "--split-qkv")}
TP_MOE_ARGS = ("--tp", "2", "--experts", "4")
TP_MOE = {
    "tp2-zero1": (2, "--dist", "zero1"),
    "tp2-replicated": (2, "--dist", "replicated"),
    "tp2-layerwise-muon": (2, *MUON_LW, "--no-clip"),
    "tp2xep2-zero1": (4, "--ep", "2", "--dist", "zero1"),
}
# The 4-rank jobs run 4 processes on CI's 2 cores, the suite's slowest launch: at TP2 × DP2 the
# layouts that add a data-parallel dimension (ZeRO-1 AdamMD fp32, MuonMD with the split); the
# bf16, replicated and whole-QKV variants run at 2 ranks, and TP 4's arithmetic is also
# tests/test_tensor_parallel.py's (in one process)
TP_AT_4 = {"zero1", "split"}
md_tp_check = Batches(
    "md_tp_check.py",
    [(2, "--tp", "2", *a) for a in TP_JOBS.values()]
    + [(4, "--tp", "2", *a) for k, a in TP_JOBS.items() if k in TP_AT_4]
    + [(n, "--tp", "2", *a) for n, *a in TP_SPHERES]
    + [(2, "--tp", "2", *a) for a in TP_MUON.values()]
    + [(4, "--tp", "2", *a) for k, a in TP_MUON.items() if k in TP_AT_4]
    + [(4, "--tp", "4", *a) for a in TP4.values()]
    + [(n, *ETP_MOE, *a) for n, *a in ETP.values()]
    + [(n, *TP_MOE_ARGS, *a) for n, *a in TP_MOE.values()]
    + [(4, "--tp", "2", "--cp", "2", *a) for a in TP_CP.values()],
)
TP_CASES = [(2, j) for j in TP_JOBS] + [(4, j) for j in TP_JOBS if j in TP_AT_4]


@pytest.mark.parametrize("nproc,job", TP_CASES)
def test_adam_md_tensor_parallel(nproc, job):
    res = md_tp_check(nproc, "--tp", "2", *TP_JOBS[job])
    assert (res["tp"], res["dp"]) == (2, nproc // 2)
    check(res, nproc, "bf16" if "bf16" in job else "fp32")
    if "bf16" in job:
        assert res["worst_rel"] < 1e-2  # bf16 weights against the fp32 reference
    assert res["dp_replicas_differ_by"] == 0.0 and res["dp_grads_differ_by"] == 0.0
    # megatron splits every hidden matrix here: SwiGLU fc1 (stride 2), row-parallel proj/fc2
    assert res["tp_split_matrices"] >= 5 and res["stride2_matrices"] >= 1
    assert res["row_parallel_matrices"] >= 2 and res["replicas_dropped"] == 0
    # the TP reduction folded into MD's one all-reduce (TP × DP for ZeRO-1, TP otherwise);
    # layer-wise: one per leaf optimizer (its own matrices; the embedding/head, ZeRO-1 sharded)
    assert res["missing_collectives"] == []
    n = 2 if job == "layerwise" else 1
    assert res["collectives_per_step"] == n and len(res["extra_collectives"]) == n
    assert res["payload"] == res["expected_payload"]
    assert sum(k[1] for k in res["extra_collectives"]) == res["payload"]
    if nproc == 2:  # against megatron's own TP traffic in one step (seen 20,705 elements: 11.9×)
        assert res["megatron_step_elements"] > 10 * res["payload"]


@pytest.mark.parametrize(
    "nproc,job", [(2, j) for j in TP_MUON] + [(4, j) for j in TP_MUON if j in TP_AT_4]
)
def test_muon_md_tensor_parallel(nproc, job):
    """MuonMD on TP pieces equals the reference on the full matrices: each matrix's Newton–Schulz
    runs on the full matrix gathered over TP (megatron's --muon-tp-mode duplicated; SwiGLU's
    stride-2 fc1 gathered as a row permutation, which orthogonalization commutes with), Q, K
    and V each on its own sphere. Seen at TP2: fp32 1.2e-7 relative, bf16 one rounding."""
    res = md_tp_check(nproc, "--tp", "2", *TP_MUON[job])
    assert (res["tp"], res["dp"]) == (2, nproc // 2)
    check(res, nproc, "bf16" if "bf16" in job else "fp32")
    assert res["dp_replicas_differ_by"] == 0.0 and res["dp_grads_differ_by"] == 0.0
    assert res["tp_split_matrices"] >= 5 and res["stride2_matrices"] >= 1
    assert res["payload"] == res["expected_payload"]  # QKV split: a norm per block
    # MD's one all-reduce per leaf optimizer; its all-gathers move what megatron's duplicated
    # Muon gathers, in one collective per group of same-placed pieces where megatron makes one
    # per matrix (and per Q, K and V)
    extra, missing = res["extra_collectives"], res["missing_collectives"]
    assert res["collectives_per_step"] == 2
    reduces = [k[1] for k in extra if k[0] == "all_reduce"]
    assert len(reduces) == 2 and sum(reduces) == res["payload"]
    gathered = lambda ks: sum(k[1] for k in ks if k[0] == "all_gather")
    gathers = lambda ks: sum(k[0] == "all_gather" for k in ks)
    assert gathered(extra) == gathered(missing) and gathers(extra) < gathers(missing)
    assert all(k[0] == "all_gather" for k in missing)


@pytest.mark.parametrize("sphere", ["row", "col"])
def test_adam_md_tensor_parallel_row_col_spheres(sphere):
    res = md_tp_check(2, "--tp", "2", "--dist", "zero1", "--sphere", sphere)
    check(res, 2)


@pytest.mark.parametrize("job", TP4)
def test_md_tensor_parallel_4(job):
    """TP 4 with megatron's GPT (runnable on CPU since the CPU mode redirects inside the backward
    pass, where megatron's all-gathers allocate on the CUDA device index). Seen: fp32 ≤ 1.9e-7
    relative, bf16 every weight one rounding of the reference's."""
    res = md_tp_check(4, "--tp", "4", *TP4[job])
    assert (res["tp"], res["dp"]) == (4, 1)
    check(res, 4, "bf16" if "bf16" in job else "fp32")
    assert res["tp_split_matrices"] >= 5 and res["stride2_matrices"] >= 1
    assert res["row_parallel_matrices"] >= 2 and res["replicas_dropped"] == 0
    assert res["payload"] == res["expected_payload"]
    extra, missing = res["extra_collectives"], res["missing_collectives"]
    reduces = [k[1] for k in extra if k[0] == "all_reduce"]
    assert sum(reduces) == res["payload"] and res["collectives_per_step"] == (
        2 if "muon" in job else 1
    )
    # MuonMD's gathers: what megatron's duplicated mode gathers, batched per group
    gathered = lambda ks: sum(k[1] for k in ks if k[0] == "all_gather")
    assert gathered(extra) == gathered(missing) and all(k[0] == "all_gather" for k in missing)


def moe_collectives(res: dict, n_reduces: int) -> None:
    """Replicas and gradients agree over (expert-)DP; MD adds ``n_reduces`` all-reduces of the
    formula's payload; its Muon gathers (batched per group of same-placed pieces) move no more
    than megatron's own Muon, which gathers every matrix apart (dense ones over a one-rank
    TP group too), and megatron's are all that is left out."""
    assert res["dp_replicas_differ_by"] == 0.0 and res["dp_grads_differ_by"] == 0.0
    assert res["payload"] == res["expected_payload"]
    extra, missing = res["extra_collectives"], res["missing_collectives"]
    reduces = [k[1] for k in extra if k[0] == "all_reduce"]
    assert len(reduces) == n_reduces and sum(reduces) == res["payload"]
    assert all(k[0] in ("all_reduce", "all_gather") for k in extra)
    gathered = lambda ks: sum(k[1] for k in ks if k[0] == "all_gather")
    assert gathered(extra) <= gathered(missing) and all(k[0] == "all_gather" for k in missing)


@pytest.mark.parametrize("job", ETP)
def test_md_expert_tensor_parallel(job):
    """Routed experts split over megatron's expert-TP group (--expert-tensor-parallel-size 2):
    each expert is one MD matrix (radius, norms, gains of the full expert), its pieces'
    partials summed over expert-TP × expert-DP in one all-reduce (a group MD makes: megatron
    has none), MuonMD orthogonalizing the full expert. Against the reference on the gathered
    full matrices, fed megatron's reduced gradients. Whole-matrix optimizers holding dense
    matrices and expert pieces in one leaf sum each over its own group. Seen: fp32 ≤ 2.2e-7,
    bf16 every weight one rounding of the reference's."""
    nproc, *args = ETP[job]
    res = md_tp_check(nproc, *ETP_MOE, *args)
    assert (res["tp"], res["etp"]) == (1, 2) and res["ep"] == (2 if "ep2" in job else 1)
    check(res, nproc, "bf16" if "bf16" in job else "fp32")
    assert res["expert_split_matrices"] >= 4  # 8 local expert pieces, 4 under EP 2
    # ZeRO-1: the dense and the expert instance; layer-wise: the embedding/head instance and
    # the expert pieces; replicated: the expert pieces only. megatron's duplicated-mode Muon
    # all-gathers every dense matrix over its one-rank TP group, which MD does not
    moe_collectives(res, 1 if "replicated" in job else 2)


@pytest.mark.parametrize("job", TP_MOE)
def test_md_moe_under_tensor_parallelism(job):
    """The MoE under TP 2: dense matrices TP-split (the router TP-replicated, added once),
    experts whole on each rank (expert-DP over the TP ranks, or EP 2 at 4 ranks), ZeRO-1 AdamMD,
    replicated AdamMD and layer-wise MuonMD against the reference on the gathered full matrices
    fed megatron's reduced gradients. Seen: ≤ 2.6e-7 relative."""
    nproc, *args = TP_MOE[job]
    res = md_tp_check(nproc, *TP_MOE_ARGS, *args)
    assert (res["tp"], res["etp"]) == (2, 1) and res["ep"] == (2 if "ep2" in job else 1)
    check(res, nproc)
    # rank 0's TP-split matrices (layer-wise: those it owns)
    assert res["tp_split_matrices"] >= (1 if "layerwise" in job else 5)
    assert res["expert_split_matrices"] == 0
    # megatron's duplicated-mode Muon gathers whole experts too; MD orthogonalizes them as held
    moe_collectives(res, 1 if "replicated" in job else 2)


@pytest.mark.parametrize("job", TP_CP)
def test_md_tensor_and_context_parallel(job):
    """TP 2 × CP 2: each rank its share of the sequence (md_check.cp_share), the reference fed
    the DP × CP mean of the gathered gradients; ZeRO-1 AdamMD sums over megatron's TP × DP × CP
    group, MuonMD (Q/K/V split) gathers over TP. Seen: 2.0e-7 relative."""
    res = md_tp_check(4, "--tp", "2", "--cp", "2", *TP_CP[job])
    assert (res["tp"], res["cp"], res["dp"]) == (2, 2, 1)
    check(res, 4)
    assert res["payload"] == res["expected_payload"]
    extra, missing = res["extra_collectives"], res["missing_collectives"]
    reduces = [k[1] for k in extra if k[0] == "all_reduce"]
    assert sum(reduces) == res["payload"] and len(reduces) == (1 if job == "zero1" else 2)
    gathered = lambda ks: sum(k[1] for k in ks if k[0] == "all_gather")
    assert gathered(extra) == gathered(missing)  # MuonMD's gathers: megatron's duplicated mode's
    assert all(k[0] == "all_gather" for k in missing)
