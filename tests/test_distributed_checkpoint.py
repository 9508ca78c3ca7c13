"""MD state through megatron-core's torch_dist checkpoints (tests/distributed/md_ckpt.py):
save at 2 ranks after 2 steps, load at 1/2/4 ranks into a model of another init, the next 3
steps equal the uninterrupted run; a checkpoint without MD state loads into an MD run with the
model unchanged."""

import re

import pytest
from _torchrun import Batches, torchrun

pytestmark = pytest.mark.distributed

CONFIGS = {
    "zero1-fp32": ("--dist", "zero1"),
    "zero1-bf16": ("--dist", "zero1", "--dtype", "bf16"),
    "zero1-moe": ("--dist", "zero1", "--experts", "4"),
    # megatron-core's Float16Optimizer maps only bf16 params to checkpoint keys
    # (optimizer.py, Float16OptimizerWithFloat16Params.sharded_state_dict), so layer-wise
    # checkpoints need bf16 params, as real runs use
    "layerwise-muon-bf16": ("--optimizer", "muon", "--dist", "layerwise", "--dtype", "bf16"),
    "replicated-fp32": ("--dist", "replicated"),
    # megatron's partial distributed optimizer (--num-distributed-optimizer-instances 2): at 2
    # ranks one rank per instance, each holding every matrix
    "zero1-instances": ("--dist", "zero1", "--instances", "2"),
    # --dist-ckpt-optim-fully-reshardable (bf16: fp32 main params, as a real run's)
    "zero1-bf16-fully-reshardable": (
        "--dist",
        "zero1",
        "--dtype",
        "bf16",
        "--sharding",
        "fully_reshardable",
    ),
}
LOADS = {
    "zero1-fp32": (1, 2, 4),
    "zero1-bf16": (4,),
    "zero1-moe": (4,),
    # at 2 ranks exact: the load's model is another init, whose radius gave MuonMD's update
    # scale after a load before (0.0022 relative after 3 steps, within the bf16 tolerance at 4)
    "layerwise-muon-bf16": (2, 4),
    "replicated-fp32": (4,),
    "zero1-instances": (4,),  # two ranks per instance
    "zero1-bf16-fully-reshardable": (1, 2),
}
# fp32: ≤ 1e-6 relative (seen ≤ 1.3e-7; 0.0 at the same world size). bf16 weights: within one
# bf16 rounding (2^-8) relative (seen ≤ 3e-10 at 4 ranks; 6.6e-4 at 1 rank, MD, either
# format: the 2-rank sums in another order, some weights rounded to the next bf16 value).
TOL = {"fp32": 1e-6, "bf16": 2**-8}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """md_ckpt.py jobs batched per world size (tests/_torchrun.py:Batches); the first request
    saves every configuration's checkpoint (2 ranks, one launch)."""
    root = tmp_path_factory.mktemp("md_ckpt")
    d = {name: str(root / name) for name in CONFIGS}
    jobs = [(2, "save", d[n], *c) for n, c in CONFIGS.items()]
    jobs += [(w, "load", d[n], *CONFIGS[n]) for n, ws in LOADS.items() for w in ws]
    jobs += [(4, "continue", d["zero1-fp32"], *CONFIGS["zero1-fp32"])]
    jobs += [(4, "continue", d["zero1-fp32"], *CONFIGS["zero1-fp32"], "--md-row-norms", "none")]
    jobs += [(2, "load", d["zero1-fp32"], *CONFIGS["zero1-fp32"], "--fused-step")]
    jobs += [(1, "load", d["zero1-instances"], *CONFIGS["zero1-fp32"])]
    full = "zero1-bf16-fully-reshardable"
    jobs += [(w, "load", d[full], *CONFIGS[full], "--plain") for w in (1, 2)]
    run = Batches("md_ckpt.py", jobs)
    for n, c in CONFIGS.items():
        assert run(2, "save", d[n], *c)["world"] == 2
    return run, d


@pytest.mark.parametrize(
    "name,nproc", [(n, w) for n, ws in LOADS.items() for w in ws], ids=lambda v: str(v)
)
def test_resume_equals_uninterrupted_run(ckpt, name, nproc):
    run, d = ckpt
    res = run(nproc, "load", d[name], *CONFIGS[name])
    assert res["world"] == nproc and res["has_md"]
    assert res["worst_rel"] <= TOL["bf16" if "bf16" in name else "fp32"]
    if nproc == 2:
        assert res["worst_rel"] == 0.0  # same sharding: exact


def test_eager_checkpoint_resumes_with_fused_kernels(ckpt):
    """--md-fused-step is execution only: a checkpoint saved by the eager step resumes with the
    compiled kernels (and the uninterrupted run they are compared with uses them too)."""
    run, d = ckpt
    res = run(2, "load", d["zero1-fp32"], *CONFIGS["zero1-fp32"], "--fused-step")
    assert res["has_md"] and res["worst_rel"] <= TOL["fp32"]


