"""Every patch of megatron.training / megatron-core that ``pretrain_gpt.py`` needs, in one place.

Each is a module attribute replaced at the narrowest seam, looked up by megatron at call time:

- ``initialize_megatron(allow_no_cuda=True)`` on CPU: ``pretrain`` calls it without the flag
  (training.py:1091) and it asserts CUDA otherwise (initialize.py:66).
- ``compile_helpers`` is a no-op: the wheel ships the compiled dataset helper but no Makefile,
  so ``make`` exits the job (core/datasets/utils.py:25-30), on GPU too.
- ``get_megatron_optimizer_config``: per-group peak LRs (--matrix-lr/--embedding-lr/
  --output-lr) as megatron param-group overrides; layer-wise sharding needs
  ``OptimizerConfig.bf16=True`` even for fp32 params (core/optimizer/layer_wise_optimizer.py:505).
- ``get_megatron_optimizer``: ``enable_md`` on the optimizer megatron built (training.py:2132),
  or the resume fix of megatron's own DistributedOptimizer (wrappers.fix_plain_resume).
- ``load_checkpoint`` (training.py:2199): checks a checkpoint's MD state against the --md-*
  flags and tells the MD optimizer whether to expect it, before megatron reads anything.
- ``get_muon_scale_factor`` (core/optimizer/emerging_optimizers.py:208): adds the paper's
  ``shape_up`` and ``rms_match`` modes to megatron's Muon.
- ``training_log`` / ``evaluate`` (training.py): our JSONL metrics after megatron's own logging.
- ``get_write_results_queue`` on CPU: torch_dist saves start a *spawn* Manager, which re-imports
  the training script (~10 s per run on a laptop; dist_checkpointing/strategies/
  filesystem_async.py:64); a fork Manager serves the same queue.
- ``add_megatron_arguments`` (arguments.py:121): ``--muon-scale-mode`` also accepts the paper's
  modes, in every parser (fault-tolerance set-up re-parses argv without our provider:
  training/ft_integration.py:78).
"""

from __future__ import annotations

import functools
import os

import torch

from megatron.md.config import MDConfig

_STATE: dict = {"optimizer": None, "md": None}


def apply(md: MDConfig | None, on_cpu: bool) -> None:
    import megatron.core.datasets.utils as data_utils
    import megatron.core.optimizer.emerging_optimizers as emerging
    import megatron.training.training as mtt

    _STATE["md"] = md
    if on_cpu:
        import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa
        from megatron.training.initialize import initialize_megatron

        mtt.initialize_megatron = functools.partial(initialize_megatron, allow_no_cuda=True)
        fsa.get_write_results_queue = functools.partial(fsa.get_write_results_queue, "fork")
    data_utils.compile_helpers = lambda: None
    mtt.get_megatron_optimizer_config = _wrap_optimizer_config(mtt.get_megatron_optimizer_config)
    mtt.get_megatron_optimizer = _wrap_optimizer(mtt.get_megatron_optimizer)
    mtt.load_checkpoint = _wrap_load(mtt.load_checkpoint)
    emerging.get_muon_scale_factor = _wrap_muon_scale(emerging.get_muon_scale_factor)
    from megatron.md.train import metrics

    mtt.training_log = metrics.wrap_training_log(mtt.training_log)
    mtt.evaluate = metrics.wrap_evaluate(mtt.evaluate)
    mtt.evaluate_and_print_results = metrics.wrap_evaluate_and_print(mtt.evaluate_and_print_results)


def widen_choices() -> None:
    """Before parsing: --muon-scale-mode accepts the paper's modes in every megatron parser."""
    import megatron.training.arguments as margs

    from megatron.md.config import MUON_SCALES

    orig = margs.add_megatron_arguments
    if getattr(orig, "_md_widened", False):
        return

    @functools.wraps(orig)
    def add_megatron_arguments(parser):
        parser = orig(parser)
        action = parser._option_string_actions["--muon-scale-mode"]
        action.choices = list(dict.fromkeys([*action.choices, *MUON_SCALES]))
        return parser

    add_megatron_arguments._md_widened = True
    margs.add_megatron_arguments = add_megatron_arguments


def current_optimizer():
    return _STATE["optimizer"]


def _wrap_optimizer_config(orig):
    @functools.wraps(orig)
    def get_config(args):
        from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

        from megatron.md.roles import is_embedding, is_output

        config, overrides = orig(args)
        if getattr(args, "md_adam_layer_wise", False):  # built as layer-wise Muon, see args.py
            config.optimizer, config.muon_split_qkv = "muon", False
            config.use_layer_wise_distributed_optimizer = True
        if config.use_layer_wise_distributed_optimizer:
            config.bf16 = True  # layer_wise_optimizer.py:505 needs it even for fp32 params
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


