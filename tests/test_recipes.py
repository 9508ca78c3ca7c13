"""The paper's recipes as the code runs them: each test pins one place where the recipe and
the paper must agree (paper sections cited)."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "md_decoupling"))
import cpu_demo  # noqa: E402

from megatron.md.config import MDConfig  # noqa: E402
from megatron.md.optimizer import MDOptimizer, model_param_groups  # noqa: E402
from megatron.md.roles import tag_qkv  # noqa: E402
from megatron.md.testing import tiny_gpt  # noqa: E402

LAYERS = 4


def _relative_direction_updates(md: MDConfig, lr: float = 1e-4) -> dict[str, float]:
    """‖ΔŴ‖/‖Ŵ‖ / lr of every MuonMD matrix after one step of a DeepSeekMoE-style model whose
    output projections are initialized at σ/sqrt(2L) (megatron's scaled init)."""
    model = tiny_gpt(5, 64, LAYERS, 16, experts=4)
    tag_qkv(model)
    groups = model_param_groups(model, lr)
    opt = MDOptimizer(groups, md=md, base="muon")
    data = torch.tensor(list(cpu_demo.TEXT.encode()), dtype=torch.long)
    x, y = next(cpu_demo.batches(data, 1, 16, 16, 0))  # enough tokens for every expert
    cpu_demo.lm_loss(model, x, y).backward()
    named = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}  # = Ŵ: the state starts at W
    opt.step()  # creates the MD state (direction = W, gains 1) and takes the step from it
    out = {}
    for n, p in named.items():
        st = opt.state[p]
        if "direction" not in st or "word_embeddings" in n or "output_layer" in n:
            continue
        out[n] = float((st["direction"] - before[n]).norm() / before[n].norm()) / lr
    return out


def test_moe_recipe_relative_update_tracks_the_lr():
    """MoE appendix: under the scaled output-projection init the sphere of those projections is
    1/sqrt(2L) smaller "and adjusts their shape-up factor accordingly". Every MuonMD matrix
    (attention, dense/shared/routed experts, router) then turns by about the LR per step. The
    factor's left-over spread is the paper's own (shape_up is exact only where the smaller
    side is d: the shared expert's 64×32 fc2 gets sqrt(2))."""
    md = MDConfig(muon_scale="shape_up", residual_init_scale=1 / math.sqrt(2 * LAYERS))
    rel = _relative_direction_updates(md)
    fc2 = [n for n in rel if "shared_experts.linear_fc2" in n]
    assert fc2 and any("local_experts" in n for n in rel) and any("router" in n for n in rel)
    bad = {n: r for n, r in rel.items() if not 0.5 <= r <= 2.0}
    assert not bad, bad
    # without the adjustment the residual-write projections move sqrt(2L) too fast
    rel_off = _relative_direction_updates(MDConfig(muon_scale="shape_up"))
    assert min(rel_off[n] / rel[n] for n in fc2) == pytest.approx(math.sqrt(2 * LAYERS), rel=0.02)
    assert max(rel_off[n] for n in fc2) > 3


def test_gain_lr_decays_to_the_run_floor():
    """MoE appendix: linear decay to min-LR 1e-5, an absolute floor per group; a fixed gain LR
    (1e-3) follows the schedule's shape between that floor and its own peak."""
    md = MDConfig(gain_lr=1e-3)
    group = {"max_lr": 1e-2, "min_lr": 1e-5}
    at = lambda lr: md.gain_lr_for({**group, "lr": lr})  # noqa: E731
    assert at(1e-2) == pytest.approx(1e-3, rel=1e-12)  # peak
    assert at(1e-5) == pytest.approx(1e-5, rel=1e-12)  # the floor, not 1e-3 · 1e-5/1e-2
    assert at((1e-2 + 1e-5) / 2) == pytest.approx((1e-3 + 1e-5) / 2, rel=1e-12)  # halfway
    assert at(0.0) >= 0.0  # warmup from 0
    assert MDConfig().gain_lr_for({**group, "lr": 3e-3}) == 3e-3  # default: the matrix LR


def test_lowrank_gains_refuse_the_gain_floor():
    with pytest.raises(ValueError, match="--md-gain-map direct-floor.*lowrank"):
        MDConfig(gains="lowrank", gain_map="direct-floor")
