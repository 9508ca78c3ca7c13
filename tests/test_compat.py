"""The seams into megatron-core fail loudly: every non-public dependency is listed in
megatron/md/compat.py and checked at start-up; a moved symbol stops the run naming it."""

import types

import pytest

from megatron.md import compat


def test_every_seam_resolves_in_the_installed_megatron_core():
    compat.check()
    assert len(compat.SEAMS) >= 20


def test_a_moved_symbol_is_named(monkeypatch):
    import megatron.training.training as mtt

    monkeypatch.delattr(mtt, "get_megatron_optimizer")
    with pytest.raises(RuntimeError, match=r"training\.get_megatron_optimizer \(training/"):
        compat.check()


def test_distributed_optimizer_attributes_are_checked():
    with pytest.raises(RuntimeError, match="lacks buffers, model_param_gbuf_map"):
        compat.check_distributed_optimizer(types.SimpleNamespace())


def test_training_without_the_md_optimizer_seam_stops(monkeypatch):
    """The run logs an MD config but megatron built its optimizer around our seam: the first
    training_log refuses instead of training on without MD."""
    from megatron.md.train import metrics

    monkeypatch.setitem(metrics._S, "md", object())
    monkeypatch.setitem(metrics._S, "opt", None)

    def training_log(loss_dict, iteration, grad_norm):  # megatron's, abridged
        return None

    wrapped = metrics.wrap_training_log(training_log)
    with pytest.raises(RuntimeError, match="without megatron-md's seam"):
        wrapped(loss_dict={}, iteration=1, grad_norm=None)


def test_importing_megatron_md_changes_nothing():
    """CPU mode is an explicit call of the entry points (cpu_mode.maybe_activate), never a side
    effect of importing the package."""
    import subprocess
    import sys

    code = ("import torch; f = torch.cuda.current_device; import megatron.md.enable, "
            "megatron.md.train.args, megatron.md.reference; from megatron.md import cpu_mode; "
            "print(cpu_mode.is_active(), torch.cuda.current_device is f)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]
