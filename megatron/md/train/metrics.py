"""Our JSONL metrics file (read by the analysis tools) and the MD diagnostics.

Rows, one JSON object per line, written by the last global rank (on the last pipeline stage,
which has the losses):

- ``{"type": "run", ...}``: resolved config (megatron args and MD config), git commit, argv;
- ``{"type": "train", "iteration", "consumed_samples", "lm loss", "lr": {group: lr},
  "grad_norm", "tokens_per_s", "step_s", "flops_per_iter"[, "timers_ms": {...}][, "md": {...}]}``
  every ``--log-interval`` iterations; ``timers_ms``: the writing rank's megatron timers
  (``--timing-log-level`` ≥ 1) and ours (``md-step`` ⊃ ``md-reduce``, ``md-fuse``, and
  ``grad-norm`` and ``grad-clip``, which megatron leaves untimed; level 2),
  milliseconds per iteration; ``host`` (from the second logged iteration on, per iteration since
  the last log, the writing rank; ``host.py``): the main thread's CPU time, Python's cyclic
  garbage collection, on CUDA the caching allocator's device allocations and retries, and
  (timed phases) the forward-backward's and optimizer's wait for the device at their end — what
  separates a host-bound slowdown from a device-bound one — and the card's SM clock, power and
  temperature at the forward-backward's end (where nvidia-ml-py imports);
- ``{"type": "valid" | "test", "iteration", "lm loss"}`` after each evaluation.

A resumed run appends to the file (its run row first); where the run before it was killed
while writing a row, that partial line is ended first (``end_partial_line``), and the readers
skip it (``tools/runlog.py``).

The ``md`` entry: the diagnostics of ``diagnostics.py`` (relative update from fp32 weights,
output change, activation RMS, sphere drift, gains per class and per layer), every
``--md-log-interval`` iterations, on every run (MD or not, so baselines compare).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

import torch

from megatron.md.train.host import HostCounters

_S: dict = {"file": None, "opt": None, "diag": None, "t": None, "step_diag": None}


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0:
            return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _writer() -> bool:
    """The last rank writes, as megatron's own loggers: it is on the last pipeline stage,
    which alone knows the losses (megatron's rank order puts PP outermost)."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
    return int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1


def _write(row: dict) -> None:
    if _S["file"] is None or not _writer():
        return
    with open(_S["file"], "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def file_of(args) -> str:
    """The metrics file: ``--metrics-file``, else beside the checkpoints, else ``runs/``."""
    return args.metrics_file or os.path.join(args.save or "runs", "metrics.jsonl")


def start_run(args, md) -> str:
    """Pick the metrics file, write the run row (the last rank); returns the path."""
    path = file_of(args)
    _S["file"] = path
    _S["args"], _S["md"] = args, md
    if _S.get("host") is not None:  # a second run in this process: one gc callback
        _S["host"].close()
    _S["host"] = HostCounters()
    if _writer():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        end_partial_line(path)
        config = {k: v for k, v in sorted(vars(args).items()) if _jsonable(v)}
        _write(
            {
                "type": "run",
                "time": time.time(),
                "git": git_commit(),
                "argv": sys.argv,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "md_config": asdict(md) if md is not None else None,
                "args": config,
            }
        )
    return path


def end_partial_line(path: str) -> None:
    """A run killed while writing a row left it without its newline: end it, so this run's
    rows start on lines of their own (the readers skip the partial row: tools/runlog.py)."""
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            partial = f.read(1) != b"\n"
    except OSError:  # no file yet, or an empty one
        return
    if partial:
        with open(path, "a") as f:
            f.write("\n")


def _jsonable(v) -> bool:
    return isinstance(v, str | int | float | bool | type(None) | list | tuple | dict)


def _interval(args) -> int:
    return args.md_log_interval or args.log_interval


def _due(args, iteration: int) -> bool:
    return iteration == 1 or iteration % _interval(args) == 0


# ---- hooks ----
def attach(optimizer, model_chunks) -> None:
    """The diagnostics around ``optimizer.step`` on diagnostic iterations (diagnostics.py)."""
    from megatron.md.train.diagnostics import StepDiagnostics

    _S["opt"] = optimizer
    from megatron.training.global_vars import get_wandb_writer

    writer = get_wandb_writer()
    if writer is not None and _S.get("md") is not None:  # megatron's config has the flags
        writer.config.update({"md_config": asdict(_S["md"])}, allow_val_change=True)
    due = lambda: _due(_S["args"], _S["args"].curr_iteration + 1)  # noqa: E731
    diag = _S["step_diag"] = StepDiagnostics(optimizer, model_chunks, due)
    orig = optimizer.step

    @functools.wraps(orig)
    def step(*a, **k):
        it = _S["args"].curr_iteration + 1
        before = diag.before_step() if _due(_S["args"], it) else None
        lrs = _lrs(optimizer) if before is not None else None  # the LRs this step uses
        out = orig(*a, **k)
        if before is not None:  # (a train row's "lr" is the next step's: megatron logs it
            _S["diag"] = (it, {**diag.after_step(before), "lr": lrs})  # after the scheduler)
        return out

    optimizer.step = step


def _lrs(opt) -> dict:
    """Current LR per group, labelled by which of our peak LRs the group has."""
    args = _S["args"]
    labels = {}
    for label, lr in (
        ("default", args.lr),
        ("matrix", args.matrix_lr),
        ("embedding", args.embedding_lr),
        ("output", args.output_lr),
    ):
        if lr is not None:
            labels.setdefault(lr, []).append(label)
    out = {}
    for g in opt.param_groups:
        label = "/".join(labels.get(g.get("max_lr"), ["other"]))
        out[label] = float(g["lr"])
    return out


def _to_wandb(md: dict, iteration: int, prefix: str = "md/") -> None:
    """The diagnostics as wandb scalars ``md/<metric>/<class>`` (megatron's writer, last rank);
    the host's counters as ``host/<counter>``."""
    from megatron.training.global_vars import get_wandb_writer

    writer = get_wandb_writer()
    if writer is None:
        return
    flat = {}
    for metric, val in md.items():
        items = enumerate(val) if isinstance(val, list) else val.items()
        for k, v in items:
            if isinstance(v, list):  # gains_by_layer: [raw-gain norm, min, max]
                for part, x in zip(("raw_norm", "min", "max"), v):
                    flat[f"{prefix}{metric}/{k}/{part}"] = x
            else:
                flat[f"{prefix}{metric}/{k}"] = v
    writer.log(flat, iteration)


def wrap_training_log(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def training_log(*a, **k):
        call = sig.bind(*a, **k).arguments
        loss_dict, iteration, grad_norm = call["loss_dict"], call["iteration"], call["grad_norm"]
        args = _S.get("args")
        if _S.get("md") is not None and _S["opt"] is None:  # our optimizer seam never ran
            raise RuntimeError(
                "--md-decoupling is set but megatron built its optimizer without megatron-md's "
                "seam (megatron.training.training.get_megatron_optimizer moved?): stopping "
                "rather than training without MD (megatron/md/compat.py)"
            )
        if args is None or iteration % args.log_interval and iteration != 1:
            return orig(*a, **k)
        now = time.perf_counter()
        last = _S["t"]
        timers = _timers_ms(iteration - last[1] if last else 1)  # before megatron resets them
        _S["t"] = (now, iteration)
        row = {"type": "train", "iteration": iteration,
               "consumed_samples": args.consumed_train_samples}  # fmt: skip
        for key, v in loss_dict.items():
            row[key] = float(v)
        if _S["opt"] is not None:
            row["lr"] = _lrs(_S["opt"])
        row["grad_norm"] = None if grad_norm is None else float(grad_norm)
        if last is not None and iteration > last[1]:
            tokens = (iteration - last[1]) * args.global_batch_size * args.seq_length
            row["tokens_per_s"] = tokens / (now - last[0])
            row["step_s"] = (now - last[0]) / (iteration - last[1])
        row["flops_per_iter"] = _flops(args)
        if timers:
            row["timers_ms"] = timers
        host = _S.get("host")
        if host is not None and last is not None and iteration > last[1]:
            row["host"] = host.per_iteration(iteration - last[1])
            _to_wandb({"host": row["host"]}, iteration, prefix="")
        elif host is not None:
            host.reset()
        diag = _S["diag"]
        if diag is not None and diag[0] == iteration:
            row["md"] = diag[1]
            _S["diag"] = None
            _to_wandb(row["md"], iteration)
        _write(row)
        return orig(*a, **k)

    return training_log


#: megatron's optimizer/step timers and ours, as read into ``timers_ms``
TIMERS = (
    "forward-backward",
    "all-grads-sync",
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "grad-norm",
    "grad-clip",
    "optimizer-clip-main-grad",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
    "md-step",
    "md-reduce",
    "md-fuse",
)
#: ours, which megatron's ``training_log`` neither prints nor resets (training.py:2623): we do
OURS = frozenset({"md-step", "md-reduce", "md-fuse", "grad-norm", "grad-clip"})


def _timers_ms(n_iters: int) -> dict:
    """The writing rank's timers in ms per iteration since the last log. Megatron resets its own in
    training_log (called after this); ours (``OURS``) are not in its list, so we reset them."""
    from megatron.training.global_vars import get_timers

    try:
        timers = get_timers()
    except AssertionError:
        return {}
    out = {}
    for name in TIMERS:
        t = timers._timers.get(name)  # only enabled timers are stored (timers.py, Timers.__call__)
        if t is not None:
            out[name] = 1e3 * t.elapsed(reset=name in OURS) / max(1, n_iters)
    return out


def _flops(args) -> float:
    """Model FLOPs of one global batch (megatron's formula, as ``--log-throughput`` uses)."""
    if "flops" not in _S:
        from megatron.training.training import num_floating_point_operations

        _S["flops"] = float(num_floating_point_operations(args, args.global_batch_size))
    return _S["flops"]


#: megatron-core 0.19.2's ``evaluate_and_print_results`` under ``--full-validation`` with one
#: validation set (training/training.py:4377): it makes a 0-d tensor of the int
#: ``args.eval_iters``, whose ``tolist()`` is an int, then indexes it (``TypeError: 'int' object
#: is not subscriptable`` at the first evaluation, after training to it: seen, 2026-11-29)
FULL_VALIDATION_LINE = "eval_iters = torch.tensor(args.eval_iters, dtype=torch.long"


def one_set_full_validation_fits() -> bool:
    """Whether megatron's evaluation still holds the line the one-set workaround is for (a
    megatron-core that changed it: the run is refused at start-up, data.check_flags)."""
    import inspect

    from megatron.training import training

    return FULL_VALIDATION_LINE in inspect.getsource(training.evaluate_and_print_results)


def wrap_evaluate_and_print(orig):
    @functools.wraps(orig)
    def evaluate_and_print_results(
        prefix, forward_step_func, data_iterator, model, iteration, *a, **k
    ):
        from megatron.training import get_args

        args = get_args()
        # one validation set under --full-validation: its count as the one-element list
        # megatron's broadcast expects (FULL_VALIDATION_LINE); megatron sets it back to the int
        one_set = args.full_validation and not args.multiple_validation_sets
        if one_set and isinstance(args.eval_iters, int):
            args.eval_iters = [args.eval_iters]
        # [split, iteration, the next validation set's index (--multiple-validation-sets)]
        _S["eval"] = ["test" if "test" in str(prefix) else "valid", iteration, 0]
        try:
            return orig(prefix, forward_step_func, data_iterator, model, iteration, *a, **k)
        finally:
            _S["eval"] = None
            if one_set and isinstance(args.eval_iters, list):
                args.eval_iters = args.eval_iters[0]

    return evaluate_and_print_results


def wrap_evaluate(orig):
    @functools.wraps(orig)
    def evaluate(*a, **k):
        total, non_loss, timelimit = orig(*a, **k)
        ctx = _S.get("eval")
        if ctx is not None and not timelimit and total:
            row = {"type": ctx[0], "iteration": ctx[1]}
            if getattr(_S.get("args"), "multiple_validation_sets", False):
                names = getattr(_S["args"], "validation_set_names", None)
                row["set"] = names[ctx[2]] if names else ctx[2]  # megatron's validation-<set>
            for key, v in total.items():
                row[key] = float(v)
            _write(row)
        if ctx is not None:
            ctx[2] += 1
        return total, non_loss, timelimit

    return evaluate
