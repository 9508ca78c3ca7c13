"""The paper's throughput table: AdamW, Muon, AdamMD and MuonMD on the same model, side by side.

Runs ``pretrain_gpt.py`` once per method (mock data, same preset, batch and seed; with
``--timing-log-level 2`` so the optimizer step is broken into megatron's timers and ours), or
reads the JSONL logs of runs made elsewhere (``--logs``, or a sweep manifest such as the
``throughput`` experiment of ``sweep.py``), and prints per method, as medians over the logged
iterations after ``--warmup``: tokens/s/GPU, model TFLOP/s/GPU and MFU (megatron's FLOP count;
MFU needs a peak: known GPUs or ``--peak-tflops``), the slowdown of each MD variant against its
base (AdamMD/AdamW, MuonMD/Muon), the step's phases in ms and the host's counters (the loop
thread's CPU ms, GC ms, CUDA allocations per iteration, and the wait for the device at the
forward-backward's end). Writes throughput.{json,csv,png}.
A method whose run fails is named and left out; the others are still run and tabled, and the
tool exits 1.

    python tools/throughput.py --preset dense-181M --iters 40 --out runs/tput      # on GPUs
    python tools/throughput.py --preset tiny --iters 12 --warmup 4 --out /tmp/tput  # CPU smoke
    python tools/throughput.py --logs adamw=a/metrics.jsonl adammd=b/metrics.jsonl ...
    python tools/throughput.py --manifest runs/throughput/manifest.json
    python tools/throughput.py --preset tiny --out /tmp/t -- --seq-length=128   # extra flags

Flags after ``--`` reach every method's run, the MD step's (``--md-*``) the MD methods' only.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from runlog import LogError, RunLog, read_log, read_manifest, run_pretrain  # noqa: E402

#: methods that are another's recipe with flags added; adammd-eager / muonmd-eager: the eager
#: MD step (--md-fused-step off) beside the default, compiled on a GPU at these sizes;
#: *-graph: the default step replayed from a CUDA graph (--md-cuda-graph, GPU only);
#: adamw-again: AdamW once more, its "vs base" the first AdamW's — the run-to-run spread in the
#: same call, the yardstick of the MD rows' percentages (one run per method on an H100,
#: 2026-11-26: AdamMD's forward-backward 124 ms against AdamW's 102, the same model)
VARIANTS = {
    "adamw-again": ("adamw", []),
    "adammd-eager": ("adammd", ["--md-fused-step=off"]),
    "muonmd-eager": ("muonmd", ["--md-fused-step=off"]),
    "adammd-graph": ("adammd", ["--md-cuda-graph"]),
    "muonmd-graph": ("muonmd", ["--md-cuda-graph"]),
}
#: adammd-lw: AdamMD on whole matrices owned layer-wise (--md-adam-layer-wise), as the paper's
#: throughput table ran it (appendix "Implementation, Efficiency, and Throughput")
METHODS = ("adamw", "muon", "adammd", "muonmd", "adammd-lw", *VARIANTS)
BASE = {"adammd": "adamw", "muonmd": "muon", "adammd-lw": "adamw"}
BASE |= {name: BASE.get(recipe, recipe) for name, (recipe, _) in VARIANTS.items()}
#: dense bf16 peak TFLOP/s by device-name substring (first match wins)
PEAKS = (("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0),
         ("A100", 312.0), ("B200", 2250.0))  # fmt: skip
#: the step's timers (rank 0), in the order they run: megatron's optimizer phase holds the copy
#: of the gradients to the main ones, the gradient norm and the clipping (``grad-norm``,
#: ``grad-clip``: ours, megatron-core 0.19.2's ``ChainedOptimizer.step``, optimizer.py:1855,
#: times neither), the inner step (MD's ``md-step`` ⊃ ``md-reduce``; with fp32 params also
#: ``md-fuse``), the copy of the main params to the model's (with bf16 params, MD's
#: ``md-fuse``), the params' all-gather
PHASES = ("optimizer", "optimizer-copy-to-main-grad", "grad-norm", "grad-clip",
          "optimizer-inner-step", "md-step", "md-reduce", "optimizer-copy-main-to-model-params",
          "md-fuse", "params-all-gather", "forward-backward")  # fmt: skip
#: the train rows' ``host`` counters (megatron/md/train/host.py), per iteration: the loop
#: thread's CPU time (on a GPU with the spin of its waits for the device), Python's garbage
#: collection, the CUDA allocator's device allocations, and the forward-backward's wait for the
#: device at its end (~0: the host issues slower than the device runs; more: the device is the
#: bottleneck, by that much), and the card's SM clock and power there (lower clocks at the same
#: work: the card held back by its power or thermal limit)
HOST = {"cpu_ms": "host CPU ms", "gc_ms": "GC ms", "cuda_mallocs": "cudaMalloc/it",
        "wait_ms/forward-backward": "f-b device wait ms", "card_sm_mhz": "card SM MHz",
        "card_power_w": "card W"}  # fmt: skip


def peak_for(device: str, override: float | None) -> float | None:
    if override:
        return override
    return next((p for key, p in PEAKS if key in device), None)


def summarize(log: RunLog, warmup: int, peak: float | None) -> dict:
    """Medians over the train rows after ``warmup`` iterations."""
    rows = [r for i, r in sorted(log.train.items()) if i > warmup and r.get("step_s")]
    if not rows:
        raise LogError(
            f"{log.path}: no timed iterations after warm-up {warmup} "
            f"(last iteration {log.last_iteration()}); log every iteration and run longer"
        )
    world = int(log.args.get("world_size") or 1)
    step = statistics.median(r["step_s"] for r in rows)
    tokens = statistics.median(r["tokens_per_s"] for r in rows) / world
    flops = rows[-1].get("flops_per_iter")
    tflops = flops / step / world / 1e12 if flops else None
    device = log.run.get("device", "unknown")
    peak = peak_for(device, peak)
    phases = {}
    for name in PHASES:
        vals = [r["timers_ms"][name] for r in rows if name in r.get("timers_ms", {})]
        if vals:
            phases[name] = statistics.median(vals)
    host = {}
    for name in HOST:
        vals = [r["host"][name] for r in rows if name in r.get("host", {})]
        if vals:
            host[name] = statistics.median(vals)
    return {
        "log": str(log.path),
        "device": device,
        "world_size": world,
        "measured_iterations": len(rows),
        "step_ms": 1e3 * step,
        "tokens_per_s_per_gpu": tokens,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak if tflops and peak else None,
        "phases_ms": phases,
        "host": host,
    }


def table(results: dict[str, dict]) -> str:
    for m, r in results.items():
        base = results.get(BASE.get(m, ""))
        r["slowdown_vs_base"] = (
            base["tokens_per_s_per_gpu"] / r["tokens_per_s_per_gpu"] if base else None
        )
    cols = ["method", "tok/s/GPU", "TFLOP/s/GPU", "MFU", "vs base", "step ms", *PHASES,
            *HOST.values()]  # fmt: skip
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]

    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    for m, r in results.items():
        rel = r["slowdown_vs_base"]
        cells = [
            m,
            f(r["tokens_per_s_per_gpu"], ",.0f"),
            f(r["tflops_per_gpu"], ".3g"),
            f(r["mfu"] and 100 * r["mfu"], ".1f") + ("%" if r["mfu"] else ""),
            "" if rel is None else f"{rel:.3f}x ({100 * (1 / rel - 1):+.1f}% tok/s)",
            f(r["step_ms"], ".1f"),
            *(f(r["phases_ms"].get(p), ".1f") for p in PHASES),
            *(f(r.get("host", {}).get(h), ".1f") for h in HOST),
        ]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def write_outputs(results: dict[str, dict], out: Path, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(results, indent=1))
    with (out / "throughput.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu",
                    "slowdown_vs_base", "step_ms", *PHASES, *HOST])  # fmt: skip
        for m, r in results.items():
            w.writerow([m, r["tokens_per_s_per_gpu"], r["tflops_per_gpu"], r["mfu"],
                        r["slowdown_vs_base"], r["step_ms"],
                        *(r["phases_ms"].get(p) for p in PHASES),
                        *(r.get("host", {}).get(h) for h in HOST)])  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron.md.figstyle import method_color

    fig, (a, b) = plt.subplots(1, 2, figsize=(11.5, 3.6))
    names = list(results)
    colors = [method_color(m) or "tab:gray" for m in names]
    a.bar(names, [results[m]["tokens_per_s_per_gpu"] for m in names], color=colors)
    a.set_ylabel("tokens/s/GPU")
    a.set_title(title)
    bottom = [0.0] * len(names)

    def get(name, *inside):  # a timer's ms less those of the timers inside it
        return lambda p: p.get(name, 0) - sum(p.get(n, 0) for n in inside)

    parts = {  # disjoint pieces of the optimizer step (md-fuse is in one of the two copies)
        "grads to main": get("optimizer-copy-to-main-grad"),
        "grad norm": get("grad-norm"),
        "clipping": get("grad-clip"),
        "md-reduce": get("md-reduce"),
        "md-step (compute)": get("md-step", "md-reduce"),
        "inner step, other": get("optimizer-inner-step", "md-step"),
        "main to model params": get("optimizer-copy-main-to-model-params"),
        "params all-gather": get("params-all-gather"),
        "rest (untimed)": get("optimizer", "optimizer-copy-to-main-grad", "grad-norm",
                              "grad-clip", "optimizer-inner-step",
                              "optimizer-copy-main-to-model-params", "params-all-gather"),
    }  # fmt: skip
    for label, fn in parts.items():
        vals = [max(0.0, fn(results[m]["phases_ms"])) for m in names]
        b.bar(names, vals, bottom=bottom, label=label)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_ylabel("ms per iteration")
    b.set_title("optimizer step (rank 0 timers)")
    b.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)


def method_flags(method: str, matrix_lr: float) -> list[str]:
    """The recipe's flags of ``method`` (a variant: its recipe's, then its own)."""
    from megatron.md.train import recipes

    recipe, more = VARIANTS.get(method, (method, []))
    return [*recipes.dense_recipe(recipe, matrix_lr), *more]


def run_methods(args, extra: list[str]) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT))
    from megatron.md.train.args import extra_for
    from megatron.md.train.presets import PRESETS

    if args.preset not in PRESETS:
        sys.exit(f"--preset {args.preset!r} is not one of {', '.join(PRESETS)}")
    gpu = _cuda()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = {}
    for m in args.methods:
        metrics = args.out / f"{m}.jsonl"
        metrics.unlink(missing_ok=True)
        recipe = method_flags(m, args.matrix_lr)
        flags = [
            f"--preset={args.preset}", *recipe,
            "--lr-warmup-iters=0", "--mock-data", "--tokenizer-type=NullTokenizer",
            f"--vocab-size={PRESETS[args.preset].vocab}", f"--train-iters={args.iters}",
            "--log-interval=1", "--timing-log-level=2", "--eval-iters=0",
            f"--md-log-interval={args.iters + 1}",  # diagnostics only at iteration 1 (warm-up)
            f"--eval-interval={args.iters + 1}", "--use-distributed-optimizer",
            f"--micro-batch-size={args.micro_batch_size}",
            f"--global-batch-size={args.global_batch_size}", f"--seq-length={args.seq_length}",
            f"--max-position-embeddings={args.seq_length}", f"--metrics-file={metrics}",
            *(["--bf16"] if gpu else []), *extra_for(recipe, extra),
        ]  # fmt: skip
        print(f"[throughput] {m}: {args.iters} iterations on {args.nproc} ranks", file=sys.stderr)
        rc = run_pretrain(args.nproc, flags, args.out / f"{m}.log", args.out)
        if rc != 0:  # the others still run and are tabled; the tool exits 1 at the end
            print(f"[throughput] {m} failed (exit {rc}); see {args.out / f'{m}.log'}",
                  file=sys.stderr)  # fmt: skip
            args.failed.append(m)
            continue
        logs[m] = metrics
    return logs


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def from_manifest(path: Path) -> dict[str, dict[str, Path]]:
    """Groups of runs (same size and batch) -> method -> run dir."""
    groups: dict[str, dict[str, Path]] = {}
    for r in read_manifest(path)["runs"]:
        meta = r["meta"]
        if meta.get("method") not in METHODS:
            continue
        key = f"{meta.get('size', '?')}-gbs{meta.get('gbs', '?')}"
        groups.setdefault(key, {})[meta["method"]] = Path(r["run_dir"])
    if not groups:
        raise LogError(f"{path}: no runs with meta.method in {METHODS}")
    return groups


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--logs", nargs="+", metavar="METHOD=PATH", help="read these runs' logs")
    src.add_argument("--manifest", type=Path, help="read the runs of a sweep manifest")
    ap.add_argument("--preset", default="tiny", help="run mode: model preset")
    ap.add_argument("--methods", nargs="+", choices=METHODS,
                    default=[m for m in METHODS if m not in VARIANTS])  # fmt: skip
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, or 2 on CPU)")
    ap.add_argument("--iters", type=int, default=40, help="run mode: iterations per method")
    ap.add_argument("--warmup", type=int, default=10, help="iterations left out of the medians")
    ap.add_argument("--matrix-lr", type=float, default=4e-3)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=None, help="default mbs × ranks")
    ap.add_argument("--seq-length", type=int, default=None, help="default 4096 on GPU, 128 CPU")
    ap.add_argument("--peak-tflops", type=float, help="per-GPU peak for MFU (else by device)")
    ap.add_argument("--out", type=Path, default=Path("runs/throughput"))
    args = ap.parse_args(argv)
    args.out = args.out.resolve()  # runs start in args.out: keep their paths absolute
    if extra and (args.logs or args.manifest):
        ap.error("extra pretrain flags after -- only apply when the tool runs the methods")
    try:
        if args.manifest:
            groups = {k: {m: read_log(p) for m, p in g.items()}
                      for k, g in from_manifest(args.manifest).items()}  # fmt: skip
        elif args.logs:
            pairs = [x.split("=", 1) for x in args.logs]
            bad = [x for x, p in zip(args.logs, pairs) if len(p) != 2 or p[0] not in METHODS]
            if bad:
                ap.error(f"--logs wants METHOD=PATH with METHOD in {METHODS}; got {bad}")
            groups = {"logs": {m: read_log(p) for m, p in pairs}}
        else:
            if args.iters <= args.warmup:
                ap.error(f"--iters {args.iters} must exceed --warmup {args.warmup}")
            gpu = _cuda()
            args.nproc = args.nproc or (_gpu_count() if gpu else 2)
            args.seq_length = args.seq_length or (4096 if gpu else 128)
            args.global_batch_size = args.global_batch_size or args.micro_batch_size * args.nproc
            args.failed = []
            groups = {args.preset: {m: read_log(p) for m, p in run_methods(args, extra).items()}}
        report = {}
        for key, logs in groups.items():
            results = {m: summarize(logs[m], args.warmup, args.peak_tflops)
                       for m in METHODS if m in logs}  # fmt: skip
            text = table(results)
            print(f"\n## {key} (medians after {args.warmup} warm-up iterations)\n\n{text}")
            write_outputs(results, args.out / key if len(groups) > 1 else args.out, key)
            report[key] = results
    except LogError as e:
        sys.exit(f"[throughput] {e}")
    print(f"\n[throughput] wrote {args.out}/throughput.{{json,csv,png}}", file=sys.stderr)
    if getattr(args, "failed", None):
        sys.exit(f"[throughput] failed: {', '.join(args.failed)} (the table has the others)")


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    main()
