"""Downstream evaluation of a trained checkpoint with the LM Evaluation Harness (``lm-eval``).

Loads a ``torch_dist`` run directory (any preset, MD or not, any saved parallel layout) through
our model provider on ONE process (a GPU, or the CPU) and runs lm-eval's tasks through
``megatron.md.evaluation.harness.MegatronLM``. The paper's zero-shot set (its appendix
"Downstream evaluation": MMLU, HellaSwag, ARC-Challenge, ARC-Easy, WinoGrande; length-normalized
accuracy for HellaSwag and ARC, plain accuracy for MMLU and WinoGrande) is ``--tasks paper``;
lm-eval downloads those datasets from the Hugging Face Hub (or reads its cache), so run it where
the Hub or a filled ``HF_HOME`` is reachable. Offline, ``--local-task NAME=FILE.jsonl`` turns a
JSONL of ``{"question", "choices", "answer"}`` into a zero-shot multiple-choice task.

``--valid-loss`` first scores the run's own validation samples (the ones its first evaluation
read) through the same adapter: the mean must equal the validation loss the run logged at
``--eval-interval``, which checks that the rebuilt model is the trained one.

    python tools/evaluate.py --load runs/moe-muonmd --tasks paper --out evals/moe-muonmd.json
    python tools/evaluate.py --load runs/tiny --local-task quiz=quiz.jsonl --valid-loss
    # the paper's trajectory: every kept checkpoint of the last third, one JSON each
    python tools/evaluate.py --load runs/moe-muonmd --tasks paper --trajectory 2/3 \\
        --out evals/moe-muonmd/

Writes ``--out`` (JSON: the checkpoint, its iteration and training tokens, per-task metrics,
the paper's headline metric per task and their average, versions) and prints one line per
task. With ``--trajectory F``, ``--out`` is a folder of ``iter_NNNNNNN.json``, one per
checkpoint from F × the latest iteration on (the model built once, each checkpoint's weights
loaded into it); checkpoints already evaluated there are skipped, so a job cut by its time
limit goes on where it stopped. ``tools/downstream.py`` makes the paper's table and figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: the paper's zero-shot set and its headline metric per task (appendix, Downstream evaluation)
PAPER_TASKS = {
    "mmlu": "acc",
    "hellaswag": "acc_norm",
    "arc_challenge": "acc_norm",
    "arc_easy": "acc_norm",
    "winogrande": "acc",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="run directory (the run's --save)")
    p.add_argument("--ckpt-step", type=int, default=None, help="iteration (default: the latest)")
    p.add_argument("--tasks", default="", help="lm-eval task names, comma separated; 'paper' = "
                   + ",".join(PAPER_TASKS))  # fmt: skip
    p.add_argument("--local-task", action="append", default=[], metavar="NAME=FILE.jsonl",
                   help="a multiple-choice task: JSONL of question, choices, answer")  # fmt: skip
    p.add_argument("--include-path", default=None, help="a folder of lm-eval task YAMLs")
    p.add_argument("--num-fewshot", type=int, default=0, help="0: zero-shot, as the paper")
    p.add_argument("--limit", type=int, default=None, help="at most this many documents per task")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--tokenizer-model", default=None,
                   help="the tokenizer folder, where it moved since training")  # fmt: skip
    p.add_argument("--valid-loss", action="store_true",
                   help="also score the run's first validation evaluation's samples")  # fmt: skip
    p.add_argument("--out", default=None,
                   help="results JSON (default: print); a folder with --trajectory")  # fmt: skip
    p.add_argument("--trajectory", default=None, metavar="F",
                   help="every checkpoint from F (e.g. 2/3) × the latest iteration on")  # fmt: skip
    a = p.parse_args(argv)
    if a.trajectory is not None:
        try:
            a.trajectory = float(Fraction(a.trajectory))
        except (ValueError, ZeroDivisionError):
            a.trajectory = -1.0
        if not 0 <= a.trajectory <= 1:
            p.error("--trajectory: give a fraction of the run in [0, 1], e.g. 2/3")
        if a.ckpt_step is not None:
            p.error("--trajectory evaluates several checkpoints: drop --ckpt-step")
        if not a.out:
            p.error("--trajectory writes one JSON per checkpoint: give --out FOLDER")
    a.tasks = [t for t in a.tasks.split(",") if t]
    if "paper" in a.tasks:
        a.tasks = [t for t in a.tasks if t != "paper"] + list(PAPER_TASKS)
    a.local = {}
    for item in a.local_task:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path).is_file():
            p.error(f"--local-task {item}: give NAME=FILE.jsonl with an existing file")
        a.local[name] = str(Path(path).resolve())
    if not (a.tasks or a.local or a.valid_loss):
        p.error("nothing to do: give --tasks, --local-task or --valid-loss")
    if a.out:  # written at the end: an evaluation is not to be lost to an unwritable path
        from megatron.md.errors import Refusal
        from megatron.md.train.args import check_writable

        if a.trajectory is None and os.path.isdir(a.out):
            p.error(f"--out {a.out} is a directory: give the results file's path")
        if a.trajectory is not None and os.path.isfile(a.out):
            p.error(f"--out {a.out} is a file: --trajectory writes a folder of JSONs")
        try:
            out = a.out if a.trajectory is not None else os.path.dirname(os.path.abspath(a.out))
            check_writable("--out", out)
        except Refusal as e:
            p.error(e.msg)
    return a


def local_task_yaml(name: str, path: str) -> str:
    """An lm-eval task config (YAML; written as JSON, which YAML reads) for a JSONL file."""
    metrics = [{"metric": m, "aggregation": "mean", "higher_is_better": True}
               for m in ("acc", "acc_norm")]  # fmt: skip
    return json.dumps({
        "task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": path}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "metric_list": metrics,
    }, indent=1)  # fmt: skip


def check_local(name: str, path: str) -> int:
    """The JSONL's documents, checked before any model is built; returns their number."""
    n = 0
    for i, line in enumerate(open(path), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            choices = doc["choices"]
            ok = isinstance(doc["question"], str) and isinstance(choices, list)
            ok = ok and len(choices) >= 2 and 0 <= int(doc["answer"]) < len(choices)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise SystemExit(
                f"evaluate: error: --local-task {name}: {path}:{i} is not a document "
                '{"question": str, "choices": [str, ...], "answer": index of the right choice}'
            )
        n += 1
    if not n:
        raise SystemExit(f"evaluate: error: --local-task {name}: {path} has no documents")
    return n


def check_tokenizer(saved, a) -> None:
    """Text tasks need a tokenizer that encodes text (a NullTokenizer run reads ids only)."""
    if (a.tasks or a.local) and saved.tokenizer_type == "NullTokenizer":
        raise SystemExit(
            "evaluate: error: the run was trained with NullTokenizer (token ids, no text): "
            "only --valid-loss can score it"
        )


def check_valid_loss(saved, a) -> None:
    """``--valid-loss`` needs a run that evaluated (the paper's MoE and re-warming runs did
    not: ``--eval-iters 0``, as the authors' MoE framework)."""
    if a.valid_loss and not getattr(saved, "eval_iters", 1):
        raise SystemExit(
            "evaluate: error: --valid-loss scores the samples the run's evaluations read, and "
            "this run evaluated none (--eval-iters 0): score it with --tasks or --local-task"
        )


def valid_loss(lm, args) -> dict:
    """Mean per-token loss of the samples the run's first evaluation read (indices 0 ..
    eval_iters × global batch of its validation split), scored by ``lm.rolling``."""
    from megatron.training.training import build_train_valid_test_datasets

    from megatron.md.train import data

    if args.eod_mask_loss:
        raise SystemExit("evaluate: error: --valid-loss: the run masked eod tokens in its loss")
    _, valid, _ = build_train_valid_test_datasets(data.datasets_provider)
    n = args.eval_iters * args.global_batch_size
    total, tokens = 0.0, 0
    for i in range(n):
        s = valid[i]
        ids, labels = s["tokens"].tolist(), s["labels"].tolist()
        total -= lm.rolling(labels, prefix=ids[0])
        tokens += len(labels)
    return {"lm loss": total / tokens, "samples": n, "tokens": tokens}


def task_manager(a, workdir: str):
    """lm-eval's task index over its own tasks (where ``--tasks`` may name one: 16 s to build
    on a 2-core VM), ``--include-path`` and the ``--local-task`` YAMLs written to ``workdir``;
    built once, before the model, for every checkpoint evaluated."""
    from lm_eval.tasks import TaskManager

    include = [a.include_path] if a.include_path else []
    if a.local:
        for name, path in a.local.items():
            Path(workdir, f"{name}.yaml").write_text(local_task_yaml(name, path))
        include.append(workdir)
    return TaskManager(include_path=include or None, include_defaults=bool(a.tasks))


def _generating(index: dict, name: str, over: dict | None = None, seen=frozenset()) -> list[str]:
    """The tasks under ``name`` that generate text, resolved as lm-eval 0.4.13 builds them
    (``lm_eval/tasks/_factory.py``, ``TaskFactory``): a tag's tasks; a group's members (names,
    tags, groups, tasks with overrides, inline tasks and groups), the group's own task keys and a
    member's overrides winning over a task's configuration (includes resolved by the index);
    lm-eval's ``TaskConfig`` default (``generate_until``) where none names an output type. A
    Python-class task (``PY_TASK``) decides in its code: not seen."""
    over, entry = over or {}, index.get(name)
    if name in seen or (entry is None and "task" not in over):
        return []
    if entry is None or entry.kind.name == "TASK":  # a task (inline: its overrides alone)
        cfg = {**((entry.cfg or {}) if entry else {}), **over}
        return [name] if cfg.get("output_type", "generate_until") == "generate_until" else []
    seen = seen | {name}
    if entry.kind.name == "TAG":
        return [g for t in sorted(entry.tags) for g in _generating(index, t, over, seen)]
    if entry.kind.name == "GROUP":
        return _members(entry.cfg or {}, index, over, seen)
    return []


def _members(group: dict, index: dict, over: dict, seen: frozenset) -> list[str]:
    """A group's ``task:`` list as ``TaskFactory._build_group_members`` reads it."""
    from dataclasses import fields

    from lm_eval.config.group import GroupConfig

    own = {f.name for f in fields(GroupConfig)}
    over = {**{k: v for k, v in group.items() if k not in own}, **over}
    members, out = group.get("task", []), []
    for item in members if isinstance(members, list) else []:
        if isinstance(item, str):
            out += _generating(index, item, over, seen)
        elif isinstance(item, dict) and "group" in item:
            rest = {k: v for k, v in item.items() if k != "group"}
            if item["group"] in index:  # an existing group, with overrides
                out += _generating(index, item["group"], {**over, **rest}, seen)
            else:  # an inline group
                out += _members(item, index, over, seen)
        elif isinstance(item, dict) and "task" in item:
            out += _generating(index, item["task"], {**over, **item}, seen)
    return out


def check_tasks(a, manager) -> None:
    """Before the model is built: every ``--tasks`` name is one lm-eval knows (a task, group or
    tag), and none generates text (the adapter scores log-likelihoods), looked for through
    groups and tags as lm-eval builds them (``_generating``)."""
    index = manager.task_index
    if unknown := [t for t in a.tasks if t not in index]:
        import lm_eval

        raise SystemExit(f"evaluate: error: --tasks: lm-eval {lm_eval.__version__} has no task, "
                         f"group or tag {', '.join(unknown)} (lm_eval --tasks list names them; "
                         "a YAML of your own: --include-path)")  # fmt: skip
    if gen := [g for t in a.tasks for g in _generating(index, t)]:
        raise SystemExit(
            f"evaluate: error: --tasks: {', '.join(gen)} "
            f"{'generates' if len(gen) == 1 else 'generate'} text, which this tool does "
            "not (it scores log-likelihoods): export the checkpoint (tools/export_hf.py) and "
            "run them with lm-eval's own Hugging Face backend (docs/evaluation.md)"
        )


def run_tasks(lm, a, manager) -> dict:
    import lm_eval

    out = lm_eval.simple_evaluate(
        model=lm, tasks=a.tasks + list(a.local), num_fewshot=a.num_fewshot, limit=a.limit,
        task_manager=manager, log_samples=False, bootstrap_iters=0,
    )  # fmt: skip
    return {task: {k.split(",")[0]: v for k, v in m.items() if k != "alias" and "stderr" not in k}
            for task, m in out["results"].items()}  # fmt: skip


def headline(results: dict) -> dict:
    """The paper's metric per task of its set that ran, and their average (accuracy, %)."""
    got = {t: 100 * results[t][m] for t, m in PAPER_TASKS.items() if t in results}
    return {**got, "average": sum(got.values()) / len(got)} if got else {}


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    for name, path in a.local.items():
        check_local(name, path)
    with tempfile.TemporaryDirectory() as workdir:
        evaluate_all(a, workdir)


def evaluate_all(a, workdir: str) -> None:
    """Check the checkpoints and tasks asked for, build the run's model once, evaluate each
    checkpoint (the local tasks' YAMLs in ``workdir``)."""
    from megatron.md import cpu_mode

    cpu_mode.maybe_activate()  # first: CPU mode on a machine without CUDA, before megatron
    from megatron.md.evaluation import restore

    steps, outs = [a.ckpt_step], [a.out]
    if a.trajectory is not None:
        every = restore.trajectory(a.load, a.trajectory)
        steps = [s for s in every if not Path(a.out, f"iter_{s:07d}.json").exists()]
        print(f"[evaluate] {a.load}: checkpoints {every[0]}…{every[-1]} ({len(every)}), "
              f"{len(every) - len(steps)} of them already in {a.out}", flush=True)  # fmt: skip
        if not steps:
            return
        outs = [str(Path(a.out, f"iter_{s:07d}.json")) for s in steps]
    saved, path = restore.saved_args(a.load, steps[0])
    check_tokenizer(saved, a)
    check_valid_loss(saved, a)
    manager = task_manager(a, workdir) if a.tasks or a.local else None
    if manager is not None:
        check_tasks(a, manager)
    flags = restore.argv_for(saved, a.load, steps[0], a.valid_loss, a.tokenizer_model)
    net, args, iteration = restore.build(flags, saved)

    import torch
    from megatron.training import get_tokenizer

    from megatron.md.evaluation.harness import MegatronLM

    device = next(net.parameters()).device

    def forward(tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return net(tokens, pos, None)

    tok = get_tokenizer()
    lm = MegatronLM(forward, tok.tokenize, tok.eod, args.seq_length, a.batch_size, device)
    for k, (step, out) in enumerate(zip(steps, outs)):
        if k:
            iteration = restore.reload(net, step)
            saved, path = restore.saved_args(a.load, step)
        evaluate(lm, a, manager, args, saved, path, iteration, out)


def evaluate(lm, a, manager, args, saved, path: str, iteration: int, out: str | None) -> None:
    """One checkpoint's report, written to ``out`` (printed where None)."""
    import torch

    samples = getattr(saved, "consumed_train_samples", None)
    report = {"checkpoint": path, "iteration": iteration, "tasks": {},
              "tokens": samples * saved.seq_length if samples else None}  # fmt: skip
    if a.valid_loss:
        report["valid"] = valid_loss(lm, args)
        print(f"[evaluate] iteration {iteration}: validation loss "
              f"{report['valid']['lm loss']:.6f} over {report['valid']['samples']} samples",
              flush=True)  # fmt: skip
    if manager is not None:
        rows, asked = lm.rows_read, lm.requests
        report["tasks"] = run_tasks(lm, a, manager)
        print(f"[evaluate] iteration {iteration}: {lm.requests - asked} requests, "
              f"{lm.rows_read - rows} sequences read", flush=True)  # fmt: skip
        report["paper"] = headline(report["tasks"])
        for task, m in report["tasks"].items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in m.items() if isinstance(v, float)
                              and math.isfinite(v))  # fmt: skip
            print(f"[evaluate] iteration {iteration}: {task}: {shown}", flush=True)
    import lm_eval
    import megatron.core

    report["versions"] = {"torch": torch.__version__, "lm_eval": lm_eval.__version__,
                          "megatron_core": megatron.core.__version__}  # fmt: skip
    if out:  # complete or absent: a trajectory goes on from the checkpoints it wrote
        from megatron.md.train.files import write_whole

        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        write_whole(out, json.dumps(report, indent=1, default=str) + "\n")
        print(f"[evaluate] wrote {out}", flush=True)


if __name__ == "__main__":
    main()
