"""Optimizer-step cost of MD, measured side by side in one run.

CPU: gloo, 2 ranks, fp32 params by default. GPU: NCCL, one rank per visible GPU, bf16 params
with fp32 main params (megatron's default ``muon_fp32_matmul_prec='medium'``).
On the real matrix shapes of the paper's dense models (``SHAPES``: d, 12 layers, vocab 131072),
with megatron-core's own optimizers and ``enable_md``:

- AdamMD / Adam under ZeRO-1 (``DistributedOptimizer``): AdamMD as a user gets it
  (``adam_md``: ``--md-fused-step auto``, the compiled kernels at these sizes), with the eager
  step (``adam_md_eager``) and with the compiled kernels
  (``adam_md_fused``); the first, untimed round compiles;
- MuonMD / Muon layer-wise (``LayerWiseDistributedOptimizer``, Adam for embeddings/LM head),
  likewise as a user gets it (``muon_md``: compiled on a GPU at these sizes, eager on a CPU),
  eager (``muon_md_eager``) and compiled (``muon_md_fused``);
- AdamMD with each step's phase 1 and fuse merged over more groups (``adam_md_merged``:
  ``compiled.MERGE_ELEMENTS`` 2^28, one call each at 181M where the default's 2^26 makes two;
  the merged calls exist where the kernels take whole stacks, a GPU) / Adam;
- AdamMD layer-wise (``--md-adam-layer-wise``) / AdamMD ZeRO-1: the two sharding strategies;
- optimizer-state bytes with MD / without, bf16 params (fp32 main params held by megatron).

The two optimizers of a ratio are built together and stepped in turn, ``--steps`` rounds; a
ratio is the median over rounds of (MD time / base time) in the same round, for the full
``optimizer.step()`` (clip, inner step, copy to the model, param all-gather), for the step less
the param all-gather ("compute": the same bytes on both sides, and gloo's all-gather is the
noisiest part on a CPU; subtracted is the all-gather of the rank that waited least there) and
for the inner torch step alone, each the slowest rank's, with megatron's phases timed too
(``PHASES``); random gradients are written into the grad buffers once (no forward/backward).
Also per step under ZeRO-1: the bytes of MD's one extra all-reduce against the bytes of
megatron's param all-gather (the whole param buffer). Prints a table and one JSON line per
world size; ``--world 1 2 4`` runs the ladder
(one local launch per size, megatron/md/localrun.py) and ``--json`` collects it.

    python tools/bench_md_step.py [--model 181M 457M] [--steps 3] [--nproc 2] [--dtype bf16]
    python tools/bench_md_step.py --model 181M 457M 827M 1.29B --world 1 2 4 --dtype fp32 bf16
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's megatron.md
from megatron.md import cpu_mode  # noqa: E402
from megatron.md.launch import local_ranks  # noqa: E402

SHAPES = {  # d, layers, heads, kv groups, d_ff (recipe §3); head dim 128
    "181M": (512, 12, 4, 2, 2048),
    "457M": (1024, 12, 8, 4, 4096),
    "827M": (1536, 12, 12, 6, 6144),
    "1.29B": (2048, 12, 16, 8, 8192),
    "smoke": (128, 2, 1, 1, 256),  # not the paper's: the test suite's quick check of this tool
    "smoke-tp": (128, 2, 2, 2, 256),  # the same under TP 2 (whole query groups per rank)
}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 131072
GBS_TOKENS = 128 * 4096  # the paper's global batch in tokens (128 sequences of 4096)


#: megatron's tensor-parallel split of each matrix: (axis, stride) by name (column-parallel
#: QKV/fc1/embedding/LM head split rows, fc1 as SwiGLU's two halves; row-parallel proj/fc2)
TP_SPLIT = {"linear_qkv": (0, 1), "linear_fc1": (0, 2), "linear_proj": (1, 1),
            "linear_fc2": (1, 1), "word_embeddings": (0, 1), "output_layer": (0, 1)}  # fmt: skip


def shape_model(name: str, vocab: int, tp: int = 1) -> torch.nn.Module:
    """Parameters with megatron-core GPT names and the paper's shapes (no forward); under
    tensor parallelism (``tp`` > 1, megatron's model parallelism initialized) this rank's
    piece of each split matrix, with megatron's TP attributes."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    d, layers, heads, kv, ff = SHAPES[name]
    shapes = {"embedding.word_embeddings.weight": (vocab, d)}
    for i in range(layers):
        pre = f"decoder.layers.{i}."
        shapes[pre + "self_attention.linear_qkv.weight"] = ((heads + 2 * kv) * 128, d)
        shapes[pre + "self_attention.linear_proj.weight"] = (d, heads * 128)
        shapes[pre + "mlp.linear_fc1.weight"] = (2 * ff, d)
        shapes[pre + "mlp.linear_fc2.weight"] = (d, ff)
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            shapes[pre + norm + ".weight"] = (d,)
    shapes["decoder.final_layernorm.weight"] = (d,)
    shapes["output_layer.weight"] = (vocab, d)
    root = torch.nn.Module()
    gen = torch.Generator(DEV).manual_seed(0)
    for full, shape in shapes.items():
        split = next((v for k, v in TP_SPLIT.items() if k in full), None) if tp > 1 else None
        if split is not None:
            shape = tuple(n // tp if i == split[0] else n for i, n in enumerate(shape))
        mod = root
        *path, leaf = full.split(".")
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=DEV) * d**-0.5)
        if split is not None:
            set_tensor_model_parallel_attributes(p, True, split[0], split[1])
        if "embedding" in full or "output_layer" in full:
            p.is_embedding_or_output_parameter = True
        mod.register_parameter(leaf, p)
    return root


