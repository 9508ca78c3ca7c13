"""A trained model back from a ``torch_dist`` checkpoint, for evaluation.

The architecture is the run's own: the args it saved in the checkpoint's common state are
turned back into ``pretrain_gpt.py`` flags (``ARCH``, from megatron's own and ours) and parsed
by the same code as training, so every default and check is the training run's. The model is
built by our model provider and loaded by megatron's ``load_checkpoint`` without optimizer or
RNG state on one process: TP = PP = EP = 1, whatever layout saved it (``torch_dist`` reshards on
load). A checkpoint of another shape than the rebuilt model is refused by the ``--load`` checks
(``ckpt_checks.check_shape``) before anything is read.
"""

from __future__ import annotations

import argparse
import os

#: args that make the model what it is (megatron's ``load_args_from_checkpoint`` list,
#: checkpointing.py, load_args_from_checkpoint, and ours); their saved values are replayed as flags
ARCH = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "seq_length", "max_position_embeddings",
    "position_embedding_type", "rotary_base", "rotary_percent", "rotary_interleaved",
    "use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor",
    "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
    "untie_embeddings_and_output_weights", "layernorm_zero_centered_gamma", "normalization",
    "layernorm_epsilon",
    "qk_layernorm", "make_vocab_size_divisible_by", "vocab_size", "tokenizer_type",
    "tokenizer_model", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk",
    "moe_router_pre_softmax", "moe_grouped_gemm", "moe_shared_expert_intermediate_size",
    "moe_router_score_function", "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor", "moe_router_dtype", "transformer_impl", "bf16", "fp16",
    "paper_arch", "sandwich_norm", "block_output_scale", "prenorm_block_scale",
    "scaled_output_init", "embedding_scale",
    "init_method_std", "hidden_dropout", "attention_dropout", "arch", "ngpt_alpha_init",
    "ngpt_residual_scale",
)  # fmt: skip
#: what megatron's validation samples depend on (``--valid-loss``: the same samples as the run)
DATA = (
    "mock_data", "data_path", "split", "seed", "train_iters", "train_samples", "eval_interval",
    "eval_iters", "global_batch_size", "data_cache_path", "reset_position_ids",
    "reset_attention_mask", "eod_mask_loss",
)  # fmt: skip


def saved_args(load: str, step: int | None = None):
    """(the run's args namespace, the checkpoint directory) of ``load``'s latest (or ``step``)."""
    from megatron.core import dist_checkpointing

    from megatron.md.train.ckpt_checks import locate

    if not os.path.isdir(load):
        raise SystemExit(f"evaluate: error: --load {load}: no such directory")
    try:
        ckpt = locate(load, step)
    except SystemExit as e:
        raise SystemExit(f"evaluate: error: {e.msg if hasattr(e, 'msg') else e}")
    if ckpt is not None and ckpt.format != "torch_dist":
        raise SystemExit(f"evaluate: error: {ckpt.path} is a --ckpt-format {ckpt.format} "
                         "checkpoint; evaluation reads torch_dist")  # fmt: skip
    path = ckpt and ckpt.path
    if path is None:
        raise SystemExit(
            f"evaluate: error: --load {load}: no latest_checkpointed_iteration.txt (not a run "
            "directory with a saved checkpoint; give --ckpt-step N for one of its iter_* folders)"
        )
    common = dist_checkpointing.load_common_state_dict(path)
    saved = common.get("args") if isinstance(common, dict) else None
    if saved is None:
        raise SystemExit(f"evaluate: error: {path} saved no args (not a megatron checkpoint)")
    return saved, path


def _parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from megatron.md.train import args as md_args
    from megatron.md.train import patches

    patches.prepare_parsers()
    parser = argparse.ArgumentParser(allow_abbrev=False)
    return md_args.add_md_args(add_megatron_arguments(parser))


def replay(saved, names) -> list[str]:
    """Flags that set each of ``names`` to its value in ``saved`` (as parsed at training)."""
    out: list[str] = []
    for action in _parser()._actions:
        name = action.dest
        if name not in names or not hasattr(saved, name) or not action.option_strings:
            continue
        if name == "block_output_scale" and not getattr(saved, "sandwich_norm", True):
            continue  # (its default, saved by every run; refused without Sandwich Norm)
        if name.startswith("ngpt_") and getattr(saved, "arch", "gpt") != "ngpt":
            continue  # (the same, without --arch ngpt)
        value = getattr(saved, name)
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if value is not None:
                out.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(action, argparse._StoreTrueAction):
            out += [flag] if value else []
        elif isinstance(action, argparse._StoreFalseAction):
            out += [flag] if not value else []
        elif value is None:
            continue
        elif isinstance(value, (list, tuple)) and action.nargs is None:  # e.g. a layer pattern
            out.append(f"{flag}=[{','.join(map(str, value))}]")
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out.append(f"{flag}={value}")
    return out


#: flags of a Transformer Engine run that the local layer spec does not take
TE_ONLY = ("--transformer-impl", "--moe-grouped-gemm")


