"""The checkpoint a run resumes from, found and checked before megatron reads anything:
which directory (``locate``: the tracker or ``--ckpt-step``), in which format, complete files,
the same model shape, the same optimizer, a (TP, PP) layout its optimizer state's format
loads at, the param layout layer-wise AdamMD saved with, MD state that matches
``--md-decoupling``, and the shards' checksums (``digest.py``). Each failure is a refusal
naming the checkpoint and the way out; nothing on disk is touched."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field

from megatron.md import errors
from megatron.md.checkpoint import MD_KEY_PREFIX

#: megatron args that fix parameter shapes (a checkpoint of another shape cannot be loaded)
SHAPE_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "padded_vocab_size", "num_experts", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "untie_embeddings_and_output_weights",
    "qk_layernorm", "add_bias_linear", "swiglu", "normalization",
)  # fmt: skip
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass
class Checkpoint:
    """One saved iteration of a run directory."""

    path: str
    """The ``iter_NNNNNNN`` (or ``release``) directory."""
    format: str
    """torch_dist, or torch (megatron's ``--ckpt-format torch``: ``mp_rank_*`` files)."""
    keys: dict = field(default_factory=dict)
    """torch_dist: every tensor key of its metadata, with DCP's metadata of it (filled by
    ``check_complete``)."""
    common: dict | None = None
    """torch_dist: its common (non-tensor) state, args included (filled by ``check_all``)."""
    flag: str = "--load"
    """The flag that gave it (--load, --init-from, --pretrained-checkpoint): refusals say it."""


def fail(where: str | Checkpoint, msg: str):
    """A refusal of the checkpoint ``where`` (its path: named by --load), naming its flag.
    The ways out say ``--no-load-optim``; for ``--init-from`` that is ``--init-weights-only``
    (patches._load_init reads the one as the other, but the docs name only the latter)."""
    flag, path = (where.flag, where.path) if isinstance(where, Checkpoint) else ("--load", where)
    if flag == "--init-from":
        msg = msg.replace("--no-load-optim", "--init-weights-only")
    errors.fail(f"{flag}: checkpoint {path}: {msg}; nothing was read or changed")


def iterations(load: str) -> list[int]:
    """The iterations saved in run directory ``load`` (its ``iter_*`` folders), ascending."""
    try:
        names = os.listdir(load)
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"iter_(\d{7})", n)))


def complete(load: str) -> list[int]:
    """The iterations of ``load`` whose checkpoint is complete (a format's files present)."""
    return [i for i in iterations(load) if saved_format(os.path.join(load, f"iter_{i:07d}"))]