def build(
    name: str,
    optimizer: str,
    md_on: bool,
    dtype: str,
    vocab: int,
    fused: str = "auto",
    tp: int = 1,
    graph: bool = False,
    module=None,
    bucket: int | None = None,
):
    """megatron's DDP model and optimizer of ``name``'s shape model (``shape_model``), or of
    ``module`` (a (model, TransformerConfig) pair: ``bench_dispatch.py --experts``' MoE
    model), with MD enabled where ``md_on``; ``bucket``: megatron's gradient buckets of about
    that many elements (``testing.megatron_optimizer``' ``bucket_size``); random gradients in
    its buffers."""
    from megatron.core.transformer import TransformerConfig

    from megatron.md.config import MDConfig
    from megatron.md.enable import enable_md
    from megatron.md.leaves import leaf_optimizers
    from megatron.md.testing import megatron_optimizer

    if module is None:
        d, layers, heads, kv, _ = SHAPES[name]
        # the attention layout of shape_model's QKV (megatron tags it for Muon's Q/K/V split)
        cfg = TransformerConfig(
            num_layers=layers, hidden_size=d, num_attention_heads=heads, num_query_groups=kv,
            kv_channels=128, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        )  # fmt: skip
        module = shape_model(name, vocab, tp)
    else:
        module, cfg = module
    if dtype == "bf16":
        module = module.to(torch.bfloat16)
    layer_wise = optimizer in ("muon", "adam_lw")  # adam_lw: --md-adam-layer-wise
    dmodel, opt = megatron_optimizer(
        module, cfg, "layerwise" if layer_wise else "zero1",
        torch.distributed.get_world_size() // tp, optimizer, bucket_size=bucket,
        lr=1e-3, weight_decay=0.0, clip_grad=1.0,
        # under TP, Muon and MuonMD orthogonalize full matrices (MD's recipe; tensor_parallel.py)
        muon_tp_mode="duplicated" if tp > 1 else "blockwise",
        bf16=dtype == "bf16" or layer_wise,  # LayerWise needs bf16=True
        muon_split_qkv=True,  # megatron's default, and MuonMD's (MDConfig.split_qkv)
        muon_nesterov=True, muon_scale_mode="unit_rms_norm",
        # 'medium' (megatron's default) runs bf16 matmuls: fast on GPU, very slow on CPU
        muon_fp32_matmul_prec="medium" if DEV == "cuda" else "highest",
    )  # fmt: skip
    if md_on:
        ocfg = leaf_optimizers(opt)[0].config
        md = MDConfig(adam_layer_wise=optimizer == "adam_lw", fused_step=fused, cuda_graph=graph,
                      # the gains' betas are megatron's --adam-beta1/2 in pretrain_gpt.py
                      gain_betas=(ocfg.adam_beta1, ocfg.adam_beta2))  # fmt: skip
        enable_md(opt, [dmodel], md)
    gen = torch.Generator(DEV).manual_seed(1)
    for p in dmodel.module.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=gen, device=DEV) * 1e-3)
    if graph:  # the eager warm-up steps and the capture, before any is timed
        from megatron.md.engine.graph import WARMUP

        for _ in range(WARMUP + 1):
            opt.step()
    return dmodel, opt


