"""The software stack megatron-md runs on, checked at start-up: a mismatch is named before any
work starts (``python -m megatron.md.stack`` prints the versions; ``--strict`` exits 1 on a
problem, as the container build does)."""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

#: the megatron-core release every seam of megatron-md is written against (file:line citations)
MEGATRON_CORE = "0.19.2"


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron-core": version("megatron-core"),
        "emerging-optimizers": version("emerging-optimizers"),
        "transformer-engine": version("transformer_engine") or version("transformer-engine"),
        "apex": version("apex"),
    }


def problems(transformer_impl: str | None = None) -> list[str]:
    """What keeps megatron-md from running as tested, each naming the packages and the fix."""
    found = versions()
    out = []
    if found["megatron-core"] != MEGATRON_CORE:
        out.append(
            f"megatron-core {found['megatron-core']} is installed; megatron-md is written against "
            f"{MEGATRON_CORE} (its seams cite that release's files): pip install "
            f"megatron-core=={MEGATRON_CORE} (in a container: bash container/install.sh)"
        )
    if transformer_impl == "transformer_engine":
        te = found["transformer-engine"]
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ModuleNotFoundError if te is None else () as e:
            out.append(
                f"--transformer-impl transformer_engine, but Transformer Engine is not installed "
                f"({e}): use the NGC PyTorch container (container/README.md) or "
                "--transformer-impl local"
            )
        except Exception as e:  # a TE built for another torch fails here with a symbol error
            what = f"Transformer Engine {te}" if te else "Transformer Engine"
            out.append(
                f"--transformer-impl transformer_engine, but {what} does not load with torch "
                f"{found['torch']} ({type(e).__name__}: {str(e)[:200]}). Inside an NGC "
                "container keep the container's torch (bash container/install.sh); elsewhere "
                "install a TE built for this torch, or use --transformer-impl local"
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--strict", action="store_true", help="exit 1 when there is a problem")
    ap.add_argument("--transformer-impl", default=None, help="also check this implementation")
    args = ap.parse_args(argv)
    for k, v in versions().items():
        print(f"{k:<20} {v or '-'}")
    found = problems(args.transformer_impl)
    for p in found:
        print(f"problem: {p}", file=sys.stderr)
    return 1 if found and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
