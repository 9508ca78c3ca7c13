"""Every megatron-core / megatron.training dependency of megatron-md that is not public API,
in one table (``SEAMS``), checked at start-up, and the one place the attributes megatron-md
replaces are listed: ``apply`` loops over the table (``train/patches.py`` and ``cpu_mode``
call it for their layer), ``check`` resolves it.

An upgrade of megatron-core that moves or renames one of these, or reorders the parameters
megatron-md passes or reads (``Seam.params``), must stop a run before any work, naming the
symbol, never let it train without MD while logging an MD config. Each row names the
megatron-core 0.19.2 file:line it was written against: the definition, or the call that looks
a replaced global up (tests/test_compat.py checks each line still names its seam).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass

#: layers of the table: optimizer (what ``enable_md`` reads: library code a user may call
#: from their own loop), training (what ``pretrain_gpt.py`` replaces in megatron.training),
#: parser (replaced before parsing), cpu (replaced by ``pretrain_gpt.py`` in CPU mode),
#: cpu-mode (replaced by ``cpu_mode.activate`` itself, for every entry point)
LAYERS = ("optimizer", "training", "parser", "cpu", "cpu-mode")


@dataclass(frozen=True)
class Seam:
    """One non-public megatron-core symbol megatron-md reads or replaces."""

    module: str
    """Module holding the attribute."""
    path: str
    """Attribute path in it (``Class.method`` for a method read)."""
    where: str
    """Where in megatron-core 0.19.2."""
    layer: str
    """One of ``LAYERS``."""
    why: str
    """What megatron-md needs it for."""
    replace: str | None = None
    """``module:function`` building the replacement from the original (``function(orig,
    context)``); None: only read."""
    params: tuple[str, ...] = ()
    """The parameters megatron-md relies on (those its replacement takes by position or reads
    by name; those it passes calling a read row): the original's signature must open with
    these, in this order (``self`` first for a method). Empty: none (a replacement that passes
    every argument on as it came, or an attribute that is not called)."""


_P = "megatron.md.train.patches:"
#: every seam, grouped by layer
SEAMS: tuple[Seam, ...] = (
    # training loop (module globals megatron looks up at call time)
    Seam("megatron.training.training", "setup_model_and_optimizer",
         "training/training.py:1228", "training",
         "the nodes' checks (software, shared --save and logs) before the model is built",
         _P + "check_nodes_first"),
    Seam("megatron.training.training", "get_megatron_optimizer", "training/training.py:2132",
         "training", "enable_md on the optimizer megatron builds", _P + "wrap_optimizer",
         params=("config", "model_chunks")),
    Seam("megatron.training.training", "get_megatron_optimizer_config",
         "training/training.py:2117", "training",
         "per-group peak LRs; bf16=True for layer-wise sharding", _P + "wrap_optimizer_config",
         params=("args",)),
    Seam("megatron.training.training", "load_checkpoint", "training/training.py:2199",
         "training", "checkpoint checks before megatron reads, non-finite and weights-only "
         "loads after, --init-from", _P + "wrap_load",
         params=("ddp_model", "optimizer", "opt_param_scheduler")),
    Seam("megatron.training.training", "save_checkpoint", "training/training.py:3086",
         "training", "no non-finite state saved; checksums after each save; a failed write "
         "said in one line", _P + "wrap_save",
         params=("iteration", "model", "optimizer")),
    Seam("megatron.core.dist_checkpointing.strategies.filesystem_async",
         "FileSystemWriterAsync.write_preloaded_data",
         "core/dist_checkpointing/strategies/filesystem_async.py:364", "training",
         "each rank's write errors kept (megatron passes on only their class)",
         "megatron.md.train.savefail:record_writer_errors"),
    Seam("megatron.training.training", "training_log", "training/training.py:3985",
         "training", "our JSONL metrics and diagnostics", _P + "wrap_training_log",
         params=("loss_dict", "total_loss_dict", "learning_rate", "iteration", "loss_scale",
                 "report_memory_flag", "skipped_iter", "grad_norm")),
    Seam("megatron.training.training", "evaluate", "training/training.py:4402", "training",
         "validation rows", _P + "wrap_evaluate"),
    Seam("megatron.training.training", "evaluate_and_print_results", "training/training.py:4040",
         "training", "valid/test label of a validation row; one validation set's "
         "--full-validation (metrics.FULL_VALIDATION_LINE)", _P + "wrap_evaluate_and_print",
         params=("prefix", "forward_step_func", "data_iterator", "model", "iteration")),
    Seam("megatron.core.optimizer.optimizer", "get_grad_norm_fp32",
         "core/optimizer/optimizer.py:52", "training",
         "MD's non-finite probe read with megatron's gradient norm", _P + "wrap_grad_norm",
         params=("grads_for_norm",)),
    Seam("megatron.core.optimizer.layer_wise_optimizer", "get_grad_norm_fp32",
         "core/optimizer/layer_wise_optimizer.py:17", "training",
         "the same for the layer-wise optimizer", _P + "wrap_grad_norm",
         params=("grads_for_norm",)),
    Seam("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
         "core/optimizer/optimizer.py:52", "training",
         "the clipping timed (ChainedOptimizer.step, optimizer.py:1855, times it not)",
         _P + "time_grad_clip"),
    Seam("megatron.core.optimizer.emerging_optimizers", "get_muon_scale_factor",
         "core/optimizer/emerging_optimizers.py:208", "training",
         "shape_up and rms_match for plain Muon", _P + "wrap_muon_scale",
         params=("size_out", "size_in", "mode")),
    Seam("megatron.core.optimizer.emerging_optimizers",
         "TensorParallelAdaptiveMuon._apply_muon_scale",
         "core/optimizer/emerging_optimizers.py:330", "training",
         "NorMuon: Muon's scale once (megatron's TP orthogonalization applies it; "
         "AdaptiveMuon.step applies it again from a scale_mode megatron never sets)",
         _P + "normuon_scale_once",
         params=("self", "update", "size_out", "size_in")),
    Seam("megatron.core.optimizer.emerging_optimizers", "TensorParallelAdaptiveMuon.state_dict",
         "core/optimizer/emerging_optimizers.py:330", "training",
         "NorMuon's reduced second moment saved at its parameter's shape (megatron's "
         "dist_checkpointing shards optimizer state like the parameter, asserting the shape)",
         _P + "normuon_state_dict",
         params=("self",)),
    Seam("megatron.core.optimizer.emerging_optimizers",
         "TensorParallelAdaptiveMuon.load_state_dict", "core/optimizer/emerging_optimizers.py:330",
         "training", "NorMuon's second moment reduced again after a load",
         _P + "normuon_load_state_dict",
         params=("self", "state_dict")),
    Seam("megatron.core.dist_checkpointing.strategies.torch",
         "TorchDistLoadShardedStrategy.load_tensors_metadata",
         "core/dist_checkpointing/strategies/torch.py:1008", "training",
         "a checkpoint's tensor metadata on a torch whose TensorProperties has strides (every "
         "--dist-ckpt-strictness load but the default failed)",
         "megatron.md.train.dcpmeta:tensors_metadata",
         params=("self", "checkpoint_dir", "metadata")),
    Seam("megatron.core.dist_checkpointing.strategies.torch", "_get_filesystem_reader",
         "core/dist_checkpointing/strategies/torch.py:902", "training",
         "the metadata read as megatron reads it (dcpmeta.tensors_metadata)",
         params=("checkpoint_dir",)),
    Seam("megatron.core.datasets.utils", "compile_helpers", "training/initialize.py:178",
         "training", "no-op: the wheel ships the compiled helper but no Makefile",
         _P + "no_compile_helpers"),
    Seam("megatron.core.datasets.gpt_dataset",
         "GPTDataset._build_document_sample_shuffle_indices",
         "core/datasets/gpt_dataset.py:440", "training",
         "its index cache written whole (runs sharing a cache crashed each other)",
         "megatron.md.train.datacache:atomic_build",
         params=("self",)),
    Seam("megatron.core.datasets.blended_dataset", "BlendedDataset._build_indices",
         "core/datasets/blended_dataset.py:111", "training",
         "the same for a blend's indices", "megatron.md.train.datacache:atomic_build",
         params=("self",)),
    Seam("megatron.core.timers", "Timer.stop", "core/timers.py:156", "training",
         "the time each timer's synchronize waits for the device (the host counters' waits)",
         "megatron.md.train.host:timer_stop_wait",
         params=("self", "barrier")),
    Seam("megatron.training.global_vars", "get_wandb_writer", "training/global_vars.py:48",
         "training", "MD diagnostics and config into wandb"),
    Seam("megatron.training.global_vars", "_set_tensorboard_writer",
         "training/global_vars.py:210", "parser",
         "the TensorBoard writer opened after the start-up checks, not while parsing",
         "megatron.md.train.wandbrun:opened_later",
         params=("args",)),
    Seam("megatron.training.global_vars", "_set_wandb_writer", "training/global_vars.py:230",
         "parser", "the wandb run opened after the start-up checks, not while parsing; a "
         "resumed run's own continued", "megatron.md.train.wandbrun:opened_later",
         params=("args",)),
    Seam("megatron.training.arguments", "add_megatron_arguments", "training/arguments.py:121",
         "parser", "our --muon-scale-mode choices in every parser; help with a bare %",
         _P + "wrap_parser",
         params=("parser",)),
    # CPU mode
    Seam("megatron.training.training", "initialize_megatron", "training/training.py:1091",
         "cpu", "allow_no_cuda", _P + "allow_no_cuda",
         params=("allow_no_cuda",)),
    Seam("megatron.core.dist_checkpointing.strategies.filesystem_async",
         "get_write_results_queue", "core/dist_checkpointing/strategies/filesystem_async.py:200",
         "cpu", "a fork Manager (spawn re-imports the script)", _P + "fork_results_queue",
         params=("mp_mode",)),
    Seam("megatron.core.dist_checkpointing.strategies.filesystem_async", "_results_queue",
         "core/dist_checkpointing/strategies/filesystem_async.py:49", "cpu",
         "the queue get_write_results_queue keeps: one served by a Manager dying with its rank"),
    Seam("megatron.training.training", "set_jit_fusion_options", "training/training.py:1117",
         "cpu", "the JIT warm-up's random draws without its compiles (~2 s a rank)",
         "megatron.md.train.cpu_warmup:draws_only",
         params=("tp_size",)),
    Seam("megatron.core.fusions.fused_bias_dropout", "bias_dropout_add_fused_train",
         "core/fusions/fused_bias_dropout.py:70", "cpu",
         "compiled or not: whether the warm-up's draws are made without it"),
    Seam("megatron.training.initialize", "_warmup_jit_function", "training/initialize.py:497",
         "cpu", "the warm-up cpu_warmup.draws stands for (the test compares the two)"),
    Seam("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
         "core/tensor_parallel/random.py:318", "cpu-mode", "the CPU generator's state",
         "megatron.md.cpu_mode:rng_get"),
    Seam("megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
         "core/tensor_parallel/random.py:323", "cpu-mode", "the CPU generator's state",
         "megatron.md.cpu_mode:rng_set",
         params=("new_state",)),
    # optimizer internals read by the MD integrations
    Seam("megatron.core.optimizer.distrib_optimizer",
         "DistributedOptimizer._get_model_param_range_map",
         "core/optimizer/distrib_optimizer.py:786",
         "optimizer", "a ZeRO-1 rank's slice of each parameter", params=("self", "param")),
    Seam("megatron.core.optimizer.distrib_optimizer",
         "DistributedOptimizer._copy_main_params_to_model_params",
         "core/optimizer/distrib_optimizer.py:2792", "optimizer",
         "writes the fused W = Γ ⊙ Ŵ instead of a copy", params=("self",)),
    Seam("megatron.core.optimizer.distrib_optimizer",
         "DistributedOptimizer._set_main_param_and_optimizer_states",
         "core/optimizer/distrib_optimizer.py:1193", "optimizer",
         "a fully-reshardable load without the Adam step it then reads (wrappers.py)",
         params=("self", "model_param", "tensors")),
    Seam("megatron.core.optimizer.optimizer",
         "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
         "core/optimizer/optimizer.py:1112", "optimizer", "writes the fused W for bf16 params",
         params=("self",)),
    Seam("megatron.core.optimizer.optimizer", "MegatronOptimizer.get_grads_for_grad_norm",
         "core/optimizer/optimizer.py:280", "optimizer", "MD's probe in the gradient norm",
         params=("self", "grad_norm_group")),
    Seam("megatron.core.optimizer.optimizer", "param_group_identifier_keys",
         "core/optimizer/optimizer.py:139", "optimizer",
         "--init-from gives the load this run's groups"),
    Seam("megatron.core.optimizer.layer_wise_optimizer", "LayerWiseDistributedOptimizer",
         "core/optimizer/layer_wise_optimizer.py:167", "optimizer",
         "MuonMD's whole-matrix sharding"),
    Seam("megatron.core.optimizer.emerging_optimizers", "TensorParallelMuon",
         "core/optimizer/emerging_optimizers.py:160", "optimizer", "MuonMD replaces its step"),
    Seam("megatron.core.optimizer", "_get_qkv_split_shapes", "core/optimizer/__init__.py:788",
         "optimizer", "megatron tags fused QKV weights (is_qkv) for Muon's Q/K/V split"),
    Seam("megatron.core.tensor_parallel.layers", "_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS",
         "core/tensor_parallel/layers.py:63", "optimizer",
         "tensor_model_parallel, partition_dim, partition_stride: a TP rank's piece"),
    Seam("megatron.core.parallel_state", "get_tensor_and_data_parallel_group",
         "core/parallel_state.py:1903", "optimizer", "ZeRO-1 under TP: one all-reduce",
         params=("check_initialized", "with_context_parallel")),
    Seam("megatron.core.dist_checkpointing.optimizer", "get_param_id_to_sharded_param_map",
         "core/dist_checkpointing/optimizer.py:45", "optimizer",
         "MD state keyed by the model's checkpoint keys",
         params=("model_sharded_state_dict", "optim_params_iter")),
)  # fmt: skip


def resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def owner(s: Seam):
    """The object holding ``s``'s attribute (its module, or the class of a ``Class.method``
    row) and the attribute's name."""
    parent, _, name = s.path.rpartition(".")
    return (resolve(s.module, parent) if parent else importlib.import_module(s.module)), name