def state_bytes(opt) -> int:
    """Bytes the optimizer holds: fp32 main shards of bf16 params, moments, MD extras."""
    from megatron.md.leaves import leaf_optimizers

    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for o in leaf_optimizers(opt):
        for group in getattr(o, "shard_fp32_from_float16_groups", None) or getattr(
            o, "fp32_from_float16_groups", []
        ):
            for t in group:
                add(t)
        for st in o.optimizer.state.values():
            for t in st.values():
                add(t)
        for st in getattr(o.optimizer, "md_state", {}).values():
            for t in st.values():
                add(t)
    return total


def collective_bytes(dmodel, opt) -> dict:
    """Per step: MD's extra all-reduce payload (all ZeRO-1 instances) vs the param all-gather
    (the full param buffers; each rank receives (world-1)/world of them)."""
    from megatron.md.leaves import leaf_optimizers

    md = sum(getattr(o.optimizer, "last_payload_bytes", 0) for o in leaf_optimizers(opt))
    gather = sum(
        b.param_data.numel() * b.param_data.element_size()
        for b in [*dmodel.buffers, *dmodel.expert_parallel_buffers]
        if b.param_data is not None
    )
    return {"md_allreduce": md, "param_allgather": gather, "ratio": md / gather}


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


#: megatron's DistributedOptimizer phases timed on their own (method -> name); the rest of
#: ``step()`` is the inner torch step and small bookkeeping
PHASES = {
    "prepare_grads": "grads",
    "get_grad_norm": "norm",
    "clip_grad_norm": "clip",
    "_copy_main_params_to_model_params": "copy",
    "start_param_sync_for_bucket_group_subset": "all_gather",
    "allgather_params": "all_gather",  # LayerWise without a param buffer
}
GATHERS = ("start_param_sync_for_bucket_group_subset", "allgather_params")


def _timed(fn, sink: list):
    def timed(*a, **k):
        sync()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        sync()
        sink.append(time.perf_counter() - t0)
        return out

    return timed


