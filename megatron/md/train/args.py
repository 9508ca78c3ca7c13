"""Our command-line flags (``--md-*``, per-group LRs, architecture extras), added to megatron's
parser as one argument group, and their validation, done once before any expensive work."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from megatron.md import compatibility, errors
from megatron.md.config import BARE, CHOICES, FROM_MEGATRON_FLAGS, MUON_SCALES, MDConfig
from megatron.md.train import data, datacheck, model, recipes, schedule
from megatron.md.train.files import unwritable

#: --muon-scale-mode values megatron-core's Muon knows; the rest are ours (see patches.py).
UPSTREAM_MUON_SCALES = ("spectral", "unit_rms_norm", "shape_scaling")
BLOCK_SCALES = ("1/L", "1/sqrt(2L)", "1")
#: --ngpt-residual-scale: the base scale of nGPT's residual steps alpha (ngpt.py)
RESIDUAL_SCALES = ("1/sqrt(d)", "1")
#: flags of the MD step -> their MDConfig field (``add_md_config_flags`` adds one per field
#: megatron's own flags do not set): refused without --md-decoupling, where nothing reads them
MD_STEP_FLAGS = {
    "--md-" + f.name.replace("_", "-"): f
    for f in dataclasses.fields(MDConfig)
    if f.name not in FROM_MEGATRON_FLAGS
}
#: flags of the nGPT architecture, refused without --arch ngpt (nothing else reads them)
NGPT_FLAGS = {"--ngpt-alpha-init", "--ngpt-residual-scale"}


def extra_for(recipe: list[str], extra: list[str]) -> list[str]:
    """A tool's extra ``pretrain_gpt.py`` flags, given once for every method, for the method
    whose flags are ``recipe``: without ``--md-decoupling`` there (given, or by an
    ``--optimizer`` name that expands to it), less the MD step's (``MD_STEP_FLAGS``, which such a
    run refuses), with a value given apart."""
    if "--md-decoupling" in recipes.optimizer_aliases(recipe):
        return list(extra)
    out, i = [], 0
    while i < len(extra):
        flag = extra[i]
        i += 1
        if flag.split("=", 1)[0] not in MD_STEP_FLAGS:
            out.append(flag)
        elif "=" not in flag and i < len(extra) and not extra[i].startswith("-"):
            i += 1  # (its value)
    return out


def add_md_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("megatron-md", "Magnitude-Direction decoupling (megatron-md)")
    g.add_argument(
        "--preset",
        type=str,
        default=None,
        help="named model size (megatron/md/train/presets.py); expanded before the "
        "other flags, so flags given on the command line override it",
    )
    g.add_argument(
        "--md-decoupling",
        action="store_true",
        help="AdamMD / MuonMD: the MD step inside megatron's optimizer (weight decay defaults "
        "to 0; the --md-* defaults are the paper's choices except the radius: the paper's "
        "runs, as the recipes of recipes.py and sweep.py set them, add --md-radius shape and, "
        "for MuonMD, --muon-scale-mode shape_up, which on the shape sphere equals sphere_rms)",
    )
    add_md_config_flags(g)
    g.add_argument(
        "--adaptive-muon-moment2-method",
        choices=("adamuon", "normuon", "namo"),
        default="adamuon",
        help="megatron-core's OptimizerConfig field for --optimizer adaptive_muon; only "
        "normuon runs (--optimizer normuon sets both)",
    )
    g.add_argument(
        "--adaptive-muon-beta2",
        type=float,
        default=0.95,
        help="NorMuon's second-moment decay (megatron-core's and NorMuon's default)",
    )
    g.add_argument(
        "--adaptive-muon-eps",
        type=float,
        default=1e-8,
        help="NorMuon's floor under the second moment (megatron-core's default)",
    )
    g.add_argument(
        "--md-from-plain-checkpoint",
        action="store_true",
        help="continual training: --load a checkpoint without MD state (e.g. AdamW) with its "
        "optimizer state; MD state is created from its weights (radius = their norm, gains 1)",
    )
    g.add_argument(
        "--init-from",
        type=str,
        default=None,
        help="continual training (re-warming): while --load holds no checkpoint of this run, "
        "start from this checkpoint directory instead (its latest iteration): its weights and "
        "optimizer state, at iteration 0 with this run's LR schedule; a requeued run resumes "
        "from --load as usual",
    )
    g.add_argument(
        "--init-weights-only",
        action="store_true",
        help="with --init-from: take only the weights (a fresh optimizer; MD's state is made "
        "from them: gains 1)",
    )
    g.add_argument(
        "--init-fresh-moments",
        action="store_true",
        help="with --init-from: take the optimizer state but zero its moments and step counts "
        "(MD's directions and gains are kept): the re-warming experiment's fresh-optimizer "
        "arm as the authors ran it (their --reset-optimizer-moments)",
    )
    g.add_argument(
        "--init-continue-data",
        action="store_true",
        help="with --init-from: the data stream goes on where the source's stopped (its "
        "consumed samples are skipped), as the authors' re-warming arms; without it this run "
        "reads the data from the start",
    )
    g.add_argument(
        "--md-log-interval",
        type=int,
        default=0,
        help="MD diagnostics every N iterations into the metrics file (0: --log-interval)",
    )
    g.add_argument(
        "--matrix-lr",
        type=float,
        default=None,
        help="peak LR of 2-D hidden matrices (default --lr)",
    )
    g.add_argument(
        "--embedding-lr",
        type=float,
        default=None,
        help="peak LR of the input embedding (default --lr)",
    )
    g.add_argument(
        "--output-lr", type=float, default=None, help="peak LR of the untied LM head (default --lr)"
    )
    g.add_argument(
        "--wsd-cooldown-fraction",
        type=float,
        default=None,
        help="with --lr-decay-style WSD: cooldown over this fraction of the run (--train-iters, "
        "or --train-samples)",
    )
    g.add_argument(
        "--paper-arch",
        action="store_true",
        help="the paper's GPT (every --preset implies it): Sandwich Norm, embeddings × sqrt(d), "
        "init std 1/sqrt(d) for every matrix (output projections too, unless "
        "--scaled-output-init); without it megatron's own defaults apply",
    )
    g.add_argument(
        "--sandwich-norm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="RMSNorm and a fixed scale on each block output (default: --paper-arch; the "
        "paper's MoE models have none)",
    )
    g.add_argument(
        "--rope-scaling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Llama 3.x RoPE scaling by --rope-scaling-factor (megatron's --use-rope-scaling): "
        "on in the paper's dense presets, as the authors' dense runs; --no-rope-scaling is the "
        "paper's text (RoPE with base 5e5 alone)",
    )
    g.add_argument(
        "--block-output-scale",
        choices=BLOCK_SCALES,
        default="1/L",
        help="fixed scale alpha of each block output after its Sandwich norm",
    )
    g.add_argument(
        "--prenorm-block-scale",
        choices=BLOCK_SCALES[:2],
        default=None,
        help="with --no-sandwich-norm: fixed scale alpha of each block output, no norm after it "
        "(x + alpha * f(norm(x))): the authors' --fixed-layer-scale without --post-norm "
        "(gainz exp3-depth-transfer.sh, exp3-depth-prenorm); default: none",
    )
    g.add_argument(
        "--scaled-output-init",
        action="store_true",
        help="with --paper-arch: init std sigma/sqrt(2L) for attention/MLP output projections "
        "(the paper's MoE MuonMD runs; megatron's own default); else all at 1/sqrt(d)",
    )
    g.add_argument(
        "--embedding-scale",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="multiply embeddings by sqrt(d) (default: --paper-arch)",
    )
    g.add_argument(
        "--arch",
        choices=("gpt", "ngpt"),
        default="gpt",
        help="gpt: megatron-core's GPT (with --paper-arch the paper's); ngpt: the normalized "
        "Transformer of the paper's nGPT comparison (megatron/md/train/ngpt.py; with "
        "--md-decoupling, local layer spec, TP = PP = 1, dense, no biases or dropout)",
    )
    g.add_argument(
        "--ngpt-alpha-init",
        type=float,
        default=None,
        help="--arch ngpt: initial residual step |alpha| of every block (default 1/L, the "
        "number of layers, as the authors' nGPT runs: gainz submissions/exp13-ngpt-matrix-lr.sh "
        "--layer-scale; nGPT's own paper: 0.05)",
    )
    g.add_argument(
        "--ngpt-residual-scale",
        choices=RESIDUAL_SCALES,
        default="1/sqrt(d)",
        help="--arch ngpt: base scale alpha is stored at (nGPT's 1/sqrt(d) raises its effective "
        "LR; 1 is the paper's ablation)",
    )
    g.add_argument(
        "--ckpt-checksums",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CRC-32 of every checkpoint file, written beside it after each save (a background "
        "thread) and verified before a load: a changed shard is named and nothing loads",
    )
    g.add_argument(
        "--metrics-file",
        type=str,
        default=None,
        help="JSONL metrics (default: <save>/metrics.jsonl, else runs/metrics.jsonl)",
    )
    return parser


def add_md_config_flags(group) -> None:
    """One ``--md-<field>`` flag per MDConfig field (default, choices and help from the field
    and its docstring), except the fields megatron's own flags set (FROM_MEGATRON_FLAGS)."""
    docs = MDConfig.docs()
    for flag, f in MD_STEP_FLAGS.items():
        kind = str(f.type)
        if kind == "bool":
            group.add_argument(flag, action="store_true", help=docs[f.name])
        elif f.name in CHOICES:
            bare = {"nargs": "?", "const": BARE[f.name]} if f.name in BARE else {}
            group.add_argument(
                flag, choices=CHOICES[f.name], default=f.default, help=docs[f.name], **bare
            )
        else:
            typ = int if kind == "int" else float
            group.add_argument(flag, type=typ, default=f.default, help=docs[f.name])


