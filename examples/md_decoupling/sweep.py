"""Submit (or print) a whole experiment: one SLURM job per grid point, and a manifest.

    python examples/md_decoupling/sweep.py dense-grid --dry-run
    python examples/md_decoupling/sweep.py ablation-sphere --nodes 2 --time 24:00:00
    python examples/md_decoupling/sweep.py ablation-sphere --resume    # what is not done/queued
    python examples/md_decoupling/sweep.py dense-grid --array --array-max 8   # one job array
    python examples/md_decoupling/sweep.py status --run-root runs/ablation-sphere
    python examples/md_decoupling/sweep.py moe-ladder --ep 4 --only 'moe-0.27B.*15B'
    python examples/md_decoupling/sweep.py --list

Experiments live in ``experiments.py`` (next to this file); recipes and LR-transfer rules in
``megatron/md/train/recipes.py``, sizes in ``presets.py``. Each job runs ``launch.sbatch`` with
RUN_NAME = the run's name (which encodes size, method, matrix LR and variant) and RUN_ROOT;
site settings (data, container, NCCL, wandb) go through the launcher's environment knobs.

Before anything is submitted every distinct command is validated with ``pretrain_gpt.py``'s own
parser on this (login) node, with what launch.sbatch gives a job before the run's flags
(``launcher_args``: PRECISION_ARGS, DIST_ARGS, LOG_ARGS, SAVE_INTERVAL, as the jobs will see
them) and the site's DATA_ARGS (``validate``: three cases, each said by name — data and
tokenizer visible here: checked too; not visible here, e.g. ``/data`` mounted on compute nodes
only: the flags are checked, the files when each job starts; DATA_ARGS unset: refused, since
every job would start without data, unless ``--mock-data`` asks for megatron's mock data on
purpose). Without torch here validation is refused by name (``--no-validate`` submits
unvalidated). The manifest (JSON: experiment, git commit, and per run its name, job
id, flags, metadata and run directory) is written after each submission, so a failing
``sbatch`` midway leaves every job already queued in it; the analysis tools read it back.
``--resume`` skips runs that finished (``<run>/finished``) or whose job is still queued or
running, and keeps the manifest entries of runs ``--only`` leaves out; a run root whose
manifest lists runs is refused without it (a second submission would queue every run again
beside the first jobs, two jobs writing one run directory, and replace the manifest).
``--dry-run`` prints what would be submitted and writes nothing. Jobs are requeued at their
time limit (the launcher's REQUEUE=1; ``--no-requeue`` not).
"""

from __future__ import annotations

import argparse
import contextlib
import io
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

from megatron.md.progress import duration  # noqa: E402

LAUNCHER = ROOT / "examples" / "md_decoupling" / "launch.sbatch"


def plan(
    experiment: str,
    lrs,
    run_root: str,
    ep: int,
    only: str | None,
    mbs: int = 4,
    methods=None,
    text: bool = False,
    extra: list[str] = (),
) -> list[experiments.Run]:
    runs = experiments.experiment(experiment, lrs, methods, text)
    if only:
        runs = [r for r in runs if re.search(only, r.name)]
    for r in runs:
        r.flags = [f.format(run_root=run_root, ep=ep, mbs=mbs) for f in r.flags] + list(extra)
    return runs


def site_options(args) -> list[str]:
    """sbatch options of the site: GPUs per node, account, partition (where given)."""
    out = [f"--gpus-per-node={args.gpus_per_node}"] if args.gpus_per_node else []
    out += [f"--account={args.account}"] if args.account else []
    return out + ([f"--partition={args.partition}"] if args.partition else [])


def exports(args, run_root: str, **more) -> str:
    """sbatch's ``--export``: the whole environment (the site's knobs) plus the run's; every
    job requeues itself at its time limit unless ``--no-requeue`` (launch.sbatch's REQUEUE)."""
    env = {"RUN_ROOT": run_root, **more, "REQUEUE": "0" if args.no_requeue else "1"}
    if args.mock_data:  # a value with spaces: sbatch splits --export at commas only
        env["DATA_ARGS"] = MOCK_DATA
    return "--export=ALL," + ",".join(f"{k}={v}" for k, v in env.items())


