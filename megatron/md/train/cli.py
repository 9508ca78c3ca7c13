"""The ``pretrain_gpt.py`` command line as a library: argv expansion (preset, CPU settings, the
MD recipe, Muown's rewrite), megatron's parse plus ours, defaults that depend on other flags,
the single-process environment, and the run itself (``main``). ``pretrain_gpt.py`` is a short
entry over this module; the tools (evaluation, export, the flag reference, the sweep
front-end's validation) import it instead of executing the script.

Import order matters on a machine without CUDA: ``device.start`` (CPU mode) must run before
``megatron.training`` is imported, which this module does only inside its functions.
"""

from __future__ import annotations

import math
import os
import sys
import traceback

from megatron.md import errors
from megatron.md.launch import flag_value
from megatron.md.train import args as md_args
from megatron.md.train import (
    attempts,
    datacheck,
    files,
    patches,
    presets,
    runlock,
    shutdown,
    startup,
    wandbrun,
)
from megatron.md.train.ckpt_checks import tracked
from megatron.md.train.recipes import MD_RECIPE, optimizer_aliases


def given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def expand_argv(argv: list[str], on_cpu: bool) -> list[str]:
    """Preset, CPU and MD-recipe flags placed before the user's own (later flags win)."""
    argv = optimizer_aliases(argv)
    front: list[str] = []
    preset = flag_value(argv, "--preset")
    if preset is not None:
        try:
            front += presets.preset_flags(preset)
        except ValueError as e:
            errors.fail(str(e))
    if on_cpu:
        front += patches.cpu_flags()
    elif missing := patches.kernel_flags():
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[megatron-md] no Transformer Engine / apex kernels here: {' '.join(missing)}")
        front += missing
    if "--md-decoupling" in argv:
        front += MD_RECIPE
    if flag_value(argv, "--wandb-project"):  # read while megatron parses (global_vars.py)
        save = flag_value(argv, "--save") or "runs"
        # megatron logs wandb history only beside a TensorBoard writer (training_log)
        front.append(f"--tensorboard-dir={os.path.join(save, 'tensorboard')}")
        front.append(f"--wandb-exp-name={os.path.basename(os.path.normpath(save))}")
    return front + argv


def finalize(args, argv: list[str]) -> None:
    """Defaults that depend on other flags; which flags the command line gave."""
    args.given_flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    if args.paper_arch and not given(argv, "--init-method-std"):
        args.init_method_std = 1 / math.sqrt(args.hidden_size)  # the paper: 1/sqrt(d)
    if args.rope_scaling is not None:  # ours (the dense presets give it) sets megatron's switch
        if given(argv, "--use-rope-scaling") and not args.rope_scaling:
            errors.fail("--use-rope-scaling and --no-rope-scaling contradict each other: give one")
        args.use_rope_scaling = args.rope_scaling
    for flag in ("sandwich_norm", "embedding_scale"):  # on with --paper-arch unless given
        if getattr(args, flag) is None:
            setattr(args, flag, args.paper_arch and args.arch == "gpt")
    if args.arch == "ngpt":  # nGPT normalizes q and k itself (a preset's --qk-layernorm)
        args.qk_layernorm = False
    args.eval_interval_defaulted = args.eval_interval is None
    if args.eval_interval is None:
        # megatron-core 0.19.2 has no default here and divides by it while sizing the datasets
        # (TypeError); 1000 is Megatron-LM's long-standing default
        args.eval_interval = 1000
    if args.wsd_cooldown_fraction is not None:  # of the run, in its unit (iters or samples)
        if args.train_iters:
            args.lr_wsd_decay_iters = max(1, round(args.wsd_cooldown_fraction * args.train_iters))
        elif args.train_samples:
            args.lr_wsd_decay_samples = max(
                1, round(args.wsd_cooldown_fraction * args.train_samples)
            )
    if args.tokenizer_type is None:
        errors.fail(
            "give --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR "
            "(tools/train_tokenizer.py), or NullTokenizer --vocab-size N with --mock-data"
        )


