"""Laptop-scale controls for the optimizer comparison (part 1 of ``run.py``), and one longer run.

Part 1 of the laptop reproduction found Muon ahead of MuonMD. Its recipe differs from the
paper's dense one in two ways that could explain that without saying anything about the
method: MuonMD's gains follow the matrix LR (6.4e-2 at its optimum, far above any gains LR of
the paper), and Muon had a warmup the paper's dense Muon does not. This script runs, at d = 128
with the same data, model and budget as part 1 (160 iterations, 328k tokens per run):

- the four methods of part 1 (Muon and MuonMD with megatron's default Q/K/V split);
- the controls: Muon without warmup; MuonMD with the gains LR fixed at 1e-3 (the paper's MoE
  setting); MuonMD without gains (``--md-gains none``);

each as a full matrix-LR sweep (5 points ×2 apart, extended past an edge optimum) with two
seeds at every point, scored by the mean final validation loss of the two seeds. Then
``--parts long``: the four methods at those optima for ``--long-iters`` (1200) iterations on
the larger prose corpus (``tools/build_demo_corpus.py --prose``: the addresses and
Shakespeare's plays, 3.96M tokens with the demo tokenizer; a run reads 2.46M, under one epoch).

    python examples/md_decoupling/cpu_repro/controls.py                 # sweeps (~2 h, 2 cores)
    python examples/md_decoupling/cpu_repro/controls.py --parts long    # + the long runs (~1 h)

Writes ``<out>/controls.json`` (every run, the table) and ``controls.png``; finished runs are
kept (re-running continues).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as repro  # noqa: E402

WARM = ["--weight-decay=0.1"]  # + 10 % warmup, added per run length
MUON = ["--optimizer=muon", "--muon-momentum=0.95", "--muon-nesterov",
        "--muon-scale-mode=unit_rms_norm"]  # fmt: skip
MUONMD = ["--optimizer=muon", "--md-decoupling", "--muon-scale-mode=shape_up"]
NGPT = ["--arch=ngpt", "--transformer-impl=local"]
#: arm -> (flags, warmup?, first LR of the grid)
ARMS = {
    "adamw": (["--optimizer=adam", *WARM], True, 4e-3),
    "adammd": (["--optimizer=adam", "--md-decoupling"], False, 2e-3),
    "muon": ([*MUON, *WARM], True, 1.6e-2),
    "muon-nowarmup": ([*MUON, *WARM], False, 1.6e-2),
    "muonmd": (MUONMD, False, 8e-3),
    "muonmd-gainlr1e-3": ([*MUONMD, "--md-gain-lr=1e-3"], False, 8e-3),
    "muonmd-nogains": ([*MUONMD, "--md-gains=none"], False, 8e-3),
    # the nGPT comparison (paper appendix): nGPT as proposed (unit vectors after a plain Adam
    # step, one LR for every parameter: {lr} is the swept LR), nGPT's architecture with MD
    "ngpt": (
        [
            "--optimizer=adam",
            "--md-decoupling",
            *NGPT,
            "--md-sphere=hidden",
            "--md-radius=unit",
            "--md-gains=none",
            "--lr={lr}",
            "--embedding-lr={lr}",
            "--output-lr={lr}",
        ],
        False,
        2e-3,
    ),  # fmt: skip
    "adammd-ngptarch": (["--optimizer=adam", "--md-decoupling", *NGPT], False, 2e-3),
    # the same at nGPT's one LR: its scaling vectors, embeddings and LM head at the swept LR
    "adammd-ngptarch-onelr": (
        [
            "--optimizer=adam",
            "--md-decoupling",
            *NGPT,
            "--lr={lr}",
            "--embedding-lr={lr}",
            "--output-lr={lr}",
        ],
        False,
        4e-3,
    ),  # fmt: skip
    "muonmd-ngptarch": ([*MUONMD, *NGPT], False, 8e-3),
}
SEEDS = (1234, 1235)
LONG = ("adamw", "adammd", "muon", "muonmd")


def spec(args, part: str, arm: str, lr: float, seed: int, iters: int) -> dict:
    flags, warm, _ = ARMS[arm]
    flags = [f.format(lr=f"{lr:.4g}") for f in flags]
    warmup = [f"--lr-warmup-iters={max(1, iters // 10)}"] if warm else []
    name = f"{part}-{arm}-lr{lr:.4g}-s{seed}"
    evals = iters if part == "sweep" else 200
    data = args.long_data_flags if part == "long" else args.data_flags
    common = [*data, "--preset=tiny", *repro.width_flags(128),
              f"--train-iters={iters}", f"--seq-length={args.seq}",
              f"--max-position-embeddings={args.seq}", f"--micro-batch-size={args.gbs // 2}",
              f"--global-batch-size={args.gbs}", "--lr-decay-style=linear", "--min-lr=1e-6",
              "--adam-beta1=0.9", "--adam-beta2=0.99", "--clip-grad=1.0", "--lr=3e-3",
              "--embedding-lr=3e-3", "--output-lr=1e-3", f"--matrix-lr={lr:.4g}",
              "--log-interval=1", "--md-log-interval=10", f"--eval-interval={evals}",
              f"--eval-iters={args.eval_iters}", "--use-distributed-optimizer",
              f"--seed={seed}", *flags, *warmup]  # fmt: skip
    meta = {"size": "d128", "method": arm, "matrix_lr": lr, "seed": seed, "part": part,
            "variant": f"seed {seed}"}  # fmt: skip
    return {"name": name, "flags": common, "run_dir": str(args.out / name), "meta": meta}


def execute(runs: list[dict], args) -> None:
    todo = [r for r in runs if not repro.done(r, int(_flag(r, "train-iters")))]
    print(f"[controls] {len(runs)} runs, {len(runs) - len(todo)} finished", file=sys.stderr)
    repro.run_all(todo, "controls", lambda r: repro.run_one(r, 2, args.out))


def _flag(run: dict, name: str) -> str:
    return next(f.split("=", 1)[1] for f in run["flags"] if f.startswith(f"--{name}="))


def sweep(arm: str, args) -> list[dict]:
    """The arm's 5-point grid with both seeds, extended up to twice past an edge optimum."""
    lrs = [ARMS[arm][2] * 2**k for k in range(5)]
    for _ in range(3):
        runs = [spec(args, "sweep", arm, lr, s, args.iters) for lr in lrs for s in SEEDS]
        execute(runs, args)
        best = min(lrs, key=lambda lr: score(runs, lr)[0])
        if best == lrs[-1] and len(lrs) < 7:
            lrs.append(best * 2)
        elif best == lrs[0] and len(lrs) < 7:
            lrs.insert(0, best / 2)
        else:
            return runs
    return runs


