"""Dataset and forward-step providers for ``megatron.training.pretrain``: megatron-core's
GPTDataset (``--data-path`` blends of ``tools/preprocess_data.py`` output) or MockGPTDataset
(``--mock-data``), and the standard masked LM loss."""

from __future__ import annotations

import json
from functools import partial

import torch

from megatron.md import errors
from megatron.md.train.datacheck import check_same_samples, data_prefixes, split_sets

#: megatron's dataset flags (their argparse destinations) and the GPTDatasetConfig field each
#: sets; megatron-core ships no function that maps them (Megatron-LM's own pretrain_gpt.py
#: does), and the ones not passed here were ignored without a word
DATASET_FLAGS = {
    "seed": "random_seed",
    "seq_length": "sequence_length",
    "split": "split",
    "data_cache_path": "path_to_cache",
    "reset_position_ids": "reset_position_ids",
    "reset_attention_mask": "reset_attention_mask",
    "eod_mask_loss": "eod_mask_loss",
    "create_attention_mask_in_dataloader": "create_attention_mask",
    "multiple_validation_sets": "multiple_validation_sets",
    "full_validation": "full_validation",
    "num_dataset_builder_threads": "num_dataset_builder_threads",
    "mmap_bin_files": "mmap_bin_files",
    "mid_level_dataset_surplus": "mid_level_dataset_surplus",
    "allow_ambiguous_pad_tokens": "allow_ambiguous_pad_tokens",
    "dataloader_fast_cache_load": "fast_cache_load",
    "dataloader_defer_npy_index_mmap": "defer_npy_index_mmap",
    "object_storage_cache_path": "object_storage_cache_path",
}


def dataset_config(args) -> dict:
    """GPTDatasetConfig's fields from megatron's flags (``DATASET_FLAGS``; a
    ``--per-dataset-sequences-path`` file read as JSON: each dataset's sequence count, which
    spares reading its index), but the blend and the tokenizer."""
    out = {field: getattr(args, flag) for flag, field in DATASET_FLAGS.items()}
    if getattr(args, "per_dataset_sequences_path", None):
        with open(args.per_dataset_sequences_path) as f:
            out["sequences_per_dataset"] = json.load(f)
    return out


def check_flags(args) -> None:
    """The dataset flags' refusals, at start-up: a parser without one of ``DATASET_FLAGS``,
    flags this forward step cannot honour, and the combinations megatron-core 0.19.2 stops
    only once the model is built."""
    if gone := [f for f in DATASET_FLAGS if not hasattr(args, f)]:  # else at the data's build
        errors.fail(
            f"megatron's parser no longer has {', '.join(gone)} (megatron/md/train/data.py "
            "maps them to its dataset config; written against megatron-core 0.19.2)"
        )
    for flag, what in (("sft", "SFTDataset"), ("fim_data", "GPTFIMDataset")):
        if getattr(args, flag, False):  # (Megatron-LM's own entry point picks them)
            errors.fail(
                f"--{flag.replace('_', '-')}: pretrain_gpt.py builds megatron-core's GPTDataset "
                f"(or the mock one), not megatron's {what} (megatron/training/datasets/): the "
                "flag would train on plain pretraining samples"
            )
    for flag in ("dataloader_inter_document_masking", "hybrid_context_parallel"):
        if getattr(args, flag, False):
            errors.fail(
                f"--{flag.replace('_', '-')} needs a forward step that reads packed sequences' "
                "document boundaries (cu_seqlens); pretrain_gpt.py's reads none, and attention "
                "would cross documents without a word"
            )
    if path := getattr(args, "per_dataset_sequences_path", None):
        try:
            with open(path) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            errors.fail(
                f"--per-dataset-sequences-path {path} cannot be read as JSON "
                f"({type(e).__name__}: {e})",
                node=True,
            )
    if args.multiple_validation_sets and not args.full_validation:
        errors.fail(
            "--multiple-validation-sets needs --full-validation (megatron-core 0.19.2 raises "
            "NotImplementedError without it)"
        )
    asked = args.multiple_validation_sets or args.validation_set_names
    per_split = (split_sets(args) if asked else None) or {}  # each split's own datasets
    if args.multiple_validation_sets and (
        args.test_data_path or _test_share(args.split) or per_split.get("test")
    ):
        errors.fail(
            "--multiple-validation-sets with a test set: megatron-core 0.19.2's test "
            "evaluation at the run's end then fails (a TypeError, after training): drop the "
            "test set (--split with a test share of 0, no --test-data-path)"
        )
    sets = per_split.get("valid")
    if args.multiple_validation_sets and not sets:
        errors.fail(
            "--multiple-validation-sets evaluates each --valid-data-path dataset on its own; "
            "without --valid-data-path megatron-core 0.19.2 builds one validation set (a "
            "--data-path blend's share) and the run logs it as set 0: name the sets with "
            "--valid-data-path (or --per-split-data-args-path)"
        )
    names = args.validation_set_names
    if names and (not args.multiple_validation_sets or len(names) != len(sets or [])):
        errors.fail(
            (
                f"--validation-set-names names {len(names)} set(s) for {len(sets or [])} "
                "validation datasets"
                if args.multiple_validation_sets
                else "--validation-set-names needs --multiple-validation-sets"
            )
            + " (megatron-core 0.19.2 asserts it at the first evaluation, after training "
            "has begun)"
        )
    if args.phase_transition_iterations and not args.train_samples:  # (training.py:4491)
        errors.fail(
            "--phase-transition-iterations needs --train-samples: megatron-core 0.19.2 sizes "
            "each phase's datasets from it (with --train-iters: a TypeError once the model is "
            "built)"
        )
    if args.full_validation and not args.multiple_validation_sets:
        from megatron.md.train.metrics import one_set_full_validation_fits

        if not one_set_full_validation_fits():
            errors.fail(
                "--full-validation with one validation set: megatron-core's evaluation no "
                "longer holds the line megatron-md works around (train/metrics.py, "
                "FULL_VALIDATION_LINE): check the workaround against this release"
            )
    if args.full_validation:
        for flag in ("data_path", "valid_data_path"):
            items = getattr(args, flag, None) or []
            if data_prefixes(items) != list(items):
                errors.fail(
                    f"--full-validation takes --{flag.replace('_', '-')} without weights "
                    "(megatron asserts it as it builds the validation sets)"
                )


