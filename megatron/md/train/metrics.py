"""Our JSONL metrics file (read by the analysis tools) and the MD diagnostics.

Rows, one JSON object per line, written by global rank 0:

- ``{"type": "run", ...}``: resolved config (megatron args and MD config), git commit, argv;
- ``{"type": "train", "iteration", "consumed_samples", "lm loss", "lr": {group: lr},
  "grad_norm", "tokens_per_s", "step_s", "flops_per_iter"[, "timers_ms": {...}][, "md": {...}]}``
  every ``--log-interval`` iterations; ``timers_ms``: rank 0's megatron timers
  (``--timing-log-level`` ≥ 1) and ours (``md-step`` ⊃ ``md-reduce``, ``md-fuse``; level 2),
  milliseconds per iteration;
- ``{"type": "valid" | "test", "iteration", "lm loss"}`` after each evaluation.

MD diagnostics (every ``--md-log-interval`` iterations, on every run, MD or not, so baselines
compare): relative update ‖ΔW‖/‖W‖ per matrix class (mean over its matrices, from the fp32
weights the optimizer holds, never bf16 model weights), per-layer
activation RMS (block outputs, first micro-batch), and for MD runs the sphere drift
max |‖Ŵ‖−c|/c and the gain spread (raw-gain norm, min and max φ(ĝ)) per class.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict

import torch

CLASSES = ("qkv", "proj", "fc1", "fc2", "router", "experts", "shared", "embeddings", "output")
_S: dict = {"file": None, "opt": None, "chunks": None, "diag": None, "acts": {}, "t": None}


def matrix_class(name: str) -> str | None:
    """The class of a 2-D parameter for the diagnostics (None: not reported)."""
    if name.endswith("word_embeddings.weight"):
        return "embeddings"
    if name.endswith("output_layer.weight"):
        return "output"
    if ".router." in name:
        return "router"
    if "shared_experts" in name:
        return "shared"
    if ".experts." in name:
        return "experts"
    for key, cls in (("linear_qkv", "qkv"), ("linear_proj", "proj")):
        if key in name:
            return cls
    for key, cls in (("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
        if key in name:
            return cls
    return None


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


def _rank0() -> bool:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def _write(row: dict) -> None:
    if _S["file"] is None or not _rank0():
        return
    with open(_S["file"], "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def start_run(args, md) -> str:
    """Pick the metrics file, write the run row (rank 0); returns the path."""
    path = args.metrics_file or os.path.join(args.save or "runs", "metrics.jsonl")
    _S["file"] = path
    _S["args"] = args
    if _rank0():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
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


def _jsonable(v) -> bool:
    return isinstance(v, str | int | float | bool | type(None) | list | tuple | dict)


def _interval(args) -> int:
    return args.md_log_interval or args.log_interval


def _due(args, iteration: int) -> bool:
    return iteration == 1 or iteration % _interval(args) == 0


# ---- hooks ----
def attach_optimizer(opt) -> None:
    _S["opt"] = opt
    orig = opt.step

    @functools.wraps(orig)
    def step(*a, **k):
        args = _S["args"]
        it = args.curr_iteration + 1
        before = _snapshot() if _due(args, it) else None
        out = orig(*a, **k)
        if before is not None:
            _S["diag"] = (it, _diagnostics(before))
        return out

    opt.step = step


def attach_model(model_chunks) -> None:
    """Block-output RMS hooks (active only on diagnostic iterations)."""
    _S["chunks"] = model_chunks
    for chunk in model_chunks:
        decoder = getattr(_unwrap(chunk), "decoder", None)
        for i, layer in enumerate(getattr(decoder, "layers", [])):
            layer.register_forward_hook(functools.partial(_act_hook, i))


def _unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def _act_hook(i, module, inputs, output):
    args = _S.get("args")
    if args is None or not module.training:
        return
    it = args.curr_iteration + 1
    if not _due(args, it):
        return
    acts = _S["acts"].setdefault(it, {})
    if i not in acts:  # first micro-batch only
        h = output[0] if isinstance(output, tuple) else output
        acts[i] = float(h.detach().float().pow(2).mean().sqrt())


def _names() -> dict:
    """Model parameter -> (name, diagnostic class) for the reported matrices."""
    out = {}
    for chunk in _S["chunks"] or []:
        for name, p in _unwrap(chunk).named_parameters():
            cls = matrix_class(name) if p.ndim == 2 else None
            if cls is not None:
                out[p] = (name, cls)
    return out


def _owned_weights():
    """(leaf optimizer, main param, name, class) of every reported matrix this rank steps."""
    from megatron.md.checkpoint import leaf_optimizers
    from megatron.md.mains import main_params

    names = _names()
    for opt in leaf_optimizers(_S["opt"]):
        for mp in main_params(opt):
            if mp.model in names:
                yield opt, mp, *names[mp.model]


@torch.no_grad()
def _snapshot() -> dict:
    """The fp32 weights W this rank steps (its ZeRO-1 slices / whole matrices), before a step:
    the relative update is measured on them, not on bf16 model weights, whose rounding would
    bias it upward at small LRs."""
    from megatron.md.mains import fp32_weight

    return {(name, mp.start): fp32_weight(opt, mp).clone() for opt, mp, name, _ in _owned_weights()}


@torch.no_grad()
def _diagnostics(before: dict) -> dict:
    """Relative update ‖ΔW‖/‖W‖ per class (mean over its matrices) from the fp32 weights of
    every rank, and the MD statistics: one ``all_gather_object`` in all."""
    from megatron.md.mains import fp32_weight

    parts = []
    for opt, mp, name, cls in _owned_weights():
        w = fp32_weight(opt, mp)
        dw2 = float((w - before[(name, mp.start)]).double().square().sum())
        parts.append((name, cls, mp.start, dw2, float(w.double().square().sum())))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (parts, _md_local()))
    slices: dict[str, dict] = {}
    for rank_parts, _ in gathered:
        for name, cls, start, dw2, w2 in rank_parts:  # replicas of one slice counted once
            slices.setdefault((name, cls), {})[start] = (dw2, w2)
    rel: dict[str, list[float]] = {}
    for (_, cls), by_start in slices.items():
        dw2, w2 = (sum(v) for v in zip(*by_start.values()))
        rel.setdefault(cls, []).append(math.sqrt(dw2 / max(w2, 1e-60)))
    out = {"rel_update": {c: sum(v) / len(v) for c, v in rel.items()}}
    out.update(_md_merge([items for _, items in gathered]))
    return out


def _md_local() -> list[dict]:
    """This rank's sphere-norm partials and gain statistics of every MD matrix it steps."""
    from megatron.md import maps
    from megatron.md.checkpoint import leaf_optimizers

    local = []
    for o in leaf_optimizers(_S["opt"]):
        inner = o.optimizer
        if not hasattr(inner, "slots"):
            continue
        for p, slot in inner.slots.items():
            md, st = slot.md, inner.md_state[p]
            part = torch.zeros(md.n_norm, dtype=torch.float64)
            if md.n_norm:
                tmp = torch.zeros(md.n_norm, dtype=torch.float32, device=p.device)
                md.norm_partials(inner._flat_dir(p), tmp)
                part = tmp.double().cpu()
            gains = [st[n] for n in md.gain_names if n in ("gain_row", "gain_col", "gain_scalar")]
            phi = [maps.phi(g, md.spec.gain_map) for g in gains]
            radius = st.get("radius")
            local.append(
                {
                    "name": slot.name,
                    "start": md.start,
                    "partial": part,
                    "radius": None if radius is None else radius.detach().double().cpu(),
                    "raw_sq": sum(float((g.double() ** 2).sum()) for g in gains),
                    "gmin": min((float(x.min()) for x in phi), default=None),
                    "gmax": max((float(x.max()) for x in phi), default=None),
                }
            )
    return local


