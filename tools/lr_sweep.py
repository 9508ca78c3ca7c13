"""LR sweeps: tail loss vs matrix LR per method and model size, with each optimum marked.

Reads a sweep manifest (``examples/md_decoupling/sweep.py``, or any JSON with
``runs[].name/meta/flags/run_dir``; ``meta`` gives ``size``, ``method``, ``matrix_lr`` and an
optional ``variant``) and each run's log (``<run_dir>/metrics.jsonl``, or ``meta.log`` when
set). A run's score is its tail loss: the mean LM loss of its last ``--tail`` (25) logged
iterations, the paper's last 25 iterations where every iteration is logged (the experiments'
``--log-interval 1``); a run logged less often is scored on its last 25 logged losses and
named, and the CSV's ``tail_iterations`` gives every run's span. Runs that are missing, stopped
before ``--train-iters`` or not finite are reported with their status and left out of the
optimum; they never stop the tool.

Writes ``lr_sweep.json`` (every run and the optima), ``lr_sweep.csv`` (one row per run, with
the active non-embedding parameter count and token count that ``tools/scaling_law.py``
reads), ``lr_sweep.png`` (a panel per size: a curve per method) and ``lr_transfer.png`` (a
panel per method: a curve per size, i.e. the paper's width/depth transfer figure).

    python tools/lr_sweep.py runs/dense-grid/manifest.json --out runs/dense-grid/analysis
    python tools/lr_sweep.py runs/dense-grid/analysis/lr_sweep.csv --replot   # figures only

Figures follow ``megatron/md/figstyle.py``: one colour per method in every panel, sizes in
numeric order on one sequential map, a line style per variant (ablation arm); runs that differ
only by seed are one curve, the mean with the seeds' range as error bars.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from runlog import TAIL, LogError, flag, read_log, read_manifest  # noqa: E402

from megatron.md.figstyle import method_color, natural_key, ordered_colors  # noqa: E402


def size_counts(size: str, flags: list[str]) -> tuple[int | None, int | None]:
    """(active non-embedding parameters, tokens) of a run, or None where unknown."""
    from megatron.md.train.presets import PRESETS, count_params

    n_act = None
    if size in PRESETS:
        p = PRESETS[size]
        vocab = int(flag(flags, "vocab-size") or p.vocab)
        n_act = count_params(p, vocab)[1] - 2 * vocab * p.hidden  # embeddings and LM head out
    iters, gbs, seq = (flag(flags, k) for k in ("train-iters", "global-batch-size", "seq-length"))
    tokens = int(iters) * int(gbs) * int(seq) if iters and gbs and seq else None
    return n_act, tokens


def score_run(entry: dict, tail: int, x: str = "matrix_lr") -> dict:
    meta, flags = entry["meta"], entry.get("flags", [])
    size = str(meta.get("size", "?"))
    n_act, tokens = size_counts(size, flags)
    row = {
        "name": entry["name"],
        "size": size,
        "method": meta.get("method", "?"),
        "variant": meta.get("variant", ""),
        "matrix_lr": float(meta.get("matrix_lr") or flag(flags, "matrix-lr") or "nan"),
        "x": float(meta.get(x) or "nan"),
        "n_active_non_embedding": n_act,
        "tokens": tokens,
        "tail_loss": None,
        "last_iteration": 0,
    }
    path = Path(meta.get("log") or Path(entry["run_dir"]) / "metrics.jsonl")
    try:
        log = read_log(path)
    except LogError as e:
        return {**row, "status": "missing", "detail": str(e)}
    row["last_iteration"] = log.last_iteration()
    want = int(flag(flags, "train-iters") or 0)
    losses = [v for _, v in log.losses()]
    if any(not math.isfinite(v) for v in losses):
        return {**row, "status": "diverged", "detail": "non-finite loss logged"}
    if want and row["last_iteration"] < want:
        return {**row, "status": "incomplete",
                "detail": f"stopped at iteration {row['last_iteration']} of {want}"}  # fmt: skip
    t = log.tail_loss(tail)
    if t is None:
        return {**row, "status": "incomplete", "detail": f"fewer than {tail} logged iterations"}
    its = [i for i, _ in log.losses()[-tail:]]
    span = its[-1] - its[0] + 1  # the paper's tail: the last 25 iterations, each logged
    detail = "" if span == tail else (
        f"its last {tail} logged losses span {span} iterations (--log-interval > 1): the "
        f"tail is not the last {tail} iterations; log every iteration for the paper's")  # fmt: skip
    return {**row, "status": "ok", "tail_loss": t, "tail_iterations": span, "detail": detail}


def optima(rows: list[dict]) -> list[dict]:
    """Best LR per (size, method, variant) among the runs that finished."""
    best: dict[tuple, dict] = {}
    grid: dict[tuple, list[float]] = {}
    for r in rows:
        key = (r["size"], r["method"], r["variant"])
        grid.setdefault(key, []).append(r["matrix_lr"])
        if r["status"] == "ok" and (key not in best or r["tail_loss"] < best[key]["tail_loss"]):
            best[key] = r
    out = []
    for key, lrs in grid.items():
        b = best.get(key)
        out.append({
            "size": key[0], "method": key[1], "variant": key[2],
            "best_lr": b and b["matrix_lr"], "best_loss": b and b["tail_loss"],
            "at_grid_edge": bool(b) and b["matrix_lr"] in (min(lrs), max(lrs)),
            "runs": len(lrs), "ok": sum(1 for r in rows if r["status"] == "ok"
                                        and (r["size"], r["method"], r["variant"]) == key),
        })  # fmt: skip
    return out


def label(method: str, variant: str) -> str:
    return f"{method} [{variant}]" if variant else method


def seedless(variant: str) -> str:
    """A variant that only names a seed ("seed 1235") is the same curve as the first seed's."""
    return "" if re.fullmatch(r"seed \d+", variant or "") else variant