def md_config_from_args(args) -> MDConfig:
    """The typed MD config behind the flags (raises ValueError naming a bad flag)."""
    if args.md_gain_rank < 1:
        raise ValueError(f"--md-gain-rank={args.md_gain_rank} must be >= 1")
    scale = args.muon_scale_mode if args.muon_scale_mode != "spectral" else "sphere_rms"
    own = {
        f.name: getattr(args, "md_" + f.name)
        for f in dataclasses.fields(MDConfig)
        if f.name not in FROM_MEGATRON_FLAGS
    }
    return MDConfig(
        **own,
        gain_betas=(args.adam_beta1, args.adam_beta2),
        muon_scale=scale,
        # the paper's MoE MuonMD: output projections at σ/sqrt(2L), shape_up follows (MoE app.)
        residual_init_scale=1 / math.sqrt(2 * args.num_layers) if args.scaled_output_init else 1.0,
        # Q, K, V on their own spheres for Adam too: the authors' optimizer splits whatever the
        # base (feat/md-decoupling-optimizer md_decoupling.py, _normalize); Muon's own split
        # follows the same flag
        split_qkv=args.muon_split_qkv,
    )


def _check_tensor_parallel(args) -> None:
    """MD's Q/K/V split under TP > 1 or expert TP > 1 (megatron/md/tensor_parallel.py):
    whole query groups per TP rank (the rest of what TP needs: ``compatibility``)."""
    if getattr(args, "arch", "gpt") == "ngpt":
        return  # nGPT refuses TP > 1 itself, naming it
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    if args.md_decoupling and args.muon_split_qkv and groups % args.tensor_model_parallel_size:
        _fail(
            f"MD splits Q, K and V per query group, and {groups} query group(s) do not "
            f"divide over TP = {args.tensor_model_parallel_size} ranks: use a TP size that "
            "divides --num-query-groups, or --muon-no-split-qkv"
        )


