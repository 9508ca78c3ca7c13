"""Everything a GPU can show about Megatron-MD, in two commands (~12 minutes), with
one dated report (markdown and JSON: device, driver, torch, megatron-core, emerging-optimizers,
commit):

1. correctness: ``tests/distributed/md_check.py --device cuda`` in every layout it knows
   (ZeRO-1 dense and MoE, layer-wise MuonMD and AdamMD, replicated; Q/K/V split and not; fp32
   and bf16) against the reference, and MD off against megatron's own optimizers bit for bit
   (Muon: to fp32 rounding, the batched Newton–Schulz runs another cuBLAS kernel);
2. step cost: ``tools/bench_dispatch.py`` (dispatched ops, host syncs, bytes moved, matrix
   products' FLOPs by dtype) and ``tools/bench_md_step.py`` at 181M, 457M and 1.29B
   (AdamMD/Adam and MuonMD/Muon, bf16: the default step, compiled at these sizes), the step
   replayed from a CUDA graph at 181M (``--md-cuda-graph``: ``*_md_graph``), and where one
   step's time goes at 181M and 1.29B (``--profile``: kernel time against wall time and the ten
   costliest kernels of Adam, AdamMD, Muon and MuonMD); the correctness layouts include the
   graph's (``md_check.py --cuda-graph``, a moving LR);
3. end to end: ``tools/throughput.py`` on ``dense-181M`` (AdamW, Muon, AdamMD and MuonMD as
   by default and with ``--md-cuda-graph``, AdamW again last: the spread between two runs;
   bf16, local layer spec, tokens/s medians after warm-up), and a save at iteration N and a resume
   that must repeat the first run's losses exactly (both in megatron's ``--deterministic-mode``:
   without it two identical runs part on a GPU), AdamMD's with its step in a CUDA graph
   (``--md-cuda-graph``) and MuonMD's without, with the long-run checks (sphere drift, finite
   gains) on their logs;
4. Transformer Engine, if it imports: the TE spec builds and trains a few iterations, dense
   and MoE.

    python tools/gpu_check.py                      # on a GPU machine: run, write the report
    python tools/gpu_check.py --only correctness step-cost
    python tools/gpu_check.py --dry-run            # the plan; also what runs without CUDA

Without CUDA it prints the plan, checks that every flag it would pass still exists in the
script it calls (exit 1 if not: the plan cannot rot unseen), and exits 0. Steps run in order
while the budget (``--budget-s``) has room for their time cap; a step past it is reported as
skipped. What the GPU machine needs from here: docs/benchmarks.md, "Running the GPU check".
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
#: the same bounds as tests/test_distributed_md.py (fp32 relative error, bf16 excess rounding)
FP32_REL, BF16_EXCESS = 1e-6, 1e-6
#: the lines a report shows of a step's output (``Step.shows``), not its log's last lines (the
#: first GPU report lost the 181M and 457M step-cost rows, 2026-11-25; the H100's of 2026-11-26
#: AdamW's and Muon's throughput rows): bench_md_step.py's table (title, header, rows: model,
#: dtype, two spaces); --profile's lines; throughput.py's table (heading, header, rows: a
#: method, then its tokens/s) and any run that failed
STEP_COST_LINES = r"MD optimizer-step cost|model |\S+ (bf16|fp32) {2,}\S"
PROFILE_LINES = r"prof "
THROUGHPUT_LINES = (r"## |method \| |--- \||[a-z][a-z0-9-]* \| [0-9,.]+ \| "
                    r"|\[throughput\] (wrote|failed|\S+ failed \(exit)")  # fmt: skip
#: the resume step's runs save here and train as many iterations again
SAVED_AT = 12


@dataclass
class Step:
    """One command of the plan."""

    name: str
    """Report section: correctness, dispatch, step-cost, throughput, resume, te."""
    script: str
    """The script it runs, relative to the repository root (its flags are checked against it)."""
    args: list[str]
    """Its arguments; ``{out}`` is this step's output folder."""
    cap_s: int
    """Time cap: the step is killed past it, and skipped when the budget has less left."""
    torchrun: bool = False
    """Launched under ``torch.distributed.run`` with one process (one GPU)."""
    needs_te: bool = False
    """Only when Transformer Engine imports."""
    notes: list[str] = field(default_factory=list)
    """What the report says of it besides its output."""
    resumes: str | None = None
    """A resumed run: its losses must repeat those of the run ``<resumes>-a.jsonl``."""
    shows: str | None = None
    """The lines of its output the report shows (a regex matched at each line's start; None,
    or none matching: the last 12)."""
    fresh: list[str] = field(default_factory=list)
    """What it writes from scratch, under ``{out}``: removed before it runs (a second check
    into the same folder; pretrain_gpt.py refuses a --save holding a run it does not resume,
    and its metrics file is appended to)."""


