"""Test set-up: CPU mode (megatron.md.cpu_mode) on machines without CUDA, before megatron."""

import logging
import warnings

from megatron.md import cpu_mode

cpu_mode.maybe_activate()

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
logging.getLogger("megatron").setLevel(logging.ERROR)


def pytest_collection_modifyitems(items):
    """The quick tier (``bash run.sh test -m quick``): every test without a multi-process launch."""
    import pytest

    for item in items:
        if item.get_closest_marker("distributed") is None:
            item.add_marker(pytest.mark.quick)