def check(layers=LAYERS) -> None:
    """Raise naming every seam of ``layers`` that does not resolve in the installed
    megatron-core, or whose signature no longer opens with the parameters megatron-md relies
    on (``Seam.params``)."""
    missing = []
    for s in SEAMS:
        if s.layer not in layers:
            continue
        try:
            obj = resolve(s.module, s.path)
        except (ImportError, AttributeError) as e:
            missing.append(f"{s.module}.{s.path} ({s.where}; {s.why}): {type(e).__name__}")
            continue
        if s.params and (now := leading_params(obj, len(s.params))) != s.params:
            missing.append(
                f"{s.module}.{s.path} ({s.where}; {s.why}): its parameters open with "
                f"({', '.join(now)}), megatron-md relies on ({', '.join(s.params)})"
            )
    if missing:
        raise RuntimeError(
            "megatron-md's seams into megatron-core no longer fit (written against 0.19.2):\n  "
            + "\n  ".join(missing)
        )


def leading_params(obj, n: int) -> tuple[str, ...]:
    """The first ``n`` parameter names of ``obj`` as megatron-core defines it (a replacement
    already applied is read through to the original it wraps)."""
    original = getattr(obj, "__md_seam__", obj)
    try:
        return tuple(inspect.signature(original).parameters)[:n]
    except (TypeError, ValueError):  # no signature to read: a builtin, a class without one
        return ()


