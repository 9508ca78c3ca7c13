"""torchrun check: megatron-core's optimizers with ``enable_md`` vs. an oracle, after N steps.

    torchrun --nproc-per-node W md_check.py --optimizer adam|muon --dist zero1|layerwise|replicated
        [--dtype fp32|bf16] [--experts 4] [--sphere frobenius] [--vs reference|megatron]
        [--device cuda]   (NCCL, one rank per GPU; the oracle then runs on the GPU too)
        [--fused-step]    (the compiled kernels, megatron/md/engine/compiled.py)
        [--stack]         (with --fused-step on a CPU: the kernels take whole stacks, a GPU's
                           calls: phase 1 and the fuse of a step's groups one call each)
        [--device-scalars] [--lr-decay]  (the step count and LRs on the device; a moving LR)
        [--cuda-graph]    (with --device cuda: the step replayed from a CUDA graph)
        [--cp 2]          (megatron's context-parallel groups: DP × CP = W)
        [--bucket-size N] (megatron's gradient buckets of ~N elements, --overlap-grad-reduce)
        [--layers 2]      (the tiny GPT's layers: with --bucket-size, buckets of several)

Every rank feeds the same batch, so the data-parallel mean gradient equals each rank's local
gradient; the check isolates the optimizer. With ``--cp`` each rank feeds its context-parallel
share of the sequence (megatron's ``get_batch_on_this_cp_rank``: zigzag chunks, RoPE positions
of those chunks), so the ranks' gradients differ and the oracle gets their DP × CP mean, the
gradient megatron's DDP reduces over its DP × CP group. megatron-core runs CP attention only
with Transformer Engine (core/transformer/dot_product_attention.py, DotProductAttention): the model
is built with CP 1 in its config, so its local attention sees only the rank's chunks (not the ring
attention of a real CP run); the optimizer, which is what is checked, gets megatron's CP groups.

--vs reference: the oracle is the single-process ``MDOptimizer`` (reference MD step) fed the
    gradient megatron computed (captured before the DP reduction), clipped like megatron.
    With ``--bucket-size`` the reduction starts inside the backward pass (megatron's
    ``--overlap-grad-reduce``), so the gradient is read from a twin: the same model with one
    bucket and no overlap, given the checked model's weights before each step.
--optimizer adam --dist layerwise: AdamMD on whole matrices owned layer-wise (built as megatron's
    layer-wise Muon, base step swapped for Adam: MDConfig.adam_layer_wise).
--vs megatron: MD switched off (no sphere, no gains, no row norms) must reproduce megatron's
    own optimizer run through the same wrapper bit for bit (a second model in this process).

Prints one JSON line on rank 0 with the worst errors and the facts the pytest side asserts;
``A + B`` (option sets joined by ``+``) runs several checks in one launch, a line each.
"""

import argparse
import contextlib
import gc
import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.md import cpu_mode

cpu_mode.maybe_activate()

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "md_decoupling"))
import cpu_demo  # noqa: E402

from megatron.md import testing  # noqa: E402
from megatron.md.engine import basesteps, compiled  # noqa: E402
from megatron.md.train import shutdown  # noqa: E402

