"""Pretrain the paper's GPT with megatron.training's own loop, with AdamW / Muon / AdamMD / MuonMD.

    torchrun --nproc-per-node 2 pretrain_gpt.py --preset tiny --optimizer muon --md-decoupling \
        --use-distributed-optimizer --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOK \
        --data-path data/demo/sotu_text_document --seq-length 256 --max-position-embeddings 256 \
        --micro-batch-size 8 --global-batch-size 16 --lr 3e-2 --train-iters 200 --save ckpt

Every megatron flag works as upstream; ours are in ``megatron/md/train/args.py`` (``--md-*``,
``--preset``, per-group LRs, architecture extras). The command line is read, expanded and run
by ``megatron/md/train/cli.py``.
"""

import os
import sys

from megatron.md import cpu_mode

if __name__ == "__main__":
    # without CUDA: CPU mode first, before megatron.training is imported (a GPU job that
    # sees no GPU stops here instead)
    if cpu_mode.start(sys.argv[1:]):
        # the compiled MD step (--md-fused-step auto on CPU): one compile worker per rank
        # keeps two 457M ranks compiling at once within 24 GB
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    from megatron.md.train import cli

    cli.main()