def _check_optimizer_instances(args) -> None:
    """``--num-distributed-optimizer-instances N``: megatron's ZeRO-1 optimizer sharded within N
    slices of the data-parallel ranks, the gradients all-reduced between them. What megatron
    asserts after the model is built (distributed_data_parallel.py:293, optimizer/__init__.py:835)
    or with a traceback per rank (parallel_state.py:922, 1447), and what MD cannot sum over."""
    n = args.num_distributed_optimizer_instances
    if n == 1:
        return
    if n < 1:
        _fail(f"--num-distributed-optimizer-instances={n} must be >= 1")
    if not args.use_distributed_optimizer or args.use_layer_wise_distributed_optimizer:
        _fail(
            f"--num-distributed-optimizer-instances {n} splits megatron's ZeRO-1 distributed "
            "optimizer (Adam with --use-distributed-optimizer) into instances; megatron-core "
            "0.19.2 has it for nothing else (its layer-wise optimizer, which Muon and "
            "--md-adam-layer-wise use, asserts one instance): drop the flag"
        )
    dp_cp = args.data_parallel_size * args.context_parallel_size
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    edp = args.world_size // (etp * ep * args.pipeline_model_parallel_size)
    # (the ranks an instance splits, their name, the TP size MD's reduction folds in)
    groups = [(dp_cp, "data-parallel (× context-parallel)", args.tensor_model_parallel_size, "TP")]
    if args.num_experts:
        groups.append((edp, "expert data-parallel", etp, "expert TP"))
    for size, what, tp, tp_name in groups:
        if size % n:
            _fail(f"--num-distributed-optimizer-instances {n} does not divide the {size} "
                  f"{what} ranks: give a divisor of {size}")  # fmt: skip
        if args.md_decoupling and tp > 1 and size // n > 1:  # (tensor_parallel.reduce_group)
            _fail(
                f"--num-distributed-optimizer-instances {n} with {tp_name} {tp}: MD sums its "
                f"partials over megatron's {tp_name} × data-parallel group, which spans every "
                f"instance; give N = {size} (one data-parallel rank per instance) or 1"
            )


