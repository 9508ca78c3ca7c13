"""The MD step's launch-bound cost, measured where any machine can: dispatched operations.

On a GPU a small optimizer step is host-bound: its cost is the number of kernels Python
issues, not their work. This counts every aten operation dispatched (a ``TorchDispatchMode``)
during one ``optimizer.step()`` of megatron-core's own optimizers on the paper's 12-layer
layout at a tiny width (compute negligible, so only the operation stream costs), for the base
optimizer and with MD, at 12 and 24 layers:

- operations per step, base and MD; MD's extra operations per added matrix (12 → 24 layers:
  48 more matrices);
- kernel launches per step, base and MD: the operations a GPU runs as kernels — not views,
  allocations, host reads, Python numbers made tensors, nor the host-side step counters (torch's
  Adam's ``state["step"]`` and MD's, CPU tensors on a GPU too); a multi-tensor (``_foreach``)
  operation and a compiled MD call count as one, or with ``--gpu-launches`` as a GPU launches
  them: a multi-tensor operation once per ``multi_tensor_apply`` launch (``foreach_launches``),
  a compiled call once per Triton kernel inductor makes of it (``triton_kernels.py``: a merged
  call of several groups is tens). The host cost a launch-bound GPU step pays, which the
  operation count blurs (base Adam's 150 reads of its CPU step counts are operations, not
  launches);
- host synchronizations (``.item()``, ``int(tensor)``, ``.tolist()``: aten's
  ``_local_scalar_dense``) in the step, base and MD, and of MD's those its own code issues
  (the rest are megatron's: its gradient norm reads two);
- bytes read and written by the step's operations, base and MD (views and allocations move
  nothing; a ``new_ones``/``zeros_like`` writes its result, reads no argument): the memory
  traffic if nothing were fused or cached, the proxy of a bandwidth-bound step (a large
  model's on a GPU), as operations are of a launch-bound one;
- matrix-product FLOPs (``mm``, ``bmm``, ``addmm``, ``baddbmm``, ``mv``, ...), by the factors'
  dtype: the work of a compute-bound step (Muon's Newton–Schulz at scale), and whether MD
  multiplies in the precision the base does (a compiled call's products, if any, are unseen);
- the MD / base step time, measured side by side (A, B, A, B, … rounds; median of the
  per-round ratios), one process.

Base Adam as megatron runs it on a GPU without TE/apex: torch's multi-tensor Adam (``foreach``);
AdamMD/Adam under ZeRO-1, MuonMD/Muon layer-wise (megatron's Muon: per matrix). The default MD
path (``--md-fused-step auto``: eager at this size), or with ``--fused-step on`` the compiled
step as a GPU runs it at scale (its default there), each kernel call one operation. Targets
(docs/benchmarks.md): AdamMD/Adam ≤ 1.15, MuonMD/Muon ≤ 1.00, ≤ 4 extra operations per added
matrix.

With ``--experts E`` the model is the MoE ladder's layout (``moe_model``: a dense first
layer, then layers of E experts, a shared expert and a router; expert-parallel size 1, where
megatron lays the experts out among the attention's weights) at ``--num-layers``: its
same-shape matrices are no one strided view of megatron's buffers, but a few regular pieces.

With ``--nproc N`` the optimizers are ZeRO-1 over N data-parallel ranks (gloo on a CPU; the
table is rank 0's, a line more gives every rank's launches: the slowest sets the pace), and
with ``--bucket-size`` megatron's gradient buckets are about that many elements, with
``--overlap-grad-reduce``, as on a cluster: ZeRO-1 shards each bucket, so a rank holds the
matrices its shard cuts, up to two a bucket (a line gives each rank's slices cut inside
matrices and the groups they make: ``cut_groups``).

    python tools/bench_dispatch.py [--hidden-size 128] [--num-layers 12 24] [--rounds 30]
        [--fused-step on [--gpu-launches]] [--model 181M --vocab-size 131072]
        [--experts 64 --num-layers 4 8]
        [--nproc 2 --bucket-size 200000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_md_step as bench  # noqa: E402

from megatron.md import cpu_mode  # noqa: E402  (bench_md_step's path: this checkout's)

cpu_mode.maybe_activate()  # CPU mode when there is no GPU, before megatron is imported

PAIRS = {"adam_md/adam": ("adam", "adam_md"), "muon_md/muon": ("muon", "muon_md")}
_aten = torch.ops.aten
#: operations that move no data: allocations, and a view aten does not mark as one (what a
#: reshape returns after a batched matmul or a copy)
NO_TRAFFIC = {_aten.empty_like.default, _aten.new_empty.default, _aten.empty.memory_format,
              _aten.new_empty_strided.default, _aten._unsafe_view.default}  # fmt: skip
#: operations that write their result and read none of their arguments' elements
WRITE_ONLY = {
    _aten.new_ones.default, _aten.new_zeros.default, _aten.new_full.default,
    _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default,
}  # fmt: skip


def _bytes(tree) -> int:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


#: matrix products: aten operation -> the (batched) factors' argument positions
MATMULS = {_aten.mm.default: (0, 1), _aten.bmm.default: (0, 1), _aten.addmm.default: (1, 2),
           _aten.baddbmm.default: (1, 2), _aten.addbmm.default: (1, 2),
           _aten.mv.default: (0, 1), _aten.dot.default: (0, 1)}  # fmt: skip


def _matmul_flops(func, args) -> tuple[int, str] | None:
    """2·(batch)·m·n·k of a matrix product, and its factors' dtype; None for another op."""
    if func not in MATMULS:
        return None
    a, b = (args[i] for i in MATMULS[func])
    n = b.shape[-1] if b.dim() > 1 else 1
    return 2 * a.numel() * n, str(a.dtype).removeprefix("torch.")


