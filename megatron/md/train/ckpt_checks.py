"""Checks of a ``--load`` checkpoint before megatron reads it: complete files, the same model
shape, and MD state that matches ``--md-decoupling``. Each failure names the checkpoint and
the fix; nothing on disk is touched."""

from __future__ import annotations

import os

#: megatron args that fix parameter shapes (a checkpoint of another shape cannot be loaded)
SHAPE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "padded_vocab_size", "num_experts", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "untie_embeddings_and_output_weights",
    "qk_layernorm", "add_bias_linear", "swiglu", "normalization",
)  # fmt: skip
MD_KEY = "optimizer.md."


def _fail(path: str, msg: str):
    raise RuntimeError(f"--load: checkpoint {path}: {msg}; nothing was read or changed")


def check_complete(path: str) -> list[str]:
    """Every storage file the DCP metadata names exists and is long enough (a save killed or
    a copy cut short leaves them short). Returns the checkpoint's tensor keys."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as e:
        _fail(path, f".metadata is unreadable ({type(e).__name__}: {e})")
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = os.path.join(path, rel)
        have = os.path.getsize(f) if os.path.isfile(f) else None
        if have is None or have < size:
            what = "is missing" if have is None else f"is {have} bytes, its metadata needs {size}"
            _fail(path, f"{rel} {what} (truncated checkpoint)")
    return list(meta.state_dict_metadata)


def check_shape(path: str, saved_args, args) -> None:
    diff = [
        f"{k}: checkpoint {getattr(saved_args, k)!r}, this run {getattr(args, k)!r}"
        for k in SHAPE_ARGS
        if hasattr(saved_args, k)
        and hasattr(args, k)
        and getattr(saved_args, k) != getattr(args, k)
    ]
    if diff:
        _fail(path, "it is a model of another shape (" + "; ".join(diff) + ")")


def check_md(path: str, keys: list[str], args) -> bool:
    """Whether the checkpoint has MD state; refuses a silent switch between MD and plain."""
    has_md = any(MD_KEY in k for k in keys)
    loads_optim = not (args.no_load_optim or args.finetune)
    if has_md and not args.md_decoupling and loads_optim:
        _fail(
            path,
            "it was trained with --md-decoupling (its optimizer state belongs to the "
            "directions, not the weights). Add --md-decoupling with the same --md-* flags to "
            "continue it, or --no-load-optim to start a plain optimizer from its weights",
        )
    if not has_md and args.md_decoupling and loads_optim and not args.md_from_plain_checkpoint:
        _fail(
            path,
            "it has no MD state (trained without --md-decoupling). For continual training "
            "add --md-from-plain-checkpoint (keeps its optimizer moments; MD state from its "
            "weights: radius = their norm, gains 1) or --no-load-optim (fresh optimizer)",
        )
    return has_md


def check_all(path: str, args) -> bool:
    """All checks, in the order a researcher would want them named; returns has-MD-state."""
    from megatron.core import dist_checkpointing

    keys = check_complete(path)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:
        _fail(path, f"its common state is unreadable ({type(e).__name__}: {e})")
    saved = common.get("args") if isinstance(common, dict) else None
    if saved is not None:
        check_shape(path, saved, args)
    return check_md(path, keys, args)
