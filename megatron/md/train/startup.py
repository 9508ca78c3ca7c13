"""What ``pretrain_gpt.py`` says and checks once, before megatron builds anything: the stack
(megatron-core release, Transformer Engine against this torch) and every default of this run
that differs from upstream Megatron-LM's, in one block."""

from __future__ import annotations

import math
import os


def check_stack(args) -> None:
    """Stop with the stack's problems named (megatron/md/stack.py), and with every seam into
    megatron-core that no longer resolves (megatron/md/compat.py)."""
    from megatron.md import compat
    from megatron.md.stack import problems

    found = problems(args.transformer_impl)
    try:
        compat.check()
    except RuntimeError as e:
        found.append(str(e))
    if found:
        raise SystemExit("pretrain_gpt.py: error: " + "\n  ".join(found))


def differences(args, md) -> list[tuple[str, str]]:
    """(what this run does that upstream Megatron does not, the flag that changes it)."""
    from megatron.md.train.ckpt_checks import TRACKER

    out = []
    if args.arch == "ngpt":
        out.append((f"nGPT architecture: hidden states on the unit sphere, residual steps "
                    f"alpha {args.ngpt_alpha_init} at scale {args.ngpt_residual_scale}",
                    "--arch"))  # fmt: skip
    if args.sandwich_norm:
        out.append((f"Sandwich Norm: RMSNorm and scale {args.block_output_scale} on every block "
                    "output", "--no-sandwich-norm"))  # fmt: skip
    if getattr(args, "prenorm_block_scale", None):
        out.append((f"scale {args.prenorm_block_scale} on every block output (no norm after it)",
                    "--prenorm-block-scale"))  # fmt: skip
    if args.embedding_scale:
        out.append(("embeddings multiplied by sqrt(d)", "--no-embedding-scale"))
    if args.paper_arch and abs(args.init_method_std - 1 / math.sqrt(args.hidden_size)) < 1e-12:
        out.append((f"init std 1/sqrt(d) = {args.init_method_std:.4g} (upstream 0.02)",
                    "--init-method-std"))  # fmt: skip
    if args.paper_arch and not args.scaled_output_init:
        out.append(("output projections at the same init std (upstream: σ/sqrt(2L))",
                    "--scaled-output-init"))  # fmt: skip
    if getattr(args, "eval_interval_defaulted", False):
        out.append(("--eval-interval 1000 (megatron-core 0.19.2 has none and fails)",
                    "--eval-interval"))  # fmt: skip
    if (
        args.load
        and args.no_load_optim
        and not args.finetune
        and os.path.isfile(os.path.join(args.load, TRACKER))
    ):  # (a run that resumes; a first launch has nothing to continue)
        out.append(("--no-load-optim: the LR schedule continues at the checkpoint's step "
                    "(upstream restarts it at step 0)", "--finetune: iteration 0, a new "
                    "schedule"))  # fmt: skip
    if md is not None:
        out.append(("MD recipe: weight decay 0, Adam beta2 0.99, Muon momentum 0.95 Nesterov",
                    "the flags themselves"))  # fmt: skip
        if args.optimizer == "muon" and args.tensor_model_parallel_size > 1:
            out.append(("Muon orthogonalizes each full matrix under TP (upstream: each TP "
                        "piece)", "--muon-tp-mode"))  # fmt: skip
        if args.optimizer == "muon":
            out.append((f"Muon update scale '{md.muon_scale}' for MD matrices (upstream "
                        "'spectral'; sphere_rms follows the sphere radius)",
                        "--muon-scale-mode"))  # fmt: skip
    return out