def local_for_te(saved) -> str | None:
    """Why a Transformer Engine run is rebuilt with the local layer spec here (None: it is
    not, or TE loads). Its checkpoint loads into the local spec: megatron-core's local layer
    names its norms' sharded keys as TE's fused ones (gpt_layer_specs.py:459,
    ``sharded_state_dict_keys_map``), its linears carry TE's ``_extra_state``
    (tensor_parallel/layers.py:1087) and TE's grouped experts shard as ``SequentialMLP``
    (moe/experts.py:917); an MoE layer's pre-MLP norm keeps TE's name
    (``model.layer_spec``'s ``te_names``). The arithmetic is the same (RMSNorm, SwiGLU,
    softmax attention), in other kernels."""
    if getattr(saved, "transformer_impl", "local") != "transformer_engine":
        return None
    from megatron.md.stack import problems

    found = problems("transformer_engine")
    return found[0] if found else None


def argv_for(
    saved, load: str, ckpt_step: int | None, valid: bool, tokenizer_model: str | None = None
) -> list[str]:
    """The ``pretrain_gpt.py`` command line that rebuilds the run's model to evaluate it
    (megatron's batch sizes are placeholders: the harness adapter makes its own batches);
    ``tokenizer_model``: where the run's tokenizer is now, when it moved. A Transformer
    Engine run where TE does not load: the local layer spec (``local_for_te``)."""
    argv = replay(saved, set(ARCH) | (set(DATA) if valid else set()))
    if local_for_te(saved):
        argv = [f for f in argv if f.split("=")[0] not in TE_ONLY]
        argv += ["--transformer-impl=local"]
    argv += [
        f"--load={load}",
        "--no-load-optim",
        "--no-load-rng",
        "--exit-on-missing-checkpoint",
        "--micro-batch-size=1",
        "--lr=0",  # (nothing trains: the optimizer is never built)
    ]
    if getattr(saved, "arch", "gpt") == "ngpt":  # trained only with MD (ngpt.check_args)
        argv.append("--md-decoupling")
    if tokenizer_model:
        argv.append(f"--tokenizer-model={tokenizer_model}")
    if not valid:  # megatron wants data, a batch and a length of training even to evaluate
        argv += ["--mock-data", "--global-batch-size=1", "--train-iters=1"]
    if ckpt_step is not None:
        argv.append(f"--ckpt-step={ckpt_step}")
    return argv


def build(argv: list[str], saved):
    """Parse ``argv`` (``argv_for(saved, ...)``) as ``pretrain_gpt.py`` does
    (``train/cli.py``), start megatron on this one process, build the model and load the
    checkpoint's weights. Returns (the eval-mode model, megatron's args, the checkpoint's
    iteration). CPU mode, where wanted, is the caller's to start first
    (``cpu_mode.maybe_activate``)."""
    from megatron.core.enums import ModelType
    from megatron.training import get_args, get_model
    from megatron.training import training as mtt
    from megatron.training.checkpointing import load_checkpoint

    from megatron.md import cpu_mode
    from megatron.md.train import ckpt_checks, cli, model, patches, startup

    cli.single_process_env()
    if int(os.environ["WORLD_SIZE"]) != 1:
        raise SystemExit("evaluate: error: run as one process (TP = PP = 1 on one device)")
    args, _ = cli.parse(argv, cpu_mode.is_active())
    if getattr(saved, "transformer_impl", None) == "transformer_engine" != args.transformer_impl:
        args.te_names = True  # model.layer_spec: the MoE layers' pre-MLP norm as TE saved it
        print("evaluate: the run trained with Transformer Engine, which does not load here: its "
              "weights go into the local layer spec", flush=True)  # fmt: skip
    startup.check_stack(args)
    ckpt_checks.check_all(ckpt_checks.locate(args.load, args.ckpt_step), args)
    patches.apply(None, cpu_mode.is_active())  # what pretrain_gpt.py sets up (CPU mode: gloo)
    mtt.initialize_megatron()  # as pretrain() calls it (patched for the CPU)
    chunks = get_model(model.model_provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
    iteration, _ = load_checkpoint(chunks, None, None, strict=True)
    net = chunks[0]
    net.eval()
    return net, get_args(), iteration


def reload(net, step: int) -> int:
    """Checkpoint ``step`` of the same run into the model ``build`` made (the same checks
    first, megatron's ``load_checkpoint`` as there): the next point of a trajectory without
    building the model again. Returns the loaded iteration."""
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint

    from megatron.md.train import ckpt_checks

    args = get_args()
    args.ckpt_step = step
    ckpt_checks.check_all(ckpt_checks.locate(args.load, step), args)
    iteration, _ = load_checkpoint([net], None, None, strict=True)
    net.eval()
    return iteration


def trajectory(load: str, fraction: float) -> list[int]:
    """The complete checkpoints of run directory ``load`` at iteration ≥ ``fraction`` × its
    latest (the tracker's), ascending, the latest included."""
    from megatron.md.train.ckpt_checks import complete, tracked

    last = tracked(load)
    if last is None:
        raise SystemExit(f"evaluate: error: --load {load}: no tracker naming an iteration "
                         "(latest_checkpointed_iteration.txt), so no trajectory")  # fmt: skip
    return [i for i in complete(load) if fraction * last <= i <= last]