def seed_stats(pts: list[dict]) -> tuple[list, list, list, list]:
    """Per x: the mean tail loss over the seeds run there, and its min and max."""
    by_x: dict[float, list[float]] = {}
    for r in pts:
        by_x.setdefault(r["x"], []).append(r["tail_loss"])
    xs = sorted(by_x)
    mean = [sum(by_x[v]) / len(by_x[v]) for v in xs]
    return xs, mean, [min(by_x[v]) for v in xs], [max(by_x[v]) for v in xs]


def plot(rows: list[dict], out: Path, x: str = "matrix_lr") -> None:
    """``x``: the meta key on the horizontal axis; other than the matrix LR (e.g. ``gbs``, the
    MoE batch sweep), one curve per method across variants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one colour per size in every panel, in numeric order; methods: figstyle's fixed colours
    sizes = ordered_colors(r["size"] for r in rows if r["status"] == "ok")

    def panels(outer: str, inner: str, path: Path, title: str) -> None:
        keys = sorted({r[outer] for r in rows if r["status"] == "ok"}, key=natural_key)
        if not keys:
            return
        fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
        for ax, k in zip(axes[0], keys):
            series: dict[tuple, list] = {}
            for r in rows:
                if r[outer] == k and r["status"] == "ok":
                    variant = seedless(r["variant"]) if x == "matrix_lr" else ""
                    series.setdefault((r[inner], variant), []).append(r)
            variants = sorted({v for _, v in series}, key=natural_key)
            order = lambda kv: (natural_key(kv[0][0]), natural_key(kv[0][1]))  # noqa: E731
            for (name, variant), pts in sorted(series.items(), key=order):
                xs, mean, lo, hi = seed_stats(pts)
                style = ["o-", "s--", "^:", "d-."][variants.index(variant) % 4]
                color = sizes.get(name) if inner == "size" else method_color(name)
                seeds = " (seeds: mean, range)" if lo != hi else ""
                err = [[m - a for m, a in zip(mean, lo)], [b - m for m, b in zip(mean, hi)]]
                line = ax.errorbar(xs, mean, yerr=err, fmt=style, ms=3, capsize=2, color=color,
                                   label=label(name, variant) + seeds)[0]  # fmt: skip
                b = min(range(len(xs)), key=lambda i: mean[i])
                ax.plot(xs[b], mean[b], "*", ms=12, color=line.get_color())
            ax.set_xscale("log", base=2)
            ax.set_xlabel("matrix LR" if x == "matrix_lr" else x)
            ax.set_title(f"{title} {k}")
            ax.grid(alpha=0.3)
            if series:
                ax.legend(fontsize=7)
        axes[0][0].set_ylabel(f"tail loss (last {TAIL} iterations)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    panels("size", "method", out / "lr_sweep.png", "size")
    panels("method", "size", out / "lr_transfer.png", "method")


def replot(path: Path, out: Path, x: str) -> dict:
    """The figures again from an ``lr_sweep.csv`` this tool wrote (no run logs needed)."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["tail_loss"] = float(r["tail_loss"]) if r["status"] == "ok" else float("nan")
        r["x"] = float(r[x])
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out, x)
    print(f"[lr_sweep] redrew {out}/lr_sweep.png, lr_transfer.png from {path}", file=sys.stderr)
    return {"rows": len(rows)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("manifest", type=Path, nargs="+", help="sweep manifest(s) (JSON)")
    ap.add_argument("--only", help="regular expression: score only the runs whose name matches")
    ap.add_argument("--tail", type=int, default=TAIL, help="iterations in the tail loss")
    ap.add_argument("--out", type=Path, default=None, help="default: <manifest dir>/analysis")
    ap.add_argument(
        "--x", default="matrix_lr", help="run meta key on the figures' x axis (e.g. gbs)"
    )
    ap.add_argument(
        "--replot", action="store_true", help="the positional is an lr_sweep.csv: redraw figures"
    )
    args = ap.parse_args(argv)
    first = args.manifest[0]
    if args.replot:
        return replot(first, args.out or first.parent, args.x)
    try:
        manifests = [read_manifest(m) for m in args.manifest]
    except LogError as e:
        sys.exit(f"[lr_sweep] {e}")
    entries = {e["name"]: e for m in manifests for e in m["runs"]}  # one run, one row
    if args.only:
        entries = {n: e for n, e in entries.items() if re.search(args.only, n)}
        if not entries:
            sys.exit(f"[lr_sweep] --only {args.only!r} matches no run of the manifest(s)")
    manifest = {"experiment": "+".join(str(m.get("experiment")) for m in manifests)}
    out = args.out or first.parent / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    rows = [score_run(e, args.tail, args.x) for e in entries.values()]
    best = optima(rows)
    for r in rows:
        if r["status"] != "ok" or r["detail"]:
            print(f"[lr_sweep] {r['name']}: {r['status']} ({r['detail']})", file=sys.stderr)
    print("size | method | best matrix LR | tail loss | finished runs")
    print("--- | --- | --- | --- | ---")
    for b in best:
        lr = "none finished" if b["best_lr"] is None else f"{b['best_lr']:.4g}"
        edge = " (grid edge)" if b["at_grid_edge"] else ""
        loss = "" if b["best_loss"] is None else f"{b['best_loss']:.4f}"
        print(f"{b['size']} | {label(b['method'], b['variant'])} | {lr}{edge} | {loss} | "
              f"{b['ok']}/{b['runs']}")  # fmt: skip
    report = {"experiment": manifest.get("experiment"), "tail": args.tail, "runs": rows,
              "optima": best}  # fmt: skip
    (out / "lr_sweep.json").write_text(json.dumps(report, indent=1))
    with (out / "lr_sweep.csv").open("w", newline="") as f:
        keys = ["name", "size", "method", "variant", "matrix_lr", "status", "tail_loss",
                "tail_iterations", "last_iteration", "n_active_non_embedding",
                "tokens"]  # fmt: skip
        w = csv.DictWriter(f, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, out, args.x)
    print(f"[lr_sweep] wrote {out}/lr_sweep.{{json,csv,png}}, lr_transfer.png", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