def apply(layer: str, context=None) -> None:
    """Replace every attribute of ``layer``'s rows (``Seam.replace``) with the replacement
    built from the original (a ``Class.method`` path replaces the method on the class).
    Idempotent: a replaced attribute is recognized (``__md_seam__``) and built again from the
    original it wraps, never wrapped twice. A static method's replacement stays static."""
    for s in SEAMS:
        if s.layer != layer or s.replace is None:
            continue
        holder, name = owner(s)
        static = isinstance(inspect.getattr_static(holder, name), staticmethod)
        current = getattr(holder, name)
        orig = getattr(current, "__md_seam__", current)
        fn_module, fn_name = s.replace.split(":")
        new = getattr(importlib.import_module(fn_module), fn_name)(orig, context)
        if not callable(new):
            raise TypeError(f"{s.replace} built no function for {s.module}.{s.path}")
        try:
            new.__md_seam__ = orig
        except AttributeError:  # a functools.partial: wrap it to carry the marker
            new = functools.update_wrapper(functools.partial(new), orig)
            new.__md_seam__ = orig
        setattr(holder, name, staticmethod(new) if static else new)


#: DistributedOptimizer instance attributes read by zero1.py and mains.py (set in __init__)
DISTRIBUTED_OPTIMIZER_ATTRS = (
    "buffers", "model_param_gbuf_map", "data_parallel_group", "shard_fp32_from_float16_groups",
    "model_float16_groups", "shard_fp32_groups", "model_fp32_groups", "is_stub_optimizer",
    "distributed_optimizer_instance_id",
)  # fmt: skip


def check_distributed_optimizer(opt) -> None:
    """The DistributedOptimizer attributes the ZeRO-1 integration reads exist on ``opt``."""
    gone = [a for a in DISTRIBUTED_OPTIMIZER_ATTRS if not hasattr(opt, a)]
    if gone:
        raise RuntimeError(
            f"megatron-core's DistributedOptimizer lacks {', '.join(gone)} "
            "(megatron/md/compat.py lists what MD reads; written against 0.19.2)"
        )
