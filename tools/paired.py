"""Paired comparison of arms run with the same seeds (the same init and data order per seed).

Reads sweep manifests (``runs[].meta`` with ``method`` or ``arm``, and ``seed``), scores each run
by its final validation loss (``--score tail``: the tail train loss), and prints per arm the
seeds' mean and range, the paired difference to the reference arm (``--ref``) over the seeds both
ran, its 95 % t-interval, the sign of every pair, and a verdict against ``--threshold`` (nats):

- ``ahead`` / ``behind``: the interval lies beyond the threshold on one side;
- ``equal``: the interval lies inside ±threshold;
- ``undecided``: neither (too few seeds or too much spread to say).

With two seeds the t-interval is wide (t = 12.7): a verdict then needs a large, consistent
difference. Writes ``paired.json`` and ``paired.csv`` beside the first manifest (``--out``).

    python tools/paired.py runs/evidence/manifest.json --ref muonmd --part long --threshold 0.01
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runlog import LogError, read_log, read_manifest  # noqa: E402

#: two-sided 95 % quantiles of Student's t by degrees of freedom (1 … 30; more: 1.96)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t975(df: int) -> float:
    return T975[df - 1] if 1 <= df <= len(T975) else 1.96


def score(run: dict, how: str) -> float | None:
    """The run's final validation loss (or tail train loss); None when it has none."""
    try:
        log = read_log(Path(run["run_dir"]))
    except LogError:
        return None
    if how == "tail":
        return log.tail_loss()
    last = log.valid.get(max(log.valid, default=-1))
    v = float(last["lm loss"]) if last else None
    return v if v is not None and math.isfinite(v) else None


def arm_of(meta: dict) -> str:
    return str(meta.get("arm") or meta["method"])


def interval(diffs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of the paired differences' 95 % t-interval (one pair: no interval)."""
    m = statistics.mean(diffs)
    if len(diffs) < 2:
        return m, -math.inf, math.inf
    half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return m, m - half, m + half


def verdict(lo: float, hi: float, threshold: float) -> str:
    if hi < -threshold:
        return "ahead"
    if lo > threshold:
        return "behind"
    if -threshold < lo and hi < threshold:
        return "equal"
    return "undecided"


def compare(runs: list[dict], ref: str, threshold: float, how: str = "valid") -> dict:
    """Per arm: seeds, scores, mean and range; against ``ref``: the paired differences (arm −
    ref, lower is better), their interval, signs and the verdict."""
    by_arm: dict[str, dict[int, float]] = {}
    for r in runs:
        v = score(r, how)
        if v is not None:
            by_arm.setdefault(arm_of(r["meta"]), {})[int(r["meta"]["seed"])] = v
    if ref not in by_arm:
        raise LogError(f"the reference arm {ref!r} has no finished runs (arms: {sorted(by_arm)})")
    out = {}
    for arm, seeds in sorted(by_arm.items()):
        vals = [seeds[s] for s in sorted(seeds)]
        row = {"seeds": sorted(seeds), "scores": vals, "mean": statistics.mean(vals),
               "min": min(vals), "max": max(vals)}  # fmt: skip
        shared = sorted(set(seeds) & set(by_arm[ref]))
        if arm != ref and shared:
            diffs = [seeds[s] - by_arm[ref][s] for s in shared]
            m, lo, hi = interval(diffs)
            row.update(paired_seeds=shared, diffs=diffs, diff_mean=m, ci95=[lo, hi],
                       signs="".join("-" if d < 0 else "+" for d in diffs),
                       verdict=verdict(lo, hi, threshold))  # fmt: skip
        out[arm] = row
    return out


def table(result: dict, ref: str, threshold: float) -> str:
    lines = [f"arm | seeds | mean | range | vs {ref} (paired, 95 % CI) | signs | "
             f"verdict (±{threshold:g})", "--- | --- | --- | --- | --- | --- | ---"]  # fmt: skip
    for arm, r in result.items():
        rng = f"{r['min']:.4f} – {r['max']:.4f}"
        if "diff_mean" in r:
            lo, hi = r["ci95"]
            ci = f"{r['diff_mean']:+.4f} [{lo:+.4f}, {hi:+.4f}]" if math.isfinite(lo) else (
                f"{r['diff_mean']:+.4f} (one pair)")  # fmt: skip
            cells = [ci, r["signs"], r["verdict"]]
        else:
            cells = ["reference" if arm == ref else "no shared seed", "", ""]
        lines.append(" | ".join([arm, str(len(r["seeds"])), f"{r['mean']:.4f}", rng, *cells]))
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("manifest", type=Path, nargs="+")
    ap.add_argument("--ref", required=True, help="reference arm (meta.arm or meta.method)")
    ap.add_argument("--threshold", type=float, default=0.01, help="nats (default 0.01)")
    ap.add_argument("--part", help="only runs whose meta.part is this")
    ap.add_argument("--score", choices=("valid", "tail"), default="valid")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        runs = [r for m in args.manifest for r in read_manifest(m)["runs"]
                if args.part is None or r["meta"].get("part") == args.part]  # fmt: skip
        if any("seed" not in r["meta"] for r in runs):
            raise LogError("every run needs meta.seed (paired by seed)")
        result = compare(runs, args.ref, args.threshold, args.score)
    except LogError as e:
        sys.exit(f"[paired] {e}")
    print(table(result, args.ref, args.threshold))
    out = args.out or args.manifest[0].parent
    out.mkdir(parents=True, exist_ok=True)
    report = {"ref": args.ref, "threshold": args.threshold, "score": args.score, "arms": result}
    (out / "paired.json").write_text(json.dumps(report, indent=1))
    with (out / "paired.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seeds", "mean", "min", "max", "diff_mean", "ci_lo", "ci_hi",
                    "verdict"])  # fmt: skip
        for arm, r in result.items():
            lo, hi = r.get("ci95", [None, None])
            w.writerow([arm, len(r["seeds"]), r["mean"], r["min"], r["max"],
                        r.get("diff_mean"), lo, hi, r.get("verdict")])  # fmt: skip
    print(f"[paired] wrote {out}/paired.{{json,csv}}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
