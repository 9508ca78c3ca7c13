"""The seams into megatron-core fail loudly: every non-public dependency is listed in
megatron/md/compat.py and checked at start-up; a moved symbol stops the run naming it."""

import inspect
import types

import pytest
from _seams import restore_seams, saved_seams

from megatron.md import compat


def test_every_seam_resolves_in_the_installed_megatron_core():
    compat.check()
    assert len(compat.SEAMS) >= 20


def test_every_replaced_attribute_has_a_row_and_apply_twice_is_harmless():
    """compat.SEAMS is the one list of what megatron-md replaces: after applying every layer,
    each attribute that carries megatron-md's marker (``__md_seam__``: the original it wraps)
    has its row; applying again wraps the originals afresh, never a wrapper."""
    import importlib

    from megatron.md.train import patches

    saved = saved_seams()
    try:
        _check_rows(patches, importlib)
    finally:  # the other tests of this process see megatron as it was
        restore_seams(saved)


def _check_rows(patches, importlib):
    patches.prepare_parsers()
    patches.apply(None, on_cpu=True)
    first = {(s.module, s.path): compat.resolve(s.module, s.path) for s in compat.SEAMS}
    patches.prepare_parsers()
    patches.apply(None, on_cpu=True)
    rows = {(s.module, s.path) for s in compat.SEAMS if s.replace}
    for (module, path), before in first.items():
        now = compat.resolve(module, path)
        if (module, path) in rows:
            assert getattr(now, "__md_seam__", None) is getattr(before, "__md_seam__", "x")
            assert not hasattr(now.__md_seam__, "__md_seam__"), (module, path)  # not wrapped twice
    marked = set()
    for module in {s.module for s in compat.SEAMS}:
        mod = importlib.import_module(module)
        marked |= {(module, k) for k, v in vars(mod).items() if hasattr(v, "__md_seam__")}
    for s in compat.SEAMS:  # a Class.method row: the method on its class
        if "." in s.path and hasattr(compat.resolve(s.module, s.path), "__md_seam__"):
            marked.add((s.module, s.path))
    assert marked <= rows, marked - rows
    assert rows <= marked | {(s.module, s.path) for s in compat.SEAMS if s.layer == "cpu-mode"}


def test_enable_md_checks_the_optimizer_layer_only(monkeypatch):
    """A library user's own loop need not have megatron.training's seams: enable_md checks
    the optimizer rows; pretrain_gpt.py checks all of them."""
    import megatron.training.training as mtt

    monkeypatch.delattr(mtt, "training_log")
    compat.check(layers=("optimizer",))
    with pytest.raises(RuntimeError, match="training_log"):
        compat.check()


def test_a_moved_symbol_is_named(monkeypatch):
    import megatron.training.training as mtt

    monkeypatch.delattr(mtt, "get_megatron_optimizer")
    with pytest.raises(RuntimeError, match=r"training\.get_megatron_optimizer \(training/"):
        compat.check()


def test_a_changed_signature_is_named(monkeypatch):
    """A seam whose parameters moved would hand megatron-md the wrong argument under the right
    name (the save wrapper takes ``iteration, model, optimizer`` by position): refused at
    start-up, naming the seam, its line and both orders."""
    import megatron.training.training as mtt

    def save_checkpoint(model, iteration, optimizer, *a, **k):  # a reordered megatron
        return None

    monkeypatch.setattr(mtt, "save_checkpoint", save_checkpoint)
    with pytest.raises(RuntimeError) as e:
        compat.check()
    assert (
        "training.save_checkpoint (training/training.py:3086; " in str(e.value)
        and "its parameters open with (model, iteration, optimizer), megatron-md relies on "
        "(iteration, model, optimizer)"
        in str(e.value)
    )
    assert str(e.value).count("megatron-md relies on") == 1


def test_the_signature_check_reads_through_an_applied_replacement():
    """After the seams are applied (a second parser, a library call after pretrain_gpt.py's
    set-up) the check reads megatron's originals, not the replacements' own parameters (CPU
    mode's RNG setter is ``lambda state, *a, **k``)."""
    from megatron.md.train import patches

    saved = saved_seams()
    try:
        patches.prepare_parsers()
        patches.apply(None, on_cpu=True)
        compat.apply("cpu-mode")
        rng_set = compat.resolve("megatron.core.tensor_parallel.random", "_set_cuda_rng_state")
        assert compat.leading_params(rng_set.__md_seam__, 1) == ("new_state",)
        assert tuple(inspect.signature(rng_set).parameters)[:1] == ("state",)
        compat.check()
    finally:
        restore_seams(saved)


def test_every_seam_names_the_line_it_was_written_against():
    """Each row's ``where`` is a file:line of the installed megatron-core (0.19.2, as the stack
    pins it) whose text names the seam: its definition, or the call that looks a replaced
    global up. A row that drifted off its line fails here, not in a reader's hands."""
    import importlib.metadata
    import pathlib

    import megatron.core

    assert importlib.metadata.version("megatron-core") == "0.19.2"
    root = pathlib.Path(megatron.core.__file__).parent.parent
    for s in compat.SEAMS:
        file, _, line = s.where.partition(":")
        assert line.isdigit(), s.where
        text = (root / file).read_text().splitlines()[int(line) - 1]
        assert any(part in text for part in s.path.split(".")), (s.path, s.where, text)


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


def test_an_optimizer_built_without_the_nodes_checks_stops(monkeypatch):
    """megatron builds its optimizer but never called the seam before its model
    (``setup_model_and_optimizer``: the nodes' software and shared directories): refused
    before the optimizer is built, never trained on unchecked."""
    from megatron.md.train import patches

    built = []
    monkeypatch.setattr(patches, "_NODES_CHECKED", [])
    wrapped = patches.wrap_optimizer(lambda *a, **kw: built.append(1), patches.Run(None, True))
    with pytest.raises(RuntimeError, match="the nodes' checks did not run"):
        wrapped(None, [])
    assert built == []


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
