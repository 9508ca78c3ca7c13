"""NorMuon (``--optimizer normuon``): megatron-core's ``TensorParallelAdaptiveMuon`` with the
per-neuron second moment, through the seams of ``compat.SEAMS`` that make it run (Muon's scale
once) and checkpoint (its reduced second moment saved at the parameter's shape). The update
rule is written out below from NorMuon's definition as emerging-optimizers 0.3.0 implements
it (``adaptive_muon.py``: Nesterov momentum, Newton–Schulz, an EMA of the squared update's
mean along the longer dimension, rsqrt, the result matched to the orthogonalized update's
Frobenius norm, Muon's scale, decoupled weight decay)."""

import copy

import pytest
import torch
from _seams import restore_seams, saved_seams
from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import AdaptiveMuon
from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz
from megatron.core.optimizer.emerging_optimizers import TensorParallelAdaptiveMuon

from megatron.md import compat

LR, WD, MOM, BETA2, EPS = 0.02, 0.1, 0.95, 0.95, 1e-8
SHAPES = [(24, 16), (16, 24), (16, 16)]


@pytest.fixture
def normuon():
    """megatron's class with megatron-md's training seams applied (NorMuon's among them), every
    replaced attribute restored afterwards."""
    assert sum(s.path.startswith("TensorParallelAdaptiveMuon.") for s in compat.SEAMS) == 3
    saved = saved_seams()
    compat.apply("training")
    yield TensorParallelAdaptiveMuon
    restore_seams(saved)


def make(cls, params):
    return cls(params, lr=LR, momentum=MOM, nesterov=True, weight_decay=WD,
               fp32_matmul_prec="highest", moment2_method="normuon", beta2=BETA2,
               eps=EPS)  # fmt: skip


def reference_step(w, g, state):
    """One NorMuon step on ``w`` (in place), written out."""
    m = state.setdefault("m", torch.zeros_like(w))
    keep_rows = w.shape[0] >= w.shape[1]
    kept = (w.shape[0], 1) if keep_rows else (1, w.shape[1])
    v = state.setdefault("v", torch.zeros(kept))
    w.mul_(1 - LR * WD)
    m.mul_(MOM).add_((1 - MOM) * g)
    u = (1 - MOM) * g + MOM * m  # Nesterov: g.lerp(m, MOM)
    o = newton_schulz(u, steps=5, coefficient_type="quintic")
    v.mul_(BETA2).add_((1 - BETA2) * o.square().mean(dim=1 if keep_rows else 0, keepdim=True))
    n = o * v.clamp_min(EPS).rsqrt()
    n = n * (o.norm() / n.norm().clamp_min(EPS))
    scale = max(w.shape) ** 0.5  # Muon's "spectral" scale (emerging-optimizers muon.py)
    w.sub_(LR * scale * n)


def run(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def test_normuon_step_is_the_written_out_rule_and_emerging_optimizers(normuon):
    """Three steps on three shapes (rows > cols, cols > rows, square): megatron's class with
    the seams = the rule written out = emerging-optimizers' own AdaptiveMuon (fp32, 1e-6
    relative: Newton–Schulz in fp32 "highest", the same arithmetic in another order)."""
    torch.manual_seed(0)
    init = [torch.randn(*s) / 4 for s in SHAPES]
    grads = [[torch.randn(*s) for s in SHAPES] for _ in range(3)]
    ours = [torch.nn.Parameter(w.clone()) for w in init]
    run(make(normuon, ours), ours, grads)
    ref = [w.clone() for w in init]
    states = [{} for _ in SHAPES]
    for step_grads in grads:
        for w, g, st in zip(ref, step_grads, states):
            with torch.no_grad():
                reference_step(w, g, st)
    upstream = [torch.nn.Parameter(w.clone()) for w in init]
    opt = AdaptiveMuon(upstream, lr=LR, momentum=MOM, weight_decay=WD, nesterov=True,
                       fp32_matmul_prec="highest", moment2_method="normuon", beta2=BETA2,
                       eps=EPS, scale_mode="spectral")  # fmt: skip
    run(opt, upstream, grads)
    for a, b, c, w0 in zip(ours, ref, upstream, init):
        moved = (b - w0).norm()
        assert moved > 1e-2  # the steps did something
        assert (a.detach() - b).norm() / moved < 1e-6
        assert (a.detach() - c.detach()).norm() / moved < 1e-6


def test_without_the_seam_megatrons_class_fails_its_first_step():
    """Why the scale seam exists (megatron-core 0.19.2 with emerging-optimizers 0.3.0)."""
    p = torch.nn.Parameter(torch.randn(8, 4))
    p.grad = torch.randn(8, 4)
    orig = vars(TensorParallelAdaptiveMuon).get("_apply_muon_scale")
    orig = getattr(orig, "__md_seam__", TensorParallelAdaptiveMuon._apply_muon_scale)
    with pytest.raises(AttributeError, match="scale_mode"):
        orig(make(TensorParallelAdaptiveMuon, [p]), p.grad, 8, 4)


def test_the_second_moment_round_trips_through_a_state_dict(normuon):
    """Saved at the parameter's shape (what megatron's torch_dist sharding needs), loaded back
    to NorMuon's reduced shape bit for bit; the next step of the loaded optimizer equals the
    original's."""
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(*s)) for s in SHAPES]
    grads = [[torch.randn(*s) for s in SHAPES] for _ in range(3)]
    opt = make(normuon, params)
    run(opt, params, grads[:2])
    sd = opt.state_dict()
    assert [sd["state"][i]["moment2_buffer"].shape for i in range(3)] == [
        torch.Size(s) for s in SHAPES]  # fmt: skip
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = make(normuon, copies)
    other.load_state_dict(copy.deepcopy(sd))  # as from disk: torch's load keeps the tensors
    for p, q in zip(params, copies):
        a, b = opt.state[p]["moment2_buffer"], other.state[q]["moment2_buffer"]
        assert a.shape == b.shape and a.shape != p.shape and torch.equal(a, b)
    run(opt, params, grads[2:])
    run(other, copies, grads[2:])
    assert all(torch.equal(p, q) for p, q in zip(params, copies))