#: operations that run on the host on a GPU too: reads of a tensor, Python numbers made tensors
#: (the profiler's markers, its own namespace, launch nothing either)
HOST_OPS = {_aten._local_scalar_dense.default, _aten.lift_fresh.default,
            _aten.scalar_tensor.default}  # fmt: skip


#: torch's ``multi_tensor_apply`` (ATen/native/cuda/MultiTensorApply.cuh): a launch takes up to
#: this many tensors (by depth: the tensor lists it reads and writes; with a list of scalars
#: the second row) and 320 chunks of 65536 elements
MTA_TENSORS = ((110, 64, 48, 36, 30), (96, 64, 48, 36, 30))
MTA_BLOCKS, MTA_CHUNK = 320, 65536


def mta_launches(numels: list[int], depth: int, scalar_list: bool = False) -> int:
    """The kernels one multi-tensor operation launches on a GPU: ``multi_tensor_apply``'s loop,
    a launch whenever its tensors or chunks are full, and after the last chunk (at 181M the
    H200's profile showed 10 for megatron's Adam's two ``_foreach_addcdiv_``: this gives 9 + 1)."""
    cap = MTA_TENSORS[scalar_list][min(depth, 5) - 1]
    live = [n for n in numels if n]
    launches = tensors = blocks = 0
    for t, n in enumerate(live):
        tensors += 1
        chunks = -(-n // MTA_CHUNK)
        for c in range(chunks):
            blocks += 1
            last = c == chunks - 1
            if (tensors == cap and last) or blocks == MTA_BLOCKS or (last and t == len(live) - 1):
                launches += 1
                blocks = 0
                tensors = 0 if last else 1  # a tensor cut between launches starts the next
    return launches


def foreach_launches(func, args, kwargs) -> int | None:
    """A ``_foreach_*`` operation's kernel launches on a GPU (None for another operation):
    ``mta_launches`` on its fast path (every list's tensors dense, of one dtype and device, the
    lists' strides alike), one a tensor off it (torch's per-tensor loop); ``_foreach_norm``
    one more (its cleanup kernel)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    name = func.name().split("::")[-1].split(".")[0]
    if not name.startswith("_foreach_"):
        return None
    leaves = list(args) + list((kwargs or {}).values())
    lists = [a for a in leaves if isinstance(a, (list, tuple)) and a
             and all(isinstance(t, torch.Tensor) for t in a)]  # fmt: skip
    if not lists:
        return None
    scalar_list = any(isinstance(a, (list, tuple)) and a and not isinstance(a[0], torch.Tensor)
                      for a in leaves)  # fmt: skip
    first = lists[0]
    fast = all(
        dense(t) and t.dtype == lst[0].dtype and t.device == lst[0].device
        and t.stride() == first[i].stride() for lst in lists for i, t in enumerate(lst)
    )  # fmt: skip
    if not fast:
        return sum(1 for t in first if t.numel())
    depth = len(lists) + (not name.endswith("_") and name != "_foreach_norm")
    return mta_launches([t.numel() for t in first], depth, scalar_list) + (name == "_foreach_norm")


def host_counters(opt) -> set[int]:
    """ids of the step counters a GPU keeps on the host: torch's Adam's ``state["step"]`` of
    every leaf, MD's engine's (shared into those states)."""
    from megatron.md.leaves import leaf_optimizers

    out = set()
    for leaf in leaf_optimizers(opt):
        inner = leaf.optimizer
        for st in inner.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                out.add(id(st["step"]))
        engine = getattr(inner, "engine", None)
        if engine is not None:
            out.add(id(engine.step_tensor))
    return out


def count(step, host: set[int] = frozenset(), gpu: bool = False) -> tuple:
    """(aten operations dispatched by ``step()``, of which host reads of a tensor, of which
    issued by MD's own code: a frame of megatron/md/ other than the CPU mode's redirection;
    bytes the operations read and write: every tensor argument and result of an operation that
    moves data (``NO_TRAFFIC``, views: none; ``WRITE_ONLY``: the result), the memory traffic of
    the step if nothing were fused or cached — the proxy of a bandwidth-bound step, as
    operations are of a launch-bound one; matrix-product FLOPs by the factors' dtype — the
    compute of a compute-bound step, Muon's Newton–Schulz at scale; kernel launches, as the
    module says: ``host`` the ids of the host-side step counters; compiled MD calls). ``gpu``:
    the launches a GPU makes (``--gpu-launches``): a multi-tensor operation's
    ``foreach_launches``, a compiled call's Triton kernels (``triton_kernels.py``)."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    made = set(host)  # host tensors: the counters, and Python numbers made tensors here
    kept = []

    class Count(TorchDispatchMode):
        ops = syncs = md_syncs = moved = launches = 0
        flops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor)]  # fmt: skip
            on_host = tensors and all(id(t) in made for t in tensors)
            if (mm := _matmul_flops(func, args)) is not None:
                Count.flops[mm[1]] = Count.flops.get(mm[1], 0) + mm[0]
            if func is torch.ops.aten._local_scalar_dense.default:
                Count.syncs += 1
                Count.md_syncs += any(
                    "/megatron/md/" in f.filename and not f.filename.endswith("cpu_mode.py")
                    for f in traceback.extract_stack()
                )
            out = func(*args, **(kwargs or {}))
            if func in HOST_OPS and isinstance(out, torch.Tensor):
                made.add(id(out))
                kept.append(out)  # alive while counting: its id is not another tensor's
            launched = not (func.is_view or func in NO_TRAFFIC or func in HOST_OPS or on_host)
            if launched and func.namespace != "profiler":
                many = foreach_launches(func, args, kwargs) if gpu else None
                Count.launches += 1 if many is None else many
            if func.is_view or func in NO_TRAFFIC:
                pass
            elif func in WRITE_ONLY:  # the argument gives a shape, dtype and device
                Count.moved += _bytes(out)
            else:
                Count.moved += _bytes((args, kwargs)) + _bytes(out)
            return out

    with Count(), _kernels_as_one_op() as calls:
        step()
    kernels = calls[0]
    if gpu:  # after the step: inductor's code generation is not for the counter to see
        import triton_kernels

        kernels = sum(len(triton_kernels.kernels_of(fn, a)) for fn, a in calls[2])
    return (Count.ops + calls[0], Count.syncs, Count.md_syncs, Count.moved + calls[1],
            Count.flops, Count.launches + kernels, calls[0])  # fmt: skip


