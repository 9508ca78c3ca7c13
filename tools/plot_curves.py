"""Overlay training curves of several runs on one axis per metric: the LM loss and the gradient
norm by default (the paper's re-warming figure, fig. warmup centre and right), any logged
train-row key with ``--metric``. A continual run (``--init-from``) is drawn after its source:
its iterations are shifted by the source's last checkpointed iteration (``--no-shift``: as
logged). Curves are smoothed with a running mean over ``--smooth`` logged iterations.

    python tools/plot_curves.py runs/ablation-rewarm/*/ --out runs/ablation-rewarm/analysis
    python tools/plot_curves.py source=runs/a reuse=runs/b --metric "lm loss" --smooth 50
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runlog import LogError, read_log  # noqa: E402

METRICS = ("lm loss", "grad_norm")


def source_iteration(init_from: str) -> int:
    """The iteration a continual run started from: its source's tracker."""
    tracker = Path(init_from) / "latest_checkpointed_iteration.txt"
    try:
        return int(tracker.read_text().strip())
    except (OSError, ValueError):
        raise LogError(f"{tracker}: not readable, so the continual run cannot be placed "
                       "(--no-shift draws it as logged)") from None  # fmt: skip


def curves(spec: str, metrics, shift: bool) -> tuple[str, int, dict[str, list]]:
    """(label, shift, metric -> [(iteration, value)]) of one ``[LABEL=]PATH``."""
    label, _, path = spec.rpartition("=")
    log = read_log(path)
    name = label or (log.path.parent.name if log.path.name == "metrics.jsonl" else log.path.stem)
    init_from = log.args.get("init_from")
    offset = source_iteration(init_from) if shift and init_from else 0
    out = {m: [(i + offset, float(r[m])) for i, r in sorted(log.train.items())
               if r.get(m) is not None] for m in metrics}  # fmt: skip
    if not any(out.values()):
        raise LogError(f"{log.path}: none of {', '.join(metrics)} in its train rows")
    return name, offset, out


def smooth(xy: list, n: int) -> list:
    if n <= 1 or len(xy) < n:
        return xy
    out, acc = [], 0.0
    for k, (x, y) in enumerate(xy):
        acc += y - (xy[k - n][1] if k >= n else 0.0)
        if k >= n - 1:
            out.append((x, acc / n))
    return out


def plot(runs: dict, metrics, out: Path, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 3.8), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for name, (offset, data) in runs.items():
            xy = smooth(data[m], n)
            if xy:
                ax.plot(*zip(*xy), lw=1, label=name)
            if offset:
                ax.axvline(offset, color="gray", lw=0.6, ls=":")
        ax.set_xlabel("iteration")
        ax.set_title(m + (f" (running mean of {n})" if n > 1 else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("logs", nargs="+", help="JSONL metrics files or run dirs, optionally LABEL=")
    ap.add_argument("--metric", action="append", help=f"train-row key (default: {METRICS})")
    ap.add_argument("--smooth", type=int, default=1, help="running mean over N iterations")
    ap.add_argument("--no-shift", action="store_true", help="continual runs as logged")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    metrics = tuple(args.metric or METRICS)
    runs = {}
    try:
        for spec in args.logs:
            name, offset, data = curves(spec, metrics, not args.no_shift)
            runs[name] = (offset, data)
    except LogError as e:
        sys.exit(f"[plot_curves] {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "curves.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "iteration", "metric", "value"])
        for name, (_, data) in runs.items():
            w.writerows((name, i, m, v) for m, xy in data.items() for i, v in xy)
    plot(runs, metrics, args.out, args.smooth)
    print(f"[plot_curves] wrote {args.out}/curves.{{png,csv}}", file=sys.stderr)
    return runs


if __name__ == "__main__":
    main()