def _wrap_optimizer(orig):
    @functools.wraps(orig)
    def get_optimizer(config, model_chunks, *a, **kw):
        from megatron.md.enable import enable_md
        from megatron.md.train import nonfinite
        from megatron.md.wrappers import fix_plain_resume

        opt = orig(config, model_chunks, *a, **kw)
        if _STATE["md"] is not None:
            enable_md(opt, model_chunks, _STATE["md"])
        else:
            fix_plain_resume(opt)
        from megatron.training import get_args

        if not get_args().check_for_nan_in_loss_and_grad:  # else megatron stops at a NaN
            nonfinite.guard(opt)
        _STATE["optimizer"] = opt
        from megatron.md.train import metrics

        metrics.attach(opt, model_chunks)
        return opt

    return get_optimizer


def checkpoint_dir(load: str, step: int | None = None) -> str | None:
    """The torch_dist directory ``--load`` resumes from (``--ckpt-step``, else the tracker's);
    None: nothing to resume."""
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
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
            raise RuntimeError(f"--load {load}: {tracker} holds {text!r}, not an iteration")
    path = os.path.join(load, name)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise RuntimeError(
            f"--load {load}: {path} is missing or not a complete torch_dist checkpoint "
            "(no .metadata); nothing was read or changed"
        )
    return path


def _wrap_load(orig):
    @functools.wraps(orig)
    def load(model, optimizer, *a, **kw):
        from megatron.training import get_args

        from megatron.md.checkpoint import prepare_md_load
        from megatron.md.train import ckpt_checks
        from megatron.md.wrappers import begin_model_load, finish_model_load

        args = get_args()
        path = checkpoint_dir(args.load, args.ckpt_step) if args.load else None
        if path is None and getattr(args, "init_from", None):  # first start of a continual run
            return _load_init(orig, model, optimizer, *a, **kw)
        if path is not None:
            ckpt_checks.check_all(path, args)
        loads_optim = not (args.no_load_optim or args.finetune)  # else MD state is rebuilt
        if path is not None and optimizer is not None and _STATE["md"] is not None and loads_optim:
            try:
                prepare_md_load(optimizer, path)
            except ValueError:
                raise
            except Exception as e:  # unreadable metadata: say which checkpoint
                raise RuntimeError(f"--load: cannot read checkpoint {path}: {e}") from e
        if optimizer is None or _STATE["md"] is None:
            return orig(model, optimizer, *a, **kw)
        begin_model_load(optimizer)
        out = orig(model, optimizer, *a, **kw)
        if path is not None and finish_model_load(optimizer):
            from megatron.training.utils import print_rank_0

            print_rank_0(
                "[megatron-md] no optimizer state loaded: MD state from the loaded weights"
            )
        return out

    return load


def _load_init(orig, model, optimizer, scheduler, *a, **kw):
    """``--init-from``: megatron's load pointed at that checkpoint (weights, optimizer state
    unless ``--init-weights-only``; no RNG, no LR schedule: ``scheduler`` is not passed, so this
    run's starts at step 0), then iteration and consumed samples reset to 0."""
    from megatron.training import get_args
    from megatron.training.utils import print_rank_0

    args = get_args()
    saved = args.load, args.ckpt_step, args.no_load_optim, args.no_load_rng
    args.load, args.ckpt_step, args.no_load_rng = args.init_from, None, True
    args.no_load_optim = args.no_load_optim or args.init_weights_only
    adopted = _adopt_param_groups(optimizer) if not args.no_load_optim else []
    try:
        print_rank_0(f"[megatron-md] --init-from {args.init_from}: a new run from its checkpoint")
        load = _wrap_load(orig)
        load(model, optimizer, None, *a, **kw)
    finally:
        args.load, args.ckpt_step, args.no_load_optim, args.no_load_rng = saved
        for opt in adopted:
            del opt.load_state_dict  # the class's again
    args.consumed_train_samples = args.consumed_valid_samples = args.skipped_train_samples = 0
    return 0, 0


def _adopt_param_groups(optimizer) -> list:
    """For ``--init-from`` with optimizer state: megatron pairs saved and current parameter
    groups by their hyper-parameters (core/optimizer/distrib_optimizer.py:941-970), so a run
    with other LRs than the source's could not load its moments. The moments are stored per
    parameter, not per group: give the load this run's groups (its hyper-parameters) with the
    source's step count. Returns the optimizers whose ``load_state_dict`` was wrapped (on the
    instance, for this load only)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron.md.wrappers import leaf_optimizers

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


def _wrap_muon_scale(orig):
    from megatron.md.base_steps import muon_scale_factor

    @functools.wraps(orig)
    def scale(size_out, size_in, mode="spectral"):
        if mode in ("shape_up", "rms_match"):
            return muon_scale_factor(mode, size_out, size_in)
        return orig(size_out, size_in, mode=mode)

    return scale


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


def on_cpu() -> bool:
    return not torch.cuda.is_available()