def timed_step(opt):
    """A function running one full ``opt.step()``; returns (full, inner, {phase: s}) seconds,
    each the slowest rank's."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from megatron.md.leaves import leaf_optimizers

    sinks = {name: [] for name in ("inner", *PHASES.values())}

    def wrap(o, methods):
        for method in methods:
            if hasattr(o, method):  # instance attributes: the class's stay untouched
                setattr(o, method, _timed(getattr(o, method), sinks[PHASES[method]]))

    def containers(o):  # LayerWiseDistributedOptimizer is a chain that all-gathers itself
        if isinstance(o, ChainedOptimizer):
            yield o
            for c in o.chained_optimizers:
                yield from containers(c)

    for o in containers(opt):
        wrap(o, GATHERS)  # only these: a chain's other phases call its children's
    for o in leaf_optimizers(opt):
        o.optimizer.step = _timed(o.optimizer.step, sinks["inner"])
        wrap(o, PHASES)

    def one() -> tuple[float, float, dict]:
        for sink in sinks.values():
            sink.clear()
        torch.distributed.barrier()
        sync()
        t0 = time.perf_counter()
        ok, _, _ = opt.step()
        sync()
        torch.distributed.barrier()  # the slowest rank's full step
        full = time.perf_counter() - t0
        assert ok
        # max over ranks, but the all-gather's min: a rank done early waits there for the others
        per = [sum(v) for v in sinks.values()]
        per = torch.tensor([*per, -sum(sinks["all_gather"])], dtype=torch.float64, device=DEV)
        torch.distributed.all_reduce(per, op=torch.distributed.ReduceOp.MAX)
        *vals, neg_gather = per.tolist()
        phases = dict(zip(sinks, vals)) | {"all_gather": -neg_gather}
        return full, phases.pop("inner"), phases

    return one


def time_interleaved(opts: dict, steps: int) -> dict:
    """Per optimizer: median (full, inner) step seconds and the per-round times, stepping
    them in turn (A, B, A, B, ...) so that a slow phase of a shared machine hits both alike; the
    first round allocates (and compiles) and is reported apart (``first_s``)."""
    steppers = {k: timed_step(o) for k, o in opts.items()}
    times, first = {k: [] for k in opts}, {}
    for i in range(steps + 1):
        for k, one in steppers.items():
            t = one()
            if i:
                times[k].append(t)
            else:  # allocation and, for the compiled MD step, compilation: the start-up cost
                first[k] = t[0]
    return {
        k: {
            "first_s": first[k],
            "step_s": statistics.median(t[0] for t in ts),
            "inner_s": statistics.median(t[1] for t in ts),
            "steps_s": [t[0] for t in ts],
            "inners_s": [t[1] for t in ts],
            "phases_s": {p: statistics.median(t[2][p] for t in ts) for p in ts[0][2]},
            # the step less megatron's param all-gather (same bytes for both; gloo's is noisy)
            "compute_s": statistics.median(t[0] - t[2]["all_gather"] for t in ts),
            "computes_s": [t[0] - t[2]["all_gather"] for t in ts],
        }
        for k, ts in times.items()
    }


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of (numerator / denominator) from the same round."""
    return statistics.median(a / b for a, b in zip(num, den))


