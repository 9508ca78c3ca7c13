"""Long-run invariants of MD: a long CPU run of AdamMD and MuonMD on the tiny preset,
then checks on its metrics file: the sphere drift max |‖Ŵ‖ − c| / c stays ≤ 1e-5 at the end,
every gain is finite, no loss is NaN/Inf, and the loss falls (mean of the last 100 logged
iterations below the first 100). Prints a table and exits 1 if any check fails.

    python tools/long_run_check.py                     # 2,000 iterations each, 2 ranks (~15 min)
    python tools/long_run_check.py --iters 300 --methods adammd
    python tools/long_run_check.py --check runs/long/adammd.jsonl   # only check a finished run
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from runlog import LogError, read_log, run_pretrain  # noqa: E402

FLAGS = {
    "adammd": ["--optimizer=adam", "--md-decoupling", "--lr=1e-2"],
    "muonmd": ["--optimizer=muon", "--md-decoupling", "--lr=3e-3", "--matrix-lr=2e-2"],
}  # fmt: skip
DRIFT_TOL = 1e-5


def run(method: str, iters: int, nproc: int, out: Path) -> Path:
    metrics = out / f"{method}.jsonl"
    metrics.unlink(missing_ok=True)
    flags = [
        "--preset=tiny", "--mock-data", "--tokenizer-type=NullTokenizer", "--vocab-size=1024",
        "--seq-length=64", "--max-position-embeddings=64", "--micro-batch-size=4",
        f"--global-batch-size={4 * nproc}", f"--train-iters={iters}", "--log-interval=10",
        "--md-log-interval=100", "--eval-iters=0", f"--eval-interval={iters + 1}",
        "--use-distributed-optimizer", "--seed=1", f"--metrics-file={metrics}", *FLAGS[method],
    ]  # fmt: skip
    print(f"[long_run] {method}: {iters} iterations on {nproc} ranks", file=sys.stderr)
    rc = run_pretrain(nproc, flags, out / f"{method}.log", out)
    if rc:
        sys.exit(f"[long_run] {method} failed (exit {rc}); see {out / f'{method}.log'}")
    return metrics


def check(path: Path) -> dict[str, tuple[bool, str]]:
    log = read_log(path)
    losses = [v for _, v in log.losses()]
    diags = [r["md"] for _, r in sorted(log.train.items()) if "md" in r]
    if len(losses) < 20 or not diags:
        raise LogError(f"{path}: too short for the checks ({len(losses)} losses)")
    last = diags[-1]
    drift = max(last.get("sphere_drift", {}).values(), default=math.inf)
    gains = [v for k in ("gain_min", "gain_max") for v in last.get(k, {}).values()]
    k = min(100, len(losses) // 4)
    first, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return {
        "iterations": (True, str(log.last_iteration())),
        "sphere drift <= 1e-5 at the end": (drift <= DRIFT_TOL, f"{drift:.2e}"),
        "gains finite": (bool(gains) and all(map(math.isfinite, gains)),
                         f"min {min(gains):.3f}, max {max(gains):.3f}" if gains else "none"),
        "no NaN/Inf loss": (all(map(math.isfinite, losses)), f"{len(losses)} logged"),
        "loss decreasing": (tail < first, f"first {k}: {first:.3f} -> last {k}: {tail:.3f}"),
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--methods", nargs="+", default=list(FLAGS), choices=list(FLAGS))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("runs/long_run"))
    ap.add_argument("--check", type=Path, nargs="+", help="only check these metrics files")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()  # runs start in args.out: keep their paths absolute
    args.out.mkdir(parents=True, exist_ok=True)
    paths = args.check or [run(m, args.iters, args.nproc, args.out) for m in args.methods]
    ok = True
    for p in paths:
        try:
            results = check(p)
        except LogError as e:
            sys.exit(f"[long_run] {e}")
        print(f"\n{p}")
        for name, (passed, detail) in results.items():
            ok &= passed
            print(f"  {'PASS' if passed else 'FAIL'}  {name}: {detail}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