def parse(argv: list[str], on_cpu: bool, check_data: bool = True, check_save: bool = True):
    """megatron's args (+ ours) and the MD config, validated; ``sys.argv`` becomes the expanded
    command line (megatron's fault-tolerance setup re-parses it). ``check_data=False`` checks
    the flags but not the data files (the sweep front-end on a login node that cannot see
    them); ``check_save=False`` does not look at ``--save`` and ``--load`` (the front-end's
    placeholder; the authors' paths on their cluster)."""
    from megatron.training.arguments import parse_and_validate_args

    patches.prepare_parsers()
    tok = flag_value(argv, "--tokenizer-model")  # megatron loads it while validating its args
    if check_data and flag_value(argv, "--tokenizer-type") == "HuggingFaceTokenizer":
        datacheck.check_tokenizer_dir(tok)
    if flag_value(argv, "--yaml-cfg") is not None:
        errors.fail(
            "--yaml-cfg: megatron then takes every setting from the YAML file in place of the "
            "command line's (training/arguments.py:136), the presets' and MD's flags with them: "
            "give the flags on the command line"
        )
    for flag in ("--save", "--load"):
        md_args.check_not_a_file(flag, flag_value(argv, flag))
    if check_data and check_save:
        md_args.check_writable("--save", flag_value(argv, "--save"))
        md_args.check_log_dirs(argv)
    sys.argv = [sys.argv[0]] + expand_argv(argv, on_cpu)
    try:
        args = parse_and_validate_args(extra_args_provider=md_args.add_md_args)
    except AssertionError as e:  # megatron validates its flags with asserts: say it plainly
        where = traceback.extract_tb(e.__traceback__)[-1]
        msg = str(e) or f"{where.line} ({os.path.basename(where.filename)}:{where.lineno})"
        errors.fail(msg)
    finalize(args, sys.argv)
    if on_cpu and args.async_save:  # (megatron turns it off itself without the worker)
        errors.fail(
            "--async-save needs CUDA: megatron's persistent checkpoint worker sets a CUDA "
            "device in a process of its own (dist_checkpointing/strategies/async_utils.py); "
            "drop it on a CPU"
        )
    if on_cpu and args.profile and not args.use_pytorch_profiler:
        errors.fail(
            "--profile needs CUDA without --use-pytorch-profiler (megatron starts the CUDA "
            "profiler for nsys: 'Found no NVIDIA driver' at --profile-step-start): add "
            "--use-pytorch-profiler on a CPU"
        )
    if on_cpu and args.log_memory_to_tensorboard:
        errors.fail(
            "--log-memory-to-tensorboard reads CUDA's memory statistics (a KeyError on a CPU "
            "at the first log): drop it on a CPU"
        )
    md = md_args.validate(args, check_data=check_data)
    if check_data and check_save:
        md_args.check_run_dirs(args)
    if on_cpu and args.md_cuda_graph:
        errors.fail("--md-cuda-graph needs CUDA (it captures the MD step in a CUDA graph): drop "
                    "it on a CPU")  # fmt: skip
    return args, md