def test_partial_distributed_optimizer_checkpoint_loads_without_instances(ckpt):
    """A checkpoint of 2 distributed-optimizer instances (only instance 0 writes MD's state, as
    megatron's own: before, both instances wrote it as replica 0 and megatron refused the save)
    resumes in one instance, the uninterrupted run's weights to fp32 rounding."""
    run, d = ckpt
    res = run(1, "load", d["zero1-instances"], *CONFIGS["zero1-fp32"])
    assert res["has_md"] and res["worst_rel"] <= TOL["fp32"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_fully_reshardable_checkpoint_resumes_without_md(ckpt, nproc):
    """megatron's own ZeRO-1 optimizer (torch's Adam, no TE/Apex) through the fully-reshardable
    format: megatron-core 0.19.2's load left out the step its Adam state holds as a tensor and
    then read it (a KeyError at every resume, with MD too; ``wrappers.set_states_without_step``)."""
    run, d = ckpt
    res = run(nproc, "load", d["zero1-bf16-fully-reshardable"],
              *CONFIGS["zero1-bf16-fully-reshardable"], "--plain")  # fmt: skip
    assert not res["has_md"] and res["worst_rel"] <= TOL["bf16"]
    if nproc == 2:
        assert res["worst_rel"] == 0.0


def test_continual_training_from_checkpoint_without_md(ckpt):
    """Loading a plain (AdamW) checkpoint into an MD run keeps every hidden matrix's function
    (radius = its loaded norm, gains 1) and the LM head's (its unit rows' norms go into its row
    gains, which the authors' runs give it: ``--md-output-gains matrix``), and changes exactly
    one thing: the recipe's unit-norm embedding rows (recipe "Special parameters": no gain
    absorbs their norms). Measured on the loss of a fixed batch after a step at LR 0 (only the
    constraints act)."""
    run, d = ckpt
    res = run(4, "continue", d["zero1-fp32"], *CONFIGS["zero1-fp32"])
    assert not res["has_md"]
    assert res["weights_changed"] == 0.0  # loading itself writes the loaded weights as they are
    assert res["gains_one"] and res["radius_err"] <= 1e-6  # radius = the loaded norm
    assert res["head_gain_err"] <= 1e-6  # the LM head's row gains = its loaded row norms
    assert res["finite_after_step"]
    # the converted model is the loaded one with unit embedding rows, nothing else
    assert res["loss_converted"] == pytest.approx(res["loss_unit_rows"], rel=1e-6)
    assert abs(res["loss_converted"] - res["loss_loaded"]) > 1e-4  # and that is a change
    # without the row constraints the conversion keeps the function (fp32 rounding of Γ = 1)
    res = run(4, "continue", d["zero1-fp32"], *CONFIGS["zero1-fp32"], "--md-row-norms", "none")
    assert res["loss_converted"] == pytest.approx(res["loss_loaded"], rel=1e-6)


def test_other_md_settings_are_refused_before_loading(ckpt):
    _, d = ckpt
    out = torchrun("md_ckpt.py", 2, "load", d["zero1-fp32"], "--md-gains", "row", expect_fail=True)
    assert "the checkpoint's --md-gains rowcol, this run's --md-gains row" in out


def test_only_settings_that_change_what_the_state_means_are_checked():
    """A resumed run may change rates, scales and how the step runs (a re-warming run changes
    the gains' LR); a change of what the saved state means is named with its flags."""
    import dataclasses

    from megatron.md.checkpoint import check_same_config
    from megatron.md.config import MDConfig

    saved = dataclasses.asdict(MDConfig())
    rates = MDConfig(gain_lr_mult=0.5, gain_lr=1e-3, gain_betas=(0.9, 0.95), gain_eps=1e-6,
                     muon_scale="shape_up", tangent_grad=True, fused_step="on",
                     residual_init_scale=0.5, lowrank_init_std=0.1)  # fmt: skip
    check_same_config(saved, rates)
    for changed, said in (
        (MDConfig(sphere="row"), "--md-sphere frobenius, this run's --md-sphere row"),
        (MDConfig(split_qkv=False), "Q/K/V split (the default), this run's --muon-no-split-qkv"),
        (MDConfig(variant="muown"), "--md-variant md, this run's --md-variant muown"),
    ):
        with pytest.raises(ValueError, match=re.escape(said)):
            check_same_config(saved, changed)
    # a format-1 checkpoint's "muown" is the earlier reading, now muown-unit
    old = {**dataclasses.asdict(MDConfig(variant="muown-unit")), "variant": "muown"}
    check_same_config(old, MDConfig(variant="muown-unit"))
    with pytest.raises(ValueError, match="--md-variant muown-unit, this run's --md-variant muown"):
        check_same_config(old, MDConfig(variant="muown"))
    check_same_config({**old, "format": 2}, MDConfig(variant="muown"))