def untested(args, md) -> list[str]:
    """Settings of this run that the maintainers have never run (README, "Tested where")."""

    out = []
    if args.transformer_impl == "transformer_engine":
        out.append("Transformer Engine layers (--transformer-impl local is the measured path)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if (
        world > int(os.environ.get("LOCAL_WORLD_SIZE", world))
        and args.distributed_backend != "gloo"
    ):
        out.append("several nodes")  # gloo: two nodes of tests/test_slurm.py
    if args.distributed_backend == "nccl" and world > 1:
        out.append("NCCL with more than one rank")
    if md is not None:
        from megatron.core.optimizer import distrib_optimizer

        if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", False):
            out.append("MD beside TE's/apex's fused Adam (its checkpoints never loaded)")
    if getattr(args, "fp8", None):
        out.append("FP8")
    if args.sequence_parallel:
        out.append("sequence parallelism")
    if args.context_parallel_size > 1:
        out.append("context-parallel attention")
    if args.async_save:
        out.append("--async-save")
    if md is not None and md.cuda_graph and world > 1:
        # run on one rank: an H100 (2026-11-26), an H200 through a save and a --load, the
        # resumed losses bit for bit (2026-12-04; docs/benchmarks.md); not across ranks
        out.append("the MD step in a CUDA graph with more than one rank (--md-cuda-graph)")
    return out


# torch/distributed/elastic/multiprocessing/api.py, PContext.close: the seconds torchrun gives
# its ranks after passing on a stop signal before it kills them
TORCHRUN_KILL_S = 30


def stop_grace(args) -> str | None:
    """Under torchrun with ``--exit-signal-handler``: the warning that torchrun will kill the
    ranks 30 s after a stop signal (SIGTERM: preemption, ``scancel``, SLURM's early warning)
    whatever their signal save still needs; measured on CPU, 2026-11-27: ranks killed 31.6 s
    after the signal, nothing saved, where 600 s let the same run save at 40 s. None where the
    wait is set (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, read from torch 2.12 on and by
    ``megatron.md.torchrun`` on any torch; launch.sbatch sets it and starts that) or the run is
    not torchrun's (no ``TORCHELASTIC_RUN_ID``)."""

    if not args.exit_signal_handler or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    from megatron.md.torchrun import GRACE_ENV, reads_timeout

    if os.environ.get(GRACE_ENV):  # megatron.md.torchrun gave an older torchrun the wait
        return None
    import torch

    lost = (f"torchrun kills the ranks {TORCHRUN_KILL_S} s after a stop signal (preemption, "
            "scancel): a signal save that takes longer is lost (the stop before the time "
            "limit, --exit-duration-in-mins, is not affected); ")  # fmt: skip
    if not reads_timeout():
        return lost + (f"torch {torch.__version__}'s torchrun has no setting for it: start "
                       "python -m megatron.md.torchrun with TORCH_ELASTIC_SHUTDOWN_TIMEOUT set "
                       "(launch.sbatch does)")  # fmt: skip
    try:  # torchrun's own --shutdown-timeout, on its command line (the ranks' parent)
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().split(b"\0")
    except OSError:
        parent = []
    given = any(a.split(b"=")[0] in (b"--shutdown-timeout", b"--shutdown_timeout") for a in parent)
    if given or os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        return None
    return lost + "set TORCH_ELASTIC_SHUTDOWN_TIMEOUT (seconds; launch.sbatch sets 1800)"


def banner(args, md) -> str:
    rows = differences(args, md)
    never = untested(args, md)
    if not rows:
        lines = ["[megatron-md] this run uses upstream Megatron's defaults"]
    else:
        width = max(len(w) for w, _ in rows)
        lines = ["[megatron-md] defaults of this run that differ from upstream Megatron:"]
        lines += [f"  {w:<{width}}  ({flag})" for w, flag in rows]
    if never:
        lines.append("[megatron-md] never run by the maintainers: " + "; ".join(never))
    if args.save and args.no_save_optim:
        lines.append(
            "[megatron-md] warning: --no-save-optim: the checkpoints hold the weights only (no "
            "optimizer state, no LR schedule" + ("; not MD's gains and radii" if md else "")
            + "): a resume from them needs --no-load-optim and starts a fresh optimizer"
        )  # fmt: skip
    if grace := stop_grace(args):
        lines.append("[megatron-md] warning: " + grace)
    return "\n".join(lines)
