"""Compute scaling laws and compute savings vs AdamW (the paper's appendix "Scaling-law fitting").

Each run is a point at compute C = 6 · N_act · D (N_act: active non-embedding parameters, D:
training tokens) and its tail loss. Per method: the compute-optimal lower envelope (the runs
that set a new record-low loss as compute grows), a power law L = A · C^(-α) fitted to it in
log-log space (floor 0), and the compute savings against the baseline at a target loss,
C_base(L) / C_method(L), with a nonparametric bootstrap CI (``--bootstrap`` resamples of the
envelope points, refit each time). Paper (MoE ladder, L = 2.635): Muon 1.55× [1.49, 1.63],
MuonMD 2.01× [1.94, 2.11].

Input: a CSV with columns ``method``, ``tail_loss`` and either ``compute`` or
``n_active_non_embedding`` and ``tokens`` (``tools/lr_sweep.py`` writes one; rows whose
``status`` is not ``ok`` are skipped). Writes scaling_law.{json,csv,png}.

    python tools/scaling_law.py runs/moe-ladder/analysis/lr_sweep.csv --target-loss 2.635
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


class InputError(ValueError):
    pass


@dataclass
class Fit:
    A: float
    alpha: float
    n: int

    def loss(self, c):
        return self.A * np.asarray(c, dtype=float) ** (-self.alpha)

    def compute(self, loss: float) -> float:
        return (self.A / loss) ** (1.0 / self.alpha)


def envelope(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The record-low points as compute grows (ties in compute: the lowest loss)."""
    out, best = [], math.inf
    for c, loss in sorted(points, key=lambda p: (p[0], p[1])):
        if loss < best:
            out.append((c, loss))
            best = loss
    return out


def fit_power_law(points: list[tuple[float, float]]) -> Fit:
    """Least squares of log L = log A − α log C."""
    c = np.log([p[0] for p in points])
    y = np.log([p[1] for p in points])
    if len(points) < 2 or np.ptp(c) == 0:
        raise InputError("a power-law fit needs at least two envelope points at different compute")
    slope, intercept = np.polyfit(c, y, 1)
    return Fit(A=float(math.exp(intercept)), alpha=float(-slope), n=len(points))


def savings(base: Fit, other: Fit, loss: float) -> float:
    return base.compute(loss) / other.compute(loss)


def bootstrap(env: dict[str, list], baseline: str, loss: float, n: int, seed: int) -> dict:
    """Percentile CI of each method's savings: resample every method's envelope points."""
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {m: [] for m in env if m != baseline}
    for _ in range(n):
        fits = {}
        for m, pts in env.items():
            pick = [pts[i] for i in rng.integers(0, len(pts), len(pts))]
            try:
                fits[m] = fit_power_law(pick)
            except InputError:  # all draws at one compute: no slope, skip this resample
                break
        if len(fits) != len(env) or any(f.alpha <= 0 for f in fits.values()):
            continue
        for m in draws:
            draws[m].append(savings(fits[baseline], fits[m], loss))
    return {
        m: {"lo": float(np.percentile(v, 2.5)), "hi": float(np.percentile(v, 97.5)),
            "resamples": len(v)} if v else None
        for m, v in draws.items()
    }  # fmt: skip


def read_points(
    path: Path, exclude: str | None, fit_exclude: str | None = None
) -> tuple[dict[str, list[tuple[float, float]]], dict[str, list[tuple[float, float]]]]:
    """(points fitted, points only plotted) per method: ``exclude`` leaves runs out, ``fit_exclude``
    keeps them out of the envelope and fit but in the figure (the paper's 810M-active @ 7.5B)."""
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise InputError(f"{path}: no rows")
    cols = set(rows[0])
    if not {"method", "tail_loss"} <= cols or not (
        "compute" in cols or {"n_active_non_embedding", "tokens"} <= cols
    ):
        raise InputError(
            f"{path}: needs columns method, tail_loss and compute (or n_active_non_embedding "
            f"and tokens); has {sorted(cols)}"
        )
    pts: dict[str, list[tuple[float, float]]] = {}
    shown: dict[str, list[tuple[float, float]]] = {}
    for n, r in enumerate(rows, 2):
        if r.get("status", "ok") != "ok" or (exclude and re.search(exclude, r.get("name", ""))):
            continue
        try:
            c = float(r["compute"]) if r.get("compute") else (
                6 * float(r["n_active_non_embedding"]) * float(r["tokens"]))  # fmt: skip
            loss = float(r["tail_loss"])
        except (TypeError, ValueError):
            raise InputError(f"{path}:{n}: compute/loss are not numbers") from None
        if not (c > 0 and loss > 0 and math.isfinite(c * loss)):
            raise InputError(f"{path}:{n}: compute and loss must be positive and finite")
        unfitted = fit_exclude and re.search(fit_exclude, r.get("name", ""))
        (shown if unfitted else pts).setdefault(r["method"], []).append((c, loss))
    return pts, shown


