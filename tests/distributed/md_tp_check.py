"""torchrun check: AdamMD and MuonMD under megatron's tensor parallelism vs. the single-process
reference on the full matrices.

    torchrun --nproc-per-node W md_tp_check.py --tp 2 --dist zero1|replicated|layerwise
        [--dtype fp32|bf16] [--sphere frobenius|row|col] [--optimizer muon [--split-qkv]]
        [--cp 2]                          (each rank its context-parallel share of the sequence)
        [--experts 4 [--etp 2] [--ep 2]]  (MoE; experts split over megatron's expert-TP group,
                                           spread over its expert-parallel group)

TP × DP = W; every rank feeds the same batch. The model is megatron's GPT built under TP with
CPU initialization (each rank's piece is its chunk of the same full weights); the oracle is the
reference ``MDOptimizer`` on the full matrices gathered from the TP ranks, fed the gathered
gradients megatron computed. Not here: sequence parallelism (megatron-core refuses it with
torch norms, core/transformer/torch_norm.py, WrappedTorchNorm.__new__); MoE under TP, which
megatron refuses in training without it, runs its forward in eval mode (``build``);
tests/test_tensor_parallel.py covers the TP-replicated router's arithmetic.
After the steps: gathered model weights vs. the oracle's, every rank's direction slice vs. the
oracle's, the sphere invariant from the reduced norms, and the collectives MD adds to megatron's
own optimizer step. One JSON line per job on rank 0 (``A + B`` runs several jobs).
"""

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.md import cpu_mode

cpu_mode.maybe_activate()