def _torch_norms(args) -> bool:
    """Are the layers' norms torch's (megatron's local layer spec: for RMSNorm always, for
    LayerNorm without apex, as megatron found it; core/models/backends.py:29, :126)?"""
    from megatron.core.models import backends

    if args.transformer_impl != "local":
        return False
    return args.normalization == "RMSNorm" or not backends.HAVE_APEX


def _check_sequence_parallel(args) -> None:
    """Under TP megatron's MoE layer trains only with sequence parallelism (a ValueError at the
    first forward step: core/transformer/moe/moe_layer.py:629), which torch's norms refuse (an
    assertion at the model's build: core/transformer/torch_norm.py:50); both seen after the
    build, 2026-12-01 (tiny-moe, TP 2, 2 CPU ranks). megatron turns it off at TP 1."""
    tp = args.tensor_model_parallel_size
    if tp == 1:
        return
    local = ("torch's norms of the local layer spec (--transformer-impl local) refuse it "
             "(core/transformer/torch_norm.py:50)")  # fmt: skip
    if args.num_experts and not args.sequence_parallel and not args.skip_train:
        way = (f"; {local}: on this layer spec the experts train at TP 1 (split them with "
               "--expert-tensor-parallel-size, or spread them with "
               "--expert-model-parallel-size)" if _torch_norms(args) else "")  # fmt: skip
        _fail(
            f"--num-experts with TP {tp} needs --sequence-parallel: megatron's MoE layer "
            f"refuses to train without it (moe_layer.py:629, at the first step){way}"
        )
    if args.sequence_parallel and _torch_norms(args):
        _fail(f"--sequence-parallel: {local} at the model's build; use "
              "--transformer-impl transformer_engine, or drop it")  # fmt: skip


