"""Two ranks, context parallelism 2 (gloo): ``pretrain_gpt.py``'s ``get_batch`` gives each CP
rank its two of the sequence's four chunks (r and 3 − r), every tensor of a GPTDataset batch cut
the same way; rank 0 prints what the ranks got, as JSON."""

import json

import torch
from megatron.core import parallel_state as ps

from megatron.md import cpu_mode
from megatron.md.train.data import get_batch


def main() -> None:
    cpu_mode.maybe_activate()  # (no CUDA here: the batch stays on the CPU)
    torch.distributed.init_process_group("gloo")
    ps.initialize_model_parallel(context_parallel_size=2)
    b, s = 2, 16
    pos = torch.arange(s).expand(b, -1)
    batch = {  # a GPTDataset micro-batch (core/datasets/gpt_dataset.py, __getitem__), collated
        "tokens": pos + 100 * torch.arange(b)[:, None],
        "labels": pos + 1000,
        "loss_mask": (pos % 3 != 0).float(),
        "position_ids": pos.clone(),
        "attention_mask": torch.tril(torch.ones(s, s, dtype=torch.bool)).expand(b, 1, s, s),
    }
    got = get_batch(iter([batch]))
    out = {k: v.tolist() for k, v in got.items()}
    every = [None] * 2
    torch.distributed.all_gather_object(every, (ps.get_context_parallel_rank(), out))
    if torch.distributed.get_rank() == 0:
        print(json.dumps(every))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
