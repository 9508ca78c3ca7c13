"""torchrun check: CPU mode's all_gather into tensors of different sizes (which NCCL takes and
gloo refuses; megatron's layer-wise optimizer without its param layout gathers so). Rank r
contributes 1 + 3r elements of value r; prints one JSON line on rank 0."""

import json

import torch
import torch.distributed as dist

from megatron.md import cpu_mode

cpu_mode.maybe_activate()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [1 + 3 * r for r in range(world)]
    mine = torch.full((sizes[rank],), float(rank))
    got = [mine if r == rank else torch.empty(n) for r, n in enumerate(sizes)]
    dist.all_gather(got, mine)
    ok = all(bool((g == r).all()) and g.numel() == sizes[r] for r, g in enumerate(got))
    if rank == 0:
        print(json.dumps({"world": world, "gathered_right": ok}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
