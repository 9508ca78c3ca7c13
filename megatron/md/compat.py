"""Every megatron-core / megatron.training dependency of megatron-md that is not public API,
in one table, checked at start-up.

An upgrade of megatron-core that moves or renames one of these must stop a run before any
work, naming the symbol, never let it train without MD while logging an MD config. Each row:
(module, attribute path, megatron-core 0.19.2 file:line, why we depend on it). ``check()``
resolves every row; ``pretrain_gpt.py`` and ``enable_md`` call it.
"""

from __future__ import annotations

import importlib

#: (module, attribute path, where in megatron-core 0.19.2, why)
SEAMS: tuple[tuple[str, str, str, str], ...] = (
    # training loop (replaced module globals: megatron looks them up at call time)
    ("megatron.training.training", "get_megatron_optimizer", "training/training.py:2132",
     "enable_md on the optimizer megatron builds"),
    ("megatron.training.training", "get_megatron_optimizer_config", "training/training.py",
     "per-group peak LRs; bf16=True for layer-wise sharding"),
    ("megatron.training.training", "load_checkpoint", "training/training.py:2199",
     "MD checkpoint checks, weights-only loads, --init-from"),
    ("megatron.training.training", "training_log", "training/training.py",
     "our JSONL metrics and diagnostics"),
    ("megatron.training.training", "evaluate", "training/training.py", "validation rows"),
    ("megatron.training.training", "evaluate_and_print_results", "training/training.py",
     "valid/test label of a validation row"),
    ("megatron.training.training", "initialize_megatron", "training/training.py:1091",
     "allow_no_cuda on CPU"),
    ("megatron.training.arguments", "add_megatron_arguments", "training/arguments.py:121",
     "our --muon-scale-mode choices in every parser"),
    ("megatron.training.global_vars", "get_wandb_writer", "training/global_vars.py:230",
     "MD diagnostics and config into wandb"),
    ("megatron.core.datasets.utils", "compile_helpers", "core/datasets/utils.py:25",
     "no-op: the wheel ships the compiled helper but no Makefile"),
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "get_write_results_queue",
     "dist_checkpointing/strategies/filesystem_async.py:64", "fork Manager on CPU"),
    ("megatron.core.optimizer.emerging_optimizers", "get_muon_scale_factor",
     "core/optimizer/emerging_optimizers.py:208", "shape_up and rms_match for plain Muon"),
    # optimizer internals read by the MD integrations
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._get_model_param_range_map",
     "core/optimizer/distrib_optimizer.py", "a ZeRO-1 rank's slice of each parameter"),
    ("megatron.core.optimizer.distrib_optimizer",
     "DistributedOptimizer._copy_main_params_to_model_params",
     "core/optimizer/distrib_optimizer.py", "writes the fused W = Γ ⊙ Ŵ instead of a copy"),
    ("megatron.core.optimizer.optimizer",
     "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
     "core/optimizer/optimizer.py", "writes the fused W for bf16 params"),
    ("megatron.core.optimizer.optimizer", "param_group_identifier_keys",
     "core/optimizer/optimizer.py:139", "--init-from gives the load this run's groups"),
    ("megatron.core.optimizer.layer_wise_optimizer", "LayerWiseDistributedOptimizer",
     "core/optimizer/layer_wise_optimizer.py", "MuonMD's whole-matrix sharding"),
    ("megatron.core.optimizer.emerging_optimizers", "TensorParallelMuon",
     "core/optimizer/emerging_optimizers.py:160", "MuonMD replaces its step"),
    ("megatron.core.optimizer", "_get_qkv_split_shapes", "core/optimizer/__init__.py:777-791",
     "megatron tags fused QKV weights (is_qkv) for Muon's Q/K/V split; MD follows the tags"),
    ("megatron.core.tensor_parallel.layers", "_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS",
     "core/tensor_parallel/layers.py:63-70", "tensor_model_parallel, partition_dim, "
     "partition_stride: where a TP rank's piece lies (tensor_parallel.py)"),
    ("megatron.core.parallel_state", "get_tensor_and_data_parallel_group",
     "core/parallel_state.py:1903", "ZeRO-1 under TP: MD's one all-reduce over TP × DP"),
    ("megatron.core.dist_checkpointing.optimizer", "get_param_id_to_sharded_param_map",
     "core/dist_checkpointing/optimizer.py", "MD state keyed by the model's checkpoint keys"),
)  # fmt: skip

#: DistributedOptimizer instance attributes read by zero1.py and mains.py (set in __init__)
DISTRIBUTED_OPTIMIZER_ATTRS = (
    "buffers", "model_param_gbuf_map", "data_parallel_group", "shard_fp32_from_float16_groups",
    "model_float16_groups", "shard_fp32_groups", "model_fp32_groups", "is_stub_optimizer",
)  # fmt: skip


def resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check() -> None:
    """Raise naming every seam that does not resolve in the installed megatron-core."""
    missing = []
    for module, path, where, why in SEAMS:
        try:
            resolve(module, path)
        except (ImportError, AttributeError) as e:
            missing.append(f"{module}.{path} ({where}; {why}): {type(e).__name__}")
    if missing:
        raise RuntimeError(
            "megatron-md's seams into megatron-core no longer fit (written against 0.19.2):\n  "
            + "\n  ".join(missing)
        )


def check_distributed_optimizer(opt) -> None:
    """The DistributedOptimizer attributes the ZeRO-1 integration reads exist on ``opt``."""
    gone = [a for a in DISTRIBUTED_OPTIMIZER_ATTRS if not hasattr(opt, a)]
    if gone:
        raise RuntimeError(
            f"megatron-core's DistributedOptimizer lacks {', '.join(gone)} "
            "(megatron/md/compat.py lists what MD reads; written against 0.19.2)"
        )