def score(runs: list[dict], lr: float) -> tuple[float, list]:
    vals = [repro.final_valid(r["run_dir"]) for r in runs if r["meta"]["matrix_lr"] == lr]
    ok = [v for v in vals if v is not None]
    return (statistics.mean(ok) if len(ok) == len(vals) else float("inf")), vals


#: one colour per method in every panel; a control is dashed in its method's colour
def _style(arm: str) -> dict:
    base = arm.split("-")[0]
    from megatron.md.figstyle import method_color

    return {"color": method_color(base), "ls": "-" if arm == base else "--",
            "marker": {"nowarmup": "s", "gainlr1e": "^", "nogains": "v"}.get(
                arm.split("-")[1] if "-" in arm else "", "o")}  # fmt: skip


def plot(table: dict, long: list[dict], path: Path) -> None:
    """Left: final validation loss vs matrix LR per arm, the mean of two seeds with their range;
    right: the long runs' validation loss over iterations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from runlog import read_log

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm, t in table.items():
        xs = sorted(t["curve"], key=float)
        lo = [t["range"][x][0] for x in xs]
        hi = [t["range"][x][1] for x in xs]
        mean = [t["curve"][x] for x in xs]
        err = [[m - low for m, low in zip(mean, lo)], [h - m for m, h in zip(mean, hi)]]
        a.errorbar([float(x) for x in xs], mean, yerr=err, ms=4, capsize=2, label=arm,
                   **_style(arm))  # fmt: skip
    a.set_xscale("log", base=2)
    a.set_xlabel("matrix LR")
    a.set_ylabel("final validation loss (2 seeds: mean, range)")
    a.set_title("d = 128, 160 iterations: methods (solid) and controls (dashed)")
    for r in long:
        try:
            log = read_log(Path(r["run_dir"]))
        except ValueError:
            continue
        its = sorted(log.valid)
        m = r["meta"]["method"]
        label = f"{m} (lr {r['meta']['matrix_lr']:.3g})"
        b.plot(its, [log.valid[i]["lm loss"] for i in its], label=label, **_style(m))
    b.set_xlabel("iteration")
    b.set_ylabel("validation loss")
    b.set_title("at the optima, 1200 iterations (prose corpus)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=repro.ROOT / "runs" / "cpu_repro_controls")
    ap.add_argument("--data", type=Path, default=repro.ROOT / "data" / "demo")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--parts", nargs="+", default=["sweep"], choices=["sweep", "long"])
    ap.add_argument("--long-iters", type=int, default=1200)
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    args.iters, args.seq, args.gbs, args.eval_iters = 160, 256, 8, 8
    args.data_flags, args.long_data_flags = repro.corpus_flags(args.data, "long" in args.parts)
    args.out.mkdir(parents=True, exist_ok=True)
    table, runs = {}, []
    for arm in args.arms:
        rs = sweep(arm, args) if "sweep" in args.parts else []
        runs += rs
        lrs = sorted({r["meta"]["matrix_lr"] for r in rs})
        pts = {lr: score(rs, lr) for lr in lrs}
        done = {lr: p for lr, p in pts.items() if p[0] != float("inf")}
        if done:
            best = min(done, key=lambda lr: done[lr][0])
            spread = max(abs(a - b) for a, b in (p[1] for p in done.values()))
            table[arm] = {"grid": lrs, "best_lr": best, "mean_valid": done[best][0],
                          "valid_by_seed": done[best][1], "max_seed_difference": spread,
                          "curve": {f"{lr:.4g}": p[0] for lr, p in done.items()},
                          "range": {f"{lr:.4g}": [min(p[1]), max(p[1])]
                                    for lr, p in done.items()}}  # fmt: skip
    long = {}
    if "long" in args.parts:
        todo = [spec(args, "long", m, table[m]["best_lr"], SEEDS[0], args.long_iters)
                for m in LONG if m in table]  # fmt: skip
        execute(todo, args)
        runs += todo
        for r in todo:
            long[r["meta"]["method"]] = {"lr": r["meta"]["matrix_lr"],
                                         "valid": repro.final_valid(r["run_dir"])}  # fmt: skip
    plot(table, [r for r in runs if r["meta"]["part"] == "long"], args.out / "controls.png")
    manifest = {"experiment": "cpu_repro_controls", "runs": runs}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    result = {"table": table, "long": long, "iters": args.iters, "long_iters": args.long_iters}
    (args.out / "controls.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