_LW_MUON = ["--optimizer", "muon", "--dist", "layerwise"]
_GRAPH = ["--cuda-graph", "--lr-decay", "--steps", "8"]
#: md_check.py jobs (one launch, joined by ``+``, pays megatron's import once)
MD_JOBS = [
    ["--dist", "zero1"],
    ["--dist", "zero1", "--dtype", "bf16"],
    ["--dist", "zero1", "--dtype", "bf16", "--experts", "4"],
    [*_LW_MUON],
    [*_LW_MUON, "--dtype", "bf16", "--experts", "4"],
    [*_LW_MUON, "--no-split-qkv"],
    ["--optimizer", "adam", "--dist", "layerwise", "--dtype", "bf16"],
    ["--optimizer", "adam", "--dist", "replicated"],
    ["--optimizer", "muon", "--dist", "replicated", "--dtype", "bf16"],
    # the compiled step (--md-fused-step on; the default on a GPU at scale, md_check's models
    # being too small for auto to choose it)
    ["--dist", "zero1", "--fused-step"],
    ["--dist", "zero1", "--dtype", "bf16", "--experts", "4", "--fused-step"],
    ["--optimizer", "adam", "--dist", "replicated", "--fused-step"],
    [*_LW_MUON, "--dtype", "bf16", "--fused-step"],
    [*_LW_MUON, "--dtype", "bf16", "--experts", "4", "--fused-step"],
    ["--vs", "megatron", "--dist", "zero1"],
    ["--vs", "megatron", "--dist", "zero1", "--dtype", "bf16", "--experts", "4"],
    ["--vs", "megatron", *_LW_MUON, "--dtype", "bf16", "--experts", "4"],
    ["--vs", "megatron", "--optimizer", "adam", "--dist", "replicated"],
    ["--vs", "megatron", "--optimizer", "muon", "--dist", "replicated"],
    # --md-cuda-graph: 3 eager steps, a capture, 4 replays, the LR moving at every step (last:
    # a capture that fails ends the launch, and must not take the jobs above with it)
    ["--dist", "zero1", "--dtype", "bf16", "--fused-step", *_GRAPH],
    ["--dist", "zero1", "--dtype", "bf16", "--experts", "4", *_GRAPH],
    [*_LW_MUON, "--dtype", "bf16", *_GRAPH],
]


def _joined(jobs: list[list[str]]) -> list[str]:
    out: list[str] = []
    for j in jobs:
        out += [*(["+"] if out else []), *j, "--device", "cuda"]
    return out


def _pretrain_flags(preset: str, iters: int, method_flags: list[str]) -> list[str]:
    return [
        f"--preset={preset}",
        *method_flags,
        "--mock-data",
        "--tokenizer-type=NullTokenizer",
        f"--train-iters={iters}",
        "--lr-warmup-iters=0",
        "--log-interval=1",
        "--eval-iters=0",
        f"--eval-interval={iters + 1}",
        "--bf16",
        "--transformer-impl=local",
        "--micro-batch-size=4",
        "--global-batch-size=4",
        "--seq-length=1024",
        "--max-position-embeddings=1024",
        "--vocab-size=8192",  # the tiny presets' vocabulary
    ]


