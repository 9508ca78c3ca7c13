"""The reference MD step (Algorithm 2) against autograd, its invariants, and its base cases."""

import itertools

import pytest
import torch

from megatron.md import maps, reference
from megatron.md.base_steps import AdamHParams, MuonHParams
from megatron.md.config import GAIN_MAPS, GAINS, MatrixSpec, MDConfig, spec_for

GAIN_MODES = ("none", "scalar", "row", "col", "rowcol", "lowrank")


def _random_state(spec, shape, dtype=torch.float64, seed=0):
    """A state away from init (random direction and raw gains) for gradient checks."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen, dtype=dtype)
    st = reference.init_state(w, spec, "adam")
    for name in reference.GAIN_NAMES[spec.gains]:
        st[name] = st[name] + 0.3 * torch.randn(st[name].shape, generator=gen, dtype=dtype)
    if spec.gain_map == "direct-floor":
        for name in reference.GAIN_NAMES[spec.gains]:
            st[name].clamp_(min=0.05)
    return st


@pytest.mark.parametrize("gains,gain_map", list(itertools.product(GAIN_MODES, GAIN_MAPS)))
def test_split_gradient_matches_autograd(gains, gain_map):
    """Gain and direction gradients equal autograd's through W = Γ(ĝ) ⊙ Ŵ (float64)."""
    spec = MatrixSpec("frobenius", "init", gains, gain_map, gain_rank=3)
    st = _random_state(spec, (7, 5))
    names = reference.GAIN_NAMES[gains]
    leaves = {n: st[n].clone().requires_grad_(True) for n in names}
    wh = st["direction"].clone().requires_grad_(True)
    x = torch.randn(5, 4, dtype=torch.float64)

    def loss_of(w):
        return torch.tanh(w @ x).pow(2).sum() + (w * w.flip(0)).sum()

    w = reference.apply_gains(wh, {**st, **leaves}, spec)
    loss_of(w).backward()
    # G = dL/dW at the fused weight, as the model would produce it
    w_leaf = reference.fused_weight(st, spec).requires_grad_(True)
    loss_of(w_leaf).backward()
    gain_grads, g_dir = reference.split_gradient(w_leaf.grad, st, spec)
    torch.testing.assert_close(g_dir, wh.grad, rtol=1e-12, atol=1e-12)
    assert set(gain_grads) == set(names)
    for n in names:
        torch.testing.assert_close(gain_grads[n], leaves[n].grad, rtol=1e-12, atol=1e-12)


def _run_steps(spec, base, n_steps=6, shape=(24, 16), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen, dtype=dtype) / shape[1] ** 0.5
    st = reference.init_state(w, spec, base)
    base_hp = AdamHParams(lr=3e-2) if base == "adam" else MuonHParams(lr=3e-2)
    for _ in range(n_steps):
        g = torch.randn(shape, generator=gen, dtype=dtype)
        reference.md_step(w, g, st, spec, base_hp, AdamHParams(lr=1e-2))
    return w, st