def sbatch_command(run: experiments.Run, args, run_root: str, dependency: str | None) -> list[str]:
    nodes = run.meta.get("nodes", args.nodes)
    cmd = [
        "sbatch",
        f"--job-name={run.name}",
        f"--nodes={nodes}",
        f"--time={args.time}",
        f"--output={run_root}/logs/%x-%j.out",
        exports(args, run_root, RUN_NAME=run.name),
        *site_options(args),
    ]
    if dependency:
        cmd.append(f"--dependency=afterok:{dependency}")
    return [*cmd, str(LAUNCHER), *run.flags]


def array_command(runs: list, args, run_root: str, tasks: Path) -> list[str]:
    """One ``sbatch --array`` for ``runs`` (all on the same number of nodes): task i runs line
    i + 1 of ``tasks`` (launch.sbatch reads it); ``--array-max`` runs at once at most."""
    nodes = {r.meta.get("nodes", args.nodes) for r in runs}
    if len(nodes) != 1:
        sys.exit(f"[sweep] --array: the runs need {sorted(nodes)} nodes; one array takes one "
                 "size: submit each with --only")  # fmt: skip
    spec = f"0-{len(runs) - 1}" + (f"%{args.array_max}" if args.array_max else "")
    cmd = ["sbatch", f"--job-name={args.experiment}", f"--array={spec}",
           f"--nodes={nodes.pop()}", f"--time={args.time}",
           f"--output={run_root}/logs/%x-%A_%a.out", *site_options(args),
           exports(args, run_root, ARRAY_TASKS=tasks)]  # fmt: skip
    return [*cmd, str(LAUNCHER)]


def queued_jobs() -> dict[str, str]:
    """Job id -> state of this user's jobs that SLURM still holds (pending, running, …); array
    tasks one by one (``ARRAYID_TASK``)."""
    try:
        out = subprocess.run(["squeue", "-h", "-r", "--me", "-o", "%i %T"], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)


def read_manifest(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"runs": []}


def write_manifest(path: Path, data: dict) -> None:
    """Atomically (a crash mid-write never leaves a torn manifest)."""
    from megatron.md.train.files import write_whole

    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(str(path), json.dumps(data, indent=1))


def finished(entry: dict) -> bool:
    """The run's ``finished`` marker names at least its ``--train-iters``: a run continued
    with more iterations (the experiment's count raised, then ``--resume``) is not finished by
    the shorter run's marker (the run removes such a marker at its start)."""
    from megatron.md.launch import flag_value
    from megatron.md.train.files import read_count

    marker = Path(entry["run_dir"]) / "finished"
    if not marker.is_file():
        return False
    done, total = read_count(str(marker)), flag_value(entry.get("flags", []), "--train-iters")
    return done is not None and (not total or done >= int(total))


def run_state(entry: dict, jobs: dict[str, str]) -> str:
    run_dir = Path(entry["run_dir"])
    if finished(entry):
        return "finished"
    if entry.get("job_id") in jobs:
        return jobs[entry["job_id"]].lower()
    tracker = run_dir / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        return f"stopped at iteration {tracker.read_text().strip()}"
    return "not started" if entry.get("job_id") else "not submitted"


#: the data arguments ``--mock-data`` gives every job (megatron's mock data, the paper's vocab)
MOCK_DATA = "--mock-data --tokenizer-type NullTokenizer --vocab-size 131072"


def data_args(mock: bool, runs: list) -> list[str]:
    """The site's DATA_ARGS as the jobs will get them (``MOCK_DATA`` with ``--mock-data``);
    unset without ``--mock-data``: refused, every job would start without data, unless every
    run brings its own mock data (the smoke experiment)."""
    given = os.environ.get("DATA_ARGS", "").strip()
    if not (mock or given) and all("--mock-data" in r.flags for r in runs):
        return []
    if mock:
        if given:
            sys.exit("[sweep] DATA_ARGS is set and --mock-data asks for mock data: choose one")
        return shlex.split(MOCK_DATA)
    if not given:
        sys.exit("[sweep] DATA_ARGS is not set: every job would start without data. Set it "
                 "(examples/md_decoupling/site_env.example: --data-path ... --tokenizer-model "
                 "...), or pass --mock-data to train on megatron's mock data on purpose; "
                 "nothing was submitted")  # fmt: skip
    return shlex.split(given)


#: what launch.sbatch puts before a run's flags when the site leaves its knob unset (its
#: "knobs"; tests/test_sweep.py holds these to the script): bf16 on a cluster, ZeRO-1
LAUNCHER_PRECISION, LAUNCHER_DIST = "--bf16", "--use-distributed-optimizer"


