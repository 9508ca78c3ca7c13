"""Submit (or print) a whole experiment: one SLURM job per grid point, and a manifest.

    python examples/md_decoupling/sweep.py dense-grid --dry-run
    python examples/md_decoupling/sweep.py ablation-sphere --nodes 2 --time 24:00:00
    python examples/md_decoupling/sweep.py moe-ladder --ep 4 --only 'moe-0.27B.*15B'
    python examples/md_decoupling/sweep.py --list

Experiments live in ``experiments.py`` (next to this file); recipes and LR-transfer rules in
``megatron/md/train/recipes.py``, sizes in ``presets.py``. Each job runs ``launch.sbatch`` with
RUN_NAME = the run's name (which encodes size, method, matrix LR and variant) and RUN_ROOT;
site settings (data, container, NCCL, wandb) go through the launcher's environment knobs. The
manifest (JSON: experiment, git commit, and per run its name, job id, flags, metadata and run
directory) is what the analysis tools read back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
import experiments  # noqa: E402

LAUNCHER = ROOT / "examples" / "md_decoupling" / "launch.sbatch"


def plan(
    experiment: str, lrs, run_root: str, ep: int, only: str | None, mbs: int = 4
) -> list[experiments.Run]:
    runs = experiments.experiment(experiment, lrs)
    if only:
        runs = [r for r in runs if re.search(only, r.name)]
    for r in runs:
        r.flags = [f.format(run_root=run_root, ep=ep, mbs=mbs) for f in r.flags]
    return runs


def sbatch_command(run: experiments.Run, args, run_root: str, dependency: str | None) -> list[str]:
    nodes = run.meta.get("nodes", args.nodes)
    cmd = [
        "sbatch",
        f"--job-name={run.name}",
        f"--nodes={nodes}",
        f"--time={args.time}",
        f"--export=ALL,RUN_NAME={run.name},RUN_ROOT={run_root}",
    ]
    if args.account:
        cmd.append(f"--account={args.account}")
    if args.partition:
        cmd.append(f"--partition={args.partition}")
    if dependency:
        cmd.append(f"--dependency=afterok:{dependency}")
    return [*cmd, str(LAUNCHER), *run.flags]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("experiment", nargs="?", help="one of --list")
    ap.add_argument("--list", action="store_true", help="print the experiments and their sizes")
    ap.add_argument("--dry-run", action="store_true", help="print the sbatch commands only")
    ap.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=None,
        help="matrix-LR grid (default 1e-3*2^(k/2), k=0..8)",
    )
    ap.add_argument("--only", help="regular expression on run names")
    ap.add_argument("--nodes", type=int, default=int(os.environ.get("NODES", 1)))
    ap.add_argument("--time", default=os.environ.get("TIME_LIMIT", "24:00:00"))
    ap.add_argument("--account", default=os.environ.get("SBATCH_ACCOUNT"))
    ap.add_argument("--partition", default=os.environ.get("SBATCH_PARTITION"))
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE ladder)")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="per-GPU micro-batch")
    ap.add_argument(
        "--run-root",
        default=os.environ.get("RUN_ROOT"),
        help="checkpoints and metrics (default runs/<experiment>)",
    )
    ap.add_argument("--manifest", type=Path, default=None, help="default <run-root>/manifest.json")
    args = ap.parse_args(argv)
    if args.list:
        for name in experiments.EXPERIMENTS:
            print(f"{name:<24} {len(experiments.experiment(name)):>4} runs")
        return
    if args.experiment not in experiments.EXPERIMENTS:
        ap.error(
            f"experiment {args.experiment!r} is not one of {', '.join(experiments.EXPERIMENTS)}"
        )
    run_root = os.path.abspath(args.run_root or ROOT / "runs" / args.experiment)
    runs = plan(args.experiment, args.lrs, run_root, args.ep, args.only, args.micro_batch_size)
    if not runs:
        ap.error(f"--only {args.only!r} matches no run of {args.experiment}")
    job_ids: dict[str, str | None] = {}
    entries = []
    for run in runs:
        cmd = sbatch_command(run, args, run_root, job_ids.get(run.meta.get("after")))
        job = None
        if args.dry_run:
            print(shlex.join(cmd))
        else:
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            m = re.search(r"Submitted batch job (\d+)", out.stdout)
            if out.returncode != 0 or not m:
                sys.exit(f"sbatch failed for {run.name}: {out.stderr.strip() or out.stdout}")
            job = m.group(1)
            print(f"{run.name}: job {job}")
        job_ids[run.name] = job
        entries.append(
            {
                "name": run.name,
                "job_id": job,
                "flags": run.flags,
                "meta": run.meta,
                "run_dir": f"{run_root}/{run.name}",
            }
        )
    manifest = args.manifest or Path(run_root) / "manifest.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    git = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    manifest.write_text(
        json.dumps(
            {
                "experiment": args.experiment,
                "created": time.time(),
                "git": git,
                "dry_run": args.dry_run,
                "runs": entries,
            },
            indent=1,
        )
    )
    print(f"[sweep] {len(entries)} runs; manifest: {manifest}", file=sys.stderr)


if __name__ == "__main__":
    main()