def _md_merge(gathered: list[list[dict]]) -> dict:
    """Sphere drift and gain spread per class from every rank's ``_md_local``."""
    by_name: dict[str, dict] = {}
    for rank_items in gathered:
        for it in rank_items:
            e = by_name.setdefault(it["name"], {"slices": {}, **it})
            e["slices"][it["start"]] = it["partial"]  # replicas of one slice counted once
    drift, raw, gmin, gmax = {}, {}, {}, {}
    for name, e in by_name.items():
        cls = matrix_class(name) or "other"
        if e["radius"] is not None and e["slices"]:
            norm = sum(e["slices"].values()).sqrt()
            r = e["radius"].reshape(-1)
            d = float(((norm - r).abs() / r).max())
            drift[cls] = max(drift.get(cls, 0.0), d)
        if e["gmin"] is not None:
            raw.setdefault(cls, []).append(math.sqrt(e["raw_sq"]))
            gmin[cls] = min(gmin.get(cls, math.inf), e["gmin"])
            gmax[cls] = max(gmax.get(cls, -math.inf), e["gmax"])
    out = {
        "sphere_drift": drift,
        "raw_gain_norm": {c: sum(v) / len(v) for c, v in raw.items()},
        "gain_min": gmin,
        "gain_max": gmax,
    }
    return {k: v for k, v in out.items() if v}


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