def launcher_args() -> list[str]:
    """The arguments launch.sbatch gives a SLURM job before the run's own, from the site's
    knobs as the job will see them (sbatch exports this environment): precision
    (``${PRECISION_ARGS-…}``: set and empty stays empty), the distributed optimizer
    (``${DIST_ARGS:-…}``) and logging."""
    prec = os.environ.get("PRECISION_ARGS", LAUNCHER_PRECISION)
    dist = os.environ.get("DIST_ARGS") or LAUNCHER_DIST
    return shlex.split(prec) + shlex.split(dist) + shlex.split(os.environ.get("LOG_ARGS", ""))


def unseen_paths(data: list[str]) -> list[str]:
    """Data files and tokenizer folders DATA_ARGS names that this node cannot see."""
    from megatron.md.train.datacheck import data_prefixes

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--data-path", nargs="*", default=[])
    ap.add_argument("--tokenizer-type")
    ap.add_argument("--tokenizer-model")
    known, _ = ap.parse_known_args(data)
    out = [p + ext for p in data_prefixes(known.data_path) for ext in (".bin", ".idx")
           if not os.path.isfile(p + ext)]  # fmt: skip
    tok = known.tokenizer_model
    if known.tokenizer_type == "HuggingFaceTokenizer" and tok:
        if not os.path.isfile(os.path.join(tok, "tokenizer.json")):
            out.append(tok)
    return out


def validate(runs: list[experiments.Run], data: list[str]) -> None:
    """Parse every distinct command (numeric values aside) as the job would, on this node,
    with the jobs' data arguments ``data``; where this node cannot see the data or tokenizer,
    the flags only (the files are checked when each job starts)."""
    try:
        from megatron.md import cpu_mode

        cpu_mode.maybe_activate()  # a login node without CUDA parses as a CPU run would
        import megatron.training.global_vars as gv

        from megatron.md.train import cli
    except ImportError as e:
        sys.exit(f"[sweep] this Python ({sys.executable}) cannot import torch and megatron-core "
                 f"({e}), so the commands cannot be validated here: run sweep.py with the "
                 "Python of the image or venv the jobs use, or pass --no-validate to submit "
                 "without validation; nothing was submitted")  # fmt: skip

    unseen = unseen_paths(data)
    site = list(data)
    if unseen:
        print(f"[sweep] not visible on this node: {', '.join(unseen)}; the flags are checked "
              "here, the data and tokenizer when each job starts", file=sys.stderr)  # fmt: skip
        site = shlex.split(MOCK_DATA)  # megatron builds the tokenizer while parsing
    # what the launcher gives the job before the run's flags (a run's own win): data,
    # precision, distributed optimizer, logging, checkpointing (its --save-interval)
    first = [*site, *launcher_args(), "--save=/nonexistent-run-dir",
             "--load=/nonexistent-run-dir",
             f"--save-interval={os.environ.get('SAVE_INTERVAL') or 1000}"]  # fmt: skip
    seen = set()
    saved = dict(os.environ), list(sys.argv)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        for run in runs:
            key = tuple(re.sub(r"=[0-9.e+-]+$", "=N", f) for f in run.flags)
            if key in seen or any(f.startswith("--init-from") for f in run.flags):
                continue  # (an --init-from source exists only once its job ran)
            seen.add(key)
            gv.unset_global_variables()
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # megatron prints every arg
                    cli.parse(first + run.flags, on_cpu=True, check_save=False)
            except SystemExit as e:
                sys.exit(f"[sweep] {run.name}: its command does not validate: {e.code}\n"
                         "[sweep] nothing was submitted")  # fmt: skip
    finally:
        gv.unset_global_variables()
        os.environ.clear()
        os.environ.update(saved[0])
        sys.argv[:] = saved[1]


def _tail_rows(metrics: Path, nbytes: int = 1 << 18) -> list[dict]:
    """The train rows among the last ``nbytes`` of a metrics JSONL (a run's log can be long)."""
    size = metrics.stat().st_size
    with metrics.open("rb") as f:
        f.seek(max(0, size - nbytes))
        lines = f.read().decode(errors="replace").splitlines()
    rows = []
    for ln in lines[1:] if size > nbytes else lines:  # (the first line read may be cut)
        try:
            r = json.loads(ln)
        except ValueError:  # a line being written
            continue
        if r.get("type") == "train":
            rows.append(r)
    return rows


