"""torchrun check: MD optimizer state through megatron-core's torch_dist checkpoints.

    save:     train 2 steps, save (model + optimizer, dp_reshardable), train 3 more, write the
              final weights to DIR/final.pt (the uninterrupted run)
    load:     at any world size, into a model of another init (seed), load DIR/ckpt, train the
              same 3 steps, compare to final.pt
              (``--plain``: megatron's own optimizer from DIR/plain, compared to plain_final.pt)
    continue: load a checkpoint saved WITHOUT MD (plain megatron optimizer) into an MD run:
              the weights must be unchanged and the MD state fresh (gains 1, radius = norm)

    torchrun --nproc-per-node W md_ckpt.py MODE DIR [md_check options] [--md-gains G] [+ MODE ...]

Prints one JSON line on rank 0 per job (jobs joined by ``+`` share one launch).
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import md_check  # noqa: E402

from megatron.md.config import MDConfig  # noqa: E402


def save(dmodel, opt, path: Path, meta: dict) -> None:
    """``meta``: the sharded state dict's metadata (the distributed optimizer's format)."""
    from megatron.core import dist_checkpointing

    msd = dmodel.module.sharded_state_dict(metadata=meta)
    osd = opt.sharded_state_dict(msd, metadata=meta)
    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({"model": msd, "optimizer": osd}, str(path))


def load(dmodel, opt, path: Path, meta: dict) -> bool:
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    from megatron.md.checkpoint import prepare_md_load

    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    has_md = prepare_md_load(opt, keys, dist_checkpointing.load_common_state_dict(str(path)))
    msd = dmodel.module.sharded_state_dict(metadata=meta)
    osd = opt.sharded_state_dict(msd, is_loading=True, metadata=meta)
    sd = dist_checkpointing.load({"model": msd, "optimizer": osd}, str(path))
    dmodel.module.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])
    return has_md


@torch.no_grad()
def eval_loss(model, x, y, replace: dict | None = None) -> float:
    """LM loss of one batch, optionally with some parameters replaced (restored after)."""
    saved = {}
    for n, p in model.named_parameters():
        if replace and n in replace:
            saved[n] = p.detach().clone()
            p.copy_(replace[n])
    model.eval()
    loss = float(md_check.cpu_demo.lm_loss(model, x, y))
    model.train()
    for n, p in model.named_parameters():
        if n in saved:
            p.copy_(saved[n])
    return loss


def full_params(model) -> dict:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def parse(argv: list[str]):
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "load", "continue"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--md-gains", default="rowcol")
    ap.add_argument("--md-row-norms", default="row", help="embedding and LM-head rows")
    ap.add_argument(
        "--sharding",
        default="dp_reshardable",
        choices=["dp_reshardable", "fully_reshardable"],
        help="the distributed optimizer's checkpoint format (--dist-ckpt-optim-fully-reshardable)",
    )
    ap.add_argument("--plain", action="store_true", help="load: megatron's optimizer, no MD")
    ours, rest = ap.parse_known_args(argv)
    return ours, md_check.parse(rest)


def main():
    md_check.run_jobs(parse, lambda job: run(*job))  # (a job is (ours, md_check's args))


def run(ours, args) -> dict:
    """One job (fresh model and optimizers); the result rank 0 prints."""
    rank, world = dist.get_rank(), dist.get_world_size()
    md_check.init_model_parallel(args.cp, args.instances)
    meta = {"distrib_optim_sharding_type": ours.sharding}
    from megatron.md import maps
    from megatron.md.enable import enable_md
    from megatron.md.leaves import leaf_optimizers

    md = MDConfig(
        sphere=args.sphere,
        gains=ours.md_gains,
        fused_step="on" if args.fused_step else "off",
        embedding_norm=ours.md_row_norms,
        output_norm=ours.md_row_norms,
        split_qkv=md_check.split_qkv(args),
    )
    data = torch.tensor(list(md_check.cpu_demo.TEXT.encode()), dtype=torch.long)
    batches = list(md_check.cpu_demo.batches(data, 5, 4, 16, 0))
    out = {"world": world}

    if ours.mode == "save":
        model, dmodel, opt = md_check.build(args, world)
        enable_md(opt, [dmodel], md)
        for x, y in batches[:2]:
            md_check.step(dmodel, opt, x, y)
        save(dmodel, opt, ours.dir / "ckpt", meta)
        for x, y in batches[2:]:
            md_check.step(dmodel, opt, x, y)
        if rank == 0:
            torch.save(full_params(model), ours.dir / "final.pt")
        # and a checkpoint of the same model trained by megatron's own optimizer (no MD)
        model2, dmodel2, opt2 = md_check.build(args, world)
        for x, y in batches[:2]:
            md_check.step(dmodel2, opt2, x, y)
        save(dmodel2, opt2, ours.dir / "plain", meta)
        if rank == 0:
            torch.save(full_params(model2), ours.dir / "plain.pt")
        for x, y in batches[2:]:
            md_check.step(dmodel2, opt2, x, y)
        if rank == 0:
            torch.save(full_params(model2), ours.dir / "plain_final.pt")

    elif ours.mode == "load":
        # another init (another seed): what it made (MD's radius at enable_md, Muon's update
        # scale from it) must not leak through the load
        model, dmodel, opt = md_check.build(args, world, seed=12)
        if ours.plain:  # megatron's own optimizer, resumable as pretrain_gpt.py makes it
            from megatron.md.wrappers import fix_plain_resume

            fix_plain_resume(opt)
        else:
            enable_md(opt, [dmodel], md)
        md_check.step(dmodel, opt, *batches[4])  # a step before loading must not leak through
        out["has_md"] = load(dmodel, opt, ours.dir / ("plain" if ours.plain else "ckpt"), meta)
        for x, y in batches[2:]:
            md_check.step(dmodel, opt, x, y)
        final = torch.load(ours.dir / ("plain_final.pt" if ours.plain else "final.pt"))
        out["worst_rel"] = max(
            float((p.detach().float() - final[n]).norm() / final[n].norm())
            for n, p in model.named_parameters()
        )

    else:  # continue: a checkpoint without MD state
        model, dmodel, opt = md_check.build(args, world)
        enable_md(opt, [dmodel], md)
        out["has_md"] = load(dmodel, opt, ours.dir / "plain", meta)
        plain = torch.load(ours.dir / "plain.pt")
        out["weights_changed"] = max(
            float((p.detach().float() - plain[n]).abs().max()) for n, p in model.named_parameters()
        )
        gains_one, radius_err, head_err = True, 0.0, 0.0
        for o in leaf_optimizers(opt):
            inner = o.optimizer
            for main, slot in inner.slots.items():
                st = inner.md_state[main]
                if slot.name.endswith("output_layer.weight") and "gain_row" in st:
                    # the LM head's unit rows: its row gains take the loaded row norms
                    w = plain[slot.name.replace("module.", "")]
                    g = maps.phi(st["gain_row"], md.gain_map)
                    head_err = max(head_err, float((g / w.norm(dim=1) - 1).abs().max()))
                    continue
                for k in ("gain_row", "gain_col"):
                    if k in st:
                        g = maps.phi(st[k], md.gain_map)
                        gains_one &= bool(torch.allclose(g, torch.ones_like(g), atol=1e-6))
                if st["radius"] is not None and st["radius"].ndim == 0:
                    w = plain[slot.name.replace("module.", "")]
                    radius_err = max(radius_err, abs(float(st["radius"] / w.norm()) - 1))
        out["gains_one"] = gains_one
        out["radius_err"] = radius_err
        out["head_gain_err"] = head_err
        # what the conversion changes, on the loss of a fixed batch: one step at LR 0 applies
        # only the constraints (sphere projections, gains at 1)
        x, y = batches[3]
        out["loss_loaded"] = eval_loss(model, x, y)
        rows = {}  # the loaded model with its embedding rows put at unit norm
        for n, p in model.named_parameters():
            if n.endswith("word_embeddings.weight"):
                rows[n] = p.detach().float() / p.detach().float().norm(dim=1, keepdim=True)
        out["loss_unit_rows"] = eval_loss(model, x, y, rows)
        lrs = [(g, g["lr"]) for o in leaf_optimizers(opt) for g in o.optimizer.param_groups]
        for g, _ in lrs:
            g["lr"] = 0.0
        md_check.step(dmodel, opt, *batches[2])
        out["loss_converted"] = eval_loss(model, x, y)
        for g, lr in lrs:
            g["lr"] = lr
        md_check.step(dmodel, opt, *batches[2])
        out["finite_after_step"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


if __name__ == "__main__":
    main()