LR, CLIP = 1e-2, 1.0
DEV = "cpu"
NS_ONE_BY_ONE_CPU = basesteps.NS_ONE_BY_ONE_CPU  # the default, restored between the jobs


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", default="adam", choices=["adam", "muon"])
    ap.add_argument("--dist", default="zero1", choices=["zero1", "layerwise", "replicated"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2, help="the tiny GPT's layers")
    ap.add_argument("--sphere", default="frobenius")
    ap.add_argument("--vs", default="reference", choices=["reference", "megatron"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--fused-step", action="store_true", help="MDConfig.fused_step")
    ap.add_argument("--stack", action="store_true", help="engine/compiled.py STACK_ON_CPU")
    ap.add_argument(
        "--device-scalars",
        action="store_true",
        help="the step count and LRs read from the device (engine/graph.py)",
    )
    ap.add_argument(
        "--cuda-graph",
        action="store_true",
        help="MDConfig.cuda_graph: the step captured after 3 steps (CUDA only)",
    )
    ap.add_argument(
        "--lr-decay",
        action="store_true",
        help="LR × (1 - k / (2 steps)) at step k, in MD's optimizer and the one it is held to",
    )
    ap.add_argument("--cp", type=int, default=1, help="context-parallel size (DP = W / cp)")
    ap.add_argument(
        "--gain-lr-mult",
        type=float,
        default=1.0,
        help="MDConfig.gain_lr_mult: the gains' LR apart from the 1-D parameters' (one Adam)",
    )
    ap.add_argument(
        "--instances", type=int, default=1, help="--num-distributed-optimizer-instances (ZeRO-1)"
    )
    ap.add_argument(
        "--bucket-size",
        type=int,
        default=None,
        help="megatron's gradient buckets of about this many elements, reduced with "
        "--overlap-grad-reduce as on a cluster (ZeRO-1 shards each bucket: a rank holds slices "
        "cut inside matrices bucket after bucket); default one bucket, no overlap",
    )
    ap.add_argument(
        "--no-split-qkv", dest="split_qkv", action="store_false", help="--muon-no-split-qkv"
    )
    ap.add_argument(
        "--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)"
    )
    ap.add_argument(
        "--ns-one-by-one",
        action="store_true",
        help="Muon's matrices one Newton-Schulz call each, applied one by one, at every size "
        "(engine/basesteps.py NS_ONE_BY_ONE_CPU; by default from 2^20 elements on a CPU)",
    )
    args = ap.parse_args(argv)
    if args.vs == "megatron" and args.dist == "layerwise" and args.optimizer == "adam":
        ap.error("megatron-core has no layer-wise Adam to compare with")
    if args.cuda_graph and args.device != "cuda":
        ap.error("--cuda-graph needs --device cuda")
    if args.bucket_size is not None and args.vs == "megatron":
        # (its per-step check of the two models' local gradients reads them mid-reduction)
        ap.error("--bucket-size is checked against the reference only")
    if args.bucket_size is not None and args.bucket_size < 1:
        ap.error(f"--bucket-size {args.bucket_size}: a bucket holds at least one element")
    return args


def md_config(args):
    from megatron.md.config import MDConfig

    if args.vs == "megatron":  # MD switched off
        return MDConfig(
            sphere="none",
            gains="none",
            embedding_norm="none",
            output_norm="none",
            router_norm="none",
            # MD gives the router Muon scale 1 (paper); shape_scaling gives routers (fewer rows
            # than columns) 1 as well, so megatron's Muon (same mode, build()) is the same run
            muon_scale="shape_scaling",
            split_qkv=split_qkv(args),
        )
    # --optimizer adam --dist layerwise: AdamMD on whole matrices (built as layer-wise Muon)
    lw_adam = args.dist == "layerwise" and args.optimizer == "adam"
    return MDConfig(
        sphere=args.sphere,
        adam_layer_wise=lw_adam,
        fused_step="on" if args.fused_step else "off",
        cuda_graph=args.cuda_graph,
        split_qkv=args.split_qkv,  # AdamMD splits too (pretrain_gpt.py's --muon-split-qkv)
        gain_lr_mult=getattr(args, "gain_lr_mult", 1.0),  # (md_tp_check.py's jobs have none)
    )


def split_qkv(args) -> bool:
    """megatron's own Muon split for this check (its Adam, and layer-wise AdamMD built as
    Muon, do not split: MD's step does)."""
    return args.split_qkv and args.optimizer == "muon"


def build(args, world, seed: int = 11):
    """A DDP-wrapped tiny GPT (initialized from ``seed``) and megatron's optimizer for it (not
    yet MD)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    tp = 1  # the larger of the TP and expert-TP sizes
    if ps.model_parallel_is_initialized():
        tp = max(
            ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
        )
    model = testing.tiny_gpt(seed, 32, getattr(args, "layers", 2), 16, experts=args.experts)
    model = model.to(DEV)
    # built with CP 1 (the local attention refuses more), run with megatron's CP groups: RoPE
    # sizes its table from the config's CP size and slices it by the CP group
    model.config.context_parallel_size = ps.get_context_parallel_world_size()
    inner = model
    if args.dtype == "bf16":
        model.config.bf16 = True
        inner = Float16Module(model.config, model)
    dmodel, opt = testing.megatron_optimizer(
        inner, model.config, args.dist, world, args.optimizer,
        instances=getattr(args, "instances", 1),  # (md_tp_check.py's jobs have none)
        bucket_size=getattr(args, "bucket_size", None),
        lr=LR, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, adam_eps=1e-8,
        clip_grad=getattr(args, "clip", CLIP),
        # LayerWise needs bf16=True even for fp32 params (layer_wise_optimizer.py,
        # LayerWiseDistributedOptimizer)
        bf16=args.dtype == "bf16" or args.dist == "layerwise",
        muon_momentum=0.95, muon_nesterov=True, muon_split_qkv=split_qkv(args),
        # under TP, MuonMD orthogonalizes full matrices (and compares with megatron doing so);
        # layer-wise AdamMD, built as Muon, against megatron's default (no Muon gathers)
        muon_tp_mode="duplicated" if args.optimizer == "muon" and tp > 1 else "blockwise",
        muon_scale_mode="shape_scaling",  # the MD-off config's (md_config)
        muon_fp32_matmul_prec="highest",
    )  # fmt: skip
    return model, dmodel, opt


def oracle_for(model, md, base, full=None):
    """fp32 copies of the model's params in the reference optimizer, grouped by role
    (``full``: the full tensors of a TP-split model's params, in the same order)."""
    from megatron.md.optimizer import MDOptimizer
    from megatron.md.roles import param_role

    named = [(n, p) for n, p in model.named_parameters()]
    full = full or [p.detach().float() for _, p in named]
    copies = [torch.nn.Parameter(f.clone()) for f in full]
    groups = {}
    for (n, p), c in zip(named, copies):
        role = param_role(n, p)
        g = groups.setdefault(role, {"params": [], "names": [], "role": role, "lr": LR})
        g["params"].append(c)
        g["names"].append(n)
        if getattr(p, "is_qkv", False):  # megatron's QKV tags (Muon's split)
            c.is_qkv, c.qkv_split_shapes = True, p.qkv_split_shapes
    ref = MDOptimizer(list(groups.values()), md=md, base=base, betas=(0.9, 0.99), eps=1e-8)
    return named, copies, ref


#: torch.distributed's collectives, wrapped while an optimizer steps (``counted_collectives``)
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "_all_gather_base",
    "_reduce_scatter_base",
)  # fmt: skip


def _elements(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, list | tuple) and x and all(isinstance(t, torch.Tensor) for t in x):
        return sum(t.numel() for t in x)
    return 0


@contextlib.contextmanager
def counted_collectives():
    """Every call of a ``torch.distributed`` collective made meanwhile, as (name, elements of
    its largest tensor argument: the whole buffer of a reduce-scatter or all-gather, a list of
    tensors counted together). Callers that bound a collective at import time bypass it."""
    calls, saved = [], {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    for name, fn in saved.items():

        def counted(*a, _fn=fn, _name=name, **k):
            calls.append((_name, max(map(_elements, a), default=0)))
            return _fn(*a, **k)

        setattr(dist, name, counted)
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def step(dmodel, opt, x, y, calls: list | None = None, grad_of=None, after_backward=None):
    """One training step; returns each parameter's gradient before the DP reduction
    (``grad_of(p)``, default its main_grad); ``calls``: filled with the collectives of
    ``opt.step()``; ``after_backward(dmodel)``: runs right after the backward pass."""
    dmodel.zero_grad_buffer()
    opt.zero_grad()
    cpu_demo.lm_loss(dmodel, x, y).backward()
    if after_backward is not None:
        after_backward(dmodel)
    grad_of = grad_of or (lambda p: p.main_grad.detach().clone())
    local = [grad_of(p) for p in dmodel.module.parameters()]
    dmodel.finish_grad_sync()
    with counted_collectives() as got:
        ok, _, _ = opt.step()
    assert ok
    if calls is not None:
        calls[:] = got
    return local


def local_grads(dmodel, x, y) -> list[torch.Tensor]:
    """``step``'s capture without a step: each parameter's gradient of one forward-backward,
    not reduced (a model with one bucket and no overlap reduces nothing before
    ``finish_grad_sync``)."""
    dmodel.zero_grad_buffer()
    cpu_demo.lm_loss(dmodel, x, y).backward()
    return [p.main_grad.detach().clone() for p in dmodel.module.parameters()]


def bf16_excess(p: torch.Tensor, q: torch.Tensor) -> float:
    """How far bf16 ``p`` is beyond one round-to-nearest of fp32 ``q`` (half a bf16 spacing),
    relative to max|q|: what fp32 rounding along the two paths may add (~1e-7)."""
    spacing = torch.ldexp(torch.ones_like(q), torch.frexp(q.abs().clamp_min(1e-30))[1] - 8)
    over = ((p.float() - q).abs() - 0.5 * spacing).clamp_min(0)
    return float(over.max() / q.abs().max())


def _sphere_err(inner, main, d) -> float:
    """Relative error of the sphere constraint of a whole matrix's direction."""
    md = inner.slots[main].md
    r = inner.md_state[main]["radius"]
    if r is None:
        return 0.0
    from megatron.md.reference import norms, row_block_ids

    ids = row_block_ids(md.shape[0], md.spec.row_blocks)  # Q/K/V blocks: a sphere each
    cur = norms(d.view(md.shape).float(), md.spec.sphere, ids)
    return float((cur / r.view(cur.shape) - 1).abs().max())


def split_jobs(argv: list[str]) -> list[list[str]]:
    """``A + B + C``: several checks in one torchrun, run one after the other in the same
    process group (each process pays megatron's ~15 s import once)."""
    jobs = [[]]
    for a in argv:
        if a == "+":
            jobs.append([])
        else:
            jobs[-1].append(a)
    return jobs


def init_distributed(device: str) -> None:
    global DEV
    DEV = device
    if DEV == "cuda":
        import os

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo")


def drop_groups() -> None:
    """Between two jobs of one launch: destroy every process group but the world's. megatron's
    ``destroy_model_parallel`` forgets its groups without destroying them, and each job makes
    ~45 more; with them kept alive every later collective slowed (gloo, 2 ranks on 2 cores,
    2026-11-28: the TP batch's 17 jobs took 107 s in one launch, 46 s with this)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    world = dist.GroupMember.WORLD
    for group in [g for g in dist.distributed_c10d._world.pg_map if g is not world]:
        dist.destroy_process_group(group)
    gc.collect()


def run_jobs(parse_fn, check_fn) -> None:
    """Each ``A + B`` job of the command line in turn; rank 0 prints each result."""
    jobs = [parse_fn(a) for a in split_jobs(sys.argv[1:])]
    init_distributed(getattr(jobs[0], "device", "cpu"))
    for args in jobs:
        res = check_fn(args)
        if dist.get_rank() == 0:
            print(json.dumps(res), flush=True)
        drop_groups()
    dist.destroy_process_group()
    shutdown.exit_now()  # every result printed: skip the interpreter's ~2 s teardown


def main():
    run_jobs(parse, check)


def init_model_parallel(cp: int, instances: int = 1) -> None:
    """megatron's model-parallel groups for one job: TP = PP = 1, context parallel ``cp``,
    ``instances`` distributed-optimizer instances."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        1, 1, context_parallel_size=cp, num_distributed_optimizer_instances=instances
    )


def cp_share(x, y):
    """This rank's share of a [batch, seq] batch under megatron's context parallelism."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    if ps.get_context_parallel_world_size() == 1:
        return x, y
    got = get_batch_on_this_cp_rank(
        {"tokens": x, "labels": y, "cu_seqlens": None},
        is_hybrid_cp=False,
        cp_group=ps.get_context_parallel_group(),
    )
    return got["tokens"], got["labels"]


def grads_differ(grads) -> float:
    """max |Δ| between any rank's local gradients and rank 0's (0: every rank the same batch)."""
    worst = 0.0
    for g in grads:
        g0 = g.clone()
        dist.broadcast(g0, 0)
        worst = max(worst, float((g - g0).abs().max()))
    t = torch.tensor(worst, device=DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def kernels_built() -> list[str]:
    """The names of the compiled kernels any rank has built (engine/compiled.py)."""
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(compiled._compiled))
    return sorted(set().union(*names))


def check(args) -> dict:
    """One check (fresh model and optimizers, reseeded); the result rank 0 prints."""
    if args.device != DEV:
        raise ValueError("all jobs of one launch run on one device")
    world = dist.get_world_size()
    from megatron.md.enable import enable_md
    from megatron.md.leaves import leaf_optimizers

    torch.use_deterministic_algorithms(args.deterministic)
    basesteps.NS_ONE_BY_ONE_CPU = 1 if args.ns_one_by_one else NS_ONE_BY_ONE_CPU
    compiled.STACK_ON_CPU = args.stack
    md = md_config(args)
    init_model_parallel(args.cp, args.instances)
    model, dmodel, opt = build(args, world)
    # every weight's storage as megatron's DDP buffer holds it (the fused write goes in place)
    where = {n: (p.data_ptr(), p.stride()) for n, p in model.named_parameters()}
    enable_md(opt, [dmodel], md)
    if args.vs == "megatron":
        model2, dmodel2, opt2 = build(args, world)
        model2.load_state_dict(model.state_dict())
    else:
        named, copies, ref = oracle_for(model, md, args.optimizer)
    twin = None  # --bucket-size: the model whose local gradient the oracle gets
    if args.bucket_size is not None:
        twin_model, twin, _ = build(
            argparse.Namespace(**{**vars(args), "bucket_size": None}), world
        )
    inners = [o.optimizer for o in leaf_optimizers(opt) if hasattr(o.optimizer, "slots")]
    if args.device_scalars:
        for inner in inners:
            inner.use_cuda_graph(graph=False)
    cut = any(b.nc < s.md.shape[1] for i in inners for s in i.slots.values() for b in s.md.blocks)
    cut = torch.tensor(float(cut), device=DEV)
    dist.all_reduce(cut)
    # every rank's groups of ZeRO-1 slices cut inside their matrices (at one place of each),
    # those of them compiled (Kernels.cut: the merged calls), and the slices they hold
    cuts = [(g.B, g.kernels is not None) for i in inners if i.engine is not None
            for g in i.engine.cut_groups()]  # fmt: skip
    cut_groups = torch.tensor(
        [float(len(cuts)), float(sum(c[1] for c in cuts)), float(sum(c[0] for c in cuts))],
        device=DEV,
    )
    dist.all_reduce(cut_groups)
    # every rank's groups whose partials are no one span of their domain's step buffer
    # (Engine.indexed_groups: zero1.py's layout)
    indexed = sum(len(i.engine.indexed_groups()) for i in inners if i.engine is not None)
    indexed = torch.tensor(float(indexed), device=DEV)
    dist.all_reduce(indexed)

    data = torch.tensor(list(cpu_demo.TEXT.encode()), dtype=torch.long)
    sphere_err = 0.0
    grad_diff = []  # --vs megatron: per step, max |local grad of model - of model2|
    md_calls = []  # the collectives of the last MD step
    for k, (x, y) in enumerate(cpu_demo.batches(data, args.steps, 4, 16, 0)):
        if args.lr_decay:  # as a schedule moves it (the oracle's groups below)
            for o in (opt, opt2) if args.vs == "megatron" else (opt,):
                for g in o.param_groups:
                    g["lr"] = LR * (1 - k / (2 * args.steps))
        x, y = cp_share(x.to(DEV), y.to(DEV))
        if twin is not None:  # the checked model's own capture would read reduced buckets
            twin_model.load_state_dict(model.state_dict())
            grads = local_grads(twin, x, y)
            step(dmodel, opt, x, y, md_calls)
        else:
            grads = step(dmodel, opt, x, y, md_calls)
        differ = grads_differ(grads)
        if args.cp > 1:  # what DDP averages over DP × CP (here every rank)
            for g in grads:
                dist.all_reduce(g)
                g.div_(world)
        if args.vs == "megatron":
            grads2 = step(dmodel2, opt2, x, y)
            grad_diff.append(max(float((a - b).abs().max()) for a, b in zip(grads, grads2)))
            continue
        for c, g in zip(copies, grads):
            c.grad = g.float().clone()
        if args.lr_decay:
            for g in ref.param_groups:
                g["lr"] = opt.param_groups[0]["lr"]
        gn = torch.stack([c.grad.norm() for c in copies]).norm()
        coeff = CLIP / (gn + 1e-6)
        if coeff < 1:
            for c in copies:
                c.grad.mul_(coeff)
        ref.step()
        ref.zero_grad()
        # sphere invariant of the distributed state: ‖Ŵ‖ = radius (Frobenius) / each row = 1
        for inner in inners:
            sq = {}
            for k, (main, slot) in enumerate(inner.slots.items()):
                d = inner.direction_of(main)
                sq[main] = (slot.index if slot.index is not None else k, d)
            if inner.layout is None:
                for main, (_, d) in sq.items():
                    sphere_err = max(sphere_err, _sphere_err(inner, main, d.view(-1)))
                continue
            # ZeRO-1: every matrix's norm partials (per Q/K/V block, row or column) in the
            # global layout, one all-reduce
            offs = [0]
            for k in inner.norm_layout:
                offs.append(offs[-1] + k)
            buf = torch.zeros(offs[-1], device=DEV)
            for main, (i, d) in sq.items():
                inner.slots[main].md.norm_partials(d.view(-1).float(), buf[offs[i] : offs[i + 1]])
            if inner.reduce_group is not None:  # the ranks sharing the matrices (one instance)
                dist.all_reduce(buf, group=inner.reduce_group)
            for main, (i, _) in sq.items():
                r = inner.md_state[main]["radius"]
                if r is not None and inner.slots[main].md.spec.sphere == "frobenius":
                    got = buf[offs[i] : offs[i + 1]].sqrt()
                    sphere_err = max(sphere_err, float((got / r.view(-1) - 1).abs().max()))

    worst, worst_ulp, worst_dir, n_same, n_bf16 = 0.0, 0.0, 0.0, 0, 0
    worst_name = ""  # --vs megatron: the parameter that differs most
    if args.vs == "megatron":
        pairs = zip(model.named_parameters(), model2.parameters())
        for (name, p), q in pairs:
            d = float((p.detach() - q.detach()).abs().max())
            if d > worst:
                worst, worst_name = d, name
    else:
        for (name, p), c in zip(named, copies):
            q = c.detach()
            worst = max(worst, float((p.detach().float() - q).norm() / q.norm()))
            if args.dtype == "bf16":
                worst_ulp = max(worst_ulp, bf16_excess(p.detach(), q))
                n_bf16 += p.numel()
                n_same += int((p.detach() == q.to(torch.bfloat16)).sum())
        # the fp32 directions themselves against the reference's
        ref_dir = {c: ref.state[c].get("direction") for c in copies}
        by_model = {id(p): c for (_, p), c in zip(named, copies)}
        for inner in inners:
            for main, slot in inner.slots.items():
                rd = ref_dir[by_model[id(slot.model_param)]].reshape(-1)
                rd = rd[slot.md.start : slot.md.end]
                if rd.numel():
                    d = inner.direction_of(main)
                    worst_dir = max(worst_dir, float((d - rd).norm() / rd.norm()))
        t = torch.tensor(worst_dir, device=DEV)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst_dir = float(t)
    for name, p in model.named_parameters():
        # in place: DDP's buffer views (and a captured CUDA graph's addresses) still see it
        assert (p.data_ptr(), p.stride()) == where[name], f"{name} moved out of its storage"
        same = p.detach().clone()
        dist.broadcast(same, 0)
        assert torch.equal(same, p.detach()), f"{name} differs across ranks"

    # ZeRO-1 payload by formula (default MD): rowcol gains + Frobenius norm per matrix,
    # one norm per row of embedding, LM head and router
    from megatron.md.roles import param_role, qkv_blocks

    expected = 0
    for name, p in model.named_parameters():
        role = param_role(name, p)
        if getattr(p, "is_managed_by_layer_wise_optimizer", False):
            continue  # whole matrices, no collective
        if role == "matrix":  # a Frobenius norm per Q/K/V block when split
            expected += p.shape[0] + p.shape[1] + max(len(qkv_blocks(p)) if md.split_qkv else 0, 1)
        elif role != "vector":  # one norm per row, and the LM head's and router's gains
            expected += p.shape[0]
            side = {"output": md.output_gains, "router": md.router_gains}.get(role, "none")
            if side == "matrix" and md.gains == "rowcol":
                expected += p.shape[0] + p.shape[1]
    n_coll = sum(i.n_collectives for i in inners if i.layout is not None)
    # matrices stepped with a Q/K/V split (each owned by one rank under layer-wise sharding)
    n_split = sum(1 for i in inners for sl in i.slots.values() if sl.md.spec.row_blocks)
    n_split = torch.tensor(float(n_split), device=DEV)
    dist.all_reduce(n_split)
    n_split = int(n_split) // (world if args.dist == "replicated" else 1)
    # the collectives MD adds: megatron's own optimizer (no enable_md), same steps, last step
    base_calls = []
    _, dmodel3, opt3 = build(args, world)
    for x, y in cpu_demo.batches(data, args.steps, 4, 16, 0):
        step(dmodel3, opt3, *cp_share(x.to(DEV), y.to(DEV)), base_calls)
    extra, missing = Counter(md_calls), Counter(base_calls)
    extra.subtract(base_calls)
    missing.subtract(md_calls)
    from megatron.core import parallel_state as ps

    zero1 = [i for i in inners if i.layout is not None]
    dp_cp = dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))
    return {
        "world": world,
        "cp": ps.get_context_parallel_world_size(),
        # the size of the group MD's all-reduce goes over (ZeRO-1 instances; 0: none)
        "md_group_sizes": sorted({dist.get_world_size(i.reduce_group) for i in zero1}),
        # the dense ZeRO-1 instance's all-reduce goes over megatron's DP × CP group
        "md_group_is_dp_cp": [
            dist.get_process_group_ranks(i.reduce_group) == dp_cp
            for i in zero1
            if i.reduce_group is not None
        ],
        "grads_differ": differ,
        "worst_rel": worst,
        "grad_diff": grad_diff,
        "worst_param": worst_name,
        "bf16_excess": worst_ulp,
        "bf16_same_frac": n_same / max(n_bf16, 1),
        "worst_dir_rel": worst_dir,
        "sphere_err": sphere_err,
        "cut_inside_row": bool(cut),
        # megatron's gradient buckets (dense and expert buffers; --bucket-size)
        "buckets": sum(len(b.buckets) for b in dmodel.buffers + dmodel.expert_parallel_buffers),
        "cut_groups": int(cut_groups[0]),
        "compiled_cut_groups": int(cut_groups[1]),
        "cut_slices": int(cut_groups[2]),
        "indexed_groups": int(indexed),
        "collectives_per_step": n_coll / args.steps,
        "payload": sum(i.last_payload for i in inners if i.layout is not None),
        "expected_payload": expected,
        "md_params": sum(len(i.slots) for i in inners),
        "split_qkv_matrices": n_split,
        # this rank's engine groups stepped by the compiled kernels (--fused-step)
        "compiled_groups": sum(
            1 for i in inners if i.engine is not None for g in i.engine.groups if g.kernels
        ),
        # this rank's groups whose gradients are no one strided view of megatron's buffer but
        # regular pieces of it (an MoE layout: Group.grad_pieces)
        "piece_groups": sum(
            1
            for i in inners
            if i.engine is not None
            for g in i.engine.groups
            if g.B > 1 and g.grad_pieces() is not None
        ),
        # the compiled kernels the ranks have built so far (engine/compiled.py names; the row
        # sphere with both gains, the LM head's: "row_norm")
        "kernels": kernels_built(),
        # this rank's Muon groups orthogonalized and applied one matrix at a time
        "one_by_one_groups": sum(
            1
            for i in inners
            if i.engine is not None
            for g in i.engine.groups
            if g.base.name == "muon" and basesteps.MuonStep.one_by_one(g)
        ),
        "extra_collectives": sorted(k for k, n in extra.items() for _ in range(max(n, 0))),
        "missing_collectives": sorted(k for k, n in missing.items() for _ in range(max(n, 0))),
        "classes": sorted({type(o).__name__ for o in leaf_optimizers(opt)}),
        # the MD steps run with their numbers on the device, and replayed from a CUDA graph
        "device_steps": sum(i.engine.steps for i in inners if i.scalars is not None),
        "graph_replays": sum(i.graph.replays for i in inners if i.graph is not None),
    }


if __name__ == "__main__":
    main()
