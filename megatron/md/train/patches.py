"""The replacements of megatron.training / megatron-core attributes that ``pretrain_gpt.py``
needs. Which attributes, where and why is ``megatron/md/compat.py``'s table (``SEAMS``); each
row names one of the functions below, which builds the replacement from megatron's original
and the run (``Run``). ``apply`` installs the training (and, without CUDA, CPU) rows;
``prepare_parsers`` the parser row, before parsing.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from dataclasses import dataclass

import torch

from megatron.md import compat, errors
from megatron.md.config import MDConfig


@dataclass(frozen=True)
class Run:
    """What the replacements need to know of the run."""

    md: MDConfig | None
    """The MD config (None: a plain run)."""
    on_cpu: bool
    """CPU mode."""


def apply(md: MDConfig | None, on_cpu: bool) -> None:
    run = Run(md, on_cpu)
    compat.apply("training", run)
    if on_cpu:
        compat.apply("cpu", run)


def prepare_parsers() -> None:
    """Before parsing: the parser rows (our flags in every megatron parser: fault-tolerance
    set-up re-parses argv without our provider; the wandb run not opened while parsing)."""
    compat.apply("parser")


# ---- the replacements (compat.SEAMS names each) ----
def wrap_parser(orig, run=None):
    """--muon-scale-mode accepts the paper's modes; --optimizer lists our names too (expanded
    before parsing, ``recipes.optimizer_aliases``: argparse's refusal of another name and ``--help``
    name every one); help strings with a bare ``%`` (megatron-core 0.19.2's
    ``--moe-paged-stash-buffer-size-factor-cuda``: "10%)") are escaped, so ``--help`` prints
    instead of failing in argparse's formatting."""
    from megatron.md.config import MUON_SCALES
    from megatron.md.train.recipes import OPTIMIZER_ALIASES

    @functools.wraps(orig)
    def add_megatron_arguments(parser):
        parser = orig(parser)
        for flag, more in (("--muon-scale-mode", MUON_SCALES), ("--optimizer", OPTIMIZER_ALIASES)):
            action = parser._option_string_actions[flag]
            action.choices = list(dict.fromkeys([*action.choices, *more]))
        for a in parser._actions:
            a.help = escape_help(a)
        return parser

    return add_megatron_arguments


def escape_help(action) -> str | None:
    """``action.help`` as argparse can format it (a bare ``%`` doubled; ``%(default)s`` and the
    like kept)."""
    text = action.help
    if not text or "%" not in text:
        return text
    try:
        text % dict(vars(action), prog="")
        return text
    except (ValueError, TypeError, KeyError):
        return re.sub(r"%(?!\()", "%%", text.replace("%%", "\0")).replace("\0", "%%")


def no_compile_helpers(orig, run=None):
    """The wheel ships the compiled dataset helper but no Makefile: ``make`` would exit the
    job, on GPU too."""
    return lambda: None


def allow_no_cuda(orig, run=None):
    """``pretrain`` calls ``initialize_megatron`` without the flag, which asserts CUDA."""
    return functools.partial(orig, allow_no_cuda=True)


def fork_results_queue(orig, run=None):
    """torch_dist saves start a *spawn* Manager, which re-imports the training script (~10 s
    per run on a laptop); a fork Manager serves the same queue (whatever mode is asked),
    started here to die with its rank: a forked server that outlives a killed rank (an
    out-of-memory kill) holds the rank's memory, its copy-on-write pages, until killed by hand.
    megatron keeps the queue in the module's ``_results_queue`` (a row of ``compat.SEAMS``)."""
    import multiprocessing
    import sys
    import threading
    from multiprocessing.managers import SyncManager

    from megatron.md.localrun import die_with_parent

    module = sys.modules[orig.__module__]

    @functools.wraps(orig)
    def get_write_results_queue(mp_mode: str = "spawn"):
        if module._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context("fork"))
            # the signal follows the forking thread's end: only the main thread's is the rank's
            main = threading.current_thread() is threading.main_thread()
            manager.start(initializer=die_with_parent if main else None)
            module._results_queue = manager.Queue()  # the proxy keeps its manager alive
        return orig(mp_mode="fork")

    return get_write_results_queue


def wrap_training_log(orig, run=None):
    from megatron.md.train import metrics

    return metrics.wrap_training_log(orig)


def wrap_evaluate(orig, run=None):
    from megatron.md.train import metrics

    return metrics.wrap_evaluate(orig)


