"""The paper's downstream table and figure (appendix "Downstream Evaluations": tab. moe-evals,
fig. moe-evals) from ``tools/evaluate.py``'s reports.

    python tools/downstream.py runs/moe-ladder/evals/moe-0.81B-6.7B-*-44.15B/ \\
        --out runs/moe-ladder/evals/report

Each argument is a report (JSON) or a folder of them (an ``evaluate.py --trajectory`` folder);
reports are grouped by the run their checkpoint belongs to. Writes ``table.md``, ``table.tex``
(booktabs, as the paper's) and ``table.csv`` (each run at its last evaluated checkpoint: the
paper's headline metric per task and their average, in %, the best per column in bold) and
``trajectory.png`` (one panel per task and one for the average, accuracy against training
tokens, one line per run in its method's colour). Rows are named by what differs between the
runs' names (the method, for the paper's three runs, spelled as the paper does).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from evaluate import PAPER_TASKS  # noqa: E402

from megatron.md.figstyle import method_color, method_name  # noqa: E402

#: the paper's column names
NAMES = {"mmlu": "MMLU", "hellaswag": "HellaSwag", "arc_challenge": "ARC-c",
         "arc_easy": "ARC-e", "winogrande": "WinoGrande", "average": "Avg."}  # fmt: skip
#: its columns in its order (evaluate.py's set), then the average
COLUMNS = {t: NAMES[t] for t in [*PAPER_TASKS, "average"]}


def read(paths: list[str]) -> dict[str, list[dict]]:
    """Run name → its reports with the paper's metrics, by iteration."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.json"))
        elif p.is_file():
            files.append(p)
        else:
            raise SystemExit(f"downstream: error: {p}: no such report or folder")
    runs: dict[str, list[dict]] = {}
    for f in files:
        try:
            rep = json.loads(f.read_text())
        except ValueError:
            raise SystemExit(f"downstream: error: {f} is not JSON")
        if not isinstance(rep, dict) or "checkpoint" not in rep:
            raise SystemExit(f"downstream: error: {f} is not a tools/evaluate.py report")
        if not rep.get("paper"):
            print(f"[downstream] {f}: none of the paper's tasks; left out", file=sys.stderr)
            continue
        runs.setdefault(Path(rep["checkpoint"]).parent.name, []).append(rep)
    if not runs:
        raise SystemExit("downstream: error: no report holds the paper's tasks (--tasks paper)")
    for reps in runs.values():
        reps.sort(key=lambda r: r["iteration"])
    return runs


def labels(names: list[str]) -> dict[str, str]:
    """Each run's name without the ``-`` parts every name shares (the whole name if alone)."""
    parts = [n.split("-") for n in names]
    common = set.intersection(*map(set, parts)) if len(names) > 1 else set()
    out = {n: "-".join(x for x in p if x not in common) or n for n, p in zip(names, parts)}
    return {n: method_name(v) for n, v in out.items()}


def table(runs: dict[str, list[dict]], label: dict[str, str], out: Path) -> list[str]:
    """``table.md``, ``table.tex`` and ``table.csv`` from each run's last report, rows named by
    ``label``; returns the markdown rows."""
    names = sorted(runs)
    cols = [c for c in COLUMNS if any(c in runs[n][-1]["paper"] for n in names)]
    last = {n: runs[n][-1]["paper"] for n in names}
    best = {c: max(last[n].get(c, float("-inf")) for n in names) for c in cols}

    def cell(n, c, bold="**{}**", missing="—"):
        v = last[n].get(c)
        if v is None:
            return missing
        return bold.format(f"{v:.1f}") if round(v, 1) == round(best[c], 1) else f"{v:.1f}"

    head = ["run", *(COLUMNS[c] for c in cols)]
    rows = [[label[n], *(cell(n, c) for c in cols)] for n in names]
    md = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    tex = [f"\\begin{{tabular}}{{l{'c' * len(cols)}}}", "\\toprule",
           " & ".join(["Optimizer", *head[1:]]) + " \\\\", "\\midrule"]  # fmt: skip
    tex += [" & ".join([label[n], *(cell(n, c, "\\textbf{{{}}}", "--") for c in cols)])
            + " \\\\" for n in names]  # fmt: skip
    out.joinpath("table.tex").write_text("\n".join([*tex, "\\bottomrule", "\\end{tabular}"]) + "\n")
    note = "; ".join(f"{label[n]}: iteration {runs[n][-1]['iteration']}"
                     + (f", {runs[n][-1]['tokens'] / 1e9:.4g}B tokens"
                        if runs[n][-1].get("tokens") else "") for n in names)  # fmt: skip
    out.joinpath("table.md").write_text("\n".join(md) + f"\n\nAccuracy (%), each run at its "
                                        f"last evaluated checkpoint ({note}).\n")  # fmt: skip
    with out.joinpath("table.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "label", "iteration", "tokens", *cols])
        for n in names:
            r = runs[n][-1]
            w.writerow([n, label[n], r["iteration"], r.get("tokens"),
                        *(r["paper"].get(c) for c in cols)])  # fmt: skip
    return md


def figure(runs: dict[str, list[dict]], label: dict[str, str], out: Path) -> None:
    """``trajectory.png``: a panel per task of the paper's set and one for the average."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(runs)
    cols = [c for c in COLUMNS if any(c in r["paper"] for n in names for r in runs[n])]
    tokens = all(r.get("tokens") for n in names for r in runs[n])
    fig, axes = plt.subplots(2, 3, figsize=(13, 7), squeeze=False)
    for ax, c in zip(axes.flat, cols):
        for n in names:
            pts = [((r["tokens"] / 1e9) if tokens else r["iteration"], r["paper"][c])
                   for r in runs[n] if c in r["paper"]]  # fmt: skip
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", ms=3, label=label[n], color=method_color(label[n]))
        ax.set_title(COLUMNS[c])
        ax.set_xlabel("training tokens (B)" if tokens else "iteration")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(cols) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "trajectory.png", dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="evaluate.py reports, or folders of them")
    p.add_argument("--out", required=True, help="folder for the tables and trajectory.png")
    a = p.parse_args(argv)
    runs = read(a.reports)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    label = labels(sorted(runs))
    print("\n".join(table(runs, label, out)))
    figure(runs, label, out)
    print(f"[downstream] wrote {out}/table.md, table.tex, table.csv, trajectory.png "
          f"({len(runs)} runs)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
