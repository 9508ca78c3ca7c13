"""The model's forward-backward in dispatched operations, per method: MD adds none.

MD lives in the optimizer step; the model keeps one fused weight per matrix, so an MD run's
forward-backward must issue exactly the operations of its base's (same model, same data).
This counts every aten operation dispatched inside megatron's forward-backward function (a
``TorchDispatchMode`` around the function ``megatron.training.training`` takes from
``get_forward_backward_func``) in iterations ``--skip``+1 .. ``--skip``+``--iters`` of a real
``pretrain_gpt.py`` run per method (its own process, one rank, ``--jobs`` runs at a time; the
tiny preset, mock data, MD's diagnostics off after iteration 1), and prints per method the
operations of each counted forward-backward and the difference from its base (AdamMD/AdamW,
MuonMD/Muon), and whether the last counted forward-backward issued its base's operations in the
same order on tensors of the same dtype, shape, strides and storage offset (else where the two
part). A method whose run fails, or a forward-backward the patch never saw (megatron moved the
seam), exits 1.

On one H100 (2026-11-26) AdamMD's forward-backward took 124 ms against AdamW's 102 and no
timer said why; this shows whether MD put work into the model (docs/benchmarks.md).

    python tools/fb_dispatch.py [--methods adamw adammd muon muonmd] [--jobs N] [--json F] [-- ...]
    python tools/fb_dispatch.py --methods adamw adammd -- --bf16 --md-fused-step=on  # as on a GPU

Flags after ``--`` reach every method's run, the MD step's (``--md-*``) the MD methods' only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = {"adammd": "adamw", "muonmd": "muon"}
#: the run: tiny and short; diagnostics (every method's hooks) only at iteration 1; batches
#: loaded in this process (worker processes' batches arrive as shared-memory tensors, 2 operations
#: each, inside or outside the counted window as timing has it)
RUN_FLAGS = ["--num-workers=0", "--preset=tiny", "--mock-data", "--tokenizer-type=NullTokenizer",
             "--vocab-size=1024", "--seq-length=64", "--max-position-embeddings=64",
             "--micro-batch-size=2", "--global-batch-size=2", "--log-interval=1",
             "--eval-iters=0", "--use-distributed-optimizer"]  # fmt: skip
MARK = "FB_DISPATCH "


def child(method: str, skip: int, iters: int, extra: list[str]) -> None:
    """In this process: the run with its forward-backward counted; prints one MARK line."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # as pretrain_gpt.py
    from megatron.md import cpu_mode
    from megatron.md.train import recipes
    from megatron.md.train.args import extra_for

    n, tmp = skip + iters, tempfile.TemporaryDirectory()  # the run's metrics file, discarded
    recipe = recipes.dense_recipe(method, 4e-3)
    flags = [*RUN_FLAGS, *recipe, "--lr-warmup-iters=0",
             f"--train-iters={n}", f"--eval-interval={n + 1}", f"--md-log-interval={n + 1}",
             f"--metrics-file={tmp.name}/metrics.jsonl", *extra_for(recipe, extra)]  # fmt: skip
    cpu_mode.start(flags)
    import megatron.training.training as training
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Record(TorchDispatchMode):
        """Each operation with its tensors' layouts, in order (`signature`)."""

        def __init__(self):
            super().__init__()
            self.seq: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = (t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.seq.append(signature(func, tensors))
            return func(*args, **(kwargs or {}))

    seen: list[list[str] | None] = []  # per forward-backward call: its sequence if recorded
    # the seam: megatron-core 0.19.2 megatron/training/training.py:3614 (in train) calls it
    real = training.get_forward_backward_func

    def counted_func(*a, **k):
        fb = real(*a, **k)

        def forward_backward(*args, **kwargs):
            seen.append(None)
            if not skip < len(seen) <= skip + iters:
                return fb(*args, **kwargs)
            with (r := Record()):
                out = fb(*args, **kwargs)
            seen[-1] = r.seq
            return out

        return forward_backward

    training.get_forward_backward_func = counted_func
    from megatron.md.train import cli

    with tmp:
        cli.main(flags)
    counted = seen[skip : skip + iters]
    if len(counted) < iters or not all(counted):
        seam = "megatron.training.training.get_forward_backward_func"
        sys.exit(f"fb_dispatch: counted {len(counted)} of {iters} forward-backward calls "
                 f"({seam} no longer the seam?)")  # fmt: skip
    by_op = collections.Counter(op.split(" ", 1)[0] for op in counted[-1])
    print(MARK + json.dumps({"method": method, "ops": [len(c) for c in counted],
                             "by_op": dict(by_op), "sequence": counted[-1]}),
          flush=True)  # fmt: skip


def signature(func, tensors) -> str:
    """An operation and the layout of every tensor it reads or writes: dtype, shape, strides and
    offset into its storage (a weight or gradient laid out differently runs another kernel, or
    the same one on misaligned memory, under the same operation's name)."""
    return " ".join([str(func), *(
        f"{str(t.dtype)[6:]}{list(t.shape)}/{list(t.stride())}+{t.storage_offset()}"
        for t in tensors)])  # fmt: skip


def first_difference(base: list[str], md: list[str]) -> dict | None:
    """Where two runs' operation sequences part (None: the same operations on the same
    layouts, in the same order)."""
    at = next((i for i, (a, b) in enumerate(zip(base, md)) if a != b), None)
    if at is None and len(base) == len(md):
        return None
    at = min(len(base), len(md)) if at is None else at
    diff = sum(a != b for a, b in zip(base, md)) + abs(len(base) - len(md))
    return {"index": at, "positions_differing": diff,
            "base": base[at] if at < len(base) else None,
            "md": md[at] if at < len(md) else None}  # fmt: skip


def measure(methods: list[str], skip: int, iters: int, extra: list[str], jobs: int = 2) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}

    def run(m: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, __file__, "--child", m, f"--skip={skip}", f"--iters={iters}",
               "--", *extra]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)

    # the runs are counted, not timed: ``jobs`` of them share the machine at a time
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        outs = dict(zip(methods, pool.map(run, methods)))
    res, failed = {}, []
    for m, out in outs.items():
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(MARK)]
        if out.returncode or not lines:
            print(f"[fb_dispatch] {m} failed (exit {out.returncode}):\n{out.stderr[-2000:]}",
                  file=sys.stderr)  # fmt: skip
            failed.append(m)
            continue
        res[m] = json.loads(lines[-1][len(MARK) :])
    for m, r in res.items():
        base = res.get(BASE.get(m, ""))
        r["extra_ops_vs_base"] = [a - b for a, b in zip(r["ops"], base["ops"])] if base else None
        if base:  # which operations differ, if any
            ops = set(r["by_op"]) | set(base["by_op"])
            r["differing_ops"] = {
                op: [base["by_op"].get(op, 0), r["by_op"].get(op, 0)]
                for op in sorted(ops)
                if base["by_op"].get(op, 0) != r["by_op"].get(op, 0)
            }
            r["sequence_differs"] = first_difference(base["sequence"], r["sequence"])
    return {"results": res, "failed": failed}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["adamw", "adammd", "muon", "muonmd"],
                    choices=["adamw", "adammd", "muon", "muonmd"])  # fmt: skip
    ap.add_argument("--skip", type=int, default=2, help="iterations run before counting")
    ap.add_argument("--iters", type=int, default=2, help="forward-backward calls counted")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="runs at a time (their operations are counted, not timed)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.skip, args.iters, extra)
    got = measure(args.methods, args.skip, args.iters, extra, args.jobs)
    print(f"Dispatched operations per forward-backward (iterations {args.skip + 1}.."
          f"{args.skip + args.iters}), tiny preset, one rank")  # fmt: skip
    print("method | ops per forward-backward | MD's extra vs base")
    print("--- | --- | ---")
    for m, r in got["results"].items():
        extra_ops = r["extra_ops_vs_base"]
        print(f"{m} | {', '.join(map(str, r['ops']))} | "
              f"{'' if extra_ops is None else ', '.join(map(str, extra_ops))}")  # fmt: skip
        if r.get("differing_ops"):
            print(f"  {m} vs {BASE[m]}, op: [base, MD] = {r['differing_ops']}")
        if r.get("sequence_differs"):
            print(f"  {m} vs {BASE[m]}, operations or layouts part: {r['sequence_differs']}")
        elif m in BASE and BASE[m] in got["results"]:
            print(f"  {m} vs {BASE[m]}: the same operations on the same tensor layouts "
                  "(dtype, shape, strides, storage offset), in the same order")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(got, indent=1))
    if got["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
