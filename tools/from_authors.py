"""Turn a launch command line of the paper authors' Megatron-LM fork into ours: their MD flags
(``--optimizer md_decoupling``/``master``, ``--hypersphere-*``, ``--gains-*``, …) become
``pretrain_gpt.py`` flags (megatron/md/train/authors.py; the table is in docs/flags.md), every
flag of theirs with no equivalent here is refused by name (exit 2), megatron's own flags pass
through. ``--check`` also parses the result with ``pretrain_gpt.py``'s parser (needs torch).

    python tools/from_authors.py -- --optimizer master --use-orthogonal-updates \\
        --hypersphere-mode flat --hypersphere-gains-mode rowcol --gain-parametrization softplus
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.md.train.authors import Untranslatable, translate  # noqa: E402


def main(argv=None) -> list[str]:
    argv = list(sys.argv[1:] if argv is None else argv)
    theirs = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--check", action="store_true", help="parse the result with our parser")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not theirs:
        ap.error("give their flags after --")
    try:
        ours = translate(theirs)
    except Untranslatable as e:
        print(f"[from_authors] {e}", file=sys.stderr)
        sys.exit(2)
    if args.check:
        from megatron.md.train import args as md_args  # noqa: F401 (imports megatron)
        from megatron.md.train.cli import parse

        parse(ours, on_cpu=True, check_save=False)  # (their --save is on their cluster)
    print(shlex.join(["python", "pretrain_gpt.py", *ours]))
    return ours


if __name__ == "__main__":
    main()