def single_process_env() -> None:
    """Run without torchrun as one process (a free local port for the rendezvous)."""
    if "RANK" in os.environ:
        return
    from megatron.md.launch import free_port

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    os.environ.update({**env, "LOCAL_RANK": "0"})


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: list[str] | None = None) -> None:
    """The whole run: parse and check once, then megatron's ``pretrain`` with our patches."""
    from megatron.md import cpu_mode

    argv = list(sys.argv[1:] if argv is None else argv)
    single_process_env()
    with errors.one_line():
        on_cpu = cpu_mode.is_active()
        args, md = parse(argv, on_cpu)
        startup.check_stack(args)
        # before any expensive work, or any write (the last rank's metrics row)
        unlocked = runlock.hold(args.save, rank(), int(os.environ.get("WORLD_SIZE", "1")))
        attempt_lines = attempts.settle(args)  # (before wandb: which checkpoint it resumes)
        wandb_line = wandbrun.prepare(args)
        finished_line = clear_finished(args)
        if rank() == 0:
            print(startup.banner(args, md), flush=True)
            for line in (*attempt_lines, wandb_line, finished_line):
                if line:
                    print("[megatron-md] " + line, flush=True)
            if unlocked:
                print("[megatron-md] warning: " + unlocked, flush=True)
        wandbrun.open_writers(args)  # (megatron opens them while parsing: compat's parser rows)
        with shutdown.children_killed_on_crash():
            run(args, md, on_cpu)


def run(args, md, on_cpu: bool) -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron.md.train import data, metrics, model

    patches.apply(md, on_cpu)
    metrics.start_run(args, md)
    cfg = pretrain_cfg_container_from_args(args)
    try:
        pretrain(
            cfg,
            data.datasets_provider,
            ModelType.encoder_or_decoder,
            data.forward_step,
            model_provider=model.model_provider,
        )
    except errors.Refusal:  # (a failed save, say) never a clean, resumable stop
        raise
    except SystemExit as e:  # megatron's early exits (signal, duration) end with sys.exit
        mark_stop(args, e.code)
        raise
    mark_finished(args)


def mark_stop(args, code) -> None:
    """A clean early stop (megatron's ``sys.exit`` with status 0 after its save: a signal, the
    duration) leaves the saved iteration in ``<save>/stopped``, and in ``<save>/exited_on_signal``
    too when ``--exit-signal-handler`` noted a signal. The launcher reads them where torchrun's
    status is not 0: torchrun ends non-zero on the signal it passed on, or is ended by a signal
    after the ranks stopped (SLURM's warning, sent up to a minute early, once landed 3 s after
    a duration stop and failed the job); either way the checkpoint is whole and the run
    resumable."""
    if not args.save or code not in (0, None) or rank() != 0:
        return
    saved = tracked(args.save)
    if saved is None:
        return
    names = ["stopped"]
    if args.exit_signal_handler:
        from megatron.training.global_vars import get_signal_handler

        if getattr(get_signal_handler(), "_signal_received", False):  # local: no collective
            names.append("exited_on_signal")
    for name in names:
        files.write_whole(os.path.join(args.save, name), f"{saved}\n")


def clear_finished(args) -> str | None:
    """A ``<save>/finished`` of a shorter run, removed (rank 0, holding the run's lock) when this
    launch trains further: a finished run continued with a larger ``--train-iters`` kept it, and
    the launcher, reading it, ended the continuation at its first time limit or preemption as
    finished, not requeued (the sweep front-end also reported the run finished)."""
    path = os.path.join(args.save or "", "finished")
    if not args.save or rank() != 0 or not os.path.isfile(path):
        return None
    done = files.read_count(path)  # None (unreadable): not evidence this run is finished
    target = args.train_iters  # (by samples: as megatron's update_train_iters counts them)
    if not target and args.train_samples and not getattr(args, "step_batch_size_schedule", None):
        target = args.train_samples // args.global_batch_size
    if not target or (done is not None and done >= target):
        return None
    os.remove(path)
    held = f"--train-iters {done}" if done is not None else "unreadable"
    return (f"{path} ({held}) removed: this run trains to {target}, and writes it again when "
            "it gets there")  # fmt: skip


def mark_finished(args) -> None:
    """``<save>/finished`` once the last iteration's checkpoint exists (the SLURM launcher's
    requeue logic reads it; a run stopped early by time or signal has none)."""
    if not args.save or rank() != 0:
        return
    saved = tracked(args.save)
    if saved is not None and saved >= args.train_iters:
        files.write_whole(os.path.join(args.save, "finished"), f"{args.train_iters}\n")