def wrap_evaluate_and_print(orig, run=None):
    from megatron.md.train import metrics

    return metrics.wrap_evaluate_and_print(orig)


def wrap_grad_norm(orig, run=None):
    """megatron's gradient norm with MD's non-finite check, timed as ``grad-norm``."""
    from megatron.md.train import host, nonfinite

    return host.timed("grad-norm", nonfinite.wrap_grad_norm(orig))


def time_grad_clip(orig, run=None):
    """megatron's clipping by the total norm, timed as ``grad-clip``."""
    from megatron.md.train import host

    return host.timed("grad-clip", orig)


def wrap_muon_scale(orig, run=None):
    """The paper's ``shape_up`` and ``rms_match`` modes for megatron's plain Muon."""
    from megatron.md.base_steps import muon_scale_factor

    @functools.wraps(orig)
    def scale(size_out, size_in, mode="spectral"):
        if mode in ("shape_up", "rms_match"):
            return muon_scale_factor(mode, size_out, size_in)
        return orig(size_out, size_in, mode=mode)

    return scale


def normuon_scale_once(orig, run=None):
    """NorMuon's update scaled once. megatron's ``TensorParallelAdaptiveMuon`` orthogonalizes
    with its TP Newton–Schulz, which already multiplies by Muon's scale factor (megatron-core's
    core/optimizer/emerging_optimizers.py:208), and ``AdaptiveMuon.step`` then calls
    ``_apply_muon_scale``, which reads a ``scale_mode`` that megatron's ``__init__`` never sets
    (the first step fails). NorMuon's normalization matches the update's Frobenius norm to the
    scaled orthogonalized momentum, so the scale is already there: this applies nothing more.
    (AdaMuon's elementwise second moment would lose the scale this way; it is refused, args.py.)"""

    def _apply_muon_scale(self, update, size_out, size_in):
        return update

    return _apply_muon_scale


def _normuon_kept_dim(p) -> int:
    """The dimension NorMuon's second moment keeps (emerging_optimizers adaptive_muon.py
    ``_init_group``: it averages along the longer one)."""
    return 0 if p.shape[-2] >= p.shape[-1] else 1


def normuon_state_dict(orig, run=None):
    """NorMuon's per-row (or per-column) second moment saved at the parameter's shape, each
    value repeated along the averaged dimension: megatron's torch_dist optimizer state is
    sharded like its parameter (dist_checkpointing/optimizer.py:100 asserts equal shapes).
    Lossless; ``normuon_load_state_dict`` takes one slice back."""

    @functools.wraps(orig)
    def state_dict(self):
        sd = orig(self)
        if getattr(self, "moment2_method", None) != "normuon":
            return sd
        params = [p for g in self.param_groups for p in g["params"]]
        state = {}
        for i, st in sd["state"].items():
            m2, p = st.get("moment2_buffer"), params[i]
            if m2 is not None and m2.shape != p.shape:
                st = {**st, "moment2_buffer": m2.expand(p.shape).contiguous()}
            state[i] = st
        return {**sd, "state": state}

    return state_dict


def normuon_load_state_dict(orig, run=None):
    """The inverse of ``normuon_state_dict``: a second moment at the parameter's shape back to
    NorMuon's reduced one (the slice at index 0 of the averaged dimension)."""

    @functools.wraps(orig)
    def load_state_dict(self, state_dict):
        orig(self, state_dict)
        if getattr(self, "moment2_method", None) != "normuon":
            return
        for p, st in self.state.items():
            m2 = st.get("moment2_buffer")
            if m2 is not None and m2.dim() == 2 and m2.shape == p.shape:
                keep = _normuon_kept_dim(p)
                st["moment2_buffer"] = (m2[:, :1] if keep == 0 else m2[:1, :]).clone()

    return load_state_dict