def analyse(points, baseline: str, target: float | None, n_boot: int, seed: int) -> dict:
    if baseline not in points:
        raise InputError(f"baseline {baseline!r} has no runs (methods: {sorted(points)})")
    env = {m: envelope(p) for m, p in points.items()}
    fits = {m: fit_power_law(e) for m, e in env.items()}
    if target is None:  # the middle of the baseline's frontier: inside the fitted range
        target = float(np.median([loss for _, loss in env[baseline]]))
    ci = bootstrap(env, baseline, target, n_boot, seed)
    return {
        "baseline": baseline,
        "target_loss": target,
        "fits": {m: asdict(f) for m, f in fits.items()},
        "envelope": env,
        "savings": {
            m: {"ratio": savings(fits[baseline], f, target), "ci95": ci[m]}
            for m, f in fits.items()
            if m != baseline
        },
    }


def plot(points, result: dict, out: Path, shown=None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron.md.figstyle import method_color

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, pts in sorted(points.items()):
        c = [p[0] for p in pts]
        line = ax.plot(c, [p[1] for p in pts], "o", alpha=0.25, ms=4, color=method_color(m))[0]
        env = result["envelope"][m]
        ax.plot([p[0] for p in env], [p[1] for p in env], "o", color=line.get_color(), ms=5)
        extra = (shown or {}).get(m, [])
        if extra:  # plotted, not fitted
            ax.plot([p[0] for p in extra], [p[1] for p in extra], "o", mfc="none", ms=5,
                    color=line.get_color())  # fmt: skip
        f = Fit(**result["fits"][m])
        grid = np.geomspace(min(c), max(c), 50)
        ax.plot(grid, f.loss(grid), "-", color=line.get_color(),
                label=f"{m}: L = {f.A:.3g}·C^-{f.alpha:.4f}")  # fmt: skip
    ax.axhline(result["target_loss"], color="gray", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compute C = 6·N_act·D (FLOPs)")
    ax.set_ylabel("tail loss")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / "scaling_law.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("csv", type=Path, help="runs: method, tail_loss, compute or N_act and tokens")
    ap.add_argument("--baseline", default="adamw")
    ap.add_argument("--target-loss", type=float, help="default: median of the baseline frontier")
    ap.add_argument("--bootstrap", type=int, default=500, help="resamples for the CI")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exclude", help="regular expression on run names to leave out")
    ap.add_argument("--fit-exclude", help="regular expression on run names to plot (hollow) "
                    "but keep out of the envelope and fit")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="default: the CSV's directory")
    args = ap.parse_args(argv)
    try:
        points, shown = read_points(args.csv, args.exclude, args.fit_exclude)
        result = analyse(points, args.baseline, args.target_loss, args.bootstrap, args.seed)
    except InputError as e:
        sys.exit(f"[scaling_law] {e}")
    out = args.out or args.csv.parent
    out.mkdir(parents=True, exist_ok=True)
    print(f"method | A | alpha | envelope points | savings at L={result['target_loss']:.4g}")
    print("--- | --- | --- | --- | ---")
    for m, f in result["fits"].items():
        s = result["savings"].get(m)
        if s is None:
            cell = "baseline"
        else:
            ci = s["ci95"]
            cell = f"{s['ratio']:.2f}x" + (f" [{ci['lo']:.2f}, {ci['hi']:.2f}]" if ci else "")
        print(f"{m} | {f['A']:.4g} | {f['alpha']:.4f} | {f['n']} | {cell}")
    (out / "scaling_law.json").write_text(json.dumps(result, indent=1))
    with (out / "scaling_law.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "A", "alpha", "envelope_points", "savings", "ci_lo", "ci_hi"])
        for m, fit in result["fits"].items():
            s = result["savings"].get(m) or {}
            ci = s.get("ci95") or {}
            w.writerow([m, fit["A"], fit["alpha"], fit["n"], s.get("ratio", 1.0),
                        ci.get("lo"), ci.get("hi")])  # fmt: skip
    result["not_fitted"] = shown
    plot(points, result, out, shown)
    print(f"[scaling_law] wrote {out}/scaling_law.{{json,csv,png}}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
