"""CPU mode: megatron's JIT warm-up as the random draws it makes, without its compiles.

Before the model is built, megatron's ``pretrain`` warms up its fused kernels
(training/initialize.py, ``set_jit_fusion_options`` → ``_warmup_jit_function``): bias-SwiGLU (or
bias-GeLU) and bias-dropout-add, torch.compile'd, called on random inputs in two autograd states
each — four dynamo compiles, ~2 s of every CPU rank's start-up (measured 2026-11-27 on a 2-core
VM, torch 2.15.0: "time to initialize megatron" 3.26 s → 1.73 s). A CPU run gains nothing from
them warm. But the warm-up draws from the random generator after the seed is set and before the
weights are initialized, so skipping it would change every CPU run's initial weights. In CPU mode
it is replaced by its draws alone: the inputs it makes (same order, shapes, dtypes, device), and
for each of its ten calls of the compiled bias-dropout-add the one int64 seed that inductor's
generated code draws for its dropout. The generator's state after it is the warm-up's
(tests/test_cpu_mode_and_demo.py compares them; an upgrade of torch that draws otherwise fails
there). When the fused kernel is not compiled (``TORCH_COMPILE_DISABLE=1``, or megatron's
``jit_fuser`` off) the warm-up runs as it is: eager and cheap, and its dropout draws otherwise."""

from __future__ import annotations

import functools

import torch

#: calls of the compiled bias-dropout-add in the warm-up: 5 in each of 2 autograd states
DROPOUT_CALLS = 10


def is_compiled() -> bool:
    """megatron's bias-dropout-add is a torch.compile wrapper and dynamo is on."""
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train as fn

    return hasattr(fn, "_torchdynamo_orig_callable") and not torch._dynamo.config.disable


def draws(tp_size: int | None = None) -> None:
    """What the warm-up draws from the generator, given megatron's args."""
    from megatron.core import parallel_state as mpu
    from megatron.training import get_args

    args = get_args()
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    rand = functools.partial(torch.rand, dtype=dtype, device="cuda")  # (CPU mode redirects)
    cp, mbs = args.context_parallel_size, args.micro_batch_size
    ffn = args.ffn_hidden_size // args.tensor_model_parallel_size
    rand(ffn)  # the activation's bias and input
    rand((args.seq_length // cp, mbs, ffn))
    seq = args.seq_length
    if args.sequence_parallel:
        seq //= tp_size or mpu.get_tensor_model_parallel_world_size()
    x = rand((seq // cp, mbs, args.hidden_size))  # bias-dropout-add's input, residual, bias
    rand((seq // cp, mbs, args.hidden_size))
    rand(args.hidden_size)
    for _ in range(DROPOUT_CALLS):
        torch.randint(2**63 - 1, (1,), device=x.device)


def draws_only(orig, run=None):
    """``set_jit_fusion_options`` (compat.SEAMS, layer cpu): for torch ≥ 2.2 it only warms up."""

    @functools.wraps(orig)
    def set_jit_fusion_options(tp_size=None):
        if not is_compiled():
            return orig(tp_size=tp_size)
        draws(tp_size)

    return set_jit_fusion_options