def wrap_optimizer_config(orig, run=None):
    """Per-group peak LRs (--matrix-lr/--embedding-lr/--output-lr) as megatron param-group
    overrides; layer-wise sharding needs ``OptimizerConfig.bf16=True`` even for fp32 params
    (``LayerWiseDistributedOptimizer`` asserts it)."""

    @functools.wraps(orig)
    def get_config(args):
        from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

        from megatron.md.roles import is_embedding, is_output

        config, overrides = orig(args)
        if getattr(args, "md_adam_layer_wise", False):  # built as layer-wise Muon, see args.py
            config.optimizer, config.muon_split_qkv = "muon", False
            config.use_layer_wise_distributed_optimizer = True
        if config.use_layer_wise_distributed_optimizer:
            # LayerWiseDistributedOptimizer.__init__ needs it even for fp32 params
            config.bf16 = True
        overrides = dict(overrides or {})
        groups = (
            ("md_embedding", args.embedding_lr, lambda p, n: is_embedding(n)),
            ("md_output", args.output_lr, lambda p, n: is_output(n)),
            (
                "md_matrix",
                args.matrix_lr,
                lambda p, n: p.ndim == 2 and not (is_embedding(n) or is_output(n)),
            ),
        )
        for name, lr, fn in groups:
            if lr is not None:
                key = ParamKey(with_name_predicate=ParamWithNamePredicate(name=name, fn=fn))
                overrides[key] = {"max_lr": lr, "min_lr": min(args.min_lr, lr)}
        return config, overrides

    return get_config


#: set once ``check_nodes_first`` has run: the optimizer's seam refuses to build without it
_NODES_CHECKED: list[bool] = []


def check_nodes_first(orig, run=None):
    """On every rank, once torch.distributed is set up and before megatron builds the model
    (``pretrain`` calls ``setup_model_and_optimizer`` first): every rank runs rank 0's software
    (a node with another megatron-core could fail or hang inside the model's set-up, naming
    nothing), ``--save`` and the logs are one directory for every node, and every node holds
    rank 0's ``--data-path`` files."""

    @functools.wraps(orig)
    def setup_model_and_optimizer(*a, **kw):
        from megatron.training import get_args

        from megatron.md.train import datacheck, nodes, sharedsave

        args = get_args()
        nodes.check_same_software()
        sharedsave.check(args.save, sharedsave.log_dirs(args))
        datacheck.check_same_files(args)
        _NODES_CHECKED.append(True)
        return orig(*a, **kw)

    return setup_model_and_optimizer


def wrap_optimizer(orig, run: Run):
    """``enable_md`` on the optimizer megatron built, or the resume fix of megatron's own
    DistributedOptimizer (wrappers.fix_plain_resume); the NaN-step guard where megatron's own
    check is off; our metrics. Refused where ``check_nodes_first`` has not run (a megatron-core
    that no longer builds the model through that seam)."""

    @functools.wraps(orig)
    def get_optimizer(config, model_chunks, *a, **kw):
        from megatron.training import get_args

        from megatron.md.enable import enable_md
        from megatron.md.train import metrics, nonfinite
        from megatron.md.wrappers import fix_plain_resume

        if not _NODES_CHECKED:
            raise RuntimeError(
                "megatron built the optimizer without calling setup_model_and_optimizer "
                "(megatron/md/compat.py's seam): the nodes' checks did not run"
            )
        opt = orig(config, model_chunks, *a, **kw)
        if run.md is not None:
            enable_md(opt, model_chunks, run.md)
        else:
            fix_plain_resume(opt)
        if not get_args().check_for_nan_in_loss_and_grad:  # else megatron stops at a NaN
            nonfinite.guard(opt)
        metrics.attach(opt, model_chunks)
        return opt

    return get_optimizer