def plan() -> list[Step]:
    """The steps, in the order they run (about 12 minutes on one H200 in all: two calls)."""
    adammd = ["--optimizer=adam", "--md-decoupling", "--lr=3e-3"]
    muonmd = ["--optimizer=muon", "--md-decoupling", "--lr=3e-3", "--matrix-lr=2e-2"]
    steps = [
        Step("correctness", "tests/distributed/md_check.py", _joined(MD_JOBS), 150, torchrun=True),
        Step("dispatch", "tools/bench_dispatch.py",
             ["--rounds", "10", "--json", "{out}/dispatch.json"], 60),
        # 10 steps: at 181M AdamMD's inner step still fell over 5 (8.0 -> 6.9 ms, H200,
        # 2026-12-04); a step costs at most 0.1 s of the check's time, the compiles ~40 s
        Step("step-cost", "tools/bench_md_step.py",
             ["--model", "181M", "457M", "1.29B", "--world", "1", "--dtype", "bf16",
              "--steps", "10", "--runs", "adam", "adam_md", "muon", "muon_md",
              "--json", "{out}/step_cost.json"], 180, shows=STEP_COST_LINES),
        # the default step replayed from a CUDA graph (--md-cuda-graph) at the launch-bound
        # size, against the base; the step-cost rows above are the same step without it (the
        # eager step beside the compiled one: H200, 2026-11-26, docs/benchmarks.md; run
        # bench_md_step.py --runs adam adam_md_eager muon muon_md_eager to see it again);
        # and AdamMD's phase 1 and fuse one compiled call each (adam_md_merged: 2 calls a
        # step at 181M, 4 by default) - whether the ~2.4 GB more its first step's check
        # copies buy host time worth having
        Step("step-cost", "tools/bench_md_step.py",
             ["--model", "181M", "--world", "1", "--dtype", "bf16", "--steps", "8",
              "--runs", "adam", "adam_md_graph", "adam_md_merged", "muon", "muon_md_graph",
              "--json", "{out}/step_graph.json"], 120, shows=STEP_COST_LINES,
             notes=["the MD step replayed from a CUDA graph (*_md_graph, --md-cuda-graph); "
                    "adam_md_merged: compiled.MERGE_ELEMENTS 2^28"]),
        # where one step's time goes, base against MD: at 181M whether AdamMD's compiled step
        # is host-bound (wall time against kernel time), at 1.29B which kernels make MuonMD's
        # step (the H100, 2026-11-26: a batched dot as a cuBLAS mat-vec, 34 of 138 ms; gone)
        Step("profile", "tools/bench_md_step.py",
             ["--profile", "--model", "181M", "1.29B", "--world", "1", "--dtype", "bf16"], 200,
             shows=PROFILE_LINES),
        Step("throughput", "tools/throughput.py",
             ["--preset", "dense-181M", "--iters", "20", "--warmup", "8", "--nproc", "1",
              "--seq-length", "2048", "--methods", "adamw", "muon", "adammd", "muonmd",
              "adammd-graph", "muonmd-graph", "adamw-again",
              "--out", "{out}", "--", "--transformer-impl=local"], 300,
             shows=THROUGHPUT_LINES),
    ]  # fmt: skip
    # AdamMD's step replayed from a CUDA graph (--md-cuda-graph) through the save and the
    # resume (first run through a --load on an H200, 2026-12-04: bit for bit);
    # MuonMD's pair is the same runs without it (AdamMD's compiled resume without the graph
    # was exact on the H100, 2026-11-26)
    for name, flags in (("adammd-graph", [*adammd, "--md-cuda-graph"]), ("muonmd", muonmd)):
        # 24 iterations: tools/long_run_check.py reads at least 20 losses
        # --deterministic-mode: without it two identical runs from scratch on the H200 parted
        # at iteration 2 (2026-11-26; F.embedding's backward and cuBLAS's workspace), so
        # a resume could not be held to bit for bit
        # --md-fused-step on: the GPU's default at scale (tiny is below it); the eager step's
        # resume was exact on the H200 (2026-11-26)
        first = [*_pretrain_flags("tiny", 2 * SAVED_AT, flags), "--save={out}/%s" % name,
                 f"--save-interval={SAVED_AT}", "--deterministic-mode",
                 "--md-fused-step=on"]  # fmt: skip
        steps += [
            Step("resume", "pretrain_gpt.py",
                 # 90 s: the first run (launch, compile, 24 iterations, two saves) took 60 s
                 # on the H100 (2026-11-26) and was cut off at its old 60 s cap
                 [*first, "--metrics-file={out}/%s-a.jsonl" % name], 90, torchrun=True,
                 notes=[f"{name}: {2 * SAVED_AT} iterations, saved at {SAVED_AT}"],
                 fresh=[name, f"{name}-a.jsonl", f"{name}-b.jsonl"]),
            Step("resume", "pretrain_gpt.py",
                 # the first run saved at the end too: load the middle one, not the latest
                 [*first, "--load={out}/%s" % name, f"--ckpt-step={SAVED_AT}",
                  "--metrics-file={out}/%s-b.jsonl" % name],
                 90, torchrun=True, resumes=name,
                 notes=[f"{name}: resumed at {SAVED_AT}, must repeat the iterations after it"]),
        ]  # fmt: skip
    steps.append(
        Step(
            "resume",
            "tools/long_run_check.py",
            ["--check", "{out}/adammd-graph-a.jsonl", "{out}/muonmd-a.jsonl"],
            30,
        )
    )
    for preset in ("tiny", "tiny-moe"):
        te = [f for f in _pretrain_flags(preset, 3, adammd) if not f.startswith("--transformer")]
        steps.append(
            Step(
                "te",
                "pretrain_gpt.py",
                [*te, "--transformer-impl=transformer_engine"],
                60,
                torchrun=True,
                needs_te=True,
                notes=[f"TE spec, {preset}"],
            )
        )
    return steps