def _test_share(split: str | None) -> float:
    """The test split's share in megatron's ``--split`` ("969,30,1", "98/2/0")."""
    parts = [float(x) for x in (split or "").replace("/", ",").split(",") if x.strip()]
    return parts[2] if len(parts) > 2 else 0.0


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    offset = 0
    if getattr(args, "init_continue_data", False):  # the source's data stream goes on
        from megatron.md.train.continual import source_samples

        offset = source_samples(args.init_from)
        train_val_test_num_samples = (train_val_test_num_samples[0] + offset,
                                      *train_val_test_num_samples[1:])  # fmt: skip
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        **dataset_config(args), blend=blend, blend_per_split=blend_per_split,
        tokenizer=get_tokenizer(),
    )  # fmt: skip
    cls = MockGPTDataset if args.mock_data else GPTDataset
    train, valid, test = BlendedMegatronDatasetBuilder(
        cls, train_val_test_num_samples, lambda: True, config
    ).build()
    if offset and train is not None:
        from megatron.md.train.continual import OffsetDataset

        train = OffsetDataset(train, offset)
    check_same_samples((train, valid, test))  # each node may read its own files and cache
    return train, valid, test


datasets_provider.is_distributed = True  # every rank builds (TP = PP = 1)


#: --check-for-spiky-loss: a loss this many times the largest of the first 100 seen is a spike
#: (the factor megatron-core's own large-gradient check uses:
#: core/distributed/param_and_grad_buffer.py:369)
SPIKY_LOSS_FACTOR = 10


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-summed LM loss, the token count, and [sum, count] for megatron's averaging."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    check_loss(loss)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def check_loss(loss: torch.Tensor) -> None:
    """megatron's rerun machinery (core/rerun_state_machine.py) sees each micro-batch's loss,
    as megatron's own GPT loss function shows it: a NaN or Inf is fatal
    (``--check-for-nan-in-loss-and-grad``, on by default), a spike is reported and, with
    ``--rerun-mode validate_results``, re-run to tell a transient fault from the data
    (``--check-for-spiky-loss``); ``--error-injection-rate`` and
    ``--result-rejected-tracker-filename`` act on these. Without it only megatron's gradient
    checks saw the run, and ``--check-for-spiky-loss`` did nothing."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    args = get_args()
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for bad, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss,
                rejection_func=bad,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,  # the forward step is deterministic
                fatal=True,
            )
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss,
            rejection_func=partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )


def get_batch(data_iterator) -> dict:
    """The next micro-batch on this rank's device (every rank reads its own: no broadcast over
    TP), and under context parallelism this rank's two of the sequence's 2 × CP chunks, as
    megatron's own GPT forward step cuts it (core/utils.py ``get_batch_on_this_cp_rank``:
    chunks r and 2·CP − 1 − r, so causal attention's work is even across the ranks). Without
    the cut every CP rank fed the whole sequence to the context-parallel attention."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron.md import cpu_mode

    batch = next(data_iterator)
    dev = "cpu" if cpu_mode.is_active() else torch.device("cuda", torch.cuda.current_device())
    batch = {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    if mpu.get_context_parallel_world_size() > 1:
        group = mpu.get_context_parallel_group()
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return batch


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    batch = get_batch(data_iterator)
    if return_schedule_plan:  # megatron's combined 1F1B schedule (--overlap-moe-expert-parallel-
        # comm; core/pipeline_parallel/combined_1f1b.py:384) takes the model's plan for the
        # output
        plan = model.build_schedule_plan(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"],
            loss_mask=batch["loss_mask"],
        )
        return plan, partial(loss_func, batch["loss_mask"])
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
    )
    return output, partial(loss_func, batch["loss_mask"])
