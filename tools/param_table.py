"""Parameter counts of every preset next to the paper's tables (recipe §3 dense, §4 MoE).

    python tools/param_table.py [--vocab-size 131072] [--json out.json]

Counts come from ``presets.count_params`` (checked against real megatron-core builds of the
tiny presets by the end-to-end test). Totals include the untied embeddings and LM head;
"active" counts a token's route through the MoE (top-2 + shared expert).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.md.train.presets import PRESETS, VOCAB, count_params  # noqa: E402


def table(vocab: int) -> list[dict]:
    rows = []
    for name, p in PRESETS.items():
        if not (p.params or p.active):
            continue
        total, active = count_params(p, vocab)
        row = {
            "preset": name,
            "total": total,
            "paper_total": p.params,
            "total_diff": total / p.params - 1,
        }
        if p.active:
            row.update(active=active, paper_active=p.active, active_diff=active / p.active - 1)
        rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=VOCAB)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = table(args.vocab_size)
    print(
        f"{'preset':<16} {'total':>10} {'paper':>8} {'diff':>7}"
        f"  {'active':>9} {'paper':>7} {'diff':>7}"
    )
    for r in rows:
        line = (
            f"{r['preset']:<16} {r['total'] / 1e6:>9.1f}M {r['paper_total'] / 1e6:>7.0f}M "
            f"{r['total_diff']:>+7.2%}"
        )
        if "active" in r:
            line += (
                f"  {r['active'] / 1e6:>8.1f}M {r['paper_active'] / 1e6:>6.0f}M "
                f"{r['active_diff']:>+7.2%}"
            )
        print(line)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