def _fail(msg: str, node: bool = False):
    """Refuse (``node``: a refusal about this node's files, which another node may not share:
    each node's first rank says it too, errors.say)."""
    errors.fail(msg, node=node)


def validate(args, check_data: bool = True) -> MDConfig | None:
    """Check flag combinations and inputs once, before the model or data are built;
    ``check_data=False``: not the data and tokenizer files (a node that cannot see them)."""
    md = None
    if args.lr is None:  # else torch's Adam constructor fails on it, far from the cause
        _fail("give --lr (the peak learning rate; --matrix-lr, --embedding-lr and --output-lr "
              "set the groups' own)")  # fmt: skip
    if args.optimizer == "adaptive_muon":  # NorMuon through megatron-core's seam
        if args.adaptive_muon_moment2_method != "normuon":
            _fail(
                f"--adaptive-muon-moment2-method {args.adaptive_muon_moment2_method} is not "
                "offered: megatron-core 0.19.2's TensorParallelAdaptiveMuon scales the update "
                "before the second moment, which only NorMuon's norm-matched update keeps "
                "(patches.normuon_scale_once); use --optimizer normuon"
            )
        if args.tensor_model_parallel_size > 1 or (args.expert_tensor_parallel_size or 1) > 1:
            _fail("--optimizer normuon under tensor parallelism has never run here (its "
                  "per-row second moment over a TP piece is untested): use TP 1")  # fmt: skip
    if args.non_persistent_save_interval or args.non_persistent_ckpt_type:
        flag = ("--non-persistent-save-interval" if args.non_persistent_save_interval
                else "--non-persistent-ckpt-type")  # fmt: skip
        _fail(
            f"{flag}: megatron loads a non-persistent checkpoint instead of --load's whenever "
            "it is as new, even under --ckpt-step (measured: --ckpt-step 4 loaded the "
            "non-persistent 6), and the checks of the checkpoint a run resumes (complete, "
            "checksums, MD state, the rewind) read --load's: use --save-interval"
        )
    if args.moe_use_upcycling:  # megatron: training/training.py:2143, the dense model's build
        _fail(
            "--moe-use-upcycling: megatron-core 0.19.2's upcycling does not run from "
            "pretrain_gpt.py (its dense model keeps --moe-ffn-hidden-size and fails to build "
            "where every layer is MoE; with dense layers it cannot load the dense checkpoint: "
            "both measured), and MD's state would be made from the weights before the upcycling"
            ": it is not supported here (a MoE checkpoint upcycled elsewhere loads with --load "
            "and --finetune)"
        )
    if getattr(args, "inprocess_restart", False):  # (Megatron-LM's own entry wraps pretrain)
        _fail(
            "--inprocess-restart: pretrain_gpt.py does not wrap its training for "
            "nvidia-resiliency-ext's in-process restart (megatron/training/inprocess_restart.py)"
            "; a stopped run is requeued by the launcher and resumes from its last checkpoint"
        )
    strict = args.dist_ckpt_strictness
    if strict == "raise_all" or strict.startswith("return_"):  # (each seen on a resume)
        _fail(
            f"--dist-ckpt-strictness {strict}: "
            + ("megatron-core 0.19.2 reports its own checkpoints' rerun_state_machine_state "
               "as missing, so every resume stops"
               if strict == "raise_all" else
               "the load returns the mismatches to its caller, which megatron's training load "
               "does not take (an AttributeError at every resume)")
            + "; log_all logs every mismatch, raise_unexpected stops on a key the model lacks"
        )  # fmt: skip
    _check_sequence_parallel(args)
    if args.rampup_batch_size is not None:  # (training/global_vars.py:127 does not pass it)
        _fail(
            "--rampup-batch-size is parsed and not used by megatron-core 0.19.2 (the batch "
            "stays --global-batch-size from the first iteration): give the ramp as "
            "--step-batch-size-schedule 'TOKENS:BATCH ...' without --global-batch-size "
            "(thresholds in tokens, e.g. '0:256 10B:512')"
        )
    if args.muon_scale_mode not in UPSTREAM_MUON_SCALES + MUON_SCALES:
        _fail(
            f"--muon-scale-mode={args.muon_scale_mode!r} is not one of "
            f"{', '.join(UPSTREAM_MUON_SCALES + MUON_SCALES[:-1])}"
        )
    if args.md_decoupling:
        try:
            md = md_config_from_args(args)
        except ValueError as e:
            _fail(str(e))
        if args.optimizer not in ("adam", "muon"):
            _fail(f"--md-decoupling works with --optimizer adam or muon, not {args.optimizer!r}")
        why = compatibility.refusal(compatibility.Setup.from_args(args))
        if why is not None:
            _fail(why)
        if md.split_qkv and getattr(args, "attention_output_gate", False):  # (the model's
            # build, then a ValueError blaming TP: seen, 2026-11-29)
            _fail(
                "--attention-output-gate adds a gate (one per attention head) to linear_qkv's "
                "rows, which MD's Q/K/V split (megatron's Muon's q, k, v shapes) does not "
                "know: add --muon-no-split-qkv (the fused matrix on one sphere), or drop the gate"
            )
        if args.optimizer == "muon" and args.muon_extra_scale_factor != 1.0:  # (whole.py's
            # check, which came after the model was built, with a traceback)
            _fail(f"--muon-extra-scale-factor={args.muon_extra_scale_factor}: MuonMD sets the "
                  "update's scale with --muon-scale-mode; drop the factor")  # fmt: skip
        if args.md_variant != "md" and args.optimizer != "muon":
            _fail(f"--md-variant {args.md_variant} is a Muon variant (use --optimizer muown)")
        if args.ckpt_format != "torch_dist" and (args.save or args.load):
            _fail(
                f"--ckpt-format {args.ckpt_format}: MD runs save and load their state in "
                "torch_dist only (the default); drop --ckpt-format"
            )
        if "--md-gain-rank" in getattr(args, "given_flags", ()) and args.md_gains != "lowrank":
            _fail(f"--md-gain-rank {args.md_gain_rank} needs --md-gains lowrank (got "
                  f"--md-gains {args.md_gains}, which has no rank)")  # fmt: skip
        etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
        if args.tensor_model_parallel_size > 1 or (args.num_experts and etp > 1):
            _check_tensor_parallel(args)  # megatron's default ETP is the TP size

        if args.md_adam_layer_wise:
            missing = []
            if args.optimizer != "adam":
                missing.append(f"--optimizer adam (got {args.optimizer})")
            # the ZeRO-1 sharding it turns into layer-wise sharding (below)
            if not (args.use_distributed_optimizer or args.use_layer_wise_distributed_optimizer):
                missing.append("--use-distributed-optimizer")
            if missing:
                _fail(f"--md-adam-layer-wise needs {' and '.join(missing)}")
            # megatron shards layer-wise only for emerging optimizers: its args say so for
            # muon (training/arguments.py, validate_args); patches build the optimizer as
            # layer-wise Muon
            args.use_layer_wise_distributed_optimizer = True
            args.use_distributed_optimizer = False
        if args.optimizer_cuda_graph:
            _fail(
                "--optimizer-cuda-graph captures megatron's whole optimizer step, where MD's "
                "step takes the LR and step count as Python numbers that a graph would freeze: "
                "use --md-cuda-graph (MD's inner step in a graph, its LR and step count read "
                "on the device)"
            )
        if args.md_cuda_graph and args.bf16 and not args.accumulate_allreduce_grads_in_fp32:
            _fail(
                "--md-cuda-graph replays the step on megatron's gradient buffer, which must then "
                "be fp32 (bf16 gradients are copied to new fp32 tensors every step): drop "
                "--grad-reduce-in-bf16 / --main-grads-dtype bf16"
            )
    elif args.md_adam_layer_wise:
        _fail("--md-adam-layer-wise needs --md-decoupling")
    elif args.md_cuda_graph:
        _fail("--md-cuda-graph needs --md-decoupling (it captures MD's step)")
    elif unread := sorted(MD_STEP_FLAGS.keys() & getattr(args, "given_flags", set())):
        _fail(f"{', '.join(unread)}: MD's step runs only with --md-decoupling, so this run would "
              f"train plain --optimizer {args.optimizer}: add --md-decoupling, or drop "
              f"{'it' if len(unread) == 1 else 'them'}")  # fmt: skip
    elif args.muon_scale_mode in ("sphere_rms", "hyperball"):
        _fail(f"--muon-scale-mode {args.muon_scale_mode} needs --md-decoupling (it follows the "
              "sphere radius)")  # fmt: skip
    if args.optimizer == "muon" and not args.md_decoupling and args.muon_scale_mode == "none":
        _fail("--muon-scale-mode none is only for --md-decoupling")
    _check_optimizer_instances(args)
    if args.use_layer_wise_distributed_optimizer and args.save and not args.bf16:
        _fail(
            "Muon with --use-distributed-optimizer (layer-wise) saves checkpoints only for bf16 "
            "params in megatron-core 0.19.2 (Float16OptimizerWithFloat16Params.sharded_state_dict"
            "): add --bf16"
        )
    if args.decoupled_lr is not None or args.decoupled_min_lr is not None:
        _fail(
            "--decoupled-lr / --decoupled-min-lr are not supported: set the embedding and LM-head "
            "peak LRs with --embedding-lr and --output-lr (the paper's per-group LRs)"
        )
    if args.wsd_cooldown_fraction is not None:
        if args.lr_decay_style != "WSD":
            _fail("--wsd-cooldown-fraction needs --lr-decay-style WSD")
        if not 0 < args.wsd_cooldown_fraction <= 1:
            _fail(f"--wsd-cooldown-fraction={args.wsd_cooldown_fraction} must be in (0, 1]")
    for flag in ("matrix_lr", "embedding_lr", "output_lr", "md_gain_lr"):
        v = getattr(args, flag)
        if v is not None and not (math.isfinite(v) and v >= 0):
            _fail(f"--{flag.replace('_', '-')}={v} must be a number >= 0")
    data.check_flags(args)
    model.check_flags(args)
    if check_data:
        datacheck.check_files(args)
    schedule.check_flags(args)
    if args.arch != "ngpt" and (unread := sorted(NGPT_FLAGS & getattr(args, "given_flags", set()))):
        _fail(f"{', '.join(unread)}: nGPT's residual steps exist only with --arch ngpt; add it, "
              "or drop the flag")  # fmt: skip
    if args.arch == "ngpt":
        from megatron.md.train.ngpt import check_args

        if args.ngpt_alpha_init is None:
            args.ngpt_alpha_init = 1.0 / args.num_layers
        err = check_args(args)
        if err:
            _fail(err)
    if args.md_from_plain_checkpoint and not (args.md_decoupling and args.load):
        _fail("--md-from-plain-checkpoint needs --md-decoupling and --load")
    for flag in ("init_weights_only", "init_fresh_moments", "init_continue_data"):
        if getattr(args, flag) and not args.init_from:
            _fail(f"--{flag.replace('_', '-')} needs --init-from")
    if args.init_weights_only and args.init_fresh_moments:
        _fail("--init-fresh-moments keeps the optimizer state (moments zeroed); "
              "--init-weights-only drops it: give one")  # fmt: skip
    if args.init_from:
        if not args.load:
            _fail("--init-from needs --load (this run's own directory, where it resumes)")
        # both are read again at every resume from --load (a requeue): its own optimizer state
        # would be dropped, and --finetune would restart it at iteration 0
        for flag, instead in (
            ("no_load_optim", "use --init-weights-only for a fresh optimizer"),
            (
                "finetune",
                "drop it: --init-from starts at iteration 0, and --init-weights-only "
                "takes only the weights",
            ),
        ):
            if getattr(args, flag):
                _fail(f"--init-from with --{flag.replace('_', '-')}: megatron reads it at every "
                      "resume of this run from --load too (a requeue would drop its optimizer "
                      f"state{' and restart at iteration 0' if flag == 'finetune' else ''}); "
                      f"{instead}")  # fmt: skip
        from megatron.md.train.ckpt_checks import locate

        found = locate(args.init_from, flag="--init-from")
        if found is None:
            _fail(f"--init-from {args.init_from}: no latest_checkpointed_iteration.txt there")
    return md