def _to_wandb(md: dict, iteration: int) -> None:
    """The diagnostics as wandb scalars ``md/<metric>/<class>`` (megatron's writer, last rank)."""
    from megatron.training.global_vars import get_wandb_writer

    writer = get_wandb_writer()
    if writer is None:
        return
    flat = {}
    for metric, val in md.items():
        items = enumerate(val) if isinstance(val, list) else val.items()
        for k, v in items:
            flat[f"md/{metric}/{k}"] = v
    writer.log(flat, iteration)


def wrap_training_log(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def training_log(*a, **k):
        call = sig.bind(*a, **k).arguments
        loss_dict, iteration, grad_norm = call["loss_dict"], call["iteration"], call["grad_norm"]
        args = _S.get("args")
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
        diag = _S["diag"]
        if diag is not None and diag[0] == iteration:
            row["md"] = diag[1]
            acts = _S["acts"].pop(iteration, {})
            row["md"]["act_rms"] = [acts[i] for i in sorted(acts)]
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
    "optimizer-clip-main-grad",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
    "md-step",
    "md-reduce",
    "md-fuse",
)


def _timers_ms(n_iters: int) -> dict:
    """Rank 0's timers in ms per iteration since the last log. Megatron resets its own in
    training_log (called after this); ours (``md-*``) are not in its list, so we reset them."""
    from megatron.training.global_vars import get_timers

    try:
        timers = get_timers()
    except AssertionError:
        return {}
    out = {}
    for name in TIMERS:
        t = timers._timers.get(name)  # only enabled timers are stored (timers.py:241)
        if t is not None:
            out[name] = 1e3 * t.elapsed(reset=name.startswith("md-")) / max(1, n_iters)
    return out


def _flops(args) -> float:
    """Model FLOPs of one global batch (megatron's formula, as ``--log-throughput`` uses)."""
    if "flops" not in _S:
        from megatron.training.training import num_floating_point_operations

        _S["flops"] = float(num_floating_point_operations(args, args.global_batch_size))
    return _S["flops"]


def wrap_evaluate_and_print(orig):
    @functools.wraps(orig)
    def evaluate_and_print_results(
        prefix, forward_step_func, data_iterator, model, iteration, *a, **k
    ):
        _S["eval"] = ("test" if "test" in str(prefix) else "valid", iteration)
        try:
            return orig(prefix, forward_step_func, data_iterator, model, iteration, *a, **k)
        finally:
            _S["eval"] = None

    return evaluate_and_print_results


def wrap_evaluate(orig):
    @functools.wraps(orig)
    def evaluate(*a, **k):
        total, non_loss, timelimit = orig(*a, **k)
        ctx = _S.get("eval")
        if ctx is not None and not timelimit and total:
            row = {"type": ctx[0], "iteration": ctx[1]}
            for key, v in total.items():
                row[key] = float(v)
            _write(row)
        return total, non_loss, timelimit

    return evaluate