@contextlib.contextmanager
def _kernels_as_one_op():
    """Each compiled MD kernel call (any: ``--fused-step on``'s, or ``auto``'s at a width where
    it compiles) counted as one operation: dynamo cannot run under a ``TorchDispatchMode``, so
    while counting, a call runs its function eagerly with dispatch modes off (the same
    arithmetic, unseen by the counter). Its bytes are a fused kernel's traffic: each tensor
    argument read once, each result written once, and an argument it writes in place (its
    version counter moved) counted again, as an in-place aten operation's (so an output
    argument counts as read too)."""
    from torch.utils._mode_utils import no_dispatch

    from megatron.md.engine import compiled

    calls, real = [0, 0, []], compiled._get  # calls, bytes, (function, arguments) of each

    def stub(name, fn, fallback: bool = False):  # no check to fall back from
        def call(*args):
            calls[0] += 1
            calls[2].append((fn, args))
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            before = [t._version for t in tensors]
            with no_dispatch():
                out = fn(*args)
            written = [t for t, v in zip(tensors, before) if t._version != v]
            calls[1] += _bytes(args) + _bytes(out) + _bytes(written)
            return out

        return call

    compiled._get = stub
    try:
        yield calls
    finally:
        compiled._get = real


def build(width: int, layers: int, run: str, vocab: int, fused: str = "auto",
          model: str | None = None, experts: int = 0, bucket: int | None = None):  # fmt: skip
    """megatron's optimizer of the shape model (``bench_md_step.shape_model``): one head and
    query group of 128, an MLP of 4 ``width``, or ``model``'s shapes (a ``bench_md_step`` size)
    at ``layers``, or with ``experts`` an MoE model (``moe_model``); the base Adam
    multi-tensor, as on a GPU. Returns (the optimizer, the model's matrices)."""
    from megatron.md.leaves import leaf_optimizers

    if model is None:
        bench.SHAPES["dispatch"] = (width, layers, 1, 1, 4 * width)
    else:
        d, _, heads, kv, ff = bench.SHAPES[model]
        bench.SHAPES["dispatch"] = (d, layers, heads, kv, ff)
    opt_name, md_on = run.split("_md")[0], "_md" in run
    dtype = "bf16" if bench.DEV == "cuda" else "fp32"
    module = moe_model(width, layers, experts, vocab) if experts else None
    dmodel, opt = bench.build("dispatch", opt_name, md_on, dtype, vocab, fused=fused,
                              module=module, bucket=bucket)  # fmt: skip
    for o in leaf_optimizers(opt):
        for g in o.optimizer.param_groups:
            g["foreach"] = True
    for _ in range(2):  # state, and any first-step work, before anything is counted or timed
        opt.step()
    return opt, sum(p.dim() == 2 for p in dmodel.module.parameters())


