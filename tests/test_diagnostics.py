"""The step diagnostics (megatron/md/train/diagnostics.py) in one process, around megatron's
own ZeRO-1 optimizer with AdamMD: the relative update and the output change are the authors'
(gainz megatron/training/internals_logging/metrics.py, ``_relative_norm_change``, and
logger.py, ``_compute_delta_y_metrics``: ‖W_new − W_old‖/‖W_old‖ and ‖Y_new − Y_old‖/‖Y_old‖),
recomputed here in float64 from the weights before and after the step and the inputs the
linears saw."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "md_decoupling"))
import cpu_demo  # noqa: E402

from megatron.md.config import MDConfig  # noqa: E402
from megatron.md.testing import megatron_optimizer, tiny_gpt  # noqa: E402


def _mean(d: dict) -> dict:
    return {c: sum(v) / len(v) for c, v in d.items()}


def test_relative_update_and_output_change_are_over_the_weights_before_the_step():
    from megatron.md.enable import enable_md
    from megatron.md.roles import matrix_class
    from megatron.md.train.diagnostics import OUT_TOKENS, StepDiagnostics

    model = tiny_gpt(5, 32, 2, 16)
    dmodel, opt = megatron_optimizer(model, model.config, "zero1", 1, "adam", lr=1e-2,
                                     weight_decay=0.0, bf16=False)  # fmt: skip
    enable_md(opt, [dmodel], MDConfig())
    diag = StepDiagnostics(opt, [dmodel], due=lambda: True)
    inputs = {}  # weight -> its linear's input in the step's forward pass, seen by our hooks

    def keep(module, args):
        inputs.setdefault(module.weight, args[0].detach().reshape(-1, args[0].shape[-1]))

    for name, mod in model.named_modules():
        if name.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")):
            mod.register_forward_pre_hook(keep)
    named = {p: n for n, p in model.named_parameters() if p.ndim == 2}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 16), generator=g)
    y = torch.randint(0, 256, (2, 16), generator=g)
    for _ in range(2):  # the second step: gains and moments no longer at their start
        inputs.clear()
        dmodel.zero_grad_buffer()
        opt.zero_grad()
        cpu_demo.lm_loss(dmodel, x, y).backward()
        dmodel.finish_grad_sync()
        old = {p: p.detach().double().clone() for p in named}
        before = diag.before_step()
        assert opt.step()[0]
        got = diag.after_step(before)

    rel, rel_new, out, out_new = {}, {}, {}, {}
    for p, name in named.items():
        cls = matrix_class(name)
        dw = p.detach().double() - old[p]
        rel.setdefault(cls, []).append(float(dw.norm() / old[p].norm()))
        rel_new.setdefault(cls, []).append(float(dw.norm() / p.detach().double().norm()))
        if p in inputs:
            xs = inputs[p][:OUT_TOKENS].double()
            out.setdefault(cls, []).append(float((xs @ dw.T).norm() / (xs @ old[p].T).norm()))
            new = (xs @ p.detach().double().T).norm()
            out_new.setdefault(cls, []).append(float((xs @ dw.T).norm() / new))
    rel, rel_new, out, out_new = map(_mean, (rel, rel_new, out, out_new))
    assert set(got["rel_update"]) == set(rel) and set(got["out_change"]) == set(out)
    assert {"qkv", "proj", "fc1", "fc2"} <= set(out)
    for c in rel:
        assert got["rel_update"][c] == pytest.approx(rel[c], rel=1e-6), c
    for c in out:
        assert got["out_change"][c] == pytest.approx(out[c], rel=1e-5), c
    # the denominators after the step differ by more than those tolerances: the check can fail
    assert max(abs(rel_new[c] / rel[c] - 1) for c in rel) > 1e-4
    assert max(abs(out_new[c] / out[c] - 1) for c in out) > 1e-4
    assert all(math.isfinite(v) and v > 0 for v in got["out_change"].values())
