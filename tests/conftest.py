"""Test set-up: CPU mode comes with `import megatron.md` on machines without CUDA."""

import logging
import warnings

import megatron.md  # noqa: F401

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
logging.getLogger("megatron").setLevel(logging.ERROR)
