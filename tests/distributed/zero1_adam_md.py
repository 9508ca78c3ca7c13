"""torchrun check: AdamMD in megatron-core's ZeRO-1 DistributedOptimizer vs. the reference.

Every rank feeds the same batch, so DDP's averaged gradient equals the single-process gradient
(to rounding) and the comparison isolates the optimizer. Prints one JSON line on rank 0.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import megatron.md  # noqa: F401  (CPU mode)


def main():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "md_decoupling"))
    import cpu_demo
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron.md.config import MDConfig
    from megatron.md.optimizer import MDOptimizer, model_param_groups
    from megatron.md.zero1 import enable_md_zero1

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    md = MDConfig(sphere=sys.argv[1] if len(sys.argv) > 1 else "frobenius")
    steps, lr = 5, 1e-2

    model = cpu_demo.build_model(11, 32, 2, 16)
    oracle = cpu_demo.build_model(11, 32, 2, 16)
    oracle.load_state_dict(model.state_dict())
    ddpc = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False
    )
    dmodel = DDP(model.config, ddpc, model)
    cfg = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_eps=1e-8,
        clip_grad=1.0,
        bf16=False,
        use_distributed_optimizer=True,
    )
    opt = enable_md_zero1(get_megatron_optimizer(cfg, [dmodel]), [dmodel], md)
    ref = MDOptimizer(model_param_groups(oracle, lr), md=md, base="adam", betas=(0.9, 0.99))

    # at least one matrix is cut inside a row on some rank
    inner = opt.chained_optimizers[0].optimizer
    cut = any(b.nc < s.md.shape[1] for s in inner.slots.values() for b in s.md.blocks)
    cut = torch.tensor(float(cut))
    dist.all_reduce(cut)

    data = torch.tensor(list(cpu_demo.TEXT.encode()), dtype=torch.long)
    for x, y in cpu_demo.batches(data, steps, 4, 16, 0):
        dmodel.zero_grad_buffer()
        opt.zero_grad()
        cpu_demo.lm_loss(dmodel, x, y).backward()
        dmodel.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
        cpu_demo.lm_loss(oracle, x, y).backward()
        gn = torch.stack([p.grad.norm() for p in oracle.parameters()]).norm()
        coeff = 1.0 / (gn + 1e-6)
        if coeff < 1:
            for p in oracle.parameters():
                p.grad.mul_(coeff)
        ref.step()
        ref.zero_grad()

    # expected payload: rowcol gains + Frobenius norm per matrix, one norm per embedding/LM-head row
    from megatron.md.optimizer import param_role

    payload = 0
    for name, p in model.named_parameters():
        role = param_role(name, p)
        if role == "matrix":
            payload += p.shape[0] + p.shape[1] + 1
        elif role in ("embedding", "output"):
            payload += p.shape[0]
    worst, n_cmp = 0.0, 0
    for (name, p), q in zip(model.named_parameters(), oracle.parameters()):
        rel = float((p.detach() - q.detach()).norm() / q.detach().norm())
        worst = max(worst, rel)
        n_cmp += 1
        same = p.detach().clone()
        dist.broadcast(same, 0)
        assert torch.equal(same, p.detach()), f"{name} differs across ranks"
    if rank == 0:
        print(
            json.dumps(
                {
                    "world": world,
                    "worst_rel": worst,
                    "n": n_cmp,
                    "cut_inside_row": bool(cut),
                    "collectives_per_step": inner.n_collectives / steps,
                    "payload": inner.last_payload,
                    "expected_payload": payload,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