def stale_flags(steps: list[Step]) -> list[str]:
    """Flags of the plan that the script they go to no longer mentions (``--flag`` as a string
    in its source, or in megatron's parser for pretrain_gpt.py, whose flags are megatron's)."""
    bad = []
    for s in steps:
        path = ROOT / s.script
        if not path.exists():
            bad.append(f"{s.name}: {s.script} does not exist")
            continue
        if s.script == "pretrain_gpt.py":
            continue  # megatron's and our flags: tests/test_pretrain_flags.py parses them
        src = path.read_text()
        if s.script == "tools/throughput.py":
            args = s.args[: s.args.index("--")] if "--" in s.args else s.args
        else:
            args = s.args
        for a in args:
            flag = a.split("=", 1)[0]
            if flag.startswith("--") and f'"{flag}"' not in src:
                bad.append(f"{s.name}: {s.script} has no {flag}")
    return bad


def clear_fresh(s: Step, out: Path) -> None:
    """Remove what ``s`` writes from scratch (``Step.fresh``)."""
    for name in s.fresh:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _command(s: Step, out: Path) -> list[str]:
    args = [a.replace("{out}", str(out)) for a in s.args]
    if s.torchrun:
        return [PY, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-port=29517",
                str(ROOT / s.script), *args]  # fmt: skip
    return [PY, str(ROOT / s.script), *args]


def _versions() -> dict:
    import importlib.metadata as md

    import torch

    got = {"date": dt.date.today().isoformat(), "torch": torch.__version__, "cuda": None}
    for pkg in ("megatron-core", "emerging-optimizers", "transformer-engine", "nvidia-ml-py"):
        try:
            got[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            got[pkg] = None
    if torch.cuda.is_available():
        got["cuda"] = torch.version.cuda
        got["device"] = torch.cuda.get_device_name()
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)  # fmt: skip
        got["driver"] = smi.stdout.strip() or None
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)  # fmt: skip
    got["commit"] = rev.stdout.strip() or None
    return got


def _te_imports() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def verdict(step: Step, rc: int, output: str, out: Path) -> tuple[bool, list[str]]:
    """Whether a finished step passed, and the lines the report shows for it."""
    lines = [f"exit {rc}"]
    ok = rc == 0
    if step.name == "correctness":
        got = _json_lines(output)
        ok &= len(got) == len(MD_JOBS)
        for job, res in zip(MD_JOBS, got):
            if "megatron" in job and "muon" in job:
                # the engine's one batched Newton–Schulz per shape runs another cuBLAS kernel
                # than megatron's one per matrix: in fp32 an fp32 rounding apart on a GPU
                # (H100, 2026-11-25: 3.5e-6 of the largest entry after one call, 2.7e-7 on
                # the weights), bit for bit on a CPU (tests/test_distributed_md.py)
                good = res["worst_rel"] <= FP32_REL
            elif "megatron" in job:
                good = res["worst_rel"] == 0.0
            elif "bf16" in job:
                good = res["bf16_excess"] <= BF16_EXCESS and res["worst_dir_rel"] <= FP32_REL
            else:
                good = res["worst_rel"] <= FP32_REL and res["worst_dir_rel"] <= FP32_REL
            if "--cuda-graph" in job:  # every step after the warm-up from the graph
                good &= res.get("graph_replays", 0) >= 5
            ok &= good
            keys = ("worst_rel", "worst_dir_rel", "bf16_excess", "sphere_err")
            nums = ", ".join(f"{k} {res[k]:.3g}" for k in keys)
            if "--cuda-graph" in job:
                nums += f", graph_replays {res.get('graph_replays')}"
            if "--fused-step" in job:  # which compiled variants the layouts took
                nums += f", kernels {' '.join(res.get('kernels', []))}"
                # groups read by regular pieces of megatron's buffer (an MoE layout)
                nums += f", piece_groups {res.get('piece_groups')}"
            lines.append(f"{'ok ' if good else 'BAD'} {' '.join(job)}: {nums}")
    elif step.resumes:
        a, b = (_losses(out / f"{step.resumes}-{k}.jsonl") for k in ("a", "b"))
        same = sorted(i for i in b if i in a and i > SAVED_AT)
        exact = bool(same) and all(a[i] == b[i] for i in same)
        ok &= exact
        what = "exactly" if exact else "NOT exactly"
        lines.append(f"{step.resumes}: iterations {same} repeated {what}")
    else:
        shown = [x for x in output.splitlines() if step.shows and re.match(step.shows, x)]
        lines += shown or output.strip().splitlines()[-12:]
    return ok, lines