def tracked(d: str) -> int | None:
    """The iteration ``d``'s tracker names (None: no tracker, ``release``, or damaged)."""
    try:
        with open(os.path.join(d, TRACKER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def resumable(load: str, but: str | None = None) -> str:
    """The way out of a tracker that names no complete checkpoint: the complete ones ``load``
    holds (the last five), to resume with ``--ckpt-step``."""
    done = [i for i in complete(load) if f"iter_{i:07d}" != but]
    if not done:
        return f"{load} holds no other complete checkpoint"
    return (f"resume a complete one with --ckpt-step N ({load} holds "
            f"{', '.join(map(str, done[-5:]))})")  # fmt: skip


def same_dir(a: str, b: str) -> bool:
    """``a`` and ``b`` name one directory (a trailing slash, a relative path, a symlink)."""
    return os.path.realpath(a) == os.path.realpath(b)


def saved_format(path: str) -> str | None:
    """The format of the saved iteration ``path`` (torch_dist: ``.metadata``; torch: megatron's
    ``mp_rank_*`` files); None: not a complete one (or no directory)."""
    entries = os.listdir(path) if os.path.isdir(path) else []
    if ".metadata" in entries:
        return "torch_dist"
    return "torch" if any(e.startswith("mp_rank_") for e in entries) else None


def no_checkpoint_to_resume(load: str, save: str | None) -> str | None:
    """Why resuming ``--load`` is a mistake, else None. megatron starts from random weights
    when ``--load`` holds no tracker (training/checkpointing.py, ``_load_base_checkpoint``: a
    warning on rank 0 only), which is a first start when ``--load`` is the run's own
    ``--save``, and a silent restart from scratch otherwise: one iteration directory given for
    its run, or a path that was mistyped."""
    if os.path.isfile(os.path.join(load, TRACKER)):
        return None
    name = os.path.basename(os.path.normpath(load))
    if saved_format(load):
        m = re.fullmatch(r"iter_(\d{7})", name)
        step = f" --ckpt-step {int(m.group(1))}" if m else ""
        return (f"--load {load} is one saved iteration, not a run directory: give its run "
                f"directory (--load {os.path.dirname(os.path.normpath(load))}{step})")  # fmt: skip
    if save and same_dir(save, load):
        return None  # a run's first start, resuming in place later
    saved = iterations(load)
    why = (
        f"it holds iter_{saved[-1]:07d} but no {TRACKER}: name one with --ckpt-step N"
        if saved
        else "it holds no checkpoint"
        if os.path.isdir(load)
        else "no such directory"
    )
    return (
        f"--load {load}: {why}; megatron would start from random weights. To start a new "
        "run give --load the same directory as --save (or no --load)"
    )


def save_over_another_run(save: str, load: str | None) -> str | None:
    """Why ``--save`` would write over a run this one does not resume, else None: megatron
    saves ``iter_N`` and rewrites the tracker in ``--save`` whatever it holds, so a new run
    given an earlier run's directory replaces that run's checkpoints (an ``iter_N`` of the same
    number) and its tracker (which then names the new run's iteration)."""
    tracker = os.path.join(save, TRACKER)
    if not os.path.isfile(tracker) or (load and same_dir(load, save)):
        return None
    latest = open(tracker).read().strip()
    resumes = f"resumes --load {load}" if load else "has no --load"
    return (
        f"--save {save} holds another run's checkpoints (its tracker names {latest}) and "
        f"this run {resumes}: its saves would write over them. Resume that run with --load "
        f"{save}, or give this run a directory of its own"
    )


def locate(load: str, step: int | None = None, flag: str = "--load") -> Checkpoint | None:
    """The checkpoint ``load`` resumes from (``step``, else the tracker's); None: nothing to
    resume (no tracker). Refused: a tracker that names no iteration, a missing or incomplete
    directory (a save killed midway), a format megatron-md cannot read."""
    tracker = os.path.join(load, TRACKER)
    if step is not None:
        text = str(step)
    elif not os.path.isfile(tracker):
        return None
    else:
        text = open(tracker).read().strip()
    name = "release" if text == "release" else None
    if name is None:
        try:
            name = f"iter_{int(text):07d}"
        except ValueError:
            errors.fail(f"{flag} {load}: {tracker} holds {text!r}, not an iteration (a save "
                        f"cut while writing it?): {resumable(load)}")  # fmt: skip
    path = os.path.join(load, name)
    if fmt := saved_format(path):
        return Checkpoint(path, fmt, flag=flag)
    errors.fail(
        f"{flag} {load}: {path} is missing or not a complete checkpoint (neither torch_dist's "
        f".metadata nor torch's mp_rank_* files): {resumable(load, name)}; nothing was read or "
        "changed"
    )


def check_format(ckpt: Checkpoint, args) -> None:
    """MD state lives in torch_dist checkpoints only; say which format was found."""
    auto = getattr(args, "auto_detect_ckpt_format", False) and not args.md_decoupling
    if ckpt.format == args.ckpt_format or auto:
        return
    if args.md_decoupling:
        fail(
            ckpt,
            f"it is a --ckpt-format {ckpt.format} checkpoint, and MD runs save and load their "
            "state in torch_dist only (--ckpt-format torch_dist, the default)",
        )
    fail(ckpt, f"it is a --ckpt-format {ckpt.format} checkpoint; this run reads "
                    f"--ckpt-format {args.ckpt_format}: give the checkpoint's format")  # fmt: skip


def check_complete(ckpt: Checkpoint) -> None:
    """Every storage file the DCP metadata names exists and is long enough (a save killed or
    a copy cut short leaves them short). Fills ``ckpt.keys``."""
    from torch.distributed.checkpoint import FileSystemReader

    path = ckpt.path
    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as e:
        import torch

        # torch 2.9.1 cannot unpickle torch 2.15.0's .metadata ("too many values to unpack
        # (expected 5)", seen 2026-12-03): DCP's metadata is not readable by an older torch
        why = f"{type(e).__name__}: {e}; this is torch {torch.__version__}"
        fail(ckpt, f".metadata is unreadable ({why}: a newer torch's checkpoint can be)")
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = os.path.join(path, rel)
        have = os.path.getsize(f) if os.path.isfile(f) else None
        if have is None or have < size:
            what = "is missing" if have is None else f"is {have} bytes, its metadata needs {size}"
            fail(ckpt, f"{rel} {what} (truncated checkpoint)")
    ckpt.keys = dict(meta.state_dict_metadata)


def _differing(saved_args, args, names) -> list[str]:
    """The args of ``names`` both hold, with different values."""
    return [k for k in names if hasattr(saved_args, k) and hasattr(args, k)
            and getattr(saved_args, k) != getattr(args, k)]  # fmt: skip


def _described(saved_args, args, names: list[str]) -> str:
    return "; ".join(f"{k}: checkpoint {getattr(saved_args, k)!r}, this run "
                     f"{getattr(args, k)!r}" for k in names)  # fmt: skip


def check_shape(where: str | Checkpoint, saved_args, args) -> None:
    if diff := _differing(saved_args, args, SHAPE_ARGS):
        fail(where, f"it is a model of another shape ({_described(saved_args, args, diff)})")


#: megatron args that set the position encoding: a resumed run computing other positions than
#: its checkpoint was trained with would continue as another model (nothing in the shapes shows)
POSITION_ARGS = (
    "position_embedding_type", "rotary_base", "rotary_percent", "use_rope_scaling",
    "rope_scaling_factor",
)  # fmt: skip


def check_layer_impl(where: str | Checkpoint, saved_args, args) -> None:
    """An MoE checkpoint loads only into the layer implementation that saved it: megatron-core
    0.19.2's local MoE layer saves its pre-MLP norm as ``mlp.linear_fc1.layer_norm_weight``,
    Transformer Engine's as ``pre_mlp_layernorm.weight`` (core/models/gpt/gpt_layer_specs.py:
    459, 336); a dense model's names are the same in both. The evaluation's local rebuild of a
    TE run maps the name (``args.te_names``, evaluation/restore.py)."""
    impls = getattr(saved_args, "transformer_impl", None), args.transformer_impl
    if not args.num_experts or None in impls or impls[0] == impls[1]:
        return
    if getattr(args, "te_names", False) and impls == ("transformer_engine", "local"):
        return
    fail(where, f"its MoE layers were saved by the {impls[0]} layers and this run builds the "
         f"{impls[1]} ones, which name the pre-MLP norm otherwise (megatron-core's local spec: "
         "mlp.linear_fc1.layer_norm_weight, Transformer Engine's: pre_mlp_layernorm.weight): "
         f"give --transformer-impl {impls[0]} (tools/evaluate.py and tools/export_hf.py read a "
         "Transformer Engine run where TE does not load)")  # fmt: skip


def _flag_for(name: str, value) -> str:
    """The flag that gives ``name`` its ``value`` (None: the flag left out)."""
    if name == "use_rope_scaling":
        return "--rope-scaling" if value else "--no-rope-scaling"
    flag = "--" + name.replace("_", "-")
    if value is None:
        return f"drop {flag}"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag}={value}"


def check_positions(where: Checkpoint, saved_args, args) -> None:
    """A resumed run (``--load`` of its own run, not ``--finetune``) keeps the position
    encoding its checkpoint was trained with: the paper's dense presets turn RoPE scaling on
    (2026-12-03), so a run started before resumes with ``--no-rope-scaling``, which the
    refusal names. A new run from a checkpoint's weights may change it (long-context)."""
    if where.flag != "--load" or args.finetune:
        return
    scaled = getattr(saved_args, "use_rope_scaling", False) and args.use_rope_scaling
    names = [k for k in POSITION_ARGS if k != "rope_scaling_factor" or scaled]
    if diff := _differing(saved_args, args, names):
        was = _described(saved_args, args, diff)
        fix = " ".join(_flag_for(k, getattr(saved_args, k)) for k in diff)
        if "use_rope_scaling" in diff:
            fix += "; the paper's dense presets turn RoPE scaling on since 2026-12-03"
        fail(where, f"it was trained with another position encoding ({was}): resuming would "
             f"continue as another model; give the checkpoint's ({fix}), or start a new run "
             "from its weights with --init-from")  # fmt: skip


def check_block_scale(where: Checkpoint, saved_args, args) -> None:
    """A resumed run (``--load`` of its own run, not ``--finetune``) keeps its blocks' output
    scale: Sandwich Norm and its α (``--block-output-scale``), or α alone
    (``--prenorm-block-scale``; a checkpoint older than the flag had none). Another scale
    trains another model and nothing in the shapes shows it; a new run from the checkpoint's
    weights may change it."""
    if where.flag != "--load" or args.finetune or not hasattr(saved_args, "sandwich_norm"):
        return
    names = ["sandwich_norm", "prenorm_block_scale"]
    if saved_args.sandwich_norm and args.sandwich_norm:
        names.append("block_output_scale")
    saved = argparse.Namespace(**{k: getattr(saved_args, k, None) for k in names})
    if not (diff := _differing(saved, args, names)):
        return
    fix = "; ".join(_flag_for(k, getattr(saved, k)) for k in diff)
    was = _described(saved, args, diff)
    fail(where, f"its blocks were trained with another output scale ({was}): resuming would "
         f"continue as another model; give the checkpoint's ({fix}), or start a new run from "
         "its weights with --init-from")  # fmt: skip


def optimizer_name(a) -> str:
    """AdamW, AdamMD, Muon, MuonMD, Muown, as the run's flags make it."""
    base = {"adam": "Adam", "muon": "Muon"}.get(a.optimizer, a.optimizer)
    if not getattr(a, "md_decoupling", False):
        return "AdamW" if base == "Adam" else base
    if getattr(a, "md_variant", "md") != "md":
        return {"muown-unit": "Muown (unit rows)", "muown-angular": "Muown-angular"}.get(
            a.md_variant, "Muown"
        )
    if base == "Adam" and getattr(a, "md_adam_layer_wise", False):
        return "AdamMD (layer-wise)"
    return base + "MD"


def check_optimizer(where: str | Checkpoint, saved_args, args) -> None:
    """Optimizer state continues only under the optimizer that made it: a change (Adam ↔ Muon,
    MD's variant, layer-wise AdamMD) is named as such, with the ways out. Plain ↔ MD is
    ``check_md``'s (continual training has its own flag)."""
    if args.no_load_optim or args.finetune:
        return
    was, now = optimizer_name(saved_args), optimizer_name(args)
    md = bool(getattr(saved_args, "md_decoupling", False)), bool(args.md_decoupling)
    if was == now or md[0] != md[1]:
        return
    fail(
        where,
        f"it was trained with {was} (--optimizer {saved_args.optimizer}) and this run is {now} "
        f"(--optimizer {args.optimizer}): {was}'s optimizer state does not continue as {now}'s. "
        "Add --no-load-optim to start this optimizer fresh from its weights"
        + (" (MD state is then made from the weights: radius = their norm, gains 1)"
           if args.md_decoupling else ""),
    )  # fmt: skip


def check_resharding(where: str | Checkpoint, saved_args, common: dict, keys, args) -> None:
    """megatron's distributed optimizer loads its state at another (TP, PP) only from the
    fully reshardable formats (training/checkpointing.py:2246, a RuntimeError after the model's
    build naming a flag that is already the default). Layer-wise Muon keeps its Adam groups in
    one as well (core/optimizer/__init__.py:832, on megatron's layer-wise param layout, the
    default; saved under ``optimizer.distributed.`` keys): loaded at another TP, megatron's
    CheckpointingException after the build (a global shape mismatch, seen 2026-12-01)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if args.no_load_optim or args.finetune:
        return
    layer_wise = getattr(args, "use_layer_wise_distributed_optimizer", False)
    if not args.use_distributed_optimizer and not (
        layer_wise and any(".optimizer.distributed." in "." + k for k in keys)
    ):
        return
    was = (getattr(saved_args, "tensor_model_parallel_size", 1),
           getattr(saved_args, "pipeline_model_parallel_size", 1))  # fmt: skip
    now = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    kind = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if (
        was == now
        or kind is None
        or kind in DistributedOptimizer.checkpoint_fully_reshardable_formats
    ):
        return
    fail(
        where,
        f"its distributed-optimizer state is in megatron's {kind} format, which loads only at "
        f"the (TP, PP) it was saved with, {was} (this run {now}): resume at TP {was[0]}, PP "
        f"{was[1]} (the data-parallel size may change), or add --no-load-optim to continue "
        "from its weights with a fresh optimizer. A run saving with "
        "--dist-ckpt-optim-fully-reshardable can change TP and PP at a resume",
    )


def check_param_layout(where: str | Checkpoint, saved_args, args) -> None:
    """Layer-wise AdamMD keeps its 1-D parameters in a distributed optimizer of their own with
    megatron's layer-wise param layout and in the layer-wise optimizer without it
    (core/optimizer/__init__.py, ``use_separate_distributed_optimizer``): their state does not
    load across (megatron's KeyError after the build, seen both ways at 2 ranks). Muon and
    MuonMD load across (seen both ways)."""
    if args.no_load_optim or args.finetune or not getattr(args, "md_adam_layer_wise", False):
        return
    was = getattr(saved_args, "use_layer_wise_param_layout", True)
    if (
        not getattr(saved_args, "md_adam_layer_wise", False)
        or was == args.use_layer_wise_param_layout
    ):
        return

    def how(layout: bool) -> str:
        return ("on megatron's layer-wise param layout (the default)" if layout
                else "with --no-use-layer-wise-param-layout")  # fmt: skip

    fail(
        where,
        f"it was saved {how(was)} and this run is {how(args.use_layer_wise_param_layout)}: "
        "layer-wise AdamMD keeps its 1-D parameters' state in another optimizer with the "
        "layout than without it. Resume as it was saved, or add --no-load-optim to continue "
        "from its weights with a fresh optimizer",
    )


def check_saved_optimizer(where: str | Checkpoint, keys, common: dict, args) -> None:
    """A checkpoint saved with ``--no-save-optim`` holds no optimizer state (nor the LR
    schedule's): megatron's load failed on it with a KeyError, and an MD run was told it had
    been trained without MD."""
    if args.no_load_optim or args.finetune:
        return
    if "optimizer" in common or any(k.startswith("optimizer.") for k in keys):
        return
    fail(
        where,
        "it holds no optimizer state (saved with --no-save-optim): add --no-load-optim to "
        "continue from its weights with a fresh optimizer (the LR schedule continues at its "
        "iteration"
        + ("; MD state is made from the weights: radius = their norm, gains 1)"
           if args.md_decoupling else ")"),
    )  # fmt: skip


def check_schedule_weight_decay(where: str | Checkpoint, common: dict, args) -> None:
    """MD trains without weight decay (its matrices stay on their spheres). A checkpoint whose
    LR schedule has weight decay (a plain run's, continued with ``--md-from-plain-checkpoint``)
    stopped at megatron's schedule check once the model was built, naming
    ``--use-checkpoint-opt_param-scheduler`` as a way out, which brought the weight decay back:
    a ValueError at the first step (seen, 2026-11-29, Muon → MuonMD at 2 ranks)."""
    if not args.md_decoupling or args.no_load_optim or args.finetune:
        return
    if args.override_opt_param_scheduler:  # this run's schedule: weight decay 0
        return
    if isinstance(where, Checkpoint) and where.flag == "--init-from":  # its schedule is not read
        return
    sched = common.get("opt_param_scheduler") or {}
    wd = [float(sched.get(k) or 0.0) for k in ("start_wd", "end_wd")]
    if not any(wd):
        return
    fail(
        where,
        f"its LR schedule has weight decay {wd[0]:g} (to {wd[1]:g}), trained without MD, and MD "
        "trains without weight decay: add --override-opt_param-scheduler (this run's schedule "
        "from the checkpoint's step, weight decay 0)"
        + ("; --use-checkpoint-opt_param-scheduler would bring its weight decay back"
           if args.use_checkpoint_opt_param_scheduler else ""),
    )  # fmt: skip


def check_md(where: str | Checkpoint, keys, args) -> bool:
    """Whether the checkpoint has MD state; refuses a silent switch between MD and plain."""
    has_md = any(MD_KEY_PREFIX in k for k in keys)
    loads_optim = not (args.no_load_optim or args.finetune)
    if has_md and not args.md_decoupling and loads_optim:
        fail(
            where,
            "it was trained with --md-decoupling (its optimizer state belongs to the "
            "directions, not the weights). Add --md-decoupling with the same --md-* flags to "
            "continue it, or --no-load-optim to start a plain optimizer from its weights",
        )
    if not has_md and args.md_decoupling and loads_optim and not args.md_from_plain_checkpoint:
        fail(
            where,
            "it has no MD state (trained without --md-decoupling). For continual training "
            "add --md-from-plain-checkpoint (keeps its optimizer moments; MD state from its "
            "weights: radius = their norm, gains 1) or --no-load-optim (fresh optimizer)",
        )
    return has_md


def check_all(ckpt: Checkpoint, args) -> bool:
    """All checks, in the order a researcher would want them named; returns has-MD-state.
    A torch-format checkpoint of a plain run is megatron's to load (nothing here reads it)."""
    from megatron.core import dist_checkpointing

    from megatron.md.train import digest

    check_format(ckpt, args)
    if ckpt.format != "torch_dist":
        return False
    check_complete(ckpt)
    if getattr(args, "ckpt_checksums", True):
        digest.verify(ckpt.path)
    try:
        ckpt.common = dist_checkpointing.load_common_state_dict(ckpt.path)
    except Exception as e:
        fail(ckpt, f"its common state is unreadable ({type(e).__name__}: {e})")
    common = ckpt.common if isinstance(ckpt.common, dict) else {}
    saved = common.get("args")
    if saved is not None:
        check_shape(ckpt, saved, args)
        check_layer_impl(ckpt, saved, args)
        check_positions(ckpt, saved, args)
        check_block_scale(ckpt, saved, args)
        check_optimizer(ckpt, saved, args)
        check_resharding(ckpt, saved, common, ckpt.keys, args)
        check_param_layout(ckpt, saved, args)
    check_saved_optimizer(ckpt, ckpt.keys, common, args)
    has_md = check_md(ckpt, ckpt.keys, args)
    check_schedule_weight_decay(ckpt, common, args)
    return has_md