def progress(entry: dict, running: bool) -> tuple[int, int, str] | None:
    """(iterations logged, --train-iters, a note) of a run from its metrics: the last logged
    iteration and, running, an ETA from the median step time of the last 20 logged steps."""
    from megatron.md.launch import flag_value

    total = flag_value(entry.get("flags", []), "--train-iters")
    total = int(total) if total else None
    metrics = Path(entry["run_dir"]) / "metrics.jsonl"
    rows = _tail_rows(metrics) if total and metrics.is_file() else []
    if not rows:
        return None
    done = int(rows[-1]["iteration"])
    steps = sorted(r["step_s"] for r in rows[-20:] if r.get("step_s"))
    note = f"iteration {done:,}/{total:,} ({100 * done / total:.0f} %)"
    if running and steps:
        note += f" · ETA {duration(steps[len(steps) // 2] * max(total - done, 0))}"
    return done, total, note


def status(args) -> None:
    manifest = args.manifest or Path(args.run_root or ".") / "manifest.json"
    data = read_manifest(manifest)
    if not data["runs"]:
        sys.exit(f"[sweep] no runs in {manifest}")
    jobs = queued_jobs()
    counts: dict[str, int] = {}
    done = total = 0
    for e in data["runs"]:
        st = run_state(e, jobs)
        counts[st.split(" at ")[0]] = counts.get(st.split(" at ")[0], 0) + 1
        got = None if st == "finished" else progress(e, running=st == "running")
        if got is not None:
            done, total = done + got[0], total + got[1]
            st += "" if st.startswith("stopped at") else " · " + got[2]
        print(f"{e['name']:<60} {e.get('job_id') or '-':>8}  {st}")
    line = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    if total:  # over the runs not finished
        line += f"; unfinished runs at {done:,}/{total:,} iterations ({100 * done / total:.0f} %)"
    print("[sweep] " + line, file=sys.stderr)


def submitted_before(prior: list[dict], path: Path) -> str:
    """The refusal of a second submission without ``--resume``: it would queue every run again
    beside the first jobs (two jobs training in one run directory) and replace the manifest
    that holds their job ids."""
    jobs = queued_jobs()
    states = [run_state(e, jobs).split(" at iteration")[0] for e in prior]
    counts = ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states))
    return (f"{path} already lists {len(prior)} submitted runs ({counts}): --resume submits "
            "only those neither finished nor queued (and keeps the manifest's other entries); "
            "another --run-root starts afresh")  # fmt: skip


def skip_state(prev: dict | None, jobs: dict[str, str], flags: list[str]) -> str | None:
    """Why a run of an earlier submission is not submitted again (None: it is); ``flags``: the
    run's flags now (finished as they ask)."""
    if not prev:
        return None
    state = run_state({**prev, "flags": flags}, jobs)
    return state if state == "finished" or prev.get("job_id") in jobs else None