@pytest.mark.parametrize("sphere", ["frobenius", "row", "col"])
@pytest.mark.parametrize("base", ["adam", "muon"])
@pytest.mark.parametrize("gains", ["rowcol", "scalar", "lowrank"])
def test_sphere_and_fusion_invariants(sphere, base, gains):
    spec = MatrixSpec(sphere, "init", gains, "softplus", gain_rank=2)
    w0 = torch.randn(24, 16, generator=torch.Generator().manual_seed(0)) / 4
    radius = reference.norms(w0, sphere)
    w, st = _run_steps(spec, base)
    rel = (reference.norms(st["direction"], sphere) - radius).abs() / radius
    assert float(rel.max()) <= 1e-6
    torch.testing.assert_close(w, reference.fused_weight(st, spec), rtol=0, atol=0)
    if gains == "rowcol":
        g_row = maps.phi(st["gain_row"], "softplus")
        g_col = maps.phi(st["gain_col"], "softplus")
        expect = torch.diag(g_row) @ st["direction"] @ torch.diag(g_col)
        torch.testing.assert_close(w, expect, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(g_row, torch.ones_like(g_row))  # the gains moved


@pytest.mark.parametrize("role", ["embedding", "output"])
def test_embedding_rows_unit_norm(role):
    """Embedding and LM-head directions at unit rows; the LM head with the matrices' row and
    column gains (the authors' runs: the fork's md_decoupling.py ``_resolve_gains_mode``), so
    its fused rows are the row gains times the column-gained unit rows; --md-output-gains none
    (the paper's text): no gains, unit fused rows."""
    spec = spec_for(role, MDConfig())
    w, st = _run_steps(spec, "adam", shape=(50, 12))
    torch.testing.assert_close(st["direction"].norm(dim=1), torch.ones(50), rtol=1e-6, atol=1e-6)
    assert spec.gains == ("rowcol" if role == "output" else "none")
    if role == "output":
        assert not torch.allclose(w.norm(dim=1), torch.ones(50), atol=1e-3)  # the gains moved
        bare = spec_for(role, MDConfig(output_gains="none"))
        assert bare.gains == "none" and spec_for("router", MDConfig()).gains == "rowcol"
        w, st = _run_steps(bare, "adam", shape=(50, 12))
    torch.testing.assert_close(w.norm(dim=1), torch.ones(50), rtol=1e-6, atol=1e-6)


def test_radius_shape_formula():
    spec = MatrixSpec("frobenius", "shape", "none", "softplus")
    w, st = _run_steps(spec, "adam", shape=(24, 16))
    assert abs(float(w.norm()) - 24**0.5) / 24**0.5 < 1e-6


def test_md_off_is_bit_identical_to_torch_adamw():
    spec = MatrixSpec("none", "init", "none", "softplus")
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 20, generator=gen)
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW(
        [p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, foreach=False
    )
    st = reference.init_state(w, spec, "adam")
    for _ in range(5):
        g = torch.randn(32, 20, generator=gen)
        p.grad = g.clone()
        opt.step()
        reference.md_step(w, g, st, spec, AdamHParams(1e-2, 0.9, 0.99, 1e-8), AdamHParams(1e-2))
    assert torch.equal(w, p.detach())


def test_md_off_is_bit_identical_to_emerging_optimizers_muon():
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    spec = MatrixSpec("none", "init", "none", "softplus", muon_scale="unit_rms_norm")
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(32, 20, generator=gen)
    p = torch.nn.Parameter(w.clone())
    opt = TensorParallelMuon(
        [p],
        lr=2e-2,
        momentum=0.95,
        nesterov=True,
        weight_decay=0.0,
        scale_mode="unit_rms_norm",
        fp32_matmul_prec="highest",
        split_qkv=False,
    )
    st = reference.init_state(w, spec, "muon")
    for _ in range(5):
        g = torch.randn(32, 20, generator=gen)
        p.grad = g.clone()
        opt.step()
        reference.md_step(w, g, st, spec, MuonHParams(lr=2e-2), AdamHParams(1e-2))
    assert torch.equal(w, p.detach())


@pytest.mark.parametrize(
    "kwargs,flag",
    [
        (dict(sphere="ball"), "--md-sphere"),
        (dict(gains="diag"), "--md-gains"),
        (dict(gain_map="tanh"), "--md-gain-map"),
        (dict(radius="huge"), "--md-radius"),
        (dict(gains="lowrank", gain_rank=0), "--md-gain-rank"),
        (dict(muon_scale="spectral"), "--muon-scale-mode"),
        (dict(embedding_norm="col"), "--md-embedding-norm"),
    ],
)
def test_bad_config_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        MDConfig(**kwargs)


def test_bad_config_lists_allowed_values():
    with pytest.raises(ValueError, match="frobenius, row, col, hidden, none"):
        MDConfig(sphere="ball")


def test_md_on_1d_tensor_and_zero_radius_raise():
    spec = MatrixSpec("frobenius", "init", "rowcol", "softplus")
    with pytest.raises(ValueError, match="2-D"):
        reference.init_state(torch.ones(5), spec, "adam")
    with pytest.raises(ValueError, match="radius"):
        reference.init_state(torch.zeros(4, 3), spec, "adam")


# ---- Muon's Q/K/V split (megatron's default --muon-split-qkv): a fused QKV matrix of 2 query
# groups, each 4 query rows, 2 key rows, 2 value rows (the interleaved layout of linear_qkv)
QKV = (4, 2, 2)


def _qkv_blocks(x: torch.Tensor) -> list[torch.Tensor]:
    """The Q, K and V rows of every query group, as megatron's Muon cuts them."""
    return [b.reshape(-1, x.shape[1]) for b in torch.split(x.view(2, 8, -1), list(QKV), dim=1)]


def test_md_off_with_qkv_split_is_bit_identical_to_megatron_muon():
    """MD off on a split QKV matrix: megatron's TensorParallelMuon(split_qkv=True) to the bit
    (each block its own Newton–Schulz call and unit_rms_norm scale)."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    spec = MatrixSpec("none", "init", "none", "softplus", muon_scale="unit_rms_norm")
    spec_split = MatrixSpec(**{**spec.__dict__, "row_blocks": QKV})
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(16, 20, generator=gen)
    p = torch.nn.Parameter(w.clone())
    opt = TensorParallelMuon(
        [p], lr=2e-2, momentum=0.95, nesterov=True, weight_decay=0.0, split_qkv=True,
        is_qkv_fn=lambda _: True, qkv_split_shapes=list(QKV), scale_mode="unit_rms_norm",
        fp32_matmul_prec="highest",
    )  # fmt: skip
    st = reference.init_state(w, spec_split, "muon")
    w_fused, st_fused = w.clone(), reference.init_state(w, spec, "muon")
    for _ in range(4):
        g = torch.randn(16, 20, generator=gen)
        p.grad = g.clone()
        opt.step()
        reference.md_step(w, g, st, spec_split, MuonHParams(lr=2e-2), AdamHParams(1e-2))
        reference.md_step(w_fused, g, st_fused, spec, MuonHParams(lr=2e-2), AdamHParams(1e-2))
    assert torch.equal(w, p.detach())
    assert not torch.allclose(w, w_fused)  # the split is not the fused Newton–Schulz


@pytest.mark.parametrize("sphere", ["frobenius", "row", "col"])
@pytest.mark.parametrize("radius", ["init", "shape"])
def test_qkv_split_gives_each_block_its_own_sphere(sphere, radius):
    """Q, K and V each stay on their own sphere: radius = the block's norm at creation (or the
    shape formula of the block's own shape), whatever the gains and the other blocks do."""
    spec = MatrixSpec(sphere, radius, "rowcol", "softplus", tangent_grad=True, row_blocks=QKV)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(16, 20, generator=gen) / 20**0.5
    w[8:12] *= 3  # the second group's Q rows: blocks start at different norms
    st = reference.init_state(w, spec, "muon")
    before = [reference.norms(b, sphere) for b in _qkv_blocks(st["direction"])]
    for _ in range(4):
        reference.md_step(w, torch.randn(16, 20, generator=gen), st, spec, MuonHParams(3e-2),
                          AdamHParams(1e-2))  # fmt: skip
    for b, (blk, r0) in enumerate(zip(_qkv_blocks(st["direction"]), before)):
        now = reference.norms(blk, sphere)
        if radius == "shape":
            rows = blk.shape[0]
            n = {"frobenius": 1, "row": rows, "col": 20}[sphere]
            r0 = torch.full_like(now, max(rows, 20) ** 0.5 / n**0.5)
        torch.testing.assert_close(now, r0, rtol=1e-5, atol=0)
    torch.testing.assert_close(w, reference.fused_weight(st, spec), rtol=0, atol=0)


def test_qkv_split_muon_scale_and_relative_update_per_block():
    """sphere_rms scales each block by its own radius / sqrt(min(rows, d_in)), so every block
    turns by the LR: ‖ΔŴ_b‖/‖Ŵ_b‖ ≈ lr for Q, K and V alike (first step, small LR)."""
    spec = MatrixSpec("frobenius", "init", "none", "softplus", muon_scale="sphere_rms",
                      row_blocks=QKV)  # fmt: skip
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(16, 20, generator=gen) / 20**0.5
    st = reference.init_state(w, spec, "muon")
    scales = reference.muon_scales(st, spec)
    for s, blk in zip(scales, _qkv_blocks(st["direction"])):
        assert float(s) == pytest.approx(float(blk.norm()) / min(blk.shape) ** 0.5, rel=1e-6)
    before = [b.clone() for b in _qkv_blocks(st["direction"])]
    lr = 1e-4
    reference.md_step(w, torch.randn(16, 20, generator=gen), st, spec, MuonHParams(lr),
                      AdamHParams(1e-2))  # fmt: skip
    for a, b in zip(before, _qkv_blocks(st["direction"])):
        assert float((b - a).norm() / a.norm()) / lr == pytest.approx(1.0, rel=0.05)


def test_shape_up_follows_a_scaled_init():
    """MoE appendix: a residual-write projection initialized at σ/sqrt(2L) has a sphere that
    much smaller, and its shape_up factor is lowered with it (init_scale), whether the radius
    is the init norm or the shape formula (which init_scale scales too: the authors'
    ``hypersphere_scale_out_proj_init``); a unit radius ignores it."""
    from megatron.md.base_steps import muon_scale_factor

    st = {"direction": torch.ones(8, 32), "radius": torch.tensor(2.0)}
    spec = MatrixSpec("frobenius", "shape", "rowcol", "softplus", init_scale=0.25)
    r = reference.shape_radius((8, 32), spec, torch.float64, "cpu")
    assert float(r) == pytest.approx(0.25 * 32**0.5, rel=1e-12)
    for radius, expect in (("init", 0.25), ("shape", 0.25), ("unit", 1.0)):
        spec = MatrixSpec("frobenius", radius, "rowcol", "softplus", muon_scale="shape_up",
                          init_scale=0.25)  # fmt: skip
        got = reference.muon_scales(st, spec)
        assert got == [muon_scale_factor("shape_up", 8, 32) * expect]


@pytest.mark.parametrize("variant", ["muown-unit", "muown-angular"])
def test_muown_unit_readings(variant):
    """The earlier reading of Muown's description (muown-unit) and its angular variant: W =
    diag(m) D with D at unit rows and m the row norms at creation (W unchanged); the direction's
    Muon step is projected onto each row's tangent space, so the rows grow (‖d − ηu‖² = 1 +
    η²‖u‖²) or go back to unit norm (angular); W = diag(m) D throughout."""
    spec = spec_for("matrix", MDConfig(variant=variant, muon_scale="shape_scaling"))
    assert (spec.sphere, spec.gains, spec.gain_map) == ("row", "row", "direct")
    assert spec.tangent_update and spec.project == (variant == "muown-angular")
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(12, 20, generator=gen) / 20**0.5
    w0 = w.clone()
    st = reference.init_state(w, spec, "muon")
    torch.testing.assert_close(reference.fused_weight(st, spec), w0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st["gain_row"], w0.norm(dim=1))
    torch.testing.assert_close(st["direction"].norm(dim=1), torch.ones(12))
    for _ in range(3):
        reference.md_step(w, torch.randn(12, 20, generator=gen), st, spec, MuonHParams(5e-2),
                          AdamHParams(1e-2))  # fmt: skip
    rows = st["direction"].norm(dim=1)
    if variant == "muown-unit":
        assert float(rows.min()) > 1 + 1e-4  # the norm grows: an implicit LR decay
    else:
        torch.testing.assert_close(rows, torch.ones(12), rtol=1e-6, atol=0)
    torch.testing.assert_close(w, reference.fused_weight(st, spec), rtol=0, atol=0)
    assert (
        MDConfig(variant=variant).variant == variant
        and spec_for("embedding", MDConfig(variant=variant)).sphere == "none"
    )


def _authors_muown_step(w, grad, st, lr, momentum, betas, eps, ns, qkv=None):
    """One step of the authors' Muown for one matrix (feat/scaling-sweeps
    megatron/core/optimizer/muown.py, ``Muown.step`` with Nesterov, no weight decay), written
    out here from their per-parameter arithmetic: W = g·v/‖v‖ per row with the state (g, ‖v‖,
    m_v, m_g, v_g); ``ns`` orthogonalizes one matrix; ``qkv``: rows per query group (q, k, v)
    when the fused QKV is split for Newton–Schulz."""
    st["step"] += 1
    g, v_norm = st["g"], st["v_norm"]
    u = w / g
    v = u * v_norm
    grad_g = (grad * u).sum(dim=1, keepdim=True)
    grad_v = (g / v_norm) * (grad - u * grad_g)
    st["m_v"].mul_(momentum).add_(grad_v)
    d = grad_v.add(st["m_v"], alpha=momentum)
    if qkv is None:
        upd = ns(d) * 0.2 * max(d.shape) ** 0.5
    else:
        groups = d.shape[0] // sum(qkv)
        parts = torch.split(d.view(groups, sum(qkv), -1), list(qkv), dim=1)
        outs = []
        for part in parts:
            x = part.reshape(-1, d.shape[1])
            outs.append((ns(x) * 0.2 * max(x.shape) ** 0.5).view(groups, -1, d.shape[1]))
        upd = torch.cat(outs, dim=1).view(d.shape)
    v_new = v - lr * upd
    b1, b2 = betas
    st["m_g"].mul_(b1).add_(grad_g, alpha=1 - b1)
    st["v_g"].mul_(b2).addcmul_(grad_g, grad_g, value=1 - b2)
    bc1, bc2 = 1 - b1 ** st["step"], 1 - b2 ** st["step"]
    g.addcdiv_(st["m_g"] / bc1, (st["v_g"] / bc2).sqrt().add_(eps), value=-lr)
    st["v_norm"] = v_new.norm(dim=1, keepdim=True)
    w.copy_(g * (v_new / st["v_norm"]))


@pytest.mark.parametrize("qkv", [None, (4, 2, 2)])
def test_muown_is_the_authors_muown(qkv):
    """--md-variant muown (``--optimizer muown``) is the authors' Muown step for step (their
    muown.py, ported above from its per-parameter math): weight normalization W = g·v/‖v‖ per
    row, g the row norms at the start, v's Muon step on the tangent-projected, g/‖v‖-scaled
    gradient with Moonlight's 0.2·sqrt(max(d_out, d_in)) scale (per Q/K/V block when split), g's
    Adam at the same LR, v's row norms free. fp32 (emerging-optimizers' Newton–Schulz takes
    fp32 only), the same Newton–Schulz on both sides: equal to fp32 rounding after 6 steps (the
    two compute W in another order; seen ≤ 3e-7)."""
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz

    spec = spec_for("matrix", MDConfig(variant="muown"), row_blocks=qkv or ())
    assert spec.weight_norm and spec.tangent_grad and not spec.project
    assert (spec.sphere, spec.gains, spec.gain_map, spec.muon_scale) == (
        "row", "row", "direct", "rms_match")  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 24, generator=gen) / 24**0.5
    w[:4] *= 3  # rows of unequal norms
    ref_w = w.clone()
    lr, betas, eps = 2e-2, (0.9, 0.95), 1e-8
    st = reference.init_state(w, spec, "muon")
    torch.testing.assert_close(reference.fused_weight(st, spec), ref_w, rtol=1e-6, atol=1e-7)
    norms0 = ref_w.norm(dim=1, keepdim=True)
    theirs = {"step": 0, "g": norms0.clone(), "v_norm": norms0.clone(),
              "m_v": torch.zeros_like(ref_w), "m_g": torch.zeros_like(norms0),
              "v_g": torch.zeros_like(norms0)}  # fmt: skip

    def ns(x):
        return newton_schulz(x, steps=5, coefficient_type="quintic")

    for _ in range(6):
        grad = torch.randn(16, 24, generator=gen)
        reference.md_step(w, grad, st, spec, MuonHParams(lr, momentum=0.95, nesterov=True),
                          AdamHParams(lr, *betas, eps=eps))  # fmt: skip
        _authors_muown_step(ref_w, grad, theirs, lr, 0.95, betas, eps, ns, qkv)
    torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(st["gain_row"], theirs["g"].view(-1), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(st["direction"].norm(dim=1), theirs["v_norm"].view(-1),
                               rtol=2e-6, atol=1e-6)  # fmt: skip
    assert float((theirs["v_norm"] / norms0 - 1).abs().max()) > 1e-3  # v's rows are free


@pytest.mark.parametrize("base", ["adam", "muon"])
@pytest.mark.parametrize("gains", GAINS)
def test_every_state_field_is_declared(gains, base):
    """state.MatrixState declares every field the reference and the engine create."""
    from megatron.md.engine.engine import Domain, Engine, Member
    from megatron.md.sliced import SliceMD
    from megatron.md.state import MatrixState

    declared = set(MatrixState.__annotations__)
    spec = spec_for("matrix", MDConfig(gains=gains))
    st = reference.init_state(torch.randn(6, 4), spec, base)
    assert set(st) <= declared, set(st) - declared
    for fp32_mode in (False, True):
        m = Member(SliceMD((6, 4), 0, 24, spec, base), torch.nn.Parameter(torch.randn(24)),
                   fp32_mode, {}, {}, 0, "d")  # fmt: skip
        Engine([m], {"d": Domain(None)}).init_state(lambda key, buf: None)
        made = {*m.state, *m.md_state}
        assert made <= declared and "radius" in made and "step" in made, made - declared


def test_muonh_is_emerging_optimizers_muon_hyperball():
    """--optimizer muonh (MuonH, the Hyperball family's Muon: ‖W‖ and ‖ΔW‖ fixed) is MD with
    the Frobenius sphere at the init norm, no gains and the ``hyperball`` scale (the
    orthogonalized update at the sphere's norm): step for step emerging-optimizers 0.3.0's
    ``MuonHyperball`` (fused QKV unsplit, no weight decay), to fp32 rounding after 6 steps."""
    from emerging_optimizers.orthogonalized_optimizers import MuonHyperball

    from megatron.md.train.recipes import OPTIMIZER_ALIASES

    flags = dict(f.split("=", 1) for f in OPTIMIZER_ALIASES["muonh"] if "=" in f)
    cfg = MDConfig(sphere=flags["--md-sphere"], radius=flags["--md-radius"],
                   gains=flags["--md-gains"], muon_scale=flags["--muon-scale-mode"])  # fmt: skip
    spec = spec_for("matrix", cfg)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(12, 20, generator=gen) / 20**0.5
    p = torch.nn.Parameter(w.clone())
    theirs = MuonHyperball([p], lr=3e-2, momentum=0.95, weight_decay=0.0, nesterov=True,
                           fp32_matmul_prec="highest")  # fmt: skip
    st = reference.init_state(w, spec, "muon")
    r0 = float(w.norm())
    for _ in range(6):
        grad = torch.randn(12, 20, generator=gen)
        p.grad = grad.clone()
        theirs.step()
        reference.md_step(w, grad, st, spec, MuonHParams(3e-2), AdamHParams(1e-3))
    torch.testing.assert_close(w, p.detach(), rtol=2e-6, atol=1e-6)
    assert float(w.norm()) == pytest.approx(r0, rel=1e-6)  # ‖W‖ fixed