def profile(name: str, vocab: int, dtype: str) -> None:
    """Where one step's time goes (``--profile``), for Adam, AdamMD, Muon and MuonMD as a user
    gets them: the self time of every op summed (device time on a GPU: the kernels; CPU time on
    a CPU) against the step's wall time (on a GPU, what the kernels leave of it is the host's
    share: launches, guards, Python), and the ten costliest ops, one ``prof`` line each, so
    that a base and its MD step compare line by line; on a GPU then the host side, ``prof
    host`` lines (``host_lines``)."""
    import gc

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    cuda = DEV == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    for opt_name, md_on in (("adam", False), ("adam", True), ("muon", False), ("muon", True)):
        dmodel, opt = build(name, opt_name, md_on, dtype, vocab)
        for _ in range(2):  # state init; the compiled step's compile (and its one recompile)
            opt.step()
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        wall = (time.perf_counter() - t0) * 1e3  # unprofiled: the profiler slows the host
        with prof(activities=acts) as p:
            opt.step()
            sync()
        ops = sorted(p.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
        if torch.distributed.get_rank():  # every rank steps (collectives), rank 0 tells
            ops = []
        run = f"{opt_name}{'+MD' if md_on else ''}"
        tag = f"prof {name} {dtype} {run}"
        total = _own_time(ops, cuda) / 1e3
        if ops:
            what = "kernels" if cuda else "CPU ops"
            print(f"{tag}: {total:.2f} ms of {what} in one step of {wall:.2f} ms wall time")
        for e in ops[:10]:
            print(f"{tag}  {getattr(e, attr) / 1e3:8.2f} ms {e.count:5d}x  {e.key[:80]}")
        if cuda and ops:
            print("\n".join(host_lines(f"prof host {name} {dtype} {run}", ops)))
        sys.stdout.flush()
        del dmodel, opt
        free(gc)


#: the CUDA driver and runtime calls that launch kernels (triton's go through the driver's)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaGraphLaunch")  # fmt: skip


def host_lines(tag: str, events, top: int = 8) -> list[str]:
    """A GPU profile's host side: the ops' summed CPU self time, the kernel launches, and the
    ``top`` costliest ops by CPU self time — where a host-bound step's wall time goes that its
    kernels do not fill (AdamMD's compiled 181M step, H200, 2026-12-04: 3.1 ms of kernels in
    10.4 ms, Adam's 4.5 in 7.5; its host side was not listed)."""
    own = _own(events, cuda=False)
    total = _own_time(events, cuda=False) / 1e3
    launches = sum(e.count for e in own if e.key in LAUNCHES)
    out = [f"{tag}: {total:.2f} ms of host ops, {launches} kernel launches"]
    for e in sorted(own, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        out.append(f"{tag}  {e.self_cpu_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:80]}")
    return out


def _own_time(events, cuda: bool) -> float:
    """The summed self time (µs) of a profile's kernels (GPU) or ops (CPU), each counted once:
    on a GPU an aten op's device time is its kernels' and a ``record_function`` range's (the
    optimizer's step) their span, so only the kernel events count (summed over every event,
    the H100's 2026-11-26 profile showed 390 ms of "kernels" in a 136 ms step)."""
    return sum(e.self_device_time_total if cuda else e.self_cpu_time_total
               for e in _own(events, cuda))  # fmt: skip


def _own(events, cuda: bool) -> list:
    """A profile's own events: the kernels (``cuda``) or the CPU ops, no annotation."""
    cpu = torch.autograd.DeviceType.CPU
    return [e for e in events if not e.is_user_annotation and (e.device_type != cpu) == cuda]


def free(gc) -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
    elif sys.platform == "linux":  # hand freed heap back to the OS before the next pair's builds
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def worker(args) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("nccl" if DEV == "cuda" else "gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(args.tp, 1)
    rank = torch.distributed.get_rank()
    if args.profile:
        for name in args.model:
            profile(name, args.vocab_size, args.dtype[0])
        return
    results = {}
    for name in args.model:
        for dtype in args.dtype:
            results[f"{name} {dtype}"] = measure(name, dtype, args, rank)
    if rank == 0:
        world = torch.distributed.get_world_size()
        where = torch.cuda.get_device_name() if DEV == "cuda" else "CPU/gloo"
        print(f"\nMD optimizer-step cost, {where}, {world} ranks (TP {args.tp}), median of "
              f"{args.steps} steps")  # fmt: skip
        print(f"{'model':<12} {'ratio':<40} {'value':>7}   (seconds: base -> MD)")
        for name, row in results.items():
            for key, val in row["ratios"].items():
                which = key.split()[-1]
                got = row["pairs"].get(key.rsplit(" ", 1)[0])
                secs = ""
                if got and which in ("step", "compute", "inner"):
                    b, m = (t[f"{which}_s"] for t in got.values())
                    secs = f"   {b:.3f} -> {m:.3f}"
                print(f"{name:<12} {key:<40} {val:>7.4g}{secs}")
        summary = {"world": world, "tp": args.tp, "steps": args.steps, "device": where,
                   "results": results}  # fmt: skip
        print(JSON_TAG + json.dumps(summary))
    torch.distributed.destroy_process_group()


JSON_TAG = "BENCH_JSON "
#: ratio name -> (denominator run, numerator run)
PAIRS = {
    "adam_md/adam": ("adam", "adam_md"),
    "muon_md/muon": ("muon", "muon_md"),
    "adam_md_eager/adam": ("adam", "adam_md_eager"),
    "adam_md_fused/adam": ("adam", "adam_md_fused"),
    "muon_md_eager/muon": ("muon", "muon_md_eager"),
    "muon_md_fused/muon": ("muon", "muon_md_fused"),
    "adam_md layer-wise/zero1": ("adam_md", "adam_lw_md"),
    "adam_md_graph/adam": ("adam", "adam_md_graph"),
    "muon_md_graph/muon": ("muon", "muon_md_graph"),
    "adam_md_merged/adam": ("adam", "adam_md_merged"),
}
#: ``adam_md_merged``'s ``compiled.MERGE_ELEMENTS`` (the default's 4x: 181M's embedding and LM
#: head, 2^26 elements each, no longer split its phase 1 and its fuse into two calls each)
MERGED_ELEMENTS = 1 << 28
#: adam/muon as megatron builds them, ``_md``: with MD as a user gets it (--md-fused-step auto);
#: ``_md_eager`` / ``_md_fused``: the eager step / the compiled kernels; ``_md_graph``: the
#: default step replayed from a CUDA graph (--md-cuda-graph, GPU only); ``_md_merged``: the
#: default step with ``MERGED_ELEMENTS``; adam_lw_md = AdamMD layer-wise
RUNS = ["adam", "adam_md", "adam_md_eager", "adam_md_fused", "muon", "muon_md", "muon_md_eager",
        "muon_md_fused", "adam_lw_md", "adam_md_graph", "muon_md_graph",
        "adam_md_merged"]  # fmt: skip


@contextlib.contextmanager
def merge_limit(elements: int | None):
    """``compiled.MERGE_ELEMENTS`` set to ``elements`` (None: as it is) while a pair steps (the
    base in it has no MD step to read it)."""
    from megatron.md.engine import compiled

    saved = compiled.MERGE_ELEMENTS
    compiled.MERGE_ELEMENTS = elements or saved
    try:
        yield
    finally:
        compiled.MERGE_ELEMENTS = saved


def measure(name: str, dtype: str, args, rank: int) -> dict:
    """Each ratio's two optimizers are built together and stepped in turn."""
    import gc

    row, ratios = {"pairs": {}}, {}
    for key, pair in PAIRS.items():
        if not set(pair) <= set(args.runs):
            continue
        opts, models = {}, []
        for run in pair:
            opt_name, md_on = run.split("_md")[0], "_md" in run
            fused = {"fused": "on", "eager": "off"}.get(run.rsplit("_", 1)[-1], "auto")
            t0 = time.perf_counter()
            dmodel, opts[run] = build(name, opt_name, md_on, dtype, args.vocab_size, fused, args.tp,
                                      graph=run.endswith("_graph"))  # fmt: skip
            models.append(dmodel)
            log(rank, f"{name} {dtype} {run}: built in {time.perf_counter() - t0:.1f} s")
        with merge_limit(MERGED_ELEMENTS if "adam_md_merged" in pair else None):
            got = time_interleaved(opts, args.steps)
        if "adam_md" in pair and "bytes" not in row:  # the payload of its last step
            row["bytes"] = collective_bytes(models[pair.index("adam_md")], opts["adam_md"])
        for run, t in got.items():
            phases = ", ".join(f"{p} {v:.3f}" for p, v in t["phases_s"].items())
            log(rank, f"  {run}: first step {t['first_s']:.1f} s, then step {t['step_s']:.3f} s, "
                      f"inner {t['inner_s']:.3f} s ({phases})")  # fmt: skip
        row["pairs"][key] = got
        base, md = pair
        for which in ("step", "compute", "inner")[: 1 if key.endswith("zero1") else 3]:
            ratios[f"{key} {which}"] = paired_ratio(
                got[md][f"{which}s_s"], got[base][f"{which}s_s"]
            )
        del models, opts
        free(gc)
    row["ratios"] = ratios
    if "bytes" not in row:  # the state and payload ratios come with the AdamMD run
        return row
    sb = {}
    for md_on in (False, True):
        dmodel, opt = build(name, "adam", md_on, "bf16", args.vocab_size, tp=args.tp)
        opt.step()  # torch AdamW creates its state lazily
        t = torch.tensor(float(state_bytes(opt)), device=DEV)
        torch.distributed.all_reduce(t)
        sb[md_on] = float(t)
        del dmodel, opt
        free(gc)
    row["ratios"]["state bytes md/base (bf16 params)"] = sb[True] / sb[False]
    row["ratios"]["md all-reduce / param all-gather bytes"] = row["bytes"]["ratio"]
    if args.tp > 1:  # megatron's TP activation all-reduces at the paper's batch, by formula
        d, layers = SHAPES[name][:2]
        dp = torch.distributed.get_world_size() // args.tp
        # 4 per layer (attention and MLP, forward and backward) of tokens × d bf16 values
        tp_bytes = 4 * layers * (GBS_TOKENS // dp) * d * 2
        row["bytes"]["megatron_tp_activations"] = tp_bytes
        row["ratios"]["md all-reduce / megatron TP all-reduce bytes"] = (
            row["bytes"]["md_allreduce"] / tp_bytes
        )
    return row


def rank_env(world: int) -> dict:
    """The environment of ``world`` local benchmark ranks: the cores shared out, and on a CPU
    huge pages for torch's large buffers (docs/benchmarks.md: without them page faults
    dominate at 457M)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // world))}
    if DEV == "cpu":
        env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return env


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["181M", "457M"], choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=torch.cuda.device_count() if DEV == "cuda" else 2)
    ap.add_argument("--vocab-size", type=int, default=VOCAB)
    ap.add_argument("--dtype", nargs="+", choices=("fp32", "bf16"),
                    default=["bf16" if DEV == "cuda" else "fp32"])  # fmt: skip
    ap.add_argument("--runs", nargs="+", choices=RUNS,
                    default=[r for r in RUNS
                             if not r.startswith("muon_md_")
                             and not r.endswith(("_graph", "_merged"))],
                    help="which optimizer builds to time (ratios need both of a pair)")  # fmt: skip
    ap.add_argument("--world", type=int, nargs="+", help="world sizes to run in turn (ladder)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel size (must divide every world size)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write every world size's results here")
    ap.add_argument("--profile", action="store_true",
                    help="where one step's time goes (Adam, AdamMD, Muon, MuonMD)")  # fmt: skip
    args = ap.parse_args(argv)
    if DEV != "cuda" and any(r.endswith("_graph") for r in args.runs):
        ap.error("the *_md_graph runs (--md-cuda-graph) need CUDA")
    if "LOCAL_RANK" in os.environ:
        # CPU mode when there is no GPU, in the ranks only: it imports megatron (~5 s on a
        # 2-core VM), which the launching process never uses
        cpu_mode.maybe_activate()
        return worker(args)
    if args.profile:
        args.dtype = args.dtype[:1]
    ladder = []
    for world in args.world or [args.nproc]:
        if world % args.tp:
            raise SystemExit(f"bench_md_step: error: --tp {args.tp} does not divide {world} ranks")
        for name in args.model:
            if SHAPES[name][3] % args.tp:
                raise SystemExit(f"bench_md_step: error: --model {name}'s {SHAPES[name][3]} "
                                 f"query groups do not divide over --tp {args.tp}")  # fmt: skip
        own = [a for a in (argv if argv is not None else sys.argv[1:])]
        cmd = local_ranks(__file__, world, own)
        out = subprocess.run(cmd, env=rank_env(world), stdout=subprocess.PIPE, text=True)
        for line in out.stdout.splitlines():
            if line.startswith(JSON_TAG):
                ladder.append(json.loads(line[len(JSON_TAG) :]))
            else:
                print(line)
        if out.returncode:
            sys.exit(out.returncode)
    if args.json:
        args.json.write_text(json.dumps(ladder, indent=1))
    print(json.dumps(ladder))


if __name__ == "__main__":
    main()
