"""Megatron-MD: Magnitude–Direction decoupling inside megatron-core's optimizers.

Importing the package switches on CPU mode when no CUDA device is present (see cpu_mode).
"""

from megatron.md import cpu_mode

cpu_mode.maybe_activate()