sys.path.insert(0, str(Path(__file__).resolve().parent))
import md_check  # noqa: E402
from md_check import bf16_excess, cpu_demo  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dist", default="zero1", choices=["zero1", "layerwise", "replicated"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--sphere", default="frobenius")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--optimizer", default="adam", choices=["adam", "muon"])
    ap.add_argument(
        "--split-qkv",
        action="store_true",
        help="Q, K, V on their own spheres (MuonMD: and Newton–Schulz calls)",
    )
    ap.add_argument("--experts", type=int, default=0, help="MoE layers with this many experts")
    ap.add_argument("--etp", type=int, default=1, help="--expert-tensor-parallel-size")
    ap.add_argument("--ep", type=int, default=1, help="--expert-model-parallel-size")
    ap.add_argument("--cp", type=int, default=1, help="--context-parallel-size")
    ap.add_argument(
        "--no-clip", dest="clip", action="store_const", const=1e9, default=md_check.CLIP,
        help="no gradient clipping (megatron's and the reference's)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.optimizer == "muon" and args.dist not in ("layerwise", "replicated"):
        ap.error("MuonMD needs whole matrices: --dist layerwise or replicated")
    if args.cp > 1 and args.experts:
        ap.error("--cp with --experts is not part of this check")
    args.vs, args.fused_step, args.cuda_graph = "reference", False, False
    return args


def split_group(p):
    """The group megatron splits parameter ``p`` over (expert-TP for routed experts, which it
    marks ``allreduce=False``; TP otherwise), or None when ``p`` is whole on every rank."""
    from megatron.core import parallel_state as ps

    if not getattr(p, "tensor_model_parallel", False):
        return None
    if getattr(p, "allreduce", True):
        group = ps.get_tensor_model_parallel_group()
    else:
        group = ps.get_expert_tensor_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def gather(t: torch.Tensor, p) -> torch.Tensor:
    """The full tensor of ``t``, a (expert-)TP rank's piece shaped like parameter ``p``
    (megatron's layout: ``size * stride`` chunks along ``partition_dim``, rank r holds r,
    r + size, ...)."""
    group = split_group(p)
    if group is None:
        return t
    size, dim, s = dist.get_world_size(group), p.partition_dim, p.partition_stride
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    chunks = [pt.chunk(s, dim) for pt in parts]
    return torch.cat([chunks[r][k] for k in range(s) for r in range(size)], dim)


def local_piece(full: torch.Tensor, p) -> torch.Tensor:
    group = split_group(p)
    if group is None:
        return full
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = full.chunk(size * p.partition_stride, p.partition_dim)
    return torch.cat([chunks[k * size + rank] for k in range(p.partition_stride)], p.partition_dim)


def build(args, world):
    """md_check.build under TP (the model is built after model-parallel init)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        args.tp, 1, expert_tensor_parallel_size=args.etp, expert_model_parallel_size=args.ep,
        context_parallel_size=args.cp,
    )  # fmt: skip
    model, dmodel, opt = md_check.build(args, world // args.tp)
    if args.experts and args.tp > 1:
        # megatron refuses MoE under TP without sequence parallelism in training mode
        # (core/transformer/moe/moe_layer.py, MoELayer.forward), and SP needs TE's norms
        # (torch_norm.py, WrappedTorchNorm.__new__): the forward runs in eval mode, which leaves
        # out the router's auxiliary loss and expert-bias update (router.py, TopKRouter.routing);
        # the gradients still reach every matrix
        model.train(False)
    return model, dmodel, opt


def step(dmodel, opt, x, y, calls=None):
    """md_check.step with the TP sum of Q/K-norm gradients that finalize_model_grads makes
    (each rank has its own heads; the sum commutes with the DP mean megatron takes first),
    returning the full gradients (gathered over TP, before the DP reduction)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    tp_sum = lambda m: _allreduce_non_tensor_model_parallel_grads([m], m.config)
    full = lambda p: gather(p.main_grad.detach().clone(), p)
    grads = md_check.step(dmodel, opt, x, y, calls, grad_of=full, after_backward=tp_sum)
    # what megatron's reduction makes of an expert gradient every rank computed alike: scaled
    # by 1 / (DP × CP) (core/distributed/distributed_data_parallel.py, DistributedDataParallel),
    # summed over expert DP. Under expert TP each rank's expert piece saw the tokens of its whole
    # expert-TP group (all-gathered), so its local gradient is that many batches' worth.
    scale = ps.get_expert_data_parallel_world_size() / ps.get_data_parallel_world_size(
        with_context_parallel=True
    )
    experts = [getattr(p, "allreduce", True) is False for p in dmodel.module.parameters()]
    return [g * scale if e else g for g, e in zip(grads, experts)]


def megatron_step_elements(dmodel, opt, x, y) -> int:
    """Elements megatron's own training step moves through collectives (forward and backward
    TP collectives, the Q/K-norm TP sum, the DP gradient reduction, the optimizer's), counted
    as ``counted_collectives`` counts MD's payload (each call's whole buffer)."""
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    dmodel.zero_grad_buffer()
    opt.zero_grad()
    with md_check.counted_collectives() as calls:
        cpu_demo.lm_loss(dmodel, x, y).backward()
        _allreduce_non_tensor_model_parallel_grads([dmodel], dmodel.config)
        dmodel.finish_grad_sync()
        opt.step()
    return sum(n for _, n in calls)


def sphere_err(inner) -> float:
    """max |‖Ŵ‖ / radius − 1| over every sphere of every matrix, from norm partials reduced the
    way the optimizer reduces them (its domains, replicas dropped)."""
    worst = 0.0
    for main, sq in inner.reduced_norms().items():
        r = inner.md_state[main]["radius"]
        if r is not None:
            worst = max(worst, float((sq.sqrt() / r.reshape(-1) - 1).abs().max()))
    return worst


def expected_payload(named, copies, inners, md) -> int:
    """Default MD, by formula on the full shapes: row+column gains and one Frobenius norm per
    hidden matrix (per block of a split QKV), one norm per row of the embedding/LM head/router
    and the LM head's and router's row+column gains.
    Whole-matrix optimizers: the rank's own matrices that are split or TP-replicated (whole
    ones need no sum); ZeRO-1 (also the embedding/head's under layer-wise sharding): every MD
    matrix it holds a slice of on any rank."""
    from megatron.core import parallel_state as ps

    from megatron.md.roles import param_role, qkv_blocks

    def summed(p) -> bool:  # a whole-matrix optimizer sums (E)TP pieces and TP replicas
        tp_replica = ps.get_tensor_model_parallel_world_size() > 1 and getattr(p, "allreduce", True)
        return split_group(p) is not None or tp_replica

    def norms(spec, d_out: int) -> int:  # Frobenius: one per Q/K/V block; row sphere: per row
        return d_out if spec.sphere == "row" else len(spec.row_blocks) or 1

    shapes = [(s.md.shape, s.md.spec.gains != "none", norms(s.md.spec, s.md.shape[0]))
              for i in inners if i.layout is None for s in i.slots.values()
              if summed(s.model_param)]  # fmt: skip
    if any(i.layout is not None for i in inners):
        side = {"output": md.output_gains, "router": md.router_gains, "embedding": "none"}
        for (n, p), c in zip(named, copies):
            role = param_role(n, p)
            if role == "vector" or getattr(p, "is_managed_by_layer_wise_optimizer", False):
                continue
            d_out = c.shape[0]
            if role == "matrix":  # a split QKV: one sphere per block (Q, K, V)
                shapes.append((c.shape, True, (len(qkv_blocks(p)) if md.split_qkv else 0) or 1))
            else:  # a unit (init-norm) row sphere, the LM head's and router's gains
                shapes.append((c.shape, side[role] == "matrix", d_out))
    return sum(d_out + d_in + n if gains else n for (d_out, d_in), gains, n in shapes)


def check(args) -> dict:
    from megatron.core import parallel_state as ps

    from megatron.md.enable import enable_md
    from megatron.md.leaves import leaf_optimizers

    world = dist.get_world_size()
    md = md_check.md_config(args)
    model, dmodel, opt = build(args, world)
    enable_md(opt, [dmodel], md)
    inners = [o.optimizer for o in leaf_optimizers(opt) if hasattr(o.optimizer, "slots")]
    full = [gather(p.detach().float(), p) for p in model.parameters()]
    named, copies, ref = md_check.oracle_for(model, md, args.optimizer, full=full)

    data = torch.tensor(list(cpu_demo.TEXT.encode()), dtype=torch.long)
    md_calls, grad_dp_diff = [], 0.0
    experts = [getattr(p, "allreduce", True) is False for _, p in named]
    # DP replicas: the dense DP group; for routed experts the expert-DP group (EP ranks hold
    # other experts)
    dp_groups = [ps.get_expert_data_parallel_group() if e else ps.get_data_parallel_group()
                 for e in experts]  # fmt: skip
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    for x, y in cpu_demo.batches(data, args.steps, 4, 16, 0):
        grads = step(dmodel, opt, *md_check.cp_share(x, y), md_calls)
        for g, group in zip(grads, dp_groups):  # every rank fed the same batch: the same gradient
            first = g.clone()
            dist.broadcast(first, dist.get_process_group_ranks(group)[0], group=group)
            grad_dp_diff = max(grad_dp_diff, float((first - g).abs().max()))
        if args.cp > 1:  # each CP rank its share of the sequence: megatron's DP × CP mean
            for g in grads:
                dist.all_reduce(g, group=dp_cp)
                g.div_(dist.get_world_size(dp_cp))
        for c, g in zip(copies, grads):
            c.grad = g.float().clone()
        # megatron clips by the norm over the whole model: the experts of the other EP ranks too
        sq = [c.grad.double().square().sum() for c in copies]
        expert_sq = torch.stack(
            [q for q, e in zip(sq, experts) if e] or [torch.zeros((), dtype=torch.float64)]
        ).sum()
        dist.all_reduce(expert_sq, group=ps.get_expert_model_parallel_group())
        dense_sq = sum(q for q, e in zip(sq, experts) if not e)
        gn = (dense_sq + expert_sq).sqrt().float()
        coeff = args.clip / (gn + 1e-6)
        if coeff < 1:
            for c in copies:
                c.grad.mul_(coeff)
        ref.step()
        ref.zero_grad()
    worst, excess, same, n = 0.0, 0.0, 0, 0
    for (_, p), c in zip(named, copies):
        w, q = gather(p.detach(), p), c.detach()
        worst = max(worst, float((w.float() - q).norm() / q.norm()))
        if args.dtype == "bf16":
            excess, n = max(excess, bf16_excess(w, q)), n + w.numel()
            same += int((w == q.to(torch.bfloat16)).sum())
    by_model = {id(p): c for (_, p), c in zip(named, copies)}
    worst_dir, worst_dir_name = 0.0, ""
    for inner in inners:
        for main, slot in inner.slots.items():
            rd = ref.state[by_model[id(slot.model_param)]]["direction"]
            rd = local_piece(rd, slot.model_param).reshape(-1)[slot.md.start : slot.md.end]
            if rd.numel():
                d = inner.direction_of(main).float()
                err = float((d - rd).norm() / rd.norm())
                if err > worst_dir:
                    worst_dir, worst_dir_name = err, slot.name
    sph = max([sphere_err(i) for i in inners] + [0.0])
    # the DP replicas of each TP rank hold the same weights (experts: their full matrices)
    dp_diff = 0.0
    for (_, p), expert, group in zip(named, experts, dp_groups):
        here = gather(p.detach(), p) if expert else p.detach()
        first = here.clone()
        dist.broadcast(first, dist.get_process_group_ranks(group)[0], group=group)
        dp_diff = max(dp_diff, float((first.float() - here.float()).abs().max()))
    facts = torch.tensor([worst_dir, sph, worst, excess, dp_diff, grad_dp_diff])
    dist.all_reduce(facts, op=dist.ReduceOp.MAX)
    worst, excess = float(facts[2]), float(facts[3])
    # MD's collectives: those of megatron's own optimizer on the same steps, plus MD's
    base_calls = []
    _, dmodel3, opt3 = build(args, world)
    for x, y in cpu_demo.batches(data, args.steps, 4, 16, 0):
        x, y = md_check.cp_share(x, y)
        step(dmodel3, opt3, x, y, base_calls)
    traffic = megatron_step_elements(dmodel3, opt3, x, y)
    extra, missing = Counter(md_calls), Counter(base_calls)
    extra.subtract(base_calls)
    missing.subtract(md_calls)
    tp_slots = [s for i in inners for s in i.slots.values() if s.md.tp is not None]
    summing = [i for i in inners if any(d.reduce is not None for d in i.domains.values())]
    return {
        "world": world,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "expert_split_matrices": sum(s.md.tp.expert for s in tp_slots),
        "dp": ps.get_data_parallel_world_size(),
        "worst_rel": worst,
        "bf16_excess": excess,
        "bf16_same_frac": same / max(n, 1),
        "worst_dir_rel": float(facts[0]),
        "worst_dir_param_rank0": worst_dir_name,
        "sphere_err": float(facts[1]),
        "dp_replicas_differ_by": float(facts[4]),
        "dp_grads_differ_by": float(facts[5]),
        "tp_split_matrices": len(tp_slots),
        "stride2_matrices": sum(s.md.tp.stride == 2 for s in tp_slots),
        "row_parallel_matrices": sum(s.md.tp.axis == 1 for s in tp_slots),
        "replicas_dropped": sum(not s.md.counts for i in inners for s in i.slots.values()),
        "collectives_per_step": sum(i.n_collectives for i in summing) / args.steps,
        "payload": sum(i.last_payload for i in summing),
        "expected_payload": expected_payload(named, copies, inners, md),
        "megatron_step_elements": traffic,
        "extra_collectives": sorted(k for k, c in extra.items() for _ in range(max(c, 0))),
        "missing_collectives": sorted(k for k, c in missing.items() for _ in range(max(c, 0))),
    }


if __name__ == "__main__":
    md_check.run_jobs(parse, check)
