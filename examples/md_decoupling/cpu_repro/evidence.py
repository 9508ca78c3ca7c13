"""Laptop-scale evidence under the corrected recipes: the side-LR control and long runs with
seeds (docs/cpu_repro.md, "Laptop evidence").

The setting of ``controls.py`` (d = 128, the paper's architecture, 2 gloo processes, sequence
256, global batch 8), with the dense recipe as the paper's runs set it (``recipes.py``): MD on
the shape sphere, Q/K/V on their own spheres, the LM head with gains, 1-D parameters at 1e-3;
Muon without warmup (the paper's dense Muon), MuonMD's gains at 1e-3 (the gain LR the controls
found). Parts:

- ``side``: at each method's best matrix LR from the controls (160 iterations, the speeches
  corpus), the Adam-stepped groups' LRs (embeddings 3e-3, LM head 1e-3, 1-D 1e-3) scaled
  together by ``SIDE_MULTS`` (×3 apart; extended ×3 past a top-edge choice, twice at most),
  two seeds: does a larger side LR close the gap to nGPT's architecture (whose laptop arms
  train every parameter at the matrix LR), and which multiplier the laptop recipe uses from
  then on (the lowest mean regret over the four methods, ``choose_side``);
- ``sweep``: the family's arms without a known optimum (the sphere alone for Adam and Muon:
  MD without gains; MuonH; NorMuon), a matrix-LR sweep at 160 iterations, one seed;
- ``long``: the arms (``--methods``; the four above by default) at their 160-iteration optima
  scaled by the recipe's length rule (``length_rule``) with the chosen side LR, ``--long-iters``
  (1200) iterations on the prose corpus (``tools/build_demo_corpus.py --prose``), two seeds
  each (seeds pair arms: the same init and data order); ``tools/paired.py`` compares them;
- ``bracket``: an MD arm its base beat in the long runs by more than 0.01 (``needs_bracket``)
  again at its long-run matrix LR ×0.5 and ×2 (``--bracket-mults``), both seeds: was the
  length rule's LR the reason?

Finished runs are kept: re-running continues (a part per sitting is fine). Writes
``<out>/evidence.json`` (every run, the tables) and ``evidence.png`` (the side-LR panel and the
long runs' validation curves, the mean of the seeds with their range).

    python examples/md_decoupling/cpu_repro/evidence.py --parts side        # ~50 min, 2 cores
    python examples/md_decoupling/cpu_repro/evidence.py --parts side long   # + ~100 min
    python examples/md_decoupling/cpu_repro/evidence.py --parts bracket     # + ~40 min an arm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as repro  # noqa: E402

MD = ["--md-decoupling", "--md-radius=shape"]
MUON = ["--optimizer=muon", "--muon-momentum=0.95", "--muon-nesterov"]
MUONMD = [*MUON, *MD, "--muon-scale-mode=shape_up", "--md-gain-lr=1e-3"]
#: arm -> (flags, warmup?, best matrix LR at 160 iterations or None: found by the ``sweep``
#: part, starting from the grid's first LR). The first four: docs/cpu_repro.md's controls.
METHODS = {
    "adamw": (["--optimizer=adam", "--weight-decay=0.1"], True, 6.4e-2),
    "adammd": (["--optimizer=adam", *MD], False, 1.6e-2),
    "muon": ([*MUON, "--weight-decay=0.1", "--muon-scale-mode=unit_rms_norm"], False, 2.56e-1),
    "muonmd": (MUONMD, False, 6.4e-2),
    # the family (the peer arms): the sphere alone (MD without gains), MuonH
    "adam-sphere": (["--optimizer=adam", *MD, "--md-gains=none"], False, None),
    "muon-sphere": ([*MUONMD, "--md-gains=none"], False, None),
    "muonh": (["--optimizer=muonh"], False, None),
    # a labelled control, not a recipe: MuonMD's gains at 10× its gain LR, so that they move
    # (at 1e-3 they stayed in [0.8, 1.25] over 1200 iterations); MuonMD's matrix LR
    "muonmd-gain1e-2": ([*MUONMD, "--md-gain-lr=1e-2"], False, 6.4e-2),
    # NorMuon (megatron's adaptive Muon with the per-neuron second moment): Muon's settings
    "normuon": (
        ["--optimizer=normuon", *MUON[1:], "--weight-decay=0.1", "--muon-scale-mode=unit_rms_norm"],
        False,
        None,
    ),
}
#: the first LR of the ``sweep`` part's grid (5 points ×2 apart, extended past an edge)
GRID_START = {"adam-sphere": 2e-3, "muon-sphere": 8e-3, "muonh": 4e-3, "normuon": 6.4e-2}
CORE = ("adamw", "adammd", "muon", "muonmd")  # the side-LR control's methods
SIDE = {"embedding-lr": 3e-3, "output-lr": 1e-3, "lr": 1e-3}  # the dense recipe's
SIDE_MULTS = (1 / 3, 1.0, 3.0, 9.0)
SEEDS = (1234, 1235)
#: an MD arm and its base: where the base's long runs beat MD's by more than BRACKET_MARGIN (the
#: seeds' mean), MD's matrix LR gets a bracket (×BRACKET, both seeds) before any claim is made
BASES = {"adammd": "adamw", "muonmd": "muon"}
BRACKET, BRACKET_MARGIN = (0.5, 2.0), 0.01


def length_rule(method: str, iters: float, base: float = 160) -> float:
    """The recipe's LR multiplier from ``base`` to ``iters`` iterations (paper, MoE appendix):
    1/sqrt(l) for AdamW and Muon (Complete(d)P; NorMuon as Muon), 1/l^0.25 for MuonMD, applied
    here to every method on the sphere (MD, the sphere alone, MuonH: our reading; the paper
    gives it for MuonMD only)."""
    ell = iters / base
    return ell**-0.5 if method in ("adamw", "muon", "normuon") else ell**-0.25


def needs_bracket(long: dict) -> list[str]:
    """The MD arms whose base's long runs beat them by more than ``BRACKET_MARGIN`` (every
    seed of both finished)."""
    return [md for md, base in BASES.items() if long.get(md) and long.get(base)
            and long[base]["mean"] < long[md]["mean"] - BRACKET_MARGIN]  # fmt: skip


def spec(args, part, method, mult, seed, iters, lr=None, scale=1.0) -> dict:
    """One run: ``mult`` scales the side LRs, ``scale`` every LR (the length rule)."""
    flags, warm, best = METHODS[method]
    lr = best if lr is None else lr
    side = [f"--{k}={v * mult * scale:.4g}" for k, v in SIDE.items()]
    warmup = [f"--lr-warmup-iters={max(1, iters // 10)}"] if warm else []
    long = part in ("long", "bracket")
    data = args.long_data_flags if long else args.data_flags
    evals = 200 if long else iters
    name = f"{part}-{method}-side{mult:.3g}-s{seed}"
    if part == "sweep":
        name = f"sweep-{method}-lr{lr:.4g}-s{seed}"
    if part == "bracket":  # its matrix LR: the long run's times the bracket's multiplier
        name = f"bracket-{method}-side{mult:.3g}-lr{lr * scale:.4g}-s{seed}"
    common = [*data, "--preset=tiny", *repro.width_flags(128), f"--train-iters={iters}",
              f"--seq-length={args.seq}", f"--max-position-embeddings={args.seq}",
              f"--micro-batch-size={args.gbs // 2}", f"--global-batch-size={args.gbs}",
              "--lr-decay-style=linear", "--min-lr=1e-6", "--adam-beta1=0.9",
              "--adam-beta2=0.99", "--clip-grad=1.0", *side, f"--matrix-lr={lr * scale:.4g}",
              "--log-interval=1", "--md-log-interval=10", f"--eval-interval={evals}",
              f"--eval-iters={args.eval_iters}", "--use-distributed-optimizer",
              f"--seed={seed}", *flags, *warmup]  # fmt: skip
    meta = {"size": "d128", "method": method, "matrix_lr": lr * scale, "side_mult": mult,
            "seed": seed, "part": part, "variant": f"side ×{mult:.3g}"}  # fmt: skip
    return {"name": name, "flags": common, "run_dir": str(args.out / name), "meta": meta}


def sweep(method: str, args) -> tuple[list[dict], float | None]:
    """The arm's matrix-LR sweep at 160 iterations (one seed, the side LRs at ×1), extended
    up to twice past an edge optimum: (its runs, the best LR by final validation loss)."""
    lrs = [GRID_START[method] * 2**k for k in range(5)]
    for _ in range(3):
        runs = [spec(args, "sweep", method, 1.0, SEEDS[0], args.iters, lr) for lr in lrs]
        if "sweep" in args.parts:
            execute(runs, args)
        done = {r["meta"]["matrix_lr"]: repro.final_valid(r["run_dir"]) for r in runs}
        done = {lr: v for lr, v in done.items() if v is not None}
        if not done:
            return runs, None
        best = min(done, key=done.get)
        if best == lrs[-1] and len(lrs) < 7 and "sweep" in args.parts:
            lrs.append(best * 2)
        elif best == lrs[0] and len(lrs) < 7 and "sweep" in args.parts:
            lrs.insert(0, best / 2)
        else:
            return runs, best
    return runs, best


def execute(runs: list[dict], args) -> None:
    todo = [r for r in runs if not repro.done(r, int(_flag(r, "train-iters")))]
    print(f"[evidence] {len(runs)} runs, {len(runs) - len(todo)} finished", file=sys.stderr)
    repro.run_all(todo, "evidence", lambda r: repro.run_one(r, 2, args.out))


def _flag(run: dict, name: str) -> str:
    return next(f.split("=", 1)[1] for f in run["flags"] if f.startswith(f"--{name}="))


def seeds_of(runs: list[dict]) -> dict:
    """(method, side multiplier) -> the final validation losses of its seeds (None: not done)."""
    out: dict[tuple, list] = {}
    for r in runs:
        m = r["meta"]
        out.setdefault((m["method"], m["side_mult"]), []).append(repro.final_valid(r["run_dir"]))
    return out


def summary(vals: list) -> dict | None:
    if not vals or any(v is None for v in vals):
        return None
    return {"mean": statistics.mean(vals), "min": min(vals), "max": max(vals), "seeds": vals}


def choose_side(side: dict) -> float | None:
    """The multiplier with the lowest mean over the methods of (loss − the method's best)."""
    methods = {m for m, _ in side}
    regret: dict[float, list] = {}
    for m in methods:
        pts = {k: v for (mm, k), v in side.items() if mm == m and v is not None}
        if not pts:
            continue
        best = min(v["mean"] for v in pts.values())
        for k, v in pts.items():
            regret.setdefault(k, []).append(v["mean"] - best)
    full = {k: statistics.mean(v) for k, v in regret.items() if len(v) == len(methods)}
    return min(full, key=full.get) if full else None


def last_diagnostics(run_dir: str) -> dict:
    """The last logged diagnostics of a run: its largest attention logit (over layers) and its
    gains' range over the hidden classes (MD arms)."""
    from runlog import read_log

    try:
        log = read_log(Path(run_dir))
    except ValueError:
        return {}
    rows = [r["md"] for _, r in sorted(log.train.items()) if r.get("md")]
    if not rows:
        return {}
    md = rows[-1]
    hidden = ("qkv", "proj", "fc1", "fc2")
    out = {"attn_logit_max": max(md.get("attn_logit_max") or [float("nan")])}
    lo = [v for k, v in md.get("gain_min", {}).items() if k in hidden]
    hi = [v for k, v in md.get("gain_max", {}).items() if k in hidden]
    if lo and hi:
        out["gain_range"] = [min(lo), max(hi)]
    return out


def family_table(long_runs: list[dict], ref: str = "muonmd", threshold: float = 0.01) -> dict:
    """Per arm of the long runs: the seeds' final validation loss, the paired difference to
    ``ref`` (tools/paired.py), the largest attention logit and the gains' range."""
    import paired

    done = [r for r in long_runs if repro.final_valid(r["run_dir"]) is not None]
    if not any(r["meta"]["method"] == ref for r in done):
        return {}
    table = paired.compare(done, ref, threshold)
    for arm, row in table.items():
        diags = [last_diagnostics(r["run_dir"]) for r in done if r["meta"]["method"] == arm]
        logits = [d["attn_logit_max"] for d in diags if "attn_logit_max" in d]
        row["attn_logit_max"] = statistics.mean(logits) if logits else None
        ranges = [d["gain_range"] for d in diags if "gain_range" in d]
        if ranges:
            row["gain_range"] = [min(r[0] for r in ranges), max(r[1] for r in ranges)]
    return table


def plot(side: dict, long_runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from runlog import read_log

    from megatron.md.figstyle import method_color

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for m in METHODS:
        pts = sorted((k, v) for (mm, k), v in side.items() if mm == m and v is not None)
        if pts:
            xs = [k for k, _ in pts]
            mean = [v["mean"] for _, v in pts]
            err = [[v["mean"] - v["min"] for _, v in pts], [v["max"] - v["mean"] for _, v in pts]]
            a.errorbar(xs, mean, yerr=err, marker="o", ms=4, capsize=2, label=m,
                       color=method_color(m))  # fmt: skip
    a.set_xscale("log", base=3)
    a.set_xlabel("side-LR multiplier (embeddings 3e-3, LM head 1e-3, 1-D 1e-3 at ×1)")
    a.set_ylabel("final validation loss (2 seeds: mean, range)")
    a.set_title("d = 128, 160 iterations, each method at its best matrix LR")
    curves: dict[str, dict[int, list]] = {}
    for r in long_runs:
        try:
            log = read_log(Path(r["run_dir"]))
        except ValueError:
            continue
        for it, row in log.valid.items():
            curves.setdefault(r["meta"]["method"], {}).setdefault(it, []).append(row["lm loss"])
    for m, by_it in curves.items():
        its = sorted(by_it)
        mean = [statistics.mean(by_it[i]) for i in its]
        b.plot(its, mean, marker="o", ms=3, label=m, color=method_color(m))
        b.fill_between(its, [min(by_it[i]) for i in its], [max(by_it[i]) for i in its],
                       alpha=0.2, color=method_color(m))  # fmt: skip
    b.set_xlabel("iteration")
    b.set_ylabel("validation loss (mean of 2 seeds, range shaded)")
    b.set_title("long runs (prose corpus)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=repro.ROOT / "runs" / "cpu_repro_evidence")
    ap.add_argument("--data", type=Path, default=repro.ROOT / "data" / "demo")
    ap.add_argument("--parts", nargs="+", default=["side"],
                    choices=["sweep", "side", "long", "bracket", "report"])  # fmt: skip
    ap.add_argument("--methods", nargs="+", default=list(CORE), choices=list(METHODS))
    ap.add_argument("--long-iters", type=int, default=1200)
    ap.add_argument("--side-mult", type=float, help="long runs: this multiplier, not the chosen")
    ap.add_argument("--bracket-mults", nargs="+", type=float, default=list(BRACKET),
                    help="bracket part: the long-run matrix LR times these")  # fmt: skip
    ap.add_argument("--best", nargs="+", default=[], metavar="METHOD=LR",
                    help="an arm's 160-iteration best matrix LR from an earlier sweep (e.g. "
                    "docs/cpu_repro/evidence.json's best_lr_160), not its sweep")  # fmt: skip
    args = ap.parse_args(argv)
    given = {}
    for pair in args.best:
        m, _, lr = pair.partition("=")
        if m not in METHODS or not lr:
            ap.error(f"--best {pair!r}: want METHOD=LR with METHOD one of {', '.join(METHODS)}")
        given[m] = float(lr)
    args.out = args.out.resolve()
    args.iters, args.seq, args.gbs, args.eval_iters = 160, 256, 8, 8
    long_parts = bool({"long", "bracket", "report"} & set(args.parts))  # on the prose corpus
    args.data_flags, args.long_data_flags = repro.corpus_flags(args.data, long_parts)
    args.out.mkdir(parents=True, exist_ok=True)
    best, sweep_runs = {}, []
    for m in args.methods:
        if m in given:
            best[m] = given[m]
        elif METHODS[m][2] is not None:
            best[m] = METHODS[m][2]
        else:
            runs, best[m] = sweep(m, args)
            sweep_runs += runs
    mults = list(SIDE_MULTS)
    while True:  # the grid, extended ×3 past a top-edge choice (twice at most)
        side_runs = [spec(args, "side", m, k, s, args.iters)
                     for m in CORE for k in mults for s in SEEDS]  # fmt: skip
        if "side" in args.parts:
            execute(side_runs, args)
        side = {key: summary(v) for key, v in seeds_of(side_runs).items()}
        chosen = choose_side(side)
        nxt = mults[-1] * 3
        ran = all(repro.done(spec(args, "side", m, nxt, s, args.iters), args.iters)
                  for m in CORE for s in SEEDS)  # fmt: skip
        if chosen != mults[-1] or len(mults) >= len(SIDE_MULTS) + 2:
            break
        if "side" not in args.parts and not ran:  # an extension not run (yet)
            break
        mults.append(nxt)
    chosen = args.side_mult or chosen
    long_runs = []
    if long_parts:
        if chosen is None:
            sys.exit("[evidence] the long runs need the side part's results (or --side-mult)")
        missing = [m for m in args.methods if best.get(m) is None]  # (report: a partial table)
        if "report" in args.parts:
            args.methods = [m for m in args.methods if m not in missing]
            missing = []
        if missing:
            sys.exit(f"[evidence] no best matrix LR yet for {', '.join(missing)}: run --parts "
                     "sweep first")  # fmt: skip
        long_runs = [spec(args, "long", m, chosen, s, args.long_iters, best[m],
                          length_rule(m, args.long_iters, args.iters))
                     for m in args.methods for s in SEEDS]  # fmt: skip
        if "long" in args.parts:
            execute(long_runs, args)
    long = {m: summary(v) for (m, _), v in seeds_of(long_runs).items()}
    bracket_runs = []
    if {"bracket", "report"} & set(args.parts):
        for m in needs_bracket(long):
            rule = length_rule(m, args.long_iters, args.iters)
            bracket_runs += [spec(args, "bracket", m, chosen, s, args.long_iters, best[m] * k, rule)
                             for k in args.bracket_mults for s in SEEDS]  # fmt: skip
        if "bracket" in args.parts:
            execute(bracket_runs, args)
    bracket: dict[str, list] = {}
    for r in bracket_runs:
        key = f"{r['meta']['method']} lr {r['meta']['matrix_lr']:.4g}"
        bracket.setdefault(key, []).append(repro.final_valid(r["run_dir"]))
    plot(side, long_runs, args.out / "evidence.png")
    runs = sweep_runs + side_runs + long_runs + bracket_runs
    (args.out / "manifest.json").write_text(json.dumps({"experiment": "cpu_repro_evidence",
                                                        "runs": runs}, indent=1))  # fmt: skip
    from megatron.md.train.metrics import git_commit

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "code": git_commit(),
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}",
        "best_lr_160": best,
        "side": {f"{m} ×{k:.3g}": v for (m, k), v in side.items()},
        "side_mult": chosen,
        "long": long,
        "family": family_table(long_runs) if long_runs else {},
        "bracket": {k: summary(v) or {"seeds": v} for k, v in bracket.items()},  # None: not run
        "iters": args.iters,
        "long_iters": args.long_iters,
    }
    (args.out / "evidence.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