def wrap_load(orig, run: Run):
    """Before megatron reads a checkpoint: find and check it (ckpt_checks), MD state against
    the flags; after: non-finite values refused, MD state made from the weights where none
    loaded, a rewind's tracker (rewind.mark), a fresh optimizer's note (freshoptim.mark).
    ``--init-from`` starts a continual run from another run's checkpoint."""

    @functools.wraps(orig)
    def load(model, optimizer, *a, **kw):
        from megatron.training import get_args
        from megatron.training.utils import print_rank_0

        from megatron.md.checkpoint import prepare_md_load
        from megatron.md.train import (
            ckpt_checks,
            freshoptim,
            nonfinite,
            rewind,
            savefail,
            schedule,
        )
        from megatron.md.wrappers import begin_model_load, finish_model_load

        args = get_args()
        # _load_init calls this load again with --load set to --init-from's directory
        flag = (
            "--init-from"
            if args.load and args.load == getattr(args, "init_from", None)
            else "--load"
        )
        ckpt = ckpt_checks.locate(args.load, args.ckpt_step, flag) if args.load else None
        if ckpt is None and getattr(args, "init_from", None):  # first start of a continual run
            return _load_init(load, model, optimizer, *a, **kw)
        # a fresh optimizer the flags ask for (not --init-from's, nor the --finetune megatron
        # sets for a --pretrained-checkpoint start below): its note, once loaded
        fresh = flag == "--load" and freshoptim.fresh(args)
        if ckpt is None and args.pretrained_checkpoint:  # megatron's finetuning start: it takes
            # this directory's weights and sets --finetune (training/checkpointing.py:2096);
            # checked as a resumed checkpoint is, and MD's state made from those weights (it
            # was made from the random ones, and the first step replaced them: loss 0.73,
            # then 4.09, fp32 params; bf16 ones were reloaded)
            ckpt = ckpt_checks.locate(args.pretrained_checkpoint, flag="--pretrained-checkpoint")
            args.finetune = True
        if ckpt is None and args.load and args.exit_on_missing_checkpoint:
            errors.fail(  # megatron's own exit here has status 0: a requeue would loop
                f"--load {args.load} holds no checkpoint (no latest_checkpointed_iteration.txt) "
                "and --exit-on-missing-checkpoint is set (a requeued job never starts from "
                "scratch): check --load, or drop the flag to start a new run there"
            )
        if ckpt is not None:
            ckpt_checks.check_all(ckpt, args)
            savefail.warn_if_no_room(args.save, ckpt.path, "the checkpoint this run resumes")
        md = run.md is not None and optimizer is not None
        if ckpt is not None and md and not (args.no_load_optim or args.finetune):
            try:
                prepare_md_load(optimizer, ckpt.keys, ckpt.common)
            except ValueError as e:
                ckpt_checks.fail(ckpt, str(e))
        if md:
            begin_model_load(optimizer)
        try:
            out = orig(model, optimizer, *a, **kw)
        except AssertionError as e:  # megatron's schedule check: one line, with the way out
            if "OptimizerParamScheduler" not in str(e):
                raise
            errors.fail(
                f"--load {args.load}: {str(e).replace('checkpointvalue', 'checkpoint value')}: "
                "to resume with another schedule add --override-opt_param-scheduler (this "
                "run's values), or --use-checkpoint-opt_param-scheduler (the checkpoint's)"
            )
        if ckpt is not None and md and finish_model_load(optimizer):
            print_rank_0("[megatron-md] no optimizer state loaded: MD state from the loaded "
                         "weights")  # fmt: skip
        if ckpt is not None:
            nonfinite.check_loaded(model, optimizer, ckpt.path, args.load)
            said = schedule.continue_after_weights_only(a[0] if a else kw.get(
                "opt_param_scheduler"), ckpt.common, args, out[0])  # fmt: skip
            if said:
                print_rank_0("[megatron-md] " + said)
            if line := rewind.mark(args, torch.distributed.get_rank()):
                print("[megatron-md] " + line, flush=True)
            if fresh:
                freshoptim.mark(args, out[0], torch.distributed.get_rank())
        return out

    return load


def wrap_save(orig, run: Run):
    """No non-finite weights or MD state are saved (the latest checkpoint stays the last good
    one); a save whose writes failed ends the run in one line (savefail.py); after a
    synchronous torch_dist save, this rank's checksums (digest.py); the wandb run that saved it
    (wandbrun.py)."""

    @functools.wraps(orig)
    def save(iteration, model, optimizer, *a, **kw):
        from megatron.training import get_args

        from megatron.md.train import digest, nonfinite, savefail, wandbrun

        args = get_args()
        digest.wait()  # the last save's checksums are written before this save starts
        nonfinite.check_before_save(model, optimizer, iteration, args.save)
        savefail.take()
        try:
            out = orig(iteration, model, optimizer, *a, **kw)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:  # torch's CheckpointException is a BaseException
            savefail.handle(e, args.save, iteration)
            raise
        path = os.path.join(args.save, f"iter_{iteration:07d}")
        sync = args.ckpt_format == "torch_dist" and not args.async_save
        if args.ckpt_checksums and sync and os.path.isfile(os.path.join(path, ".metadata")):
            digest.write_after_save(path, torch.distributed.get_rank())
        if sync and iteration < args.train_iters:
            savefail.warn_if_no_room(args.save, path, "this checkpoint")
        wandbrun.record(args.save, iteration)  # the rank that writes wandb: which run saved it
        return out

    return save