def _losses(path: Path) -> dict[int, float]:
    got = {}
    if path.exists():
        for row in map(json.loads, path.read_text().splitlines()):
            if row.get("type") == "train" and "lm loss" in row:
                got[row["iteration"]] = row["lm loss"]
    return got


def report_md(info: dict, results: list[dict]) -> str:
    head = ", ".join(f"{k} {v}" for k, v in info.items() if v is not None)
    out = [f"# GPU check, {info['date']}", "", head, ""]
    for r in results:
        out += [f"## {r['name']}: {r['status']} ({r['seconds']:.0f} s)", "", "```",
                " ".join(map(shlex.quote, r["command"])), *r["lines"], "```", ""]  # fmt: skip
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    names = sorted({s.name for s in plan()})
    ap.add_argument("--only", nargs="+", choices=names, help="run only these sections")
    ap.add_argument("--budget-s", type=int, default=560, help="wall-clock budget of all steps")
    ap.add_argument("--out", type=Path, default=None, help="default runs/gpu_check/<date>")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and check its flags")
    args = ap.parse_args(argv)
    steps = [s for s in plan() if not args.only or s.name in args.only]
    out = (args.out or ROOT / "runs" / "gpu_check" / dt.date.today().isoformat()).resolve()
    bad = stale_flags(steps)
    for b in bad:
        print(f"[gpu_check] stale plan: {b}", file=sys.stderr)
    import torch

    cuda = torch.cuda.is_available()
    if args.dry_run or not cuda:
        if not cuda:
            print("[gpu_check] no CUDA on this machine: dry run of the plan")
        total = 0
        for s in steps:
            total += s.cap_s
            note = f"  ({'; '.join(s.notes)})" if s.notes else ""
            cmd = " ".join(map(shlex.quote, _command(s, out)))
            print(f"[{s.name}] cap {s.cap_s} s{' (if TE imports)' if s.needs_te else ''}{note}")
            print(f"    {cmd}")
        print(f"[gpu_check] {len(steps)} steps, caps {total} s in all, budget {args.budget_s} s")
        return 1 if bad else 0
    if bad:
        return 1
    out.mkdir(parents=True, exist_ok=True)
    info, te = _versions(), _te_imports()
    results, start = [], time.monotonic()
    for s in steps:
        cmd = _command(s, out)
        left = args.budget_s - (time.monotonic() - start)
        res = {"name": s.name, "command": cmd, "seconds": 0.0, "lines": list(s.notes)}
        if s.needs_te and not te:
            res["status"] = "skipped: Transformer Engine does not import"
        elif s.cap_s > left:
            res["status"] = f"skipped: {left:.0f} s of the budget left, cap {s.cap_s} s"
        else:
            t0 = time.monotonic()
            clear_fresh(s, out)
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=s.cap_s, cwd=out)
                rc, text = p.returncode, p.stdout + p.stderr
            except subprocess.TimeoutExpired as e:
                rc, text = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else ""
            res["seconds"] = time.monotonic() - t0
            (out / f"{s.name}-{len(results)}.log").write_text(text)
            ok, lines = verdict(s, rc, text, out)
            res["status"] = "passed" if ok else "FAILED"
            res["lines"] += lines
        print(f"[gpu_check] {s.name}: {res['status']} ({res['seconds']:.0f} s)", flush=True)
        results.append(res)
        # after every step: a call killed from outside still leaves what ran
        (out / "report.json").write_text(json.dumps({"info": info, "steps": results}, indent=1))
        (out / "report.md").write_text(report_md(info, results))
    print(f"[gpu_check] wrote {out}/report.md")
    failed = [r for r in results if r["status"] == "FAILED"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