def submit_array(runs: list, args, run_root: str, manifest: dict, path: Path) -> dict:
    """``runs`` as one job array; their manifest entries (job id ``ARRAYID_TASK``, log file)
    written at once. Returns run name -> job id (None on a dry run)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tasks = Path(run_root) / "arrays" / f"{args.experiment}-{stamp}.tasks"
    cmd = array_command(runs, args, run_root, tasks)
    lines = "".join(shlex.join([r.name, *r.flags]) + "\n" for r in runs)
    array_id = None
    if args.dry_run:
        print("would submit: " + shlex.join(cmd))
        print(lines, end="")
    else:
        tasks.parent.mkdir(parents=True, exist_ok=True)
        tasks.write_text(lines)
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        m = re.search(r"Submitted batch job (\d+)", out.stdout)
        if out.returncode != 0 or not m:
            why = out.stderr.strip() or out.stdout
            sys.exit(f"sbatch --array failed: {why}\n[sweep] nothing of the array was submitted")
        array_id = m.group(1)
    ids = {}
    for i, r in enumerate(runs):
        ids[r.name] = job = array_id and f"{array_id}_{i}"
        log = job and f"{run_root}/logs/{args.experiment}-{job}.out"
        manifest["runs"].append({"name": r.name, "job_id": job, "flags": r.flags, "meta": r.meta,
                                 "run_dir": f"{run_root}/{r.name}", "log": log})  # fmt: skip
        if job:
            print(f"{r.name}: job {job}")
    if not args.dry_run:
        write_manifest(path, manifest)
    return ids


def list_experiments() -> None:
    """Each experiment's runs, GPU-hours and checkpoint disk (``experiments.gpu_hours``,
    ``experiments.checkpoint_bytes``: estimates)."""
    print(f"{'experiment':<26} {'runs':>5} {'GPU-hours':>10} {'checkpoints TB':>15}")
    total = disk = 0.0
    for name in experiments.EXPERIMENTS:
        runs = experiments.experiment(name)
        hours = sum(experiments.gpu_hours(r) for r in runs)
        tb = sum(experiments.checkpoint_bytes(r) for r in runs) / 1e12
        total, disk = total + hours, disk + tb
        print(f"{name:<26} {len(runs):>5} {hours:>10,.0f} {tb:>15,.1f}")
    print(f"{'all':<26} {'':>5} {total:>10,.0f} {disk:>15,.1f}")
    print(f"(GPU-hours estimated: training FLOPs at {experiments.MFU:.0%} of an H100's bf16 "
          "peak; tools/throughput.py measures the real rate. Checkpoints: those kept when the "
          "runs end, bf16, ZeRO-1)", file=sys.stderr)  # fmt: skip


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("experiment", nargs="?", help="one of --list, or 'status'")
    ap.add_argument("--list", action="store_true", help="print the experiments and their sizes")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be submitted; writes nothing (no manifest, no logs)",
    )
    ap.add_argument("--resume", action="store_true", help="skip finished and queued runs")
    ap.add_argument(
        "--no-validate",
        action="store_true",
        help="submit without parsing the commands on this node first (e.g. a login "
        "node without torch)",
    )
    ap.add_argument(
        "--mock-data",
        action="store_true",
        help="every job on megatron's mock data (DATA_ARGS must be unset)",
    )
    ap.add_argument(
        "--no-requeue",
        action="store_true",
        help="jobs stopped by their time limit are not requeued (REQUEUE=0)",
    )
    ap.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=None,
        help="matrix-LR grid (default 1e-3*2^(k/2), k=0..8, and the authors' runs' LRs past "
        f"it: {', '.join(experiments.past_grid())}); the one-LR arms of "
        f"{', '.join(experiments.one_lr_arms())} run only where the grid includes "
        f"{experiments.fmt(experiments.SIDE_MATRIX_LR)}; moe-base-sweep's default is the "
        "authors' grid per method, experiments.MOE_GRIDS; given, one grid for every method",
    )
    ap.add_argument(
        "--methods",
        nargs="+",
        choices=experiments.METHODS,
        help="dense-grid's or a dense ablation's methods in place of those the paper ran "
        "(e.g. adammd muonmd); the analysis's --only then names them",
    )
    ap.add_argument(
        "--paper-text",
        action="store_true",
        help="the paper's text where it differs from the authors' runs (the default), for the "
        "experiments experiments.TEXT_READINGS names; run root runs/<experiment>-paper-text",
    )
    ap.add_argument(
        "--flags",
        default="",
        help="pretrain_gpt.py flags added to every run's (one string, split as a shell would; "
        "they come last, so they win), e.g. --flags=--no-rope-scaling to continue dense-preset "
        "runs started before the presets scaled RoPE (MD's --md-* flags are refused for the "
        "plain runs: choose runs with --only or --methods)",
    )
    ap.add_argument("--only", help="regular expression on run names")
    ap.add_argument("--nodes", type=int, default=int(os.environ.get("NODES", 1)))
    ap.add_argument("--time", default=os.environ.get("TIME_LIMIT", "24:00:00"))
    ap.add_argument("--account", default=os.environ.get("SBATCH_ACCOUNT"))
    ap.add_argument("--partition", default=os.environ.get("SBATCH_PARTITION"))
    ap.add_argument(
        "--gpus-per-node",
        type=int,
        default=int(os.environ.get("GPUS_PER_NODE", 4)),
        help="sbatch --gpus-per-node (0: none, e.g. a CPU-only cluster)",
    )
    ap.add_argument(
        "--array",
        action="store_true",
        help="submit the runs as one SLURM job array (runs with a dependency apart)",
    )
    ap.add_argument(
        "--array-max",
        type=int,
        default=None,
        help="with --array: at most this many runs at once (sbatch --array=…%%N)",
    )
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
        return list_experiments()
    if args.experiment == "status":
        return status(args)
    if args.experiment not in experiments.EXPERIMENTS:
        known = ", ".join(experiments.EXPERIMENTS)
        ap.error(f"experiment {args.experiment!r} is not one of {known}")
    default_root = args.experiment + ("-paper-text" if args.paper_text else "")
    run_root = os.path.abspath(args.run_root or ROOT / "runs" / default_root)
    try:
        runs = plan(args.experiment, args.lrs, run_root, args.ep, args.only,
                    args.micro_batch_size, args.methods, args.paper_text,
                    shlex.split(args.flags))  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    if not runs:
        ap.error(f"--only {args.only!r} matches no run of {args.experiment}")
    manifest_path = args.manifest or Path(run_root) / "manifest.json"
    prior = read_manifest(manifest_path)["runs"]
    if prior and not args.resume:
        again = submitted_before(prior, manifest_path)
        if not args.dry_run:
            ap.error(again)
        print(f"[sweep] note: {again}", file=sys.stderr)
    data = data_args(args.mock_data, runs)
    if not args.no_validate:
        validate(runs, data)
    old = {e["name"]: e for e in prior} if args.resume else {}
    jobs = queued_jobs() if args.resume else {}
    git = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    planned = {r.name for r in runs}  # runs --only left out keep their entries
    manifest = {"experiment": args.experiment, "created": time.time(), "git": git,
                "runs": [e for e in old.values() if e["name"] not in planned]}  # fmt: skip
    if not args.dry_run:
        (Path(run_root) / "logs").mkdir(parents=True, exist_ok=True)
    job_ids: dict[str, str | None] = {}
    skipped = 0
    if args.array:  # first the array, then runs that wait for another one by one
        pending = [r for r in runs if not r.meta.get("after")
                   and not skip_state(old.get(r.name), jobs, r.flags)]  # fmt: skip
        if pending:
            job_ids.update(submit_array(pending, args, run_root, manifest, manifest_path))
    for run in runs:
        if run.name in job_ids and args.array:
            continue
        entry = {"name": run.name, "job_id": None, "flags": run.flags, "meta": run.meta,
                 "run_dir": f"{run_root}/{run.name}"}  # fmt: skip
        prev = old.get(run.name)
        state = skip_state(prev, jobs, run.flags)
        if state:
            entry["job_id"] = prev.get("job_id")
            if prev.get("log"):  # an array task's log is named by the array, not the run
                entry["log"] = prev["log"]
            job_ids[run.name] = entry["job_id"] if state != "finished" else None
            print(f"{run.name}: {state}, not submitted again")
            skipped += 1
        else:
            cmd = sbatch_command(run, args, run_root, job_ids.get(run.meta.get("after")))
            if args.dry_run:
                print("would submit: " + shlex.join(cmd))
            else:
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                m = re.search(r"Submitted batch job (\d+)", out.stdout)
                if out.returncode != 0 or not m:
                    manifest["runs"].append(entry)
                    write_manifest(manifest_path, manifest)
                    why = out.stderr.strip() or out.stdout
                    sys.exit(f"sbatch failed for {run.name}: {why}\n[sweep] the jobs "
                             f"submitted so far are in {manifest_path}")  # fmt: skip
                entry["job_id"] = m.group(1)
                print(f"{run.name}: job {entry['job_id']}")
            job_ids[run.name] = entry["job_id"]
        manifest["runs"].append(entry)
        if not args.dry_run:
            write_manifest(manifest_path, manifest)
    done = len(runs) - skipped
    if args.dry_run:
        print(f"[sweep] dry run: {done} would be submitted, {skipped} skipped; nothing written",
              file=sys.stderr)  # fmt: skip
        beside_note(args.experiment)
        return
    print(f"[sweep] {done} submitted, {skipped} skipped; manifest: {manifest_path}",
          file=sys.stderr)  # fmt: skip
    beside_note(args.experiment)


def beside_note(experiment: str) -> None:
    """Says which other experiments' runs this one's figures read (not submitted here)."""
    if others := experiments.reads_beside(experiment):
        print(f"[sweep] note: {experiment}'s figures also read the runs of "
              f"{', '.join(others)}, which this does not submit (docs/experiments.md)",
              file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