def moe_model(width: int, layers: int, experts: int, vocab: int):
    """megatron-core's GPT with the MoE ladder's layout (``megatron/md/train/presets.py``: a
    dense first layer, then DeepSeekMoE layers of ``experts`` experts of 2/3 the width, top-2
    sigmoid router, one shared expert of half that; head dimension a quarter of the width,
    dense MLP 5/2 of it) at ``width`` (``testing.tiny_gpt``), expert-parallel size 1 (the
    sweep's default): the experts share megatron's buffers with the attention's weights, layer
    by layer. Returns (the model, its TransformerConfig)."""
    from megatron.md import testing

    model = testing.tiny_gpt(0, width, layers, 16, experts, ffn=5 * width // 2,
                             expert_ffn=2 * width // 3, vocab=vocab)  # fmt: skip
    return model.to(bench.DEV), model.config


def cut_groups(opt) -> tuple[int, int]:
    """(groups, matrices) of the MD matrices this rank holds as slices cut inside them (ZeRO-1's
    shards of megatron's buckets: ``Engine.cut_groups``); (0, 0) without MD."""
    from megatron.md.leaves import leaf_optimizers

    groups = [g for o in leaf_optimizers(opt) if getattr(o.optimizer, "engine", None) is not None
              for g in o.optimizer.engine.cut_groups()]  # fmt: skip
    return len(groups), sum(g.B for g in groups)


def timed(opt) -> float:
    bench.sync()
    t0 = time.perf_counter()
    opt.step()
    bench.sync()
    return time.perf_counter() - t0


def measure(args) -> dict:
    out = {}
    for key, (base, md) in PAIRS.items():
        got = {}
        matrices = {}
        for layers in args.num_layers:
            opts = {}
            for run in (base, md):
                opts[run], matrices[layers] = build(
                    args.hidden_size, layers, run, args.vocab_size, args.fused_step, args.model,
                    args.experts, args.bucket_size,
                )  # fmt: skip
            got[layers] = {run: count(o.step, host_counters(o), args.gpu_launches)
                           for run, o in opts.items()}  # fmt: skip
            got[layers]["cut"] = cut_groups(opts[md])
            if layers == args.num_layers[0]:
                ratios = []
                for _ in range(args.rounds):
                    t = {run: timed(o) for run, o in opts.items()}
                    ratios.append(t[md] / t[base])
                got["time_ratio"] = statistics.median(ratios)
            del opts
        lo, hi = args.num_layers[0], args.num_layers[-1]
        # the matrices the added layers hold (a dense layer's: QKV, proj, fc1, fc2)
        added = matrices[hi] - matrices[lo]
        extra = lambda n: got[n][md][0] - got[n][base][0]  # noqa: E731
        base_flops = sum(got[lo][base][4].values())
        out[key] = {
            "matrices": matrices,
            "ops": {n: {r: got[n][r][0] for r in (base, md)} for n in args.num_layers},
            "syncs": {n: {r: got[n][r][1] for r in (base, md)} for n in args.num_layers},
            "md_code_syncs": {n: got[n][md][2] for n in args.num_layers},
            "extra_ops_per_added_matrix": (extra(hi) - extra(lo)) / added if hi > lo else None,
            "op_ratio": got[lo][md][0] / got[lo][base][0],
            "launches": {n: {r: got[n][r][5] for r in (base, md)} for n in args.num_layers},
            "launch_ratio": got[lo][md][5] / got[lo][base][5],
            "compiled_calls": {n: got[n][md][6] for n in args.num_layers},
            # (groups, slices) of matrices cut inside them (``cut_groups``)
            "cut_groups": {n: got[n]["cut"] for n in args.num_layers},
            "bytes": {n: {r: got[n][r][3] for r in (base, md)} for n in args.num_layers},
            "byte_ratio": got[lo][md][3] / got[lo][base][3],
            "matmul_flops": {n: {r: got[n][r][4] for r in (base, md)} for n in args.num_layers},
            # None where the base multiplies no matrices (Adam)
            "flop_ratio": sum(got[lo][md][4].values()) / base_flops if base_flops else None,
            "time_ratio": got["time_ratio"],
        }
    return out


def _mflops(by_dtype: dict) -> str:
    """Matrix-product MFLOPs, by dtype where more than one ("10.1 bfloat16 + 2.2 float32")."""
    if len(by_dtype) <= 1:
        return f"{sum(by_dtype.values()) / 1e6:.1f}"
    return " + ".join(f"{v / 1e6:.1f} {k}" for k, v in sorted(by_dtype.items()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, nargs="+", default=[12, 24])
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds of each pair")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--fused-step", choices=("auto", "on"), default="auto",
                    help="on: the compiled MD step as a GPU runs it at scale (one call per "
                         "group), each kernel call counted as one operation")  # fmt: skip
    ap.add_argument("--model", choices=[k for k in bench.SHAPES if k[0].isdigit()],
                    help="a bench_md_step size's shapes (its width, heads, MLP) at --num-layers, "
                         "instead of --hidden-size's one-head layout")  # fmt: skip
    ap.add_argument("--experts", type=int, default=0,
                    help="an MoE model of this many experts (the MoE ladder's layout at "
                         "--hidden-size, expert-parallel size 1: moe_model) instead of a dense "
                         "one")  # fmt: skip
    ap.add_argument("--nproc", type=int, default=1,
                    help="data-parallel ranks (gloo on a CPU): ZeRO-1's shards, where a rank's "
                         "first and last matrices of a bucket are cut slices; the table is rank "
                         "0's, the launches line every rank's")  # fmt: skip
    ap.add_argument("--bucket-size", type=int,
                    help="megatron's gradient buckets of about this many elements, with "
                         "--overlap-grad-reduce (a cluster's run: ZeRO-1 shards each bucket, "
                         "up to two cut matrices a bucket a rank); default one bucket")  # fmt: skip
    ap.add_argument("--gpu-launches", action="store_true",
                    help="count launches as a GPU makes them: a multi-tensor op's "
                         "multi_tensor_apply launches (its chunking), a compiled call's Triton "
                         "kernels (inductor's code for an H100, generated here: "
                         "tools/triton_kernels.py); with --fused-step on")  # fmt: skip
    args = ap.parse_args(argv)
    if args.gpu_launches and args.fused_step != "on":
        ap.error("--gpu-launches counts the compiled calls' Triton kernels: add --fused-step on "
                 "(the step a GPU runs at scale)")  # fmt: skip
    if args.experts and args.model:
        ap.error("--experts builds the MoE ladder's layout at --hidden-size: leave out --model")
    if args.nproc < 1:
        ap.error(f"--nproc {args.nproc}: at least one rank")
    if args.bucket_size is not None and args.bucket_size < 1:
        ap.error(f"--bucket-size {args.bucket_size}: a bucket holds at least one element")
    if args.experts and min(args.num_layers) < 2:
        ap.error("--experts: at least 2 layers (a dense first layer, then MoE layers)")
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        from megatron.md.launch import local_ranks

        cmd = local_ranks(__file__, args.nproc, argv if argv is not None else sys.argv[1:])
        sys.exit(subprocess.run(cmd, env=bench.rank_env(args.nproc)).returncode)
    if args.fused_step == "on":
        from megatron.md.engine import compiled

        compiled.STACK_ON_CPU = True  # a GPU's calls: the whole stack, not a matrix a call
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    if "LOCAL_RANK" not in os.environ:  # one process: its own one-rank group
        from megatron.md.launch import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_PORT=str(free_port()))  # fmt: skip
    if bench.DEV == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("nccl" if bench.DEV == "cuda" else "gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    res = measure(args)
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, res)
    if torch.distributed.get_rank():
        torch.distributed.destroy_process_group()
        return
    where = torch.cuda.get_device_name() if bench.DEV == "cuda" else "CPU"
    lo = args.num_layers[0]
    shape = f"{args.model} shapes" if args.model else f"width {args.hidden_size}"
    if len(ranks) > 1:
        shape += f", rank 0 of {len(ranks)} data-parallel ranks"
    if args.experts:
        shape += f", MoE of {args.experts} experts (a dense first layer, expert-parallel size 1)"
    launches = ("launches as a GPU's (multi-tensor chunks, Triton kernels)" if args.gpu_launches
                else "launches: a multi-tensor op or compiled call one")  # fmt: skip
    print(f"\nDispatched operations per optimizer step, {where}, {shape}, "
          f"vocab {args.vocab_size}, MD step --md-fused-step {args.fused_step}"
          f"{' (a compiled call: one op)' if args.fused_step == 'on' else ''}; {launches}; time: "
          f"median of {args.rounds} paired rounds at {lo} layers")  # fmt: skip
    print(f"{'pair':<14} {'layers':>6} {'base ops':>9} {'MD ops':>8} {'syncs b/MD':>11} "
          f"{'MD code':>8} {'op ratio':>9} {'launches b/MD':>14} {'ratio':>6} "
          f"{'time ratio':>11} {'extra/matrix':>13} "
          f"{'MB moved b/MD':>15} {'byte ratio':>11} {'matmul MFLOP b/MD':>18} "
          f"{'flop ratio':>10}")  # fmt: skip
    for key, r in res.items():
        base, md = PAIRS[key]
        for n in args.num_layers:
            first = n == lo
            per, fl = r["extra_ops_per_added_matrix"], r["matmul_flops"]
            fr = "—" if r["flop_ratio"] is None else f"{r['flop_ratio']:.4}"
            print(f"{key:<14} {n:>6} {r['ops'][n][base]:>9} {r['ops'][n][md]:>8} "
                  f"{r['syncs'][n][base]:>5}/{r['syncs'][n][md]:<5} {r['md_code_syncs'][n]:>8} "
                  f"{r['op_ratio'] if first else '':>9.4} "
                  f"{r['launches'][n][base]:>6}/{r['launches'][n][md]:<7} "
                  f"{r['launch_ratio'] if first else '':>6.3} "
                  f"{r['time_ratio'] if first else '':>11.4} "
                  f"{per if first and per is not None else '':>13} "
                  f"{r['bytes'][n][base] / 1e6:>7.1f}/{r['bytes'][n][md] / 1e6:<7.1f} "
                  f"{r['byte_ratio'] if first else '':>11.4} "
                  f"{_mflops(fl[n][base]):>8}/{_mflops(fl[n][md]):<9} "
                  f"{fr if first else '':>10}")  # fmt: skip
    world = len(ranks)
    for key in res if world > 1 else ():  # the slowest rank sets the step's pace
        for n in args.num_layers:
            per = ", ".join(f"{r[key]['launches'][n][b]}/{r[key]['launches'][n][m]}"
                            for r in ranks for b, m in [PAIRS[key]])  # fmt: skip
            print(f"{key}: launches base/MD by rank at {n} layers: {per}")
            cuts = ", ".join("{1} in {0}".format(*r[key]["cut_groups"][n]) for r in ranks)
            print(f"{key}: slices cut inside matrices, in groups, by rank at {n} layers: {cuts}")
    for key, r in res.items():
        if args.fused_step == "on":
            print(
                f"{key}: compiled MD calls a step "
                f"{', '.join(f'{v} at {n} layers' for n, v in r['compiled_calls'].items())}"
            )
    summary = {"device": where, "torch": torch.__version__, "width": args.hidden_size,
               "model": args.model, "experts": args.experts, "vocab": args.vocab_size,
               "fused_step": args.fused_step,
               "gpu_launches": args.gpu_launches, "ranks": world, "results": res,
               "launches_by_rank": [{k: r[k]["launches"] for k in r} for r in ranks]}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
