"""Plot the MD diagnostics that ``pretrain_gpt.py`` logs (``--md-log-interval``) over training.

Per run (one row of panels): relative weight update ‖ΔW‖/‖W‖ and relative output change
‖XΔWᵀ‖/‖XWᵀ‖ per matrix class, the gain spread (min and max effective gain φ(ĝ) per class, and
the raw-gain norm), the row and column gains of the middle layer (the paper's gain-dynamics
figure), per-layer activation RMS (block outputs), the sphere-norm drift max |‖Ŵ‖ − c| / c (MD
runs) and the gradient norm. Baseline runs have no gain or sphere panels. Writes
``diagnostics.png`` and ``diagnostics.csv`` (long format: run, iteration, metric, key, value).

    python tools/plot_diagnostics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --out plots/
    python tools/plot_diagnostics.py muonmd=runs/b --out plots/   # LABEL=PATH names a run
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runlog import LogError, RunLog, read_log  # noqa: E402

PANELS = ("rel_update", "out_change", "gains", "gains_by_layer", "act_rms", "sphere_drift",
          "grad_norm")  # fmt: skip


def series(log: RunLog) -> list[tuple[int, str, str, float]]:
    """(iteration, metric, key, value) for every logged diagnostic."""
    out = []
    for it, row in sorted(log.train.items()):
        md = row.get("md")
        if not md:
            continue
        if row.get("grad_norm") is not None:
            out.append((it, "grad_norm", "all", float(row["grad_norm"])))
        for metric, val in md.items():
            items = enumerate(val) if isinstance(val, list) else val.items()
            for k, v in items:
                if isinstance(v, list):  # gains_by_layer: raw-gain norm, min, max
                    out += [(it, metric, f"{k}/{p}", float(x)) for p, x in zip(PARTS, v)]
                elif v is not None:
                    out.append((it, metric, str(k), float(v)))
    return out


PARTS = ("raw_norm", "min", "max")


def plot(runs: dict[str, list], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(PANELS)
    fig, axes = plt.subplots(len(runs), n, figsize=(4 * n, 3.2 * len(runs)), squeeze=False)
    for row, (name, pts) in zip(axes, runs.items()):

        def draw(ax, metric, style="-", prefix="", keep=lambda k: True):
            keys = sorted({k for _, m, k, _ in pts if m == metric and keep(k)}, key=_key_order)
            for k in keys:
                xy = [(i, v) for i, m, kk, v in pts if m == metric and kk == k]
                ax.plot(*zip(*xy), style, lw=1, label=prefix + k)
            return bool(keys)

        draw(row[0], "rel_update")
        draw(row[0], "rel_update_block", ":", "qkv/")  # the query block: the lr-decay figure's
        row[0].set_yscale("log")
        row[0].set_title(f"{name}: relative update ‖ΔW‖/‖W‖")
        if draw(row[1], "out_change"):
            row[1].set_yscale("log")
        row[1].set_title("relative output change ‖XΔWᵀ‖/‖XWᵀ‖")
        has_gains = draw(row[2], "gain_max", "-", "max ") | draw(row[2], "gain_min", "--", "min ")
        row[2].set_title("effective gains φ(ĝ): min / max" if has_gains else "no gains (not MD)")
        if has_gains:
            twin = row[2].twinx()
            draw(twin, "raw_gain_norm", ":", "‖ĝ‖ ")
            twin.set_ylabel("raw-gain norm (dotted)")
        layers = sorted({int(k.split("/")[1]) for _, m, k, _ in pts if m == "gains_by_layer"})
        if layers:
            mid = layers[len(layers) // 2]
            for part, style in (("max", "-"), ("min", "--")):

                def keep(k, p=part):
                    return k.split("/")[1] == str(mid) and k.endswith("/" + p)

                draw(row[3], "gains_by_layer", style, "", keep)
            row[3].set_title(f"layer {mid}: row / column gains, max and min")
        else:
            row[3].set_title("no gains (not MD)")
        draw(row[4], "act_rms", "-", "layer ")
        draw(row[4], "attn_logit_max", ":", "max logit, layer ")
        row[4].set_title("block-output RMS; largest attention logit (dotted)")
        has_drift = draw(row[5], "sphere_drift")
        row[5].set_title("sphere drift |‖Ŵ‖−c|/c" if has_drift else "no sphere (not MD)")
        if has_drift:
            row[5].set_yscale("log")
        draw(row[6], "grad_norm")
        row[6].set_title("gradient norm")
        for ax in row:
            ax.set_xlabel("iteration")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "diagnostics.png", dpi=100)
    plt.close(fig)


def _key_order(k: str):
    return (0, int(k), "") if k.isdigit() else (1, 0, k)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("logs", nargs="+", help="JSONL metrics files or run dirs, optionally LABEL=")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    runs = {}
    try:
        for spec in args.logs:
            label, _, path = spec.rpartition("=")
            log = read_log(path)
            pts = series(log)
            if not pts:
                raise LogError(f"{log.path}: no diagnostics rows (train rows with 'md')")
            name = log.path.parent.name if log.path.name == "metrics.jsonl" else log.path.stem
            runs[label or name] = pts
    except LogError as e:
        sys.exit(f"[plot_diagnostics] {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "diagnostics.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "iteration", "metric", "key", "value"])
        for name, pts in runs.items():
            w.writerows((name, *p) for p in pts)
    plot(runs, args.out)
    print(f"[plot_diagnostics] wrote {args.out}/diagnostics.{{png,csv}}", file=sys.stderr)
    return runs


if __name__ == "__main__":
    main()
