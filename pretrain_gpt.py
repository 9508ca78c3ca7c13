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
    # inductor compiles in this process, megatron's jit-fused functions (torch.compile) and
    # the compiled MD step alike: its pool of worker processes outlives the compile and cost
    # dense-181M 16 % of its tokens/s on an H200 (docs/benchmarks.md; compiled.py does the same
    # for its own kernels when used without this script)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # without CUDA: CPU mode first, before megatron.training is imported (a GPU job that
    # sees no GPU stops here instead)
    cpu_mode.start(sys.argv[1:])
    from megatron.md.train import cli, shutdown

    cli.main()
    shutdown.exit_now()  # a run that finished skips the interpreter's teardown (~2 s)
