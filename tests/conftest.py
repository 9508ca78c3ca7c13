"""Test set-up: CPU mode (megatron.md.cpu_mode) on machines without CUDA, before megatron."""

import logging
import warnings

from megatron.md import cpu_mode

cpu_mode.maybe_activate()

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
logging.getLogger("megatron").setLevel(logging.ERROR)