def check_not_a_file(flag: str, path: str | None) -> None:
    if path and os.path.exists(path) and not os.path.isdir(path):
        _fail(f"{flag} {path} is a file, not a checkpoint directory")


def check_writable(flag: str, path: str | None,
                   when: str = "megatron would find out at the first save") -> None:  # fmt: skip
    """``path`` can be created and written in: megatron creates and writes ``--save`` only at
    the first save, after ``--save-interval`` iterations (``when``: what a log directory's
    failure came as). Probed on rank 0 (which says the refusal; a shared filesystem is the same
    for every rank)."""
    if not path or int(os.environ.get("RANK", "0")) != 0:
        return
    bad = unwritable(path)
    if bad and bad[1] is None:
        _fail(f"{flag} {path}: {bad[0]} is a file, not a directory")
    if bad:
        _fail(f"{flag} {path}: cannot write in {bad[0]} ({bad[1]}); {when}: give a directory "
              "this job can write")  # fmt: skip


def check_log_dirs(argv: list[str]) -> None:
    """The logs' directories can be written (the metrics file's, ``--tensorboard-dir``,
    ``--wandb-save-dir``): each was created when the run opened it, and failed then with a
    traceback (megatron's TensorBoard writer while parsing its flags)."""
    from megatron.md.launch import flag_value

    when = "the run would stop with a traceback when it opens its logs"
    metrics = flag_value(argv, "--metrics-file")
    if metrics:
        check_writable("--metrics-file", os.path.dirname(os.path.abspath(metrics)), when)
    for flag in ("--tensorboard-dir", "--wandb-save-dir"):
        check_writable(flag, flag_value(argv, flag), when)


def check_run_dirs(args) -> None:
    """What ``--save`` holds (another run's checkpoints) and what ``--load`` has to resume (a
    tracker, unless it is this run's first start): ckpt_checks says why either is refused. A
    requeued attempt of a branch from another run goes on in its own ``--save`` (forked.py)."""
    from megatron.md.train import ckpt_checks, forked

    if forked.continues(args):
        return

    err = args.save and ckpt_checks.save_over_another_run(args.save, args.load)
    pre = args.pretrained_checkpoint  # megatron's start where --load holds none yet
    starts = pre and not (
        args.load and os.path.isfile(os.path.join(args.load, ckpt_checks.TRACKER))
    )
    resumes = args.load and not (args.init_from or args.ckpt_step is not None or starts)
    if not err and resumes:
        err = ckpt_checks.no_checkpoint_to_resume(args.load, args.save)
    if not err and starts and ckpt_checks.tracked(pre) is None:
        err = (
            f"--pretrained-checkpoint {pre} holds no checkpoint (no {ckpt_checks.TRACKER} "
            "naming an iteration): give the run directory of the checkpoint to start from"
        )
    if err:
        _fail(err)