def _load_init(load, model, optimizer, scheduler, *a, **kw):
    """``--init-from``: megatron's load pointed at that checkpoint (weights, optimizer state
    unless ``--init-weights-only``, its moments zeroed with ``--init-fresh-moments``; no RNG, no
    LR schedule: ``scheduler`` is not passed, so this run's starts at step 0), then iteration and
    consumed samples reset to 0 (``--init-continue-data`` offsets the dataset instead:
    data.py)."""
    from megatron.training import get_args
    from megatron.training.utils import print_rank_0

    args = get_args()
    saved = args.load, args.ckpt_step, args.no_load_optim, args.no_load_rng
    args.load, args.ckpt_step, args.no_load_rng = args.init_from, None, True
    args.no_load_optim = args.no_load_optim or args.init_weights_only
    adopted = _adopt_param_groups(optimizer) if not args.no_load_optim else []
    try:
        print_rank_0(f"[megatron-md] --init-from {args.init_from}: a new run from its checkpoint")
        load(model, optimizer, None, *a, **kw)  # the checks too, on that checkpoint
    finally:
        args.load, args.ckpt_step, args.no_load_optim, args.no_load_rng = saved
        for opt in adopted:
            del opt.load_state_dict  # the class's again
    if args.init_fresh_moments:
        from megatron.md.train.continual import reset_moments

        if not reset_moments(optimizer):
            errors.fail(f"--init-fresh-moments: {args.init_from} gave no optimizer state to reset")
        print_rank_0("[megatron-md] --init-fresh-moments: moments and steps zeroed, "
                     "weights and MD state kept")  # fmt: skip
    args.consumed_train_samples = args.consumed_valid_samples = args.skipped_train_samples = 0
    return 0, 0


def _adopt_param_groups(optimizer) -> list:
    """For ``--init-from`` with optimizer state: megatron pairs saved and current parameter
    groups by their hyper-parameters (core/optimizer/distrib_optimizer.py,
    DistributedOptimizer.load_state_dict.make_needed_groups), so a run with other LRs than the
    source's could not load its moments. The moments are stored per parameter, not per group: give
    the load this run's groups (its hyper-parameters) with the source's step count. Returns the
    optimizers whose ``load_state_dict`` was wrapped (on the instance, for this load only)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron.md.leaves import leaf_optimizers

    wrapped = []
    for opt in leaf_optimizers(optimizer):
        if not isinstance(opt, DistributedOptimizer):
            continue
        orig = opt.load_state_dict

        def load_state_dict(state_dict, _opt=opt, _orig=orig):
            saved = state_dict["optimizer"]["param_groups"]
            steps = {g["step"] for g in saved if g.get("step") is not None}
            groups = []
            for g in _opt.optimizer.state_dict()["param_groups"]:
                g = {k: v for k, v in g.items() if k != "params"}
                if steps:
                    g["step"] = max(steps)
                groups.append(g)
            state_dict["optimizer"]["param_groups"] = groups
            return _orig(state_dict)

        opt.load_state_dict = load_state_dict
        wrapped.append(opt)
    return wrapped


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def kernel_flags() -> list[str]:
    """What megatron needs on a GPU without Transformer Engine's or apex's kernels (the local
    layer spec on a bare PyTorch image), each found the way megatron-core 0.19.2 looks for it:
    rope fusion is TE's (core/transformer/transformer_config.py:2185 refuses it at start-up),
    the fused weight-gradient accumulation apex's (core/tensor_parallel/layers.py:1070 refuses
    it), the masked-softmax kernels apex's (core/fusions/fused_softmax.py:357 would fail at the
    first forward pass), and without apex the local spec's torch LayerNorm refuses the
    persistent one (core/transformer/torch_norm.py:48)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.gpt import gpt_layer_specs

    flags = []
    fused = (rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd)
    if fused == (None, None):
        flags.append("--no-rope-fusion")
    if not _imports("fused_weight_gradient_mlp_cuda"):
        flags.append("--no-gradient-accumulation-fusion")
    if not _imports("scaled_masked_softmax_cuda"):
        flags.append("--no-masked-softmax-fusion")
    if not gpt_layer_specs.HAVE_APEX:
        flags.append("--no-persist-layer-norm")
    return flags


def cpu_flags() -> list[str]:
    """What megatron needs on a machine without CUDA (gloo, local layers, no CUDA fusions)."""
    return [
        "--distributed-backend=gloo",
        "--transformer-impl=local",
        "--no-gradient-accumulation-fusion",
        "--no-rope-fusion",
        "--no-persist-layer-norm",
        "--no-bias-swiglu-fusion",
        "--no-masked-softmax-fusion",
        "--no-bias-dropout-fusion",
        "--use-cpu-initialization",
        "--muon-fp32-matmul-prec=high",  # "medium" runs Newton-Schulz in bf16: slow on CPU
    ]
