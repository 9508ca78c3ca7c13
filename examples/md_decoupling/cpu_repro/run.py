"""Laptop-scale reproduction of the paper's three claims, on 2 CPU processes.

On the demo corpus (State of the Union addresses, built once by ``tools/build_demo_corpus.py``)
with a tiny dense GPT of the paper's architecture (4 layers, head dim 32, d_ff = 4d, sequence
256, global batch 8, 160 iterations: 328k tokens per run), through ``pretrain_gpt.py``:

1. optimizer comparison: a 5-point matrix-LR sweep (×2 steps) for AdamW, Muon, AdamMD and
   MuonMD at d = 128 under the paper's recipe (baselines: weight decay 0.1 and 10 % warmup; MD:
   neither). Score: the final validation loss (2 % of documents held out) and the tail train
   loss (mean of the last 25 iterations, ``tools/lr_sweep.py``);
2. width transfer: the same sweep for AdamW and MuonMD at d = 64 and 256 (128 from part 1): the
   optimal LR per width;
3. invariant dynamics: in the best AdamW and MuonMD runs at d = 128, the relative update
   ‖ΔW‖/‖W‖ of the hidden matrices divided by the matrix LR, over the iterations where the LR
   is at least 10 % of its peak (after warmup): its coefficient of variation, and the ratio of
   its last-quarter mean to its first-quarter mean.

Where a sweep's optimum sits on its grid's edge, up to ``--extend`` (2) more LRs are run past
that edge. ``--parts seeds`` (not in the default): part 1 again with a second seed at the two
best LRs of each method; the claim is then also judged on the two-seed mean.

Writes ``<out>/results.json``, ``lr_sweep.png``, ``lr_transfer.png``, ``relative_update.png``
and a manifest in ``sweep.py``'s format (``tools/lr_sweep.py`` reads it). Finished runs are
kept: re-running continues an interrupted reproduction (``--parts`` runs a subset). ``--smoke``:
mock data, 1 process, 6 iterations, AdamW and MuonMD, 1 LR, widths 64 and 128 — checks the
pipeline, not the claims.

    python examples/md_decoupling/cpu_repro/run.py                 # the full run (~80 min, 2 cores)
    python examples/md_decoupling/cpu_repro/run.py --smoke --out /tmp/repro
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import lr_sweep  # noqa: E402
from runlog import read_log, run_pretrain  # noqa: E402

from megatron.md.progress import Progress  # noqa: E402

METHODS = ("adamw", "muon", "adammd", "muonmd")
# ×2 steps, 5 points (+ --extend past an edge optimum), placed where 6-7-point sweeps from one
# step lower found the optima (docs/cpu_repro.md); 5 points keep the full run within ~90 min
# on 2 cores.
GRID_START = {"adamw": 4e-3, "adammd": 2e-3, "muon": 1.6e-2, "muonmd": 8e-3}
SEED, EXTRA_SEED, SEED_POINTS = 1234, 1235, 2
HIDDEN = ("qkv", "proj", "fc1", "fc2")


def method_flags(method: str, iters: int) -> list[str]:
    warm = [f"--lr-warmup-iters={max(1, iters // 10)}", "--weight-decay=0.1"]
    return {
        "adamw": ["--optimizer=adam", *warm],
        "muon": ["--optimizer=muon", "--muon-momentum=0.95", "--muon-nesterov",
                 "--muon-no-split-qkv", "--muon-scale-mode=unit_rms_norm", *warm],
        "adammd": ["--optimizer=adam", "--md-decoupling"],
        # the recorded results (docs/cpu_repro.md) orthogonalize the fused QKV matrix whole
        "muonmd": ["--optimizer=muon", "--md-decoupling", "--muon-scale-mode=shape_up",
                   "--muon-no-split-qkv"],
    }[method]  # fmt: skip


def width_flags(width: int) -> list[str]:
    heads = width // 32
    return [f"--hidden-size={width}", f"--ffn-hidden-size={4 * width}",
            f"--num-attention-heads={heads}", f"--num-query-groups={max(1, heads // 2)}",
            "--kv-channels=32"]  # fmt: skip


def plan(args) -> list[dict]:
    """The runs (sweep.py's manifest entries): part 1 at d=128, then the width sweeps."""
    points = [("compare", m, 128) for m in args.methods]
    points += [("width", m, w) for m in ("adamw", "muonmd") if m in args.methods
               for w in args.widths if w != 128]  # fmt: skip
    return [run_spec(args, part, method, width, GRID_START[method] * 2**k)
            for part, method, width in points for k in range(args.lrs)]  # fmt: skip


def extend(runs: list[dict], args) -> list[dict]:
    """Where a sweep's best final validation loss sits on its grid's edge, run the next LR past
    that edge (×2 or ÷2), up to ``args.extend`` points per sweep; returns the added runs (for
    parts not in ``args.parts``: those already finished, so the analysis still sees them)."""
    added: list[dict] = []
    for _ in range(args.extend):
        sweeps: dict[tuple, list[dict]] = {}
        for r in runs + added:
            m = r["meta"]
            if m["part"] in ("compare", "width"):
                sweeps.setdefault((m["part"], m["method"], m["width"]), []).append(r)
        new = []
        for (part, method, width), rs in sweeps.items():
            pts = sorted((r["meta"]["matrix_lr"], final_valid(r["run_dir"])) for r in rs)
            ok = [p for p in pts if p[1] is not None]
            if not ok:
                continue
            best = min(ok, key=lambda p: p[1])[0]
            if best == pts[-1][0]:
                new.append(run_spec(args, part, method, width, best * 2))
            elif best == pts[0][0]:
                new.append(run_spec(args, part, method, width, best / 2))
        new = [r for r in new if r["meta"]["part"] in args.parts or done(r, args.iters)]
        if not new:
            break
        execute(new, args)
        added += new
    return added


def seed_plan(args, runs: list[dict]) -> list[dict]:
    """Part 1 again with a second seed, at the SEED_POINTS best LRs (by valid loss) per method."""
    extra = []
    for method in args.methods:
        pts = [(final_valid(r["run_dir"]), r["meta"]["matrix_lr"]) for r in runs
               if r["meta"]["part"] == "compare" and r["meta"]["method"] == method]  # fmt: skip
        ok = sorted(p for p in pts if p[0] is not None)
        extra += [run_spec(args, "seeds", method, 128, lr, EXTRA_SEED)
                  for _, lr in ok[:SEED_POINTS]]  # fmt: skip
    return extra


def run_spec(args, part: str, method: str, width: int, lr: float, seed: int = SEED) -> dict:
    name = f"d{width}-{method}-lr{lr:.4g}" + ("" if seed == SEED else f"-seed{seed}")
    flags = [*args.data_flags, "--preset=tiny", *width_flags(width),
             f"--train-iters={args.iters}", f"--seq-length={args.seq}",
             f"--max-position-embeddings={args.seq}",
             f"--micro-batch-size={args.gbs // args.nproc}",
             f"--global-batch-size={args.gbs}", "--lr-decay-style=linear",
             "--min-lr=1e-6", "--adam-beta1=0.9", "--adam-beta2=0.99", "--clip-grad=1.0",
             "--lr=3e-3", "--embedding-lr=3e-3", "--output-lr=1e-3",
             f"--matrix-lr={lr:.4g}", "--log-interval=1", "--md-log-interval=5",
             f"--eval-interval={args.iters}", f"--eval-iters={args.eval_iters}",
             "--use-distributed-optimizer", f"--seed={seed}",
             *method_flags(method, args.iters)]  # fmt: skip
    meta = {"size": f"d{width}", "method": method, "matrix_lr": lr, "width": width, "part": part,
            "seed": seed, **({} if seed == SEED else {"variant": f"seed {seed}"})}  # fmt: skip
    return {"name": name, "flags": flags, "run_dir": str(args.out / name), "meta": meta}


def corpus_flags(data: Path, prose: bool) -> tuple[list[str], list[str] | None]:
    """The demo corpus under ``data`` (built once; the prose corpus too with ``prose``) as
    pretrain_gpt.py data flags: (the speeches', the prose corpus's or None)."""
    import build_demo_corpus

    build_demo_corpus.build(data, 8192)
    flags = ["--tokenizer-type=HuggingFaceTokenizer", f"--tokenizer-model={data / 'tokenizer'}",
             f"--data-path={data / 'sotu_text_document'}", "--split=98,2,0",
             f"--data-cache-path={data / 'cache'}"]  # fmt: skip
    if not prose:
        return flags, None
    path = build_demo_corpus.build_prose(data, 8192)
    return flags, [*flags[:2], f"--data-path={path}", *flags[3:]]


def done(run: dict, iters: int) -> bool:
    try:
        log = read_log(Path(run["run_dir"]))
    except ValueError:
        return False
    return log.last_iteration() >= iters and bool(log.valid)


def run_one(run: dict, nproc: int, cwd: Path) -> tuple[str, float]:
    """One run from scratch in its directory: ("ok" or what failed, seconds)."""
    d = Path(run["run_dir"])
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").unlink(missing_ok=True)
    t0 = time.time()
    rc = run_pretrain(nproc, [*run["flags"], f"--metrics-file={d / 'metrics.jsonl'}"],
                      d / "train.log", cwd)  # fmt: skip
    status = "ok" if rc == 0 else f"FAILED (exit {rc}, see {d / 'train.log'})"
    return status, time.time() - t0


def execute(runs: list[dict], args) -> None:
    runs = [r for r in runs if r["meta"]["part"] in args.parts]
    todo = [r for r in runs if not done(r, args.iters)]
    if not runs:
        return
    print(f"[repro] {len(runs)} runs, {len(runs) - len(todo)} already finished", file=sys.stderr)
    run_all(todo, "repro", lambda r: run_one(r, args.nproc, args.out))


def run_all(todo: list[dict], label: str, run) -> None:
    """Run each of ``todo`` (``run(r)`` -> (status, seconds)), a progress line after each."""
    bar = Progress(label, len(todo), every=0)
    for r in todo:
        status, took = run(r)
        bar.update(note=f"{r['name']}: {status}, {took:.0f} s")


def final_valid(run_dir: str) -> float | None:
    try:
        log = read_log(Path(run_dir))
    except ValueError:
        return None
    last = log.valid.get(max(log.valid, default=-1))
    return float(last["lm loss"]) if last and math.isfinite(last["lm loss"]) else None


def dynamics(run_dir: str) -> dict:
    """Relative update of the hidden matrices / matrix LR, where the LR ≥ 10 % of its peak."""
    log = read_log(Path(run_dir))
    pts = []
    for it, row in sorted(log.train.items()):
        md = row.get("md")
        # groups sharing a peak LR share a label, e.g. "matrix/output"; the LRs of the step
        # measured (the row's own "lr" is the next step's: megatron logs after the scheduler)
        lrs = (md or {}).get("lr") or row.get("lr") or {}
        lr = next((v for k, v in lrs.items() if "matrix" in k.split("/")), None)
        if md and lr:
            rel = [md["rel_update"][c] for c in HIDDEN if c in md["rel_update"]]
            pts.append((it, sum(rel) / len(rel), lr))
    peak = max(p[2] for p in pts)
    warm = int(log.args.get("lr_warmup_iters") or 0)
    use = [(it, r, lr) for it, r, lr in pts if lr >= 0.1 * peak and it > warm]
    ratio = [r / lr for _, r, lr in use]
    q = max(1, len(ratio) // 4)
    return {
        "points": [{"iteration": it, "rel_update": r, "lr": lr} for it, r, lr in pts],
        "used_iterations": [it for it, _, _ in use],
        "ratio_cv": statistics.pstdev(ratio) / statistics.mean(ratio),
        "ratio_last_over_first_quarter": statistics.mean(ratio[-q:]) / statistics.mean(ratio[:q]),
    }


def analyse(runs: list[dict], manifest: Path, args) -> dict:
    tail = min(25, max(1, args.iters // 2))  # the paper's 25, fewer for short (smoke) runs
    report = lr_sweep.main([str(manifest), "--out", str(args.out), "--tail", str(tail)])
    scores = {r["name"]: r for r in report["runs"]}
    per, seeds = {}, {}
    for r in runs:
        m = r["meta"]
        if m["part"] == "seeds":
            seeds.setdefault(m["method"], {})[m["matrix_lr"]] = final_valid(r["run_dir"])
            continue
        entry = per.setdefault(m["size"], {}).setdefault(m["method"], [])
        entry.append({"lr": m["matrix_lr"], "valid": final_valid(r["run_dir"]),
                      "tail": scores[r["name"]]["tail_loss"], "run_dir": r["run_dir"]})  # fmt: skip
    best = {}
    for size, methods in per.items():
        for method, pts in methods.items():
            ok = [p for p in pts if p["valid"] is not None]
            if ok:
                b = min(ok, key=lambda p: p["valid"])
                best.setdefault(size, {})[method] = {**b, "grid": [p["lr"] for p in pts],
                                                     "finished": len(ok)}  # fmt: skip
    claims = {}
    d128 = best.get("d128", {})
    for md, base in (("adammd", "adamw"), ("muonmd", "muon")):
        if md in d128 and base in d128:
            a, b = d128[md]["valid"], d128[base]["valid"]
            claims[f"{md} >= {base} at the optimum"] = {
                "holds": a <= b,
                "md_valid": a,
                "base_valid": b,
                "difference": a - b,
            }
            two = two_seed_best(per["d128"], seeds, (md, base))
            if two:
                diff = two[md]["mean_valid"] - two[base]["mean_valid"]
                claims[f"{md} >= {base} at the optimum"]["two_seeds"] = {
                    **two, "difference": diff, "holds": diff <= 0}  # fmt: skip
    for method in ("adamw", "muonmd"):
        opt = {s: best[s][method]["lr"] for s in sorted(best, key=lambda s: int(s[1:]))
               if method in best[s]}  # fmt: skip
        if len(opt) >= 2:
            steps = [math.log2(v / list(opt.values())[0]) for v in opt.values()]
            claims[f"{method} optimal LR across width"] = {
                "optimal_lr": opt,
                "spread_in_x2_steps": max(steps) - min(steps),
            }
    if "muonmd" in d128 and "adamw" in d128:
        dyn = {m: dynamics(d128[m]["run_dir"]) for m in ("muonmd", "adamw")}
        claims["relative update follows the LR schedule"] = {
            m: {k: v for k, v in d.items() if k != "points"} for m, d in dyn.items()
        }
        plot_dynamics(dyn, args.out / "relative_update.png")
    return {"config": {k: str(v) for k, v in vars(args).items() if k != "data_flags"},
            "best": best, "claims": claims}  # fmt: skip


def two_seed_best(d128: dict, seeds: dict, methods: tuple) -> dict | None:
    """Per method: the LR with the best mean valid loss over both seeds (LRs run with both), the
    two losses, and the largest seed-to-seed difference at any such LR."""
    out = {}
    for method in methods:
        first = {p["lr"]: p["valid"] for p in d128.get(method, []) if p["valid"] is not None}
        both = {lr: (first[lr], v) for lr, v in seeds.get(method, {}).items()
                if v is not None and lr in first}  # fmt: skip
        if not both:
            return None
        lr, pair = min(both.items(), key=lambda kv: sum(kv[1]))
        spread = max(abs(a - b) for a, b in both.values())
        out[method] = {
            "lr": lr,
            "valid": list(pair),
            "mean_valid": sum(pair) / 2,
            "lrs_with_both_seeds": sorted(both),
            "max_seed_difference": spread,
        }
    return out


def plot_dynamics(dyn: dict, path: Path) -> None:
    import matplotlib

    from megatron.md.figstyle import method_color

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for m, d in dyn.items():
        it = [p["iteration"] for p in d["points"]]
        rel = [p["rel_update"] for p in d["points"]]
        lr = [p["lr"] for p in d["points"]]
        line = a.plot(it, rel, color=method_color(m), label=f"{m}: ‖ΔW‖/‖W‖ (hidden matrices)")[0]
        a.plot(it, [x * max(rel) / max(lr) for x in lr], "--", color=line.get_color(), lw=1,
               label=f"{m}: matrix LR (scaled)")  # fmt: skip
        used = set(d["used_iterations"])
        b.plot([i for i in it if i in used], [r / x for i, r, x in zip(it, rel, lr) if i in used],
               color=line.get_color(), label=m)  # fmt: skip
    a.set_xlabel("iteration")
    a.set_yscale("log")
    a.legend(fontsize=7)
    a.set_title("relative update and the LR schedule")
    b.set_xlabel("iteration")
    b.set_ylabel("relative update / matrix LR")
    b.set_yscale("log")
    b.legend(fontsize=7)
    b.set_title("ratio (LR ≥ 10 % of peak, after warmup)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "cpu_repro")
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "demo")
    ap.add_argument("--iters", type=int, default=160)
    ap.add_argument("--lrs", type=int, default=5, help="LR grid points per method and width")
    ap.add_argument(
        "--extend",
        type=int,
        default=2,
        help="LR points added past a grid edge where a sweep's optimum sits on it (per sweep)",
    )
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["compare", "width"],
        choices=["compare", "width", "seeds"],
        help="runs to make (the analysis reads all finished ones); seeds: part 1 again with a "
        f"second seed ({EXTRA_SEED}) at the {SEED_POINTS} best LRs per method (~15 min)",
    )
    ap.add_argument("--smoke", action="store_true", help="pipeline check only (~1.5 min)")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()  # the runs' working directory is args.out
    args.seq, args.gbs, args.eval_iters = 256, 8, 8
    if args.smoke:
        args.iters, args.lrs, args.widths, args.nproc, args.extend = 6, 1, [64, 128], 1, 0
        args.methods = ["adamw", "muonmd"]
        args.seq, args.gbs, args.eval_iters = 64, 4, 1
        args.data_flags = ["--mock-data", "--tokenizer-type=NullTokenizer", "--vocab-size=1024"]
    else:
        args.data_flags, _ = corpus_flags(args.data, prose=False)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = plan(args)
    manifest = args.out / "manifest.json"
    manifest.write_text(json.dumps({"experiment": "cpu_repro", "runs": runs}, indent=1))
    t0 = time.time()
    execute(runs, args)
    runs += extend(runs, args)
    extra = seed_plan(args, runs)  # from part 1's results, so after them
    runs += [r for r in extra if "seeds" in args.parts or done(r, args.iters)]
    execute(extra, args)
    manifest.write_text(json.dumps({"experiment": "cpu_repro", "runs": runs}, indent=1))
    result = analyse(runs, manifest, args)
    result["wall_s"] = time.time() - t0
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["claims"], indent=1))
    print(f"[repro] {args.out}/results.json and figures, {time.time() - t0:.0f} s", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
