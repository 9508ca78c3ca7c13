"""enable_md in one process: bad settings are refused up front, MD timers are recorded."""

import contextlib
import copy
import sys
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "md_decoupling"))
import cpu_demo  # noqa: E402

from megatron.md.config import MDConfig  # noqa: E402
from megatron.md.testing import tiny_gpt  # noqa: E402


def _build(**overrides):
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = tiny_gpt(3, 32, 2, 16)
    ddpc = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    dmodel = DDP(model.config, ddpc, model)
    kw = dict(optimizer="adam", lr=1e-2, weight_decay=0.0, bf16=False, muon_split_qkv=False)
    kw.update(overrides)
    return dmodel, get_megatron_optimizer(OptimizerConfig(**kw), [dmodel])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(weight_decay=0.1), "--weight-decay must be 0"),
        (dict(optimizer="muon", muon_split_qkv=False), "follows --muon-split-qkv"),
        (
            dict(optimizer="muon", muon_split_qkv=True, muon_extra_scale_factor=2.0),
            "--muon-extra-scale-factor",
        ),
    ],
)
def test_bad_settings_are_refused_before_any_step(overrides, message):
    from megatron.md.enable import enable_md

    dmodel, opt = _build(**overrides)
    with pytest.raises(ValueError, match=message):
        enable_md(opt, [dmodel], MDConfig())


def test_one_compatibility_check_for_the_flags_and_enable_md():
    """The flag parser and enable_md refuse through the same ``compatibility.refusal``: each
    unsupported setting, read off the flags or off megatron's configs, gets one message."""
    from argparse import Namespace

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron.md import compatibility as c

    flags = dict(optimizer="adam", weight_decay=0.0, fp16=False, tensor_model_parallel_size=1,
                 expert_tensor_parallel_size=None, num_experts=None, muon_tp_mode="duplicated",
                 md_adam_layer_wise=False, md_variant="md")  # fmt: skip
    cases = [
        (dict(weight_decay=0.1), dict(weight_decay=0.1), {}, "--weight-decay must be 0"),
        (dict(fp16=True), dict(fp16=True), {}, "--fp16"),
        (dict(use_torch_fsdp2=True), {}, dict(use_megatron_fsdp=True), "FSDP"),
        (dict(optimizer="muon", tensor_model_parallel_size=2, muon_tp_mode="blockwise"),
         dict(optimizer="muon", muon_tp_mode="blockwise"), {}, "--muon-tp-mode duplicated"),
    ]  # fmt: skip
    for from_flags, opt_cfg, ddp_cfg, needle in cases:
        via_flags = c.refusal(c.Setup.from_args(Namespace(**{**flags, **from_flags})))
        cfg = OptimizerConfig(**{"optimizer": "adam", "lr": 1e-3, "weight_decay": 0.0, **opt_cfg})
        ddp = DistributedDataParallelConfig(**ddp_cfg) if ddp_cfg else None
        tp = "muon_tp_mode" in opt_cfg
        via_enable = c.refusal(c.Setup.from_megatron(cfg, ddp, MDConfig(), tp))
        assert via_flags == via_enable and needle in via_flags
    assert c.refusal(c.Setup.from_args(Namespace(**flags))) is None


def test_bad_md_value_is_refused():
    from megatron.md.enable import enable_md

    dmodel, opt = _build()
    with pytest.raises(ValueError, match="--md-gains"):
        enable_md(opt, [dmodel], MDConfig(gains="diagonal"))


def test_md_phases_are_timed_with_megatron_timers():
    from megatron.core.timers import Timers

    from megatron.md.enable import enable_md

    dmodel, opt = _build()
    timers = Timers(log_level=2, log_option="minmax")
    opt.config.timers = timers
    enable_md(opt, [dmodel], MDConfig())
    x = torch.randint(0, 256, (2, 16))
    dmodel.zero_grad_buffer()
    cpu_demo.lm_loss(dmodel, x, x).backward()
    dmodel.finish_grad_sync()
    opt.step()
    for name in ("md-step", "md-fuse"):
        assert timers._timers[name].elapsed(reset=False) > 0


def test_nonfinite_gradients_skip_the_step():
    """With the guard (megatron's NaN check off), a NaN gradient skips the step: no weight or
    MD state changes; the next finite step is applied."""
    from megatron.md.enable import enable_md
    from megatron.md.train import nonfinite

    dmodel, opt = _build()
    enable_md(opt, [dmodel], MDConfig())
    nonfinite.guard(opt)
    x = torch.randint(0, 256, (2, 16))

    def grads(poison: bool):
        dmodel.zero_grad_buffer()
        cpu_demo.lm_loss(dmodel, x, x).backward()
        dmodel.finish_grad_sync()
        if poison:
            next(p for p in dmodel.parameters() if p.ndim == 2).main_grad.view(-1)[3] = float("nan")

    grads(False)
    opt.step()  # creates the state
    before = [p.detach().clone() for p in dmodel.parameters()]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.optimizer.md_state.items()}
    grads(True)
    ok, grad_norm, _ = opt.step()
    assert not ok and grad_norm is None and nonfinite.guard.skipped == 1
    assert all(torch.equal(a, p) for a, p in zip(before, dmodel.parameters()))
    for p, s in opt.optimizer.md_state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
    grads(False)
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm > 0
    assert not all(torch.equal(a, p) for a, p in zip(before, dmodel.parameters()))


def test_fused_step_auto_rule():
    """--md-fused-step auto (the default): the compiled step for an optimizer instance with at
    least 2^24 MD elements on the rank (181M's hidden matrices: ~4.7e7), the eager one for
    small models; on a GPU for AdamMD and MuonMD (checked against the reference and faster
    there, H200 2026-11-26), on a CPU for AdamMD only; on/off force it."""
    from megatron.md.config import FUSED_MIN_ELEMENTS

    auto = MDConfig()
    assert auto.fused_step == "auto" and auto.use_fused("cpu", FUSED_MIN_ELEMENTS)
    assert not auto.use_fused("cpu", FUSED_MIN_ELEMENTS - 1)
    assert not auto.use_fused("cuda", FUSED_MIN_ELEMENTS - 1)
    assert MDConfig(fused_step="on").use_fused("cuda", 1) and not MDConfig(
        fused_step="off"
    ).use_fused("cuda", 1 << 30)
    # auto compiles AdamMD's groups only on a CPU (MuonMD's measured no faster there)
    assert auto.use_fused("cpu", FUSED_MIN_ELEMENTS) == {"adam"}
    assert auto.use_fused("cuda", FUSED_MIN_ELEMENTS) == {"adam", "muon"}
    assert MDConfig(fused_step="on").use_fused("cpu", 1) == {"adam", "muon"}
    with pytest.raises(ValueError, match="--md-fused-step"):
        MDConfig(fused_step="sometimes")


@pytest.mark.parametrize("mode,threshold,fused", [("auto", None, False), ("auto", 1, True),
                                                  ("on", None, True)])  # fmt: skip
def test_fused_step_reaches_the_engine(mode, threshold, fused, monkeypatch):
    """A tiny model (under the threshold) runs eager under auto, compiled when forced or over
    the threshold (the groups of whole hidden matrices the kernels cover); a miscompiled
    kernel's layout falls back to eager under auto only (``Kernels.fallback``)."""
    from megatron.md import config
    from megatron.md.enable import enable_md
    from megatron.md.leaves import leaf_optimizers

    if threshold is not None:
        monkeypatch.setattr(config, "FUSED_MIN_ELEMENTS", threshold)
    dmodel, opt = _build()
    enable_md(opt, [dmodel], MDConfig(fused_step=mode))
    (leaf,) = leaf_optimizers(opt)
    groups = [g for g in leaf.optimizer.engine.groups if g.spec.gains != "none"]
    assert groups and {g.kernels is not None for g in groups} == {fused}
    if fused:
        assert {g.kernels.fallback for g in groups} == {mode == "auto"}


def test_zero1_groups_read_their_partials_as_views():
    """ZeRO-1's global partial layout puts each kind of matrix (shape, treatment) side by side
    in param-buffer order: every group of whole matrices reads and writes its partials as one
    view of the domain's buffer — no index_add_/index_select and zeroed temporary per group
    (in buffer order alone the layers' groups interleave: 4 of 6 took them at 12 layers), and
    the step still equals the one of buffer order (test_distributed_md.py: the reference)."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron.md.enable import enable_md
    from megatron.md.leaves import leaf_optimizers

    model = tiny_gpt(3, 32, 3, 16)
    ddpc = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                         use_distributed_optimizer=True)  # fmt: skip
    dmodel = DDP(model.config, ddpc, model)
    cfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0, bf16=False,
                          use_distributed_optimizer=True)  # fmt: skip
    opt = get_megatron_optimizer(cfg, [dmodel])
    enable_md(opt, [dmodel], MDConfig())
    (leaf,) = leaf_optimizers(opt)
    engine = leaf.optimizer.engine
    stacked = [g for g in engine.groups if g.B > 1]
    assert len(stacked) >= 4, [g.B for g in engine.groups]  # the layers' QKV, proj, fc1, fc2
    assert all(engine._index[(kind, id(g))][1] is None
               for g in engine.groups for kind in ("step", "norm"))  # fmt: skip


def test_one_parameter_for_all_experts_is_refused():
    """TE's grouped experts with ``--moe-single-grouped-weight`` keep every local expert in one
    parameter (stacked 3-D or concatenated 2-D; TE's ``single_grouped_weight`` attribute says
    which modules). MD needs a sphere and gains per expert matrix, so enable_md refuses both
    before touching the optimizer, instead of stepping one big matrix or a "vector"."""
    from megatron.md.config import MDConfig
    from megatron.md.enable import enable_md

    grouped = torch.nn.Module()  # as TE's GroupedLinear sets it up
    grouped.single_grouped_weight = True
    grouped.weight = torch.nn.Parameter(torch.zeros(4 * 8, 32))
    experts = torch.nn.Module()
    experts.linear_fc1 = grouped
    with pytest.raises(ValueError, match="linear_fc1 keeps every local expert in one parameter"):
        enable_md(None, [experts], MDConfig())
    stacked = torch.nn.Module()
    stacked.weight = torch.nn.Parameter(torch.zeros(4, 8, 32))
    with pytest.raises(ValueError, match="stacks 4 matrices in one 3-D parameter"):
        enable_md(None, [stacked], MDConfig())


def test_nonfinite_md_state_is_named_before_it_lands_or_is_saved(tmp_path):
    """An inf in one direction entry (a damaged state): the next MD step's reduced sphere norm
    is not finite, so MD's probe turns NaN; it rides in megatron's gradient norm (no sync of
    its own), which is then NaN, and the check there stops the run naming the parameter and
    the tensor; a save of that state is refused the same way, the checkpoint kept as it was."""
    import math

    from megatron.md.enable import enable_md
    from megatron.md.leaves import leaf_optimizers
    from megatron.md.train import nonfinite

    dmodel, opt = _build()
    enable_md(opt, [dmodel], MDConfig())
    x = torch.randint(0, 256, (2, 16))

    def step():
        dmodel.zero_grad_buffer()
        cpu_demo.lm_loss(dmodel, x, x).backward()
        dmodel.finish_grad_sync()
        return opt.step()

    step()
    (leaf,) = leaf_optimizers(opt)
    inner = leaf.optimizer
    assert float(inner.probe) == 0 and leaf.get_grads_for_grad_norm()[-1] is inner.probe
    assert math.isfinite(opt.get_grad_norm())
    nonfinite.check_before_save([dmodel], opt, 1, str(tmp_path))  # finite: nothing to say
    main, slot = next((m, s) for m, s in inner.slots.items() if "linear_fc1" in s.name)
    inner.direction_of(main)[5] = float("inf")
    step()
    assert math.isnan(float(inner.probe))
    norm = opt.get_grad_norm()  # megatron's reduction, with the probe among the tensors
    assert math.isnan(norm)
    with pytest.raises(SystemExit, match=r"linear_fc1\.weight: its direction Ŵ"):
        nonfinite.check_grad_norm(norm, leaf.get_grads_for_grad_norm(), None)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(
        SystemExit,
        match=r"after iteration 2 is not finite \(.*linear_fc1.*"
        r"latest checkpoint in .* \(iteration 1\) is still the last good one",
    ):
        nonfinite.check_before_save([dmodel], opt, 2, str(tmp_path))


def test_an_untagged_qkv_piece_is_refused_under_the_split():
    """A fused QKV weight whose rank's piece does not hold whole query groups (megatron leaves
    it untagged) cannot be split as at TP=1: refused by name for AdamMD and MuonMD alike."""
    from megatron.md.roles import split_blocks, tag_qkv

    name = "module.decoder.layers.0.self_attention.linear_qkv.weight"
    piece = torch.nn.Parameter(torch.zeros(6, 8))  # not whole (4, 2, 2) query groups
    with pytest.raises(ValueError, match="linear_qkv.weight: not tagged for the Q/K/V split"):
        split_blocks(piece, name, split=True)
    assert split_blocks(piece, name, split=False) == ()
    model = tiny_gpt(3, 32, 2, 16)
    tag_qkv(model)
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert split_blocks(qkv, name, split=True) == tuple(qkv.qkv_split_shapes)


def test_cuda_graph_needs_a_gpu_and_names_what_a_replay_reads():
    """--md-cuda-graph on a CPU optimizer is refused; the tensors a replay must find where the
    capture saw them are every MD gradient, every 1-D gradient and every fused weight's
    destination, each named for the message that stops a run when one moved."""
    from megatron.md.enable import enable_md

    dmodel, opt = _build()
    enable_md(opt, [dmodel], MDConfig())
    inner = opt.optimizer
    with pytest.raises(ValueError, match="--md-cuda-graph needs the optimizer on a GPU"):
        inner.use_cuda_graph()
    x = torch.randint(0, 256, (2, 16))
    dmodel.zero_grad_buffer()
    cpu_demo.lm_loss(dmodel, x, x).backward()
    dmodel.finish_grad_sync()
    opt.step()
    vectors = [(i, p) for i, p in inner._vectors() if p.grad is not None]
    where = inner._addresses(vectors, inner.outputs())
    n_md, n_vec = len(inner.slots), len(vectors)
    assert n_md and n_vec and len(where) == 2 * n_md + n_vec
    names = [inner._address_name(k, vectors) for k in range(len(where))]
    assert names[0] == "the gradient of module.embedding.word_embeddings.weight"
    assert names[n_md].startswith("the gradient of a 1-D parameter of shape (")
    assert names[-1].startswith("the destination of a fused weight of shape (")


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_the_device_scalar_step_reads_nothing_back_to_the_host(optimizer):
    """What a CUDA-graph capture needs of MD's whole inner step (the engine, the 1-D
    parameters' Adam, the fused weights; not only the engine's part, test_engine.py): with the
    step count and LRs on the device, no MD code reads a tensor back to the host in megatron's
    own optimizer step (a read would end the capture; megatron's gradient norm, outside the
    graph, makes its own). Seen: none of MD's against megatron's 2, AdamMD and MuonMD."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron.md.enable import enable_md
    from megatron.md.leaves import leaf_optimizers

    dmodel, opt = _build(optimizer=optimizer, bf16=optimizer == "muon")
    enable_md(opt, [dmodel], MDConfig(split_qkv=False))  # as _build's megatron Muon
    inners = [o.optimizer for o in leaf_optimizers(opt) if hasattr(o.optimizer, "slots")]
    assert inners
    for inner in inners:
        inner.use_cuda_graph(graph=False)
    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                reads.append(any("/megatron/md/" in f.filename and "cpu_mode" not in f.filename
                                 for f in traceback.extract_stack()))  # fmt: skip
            return func(*args, **(kwargs or {}))

    x = torch.randint(0, 256, (2, 16))
    for k in range(4):
        dmodel.zero_grad_buffer()
        cpu_demo.lm_loss(dmodel, x, x).backward()
        dmodel.finish_grad_sync()
        with Reads() if k == 3 else contextlib.nullcontext():
            opt.step()
    assert reads and not any(reads), reads  # megatron's reads seen, none of MD's
    assert all(i.engine.steps == 4 for i in inners)


def _vectors_only_inner(seed: int):
    """MD's inner optimizer over 1-D parameters only: a ZeRO-1 or layer-wise shard that holds
    no MD matrix (megatron's layer-wise path without its param layout puts the norms of rank 0
    in one such optimizer)."""
    from megatron.md.inner import MDInner

    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g) for n in (8, 5)]
    inner = MDInner([dict(params=params, lr=1e-2, betas=(0.9, 0.95))], MDConfig(), None)
    inner.init_state()
    return inner, params


def _adam_steps(inner, params, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        inner.step()


def test_a_shard_without_md_matrices_resumes_its_step_count():
    """Its vectors' Adam steps with the engine's count, which a load took from the MD
    matrices' state only: with none, the count went back to 0 and the first step after a
    resume used step 1's bias correction (seen: `--md-adam-layer-wise
    --no-use-layer-wise-param-layout` at 2 ranks, iteration 5's loss 2.998 where the run had
    3.008). Resumed after 3 steps, the 4th step equals the uninterrupted run's bit for bit."""
    run, p_run = _vectors_only_inner(0)
    _adam_steps(run, p_run, 3, seed=1)
    saved = copy.deepcopy(run.state_dict())  # a load keeps the tensors it is given
    resumed, p_res = _vectors_only_inner(0)
    with torch.no_grad():
        for a, b in zip(p_res, p_run):
            a.copy_(b)
    resumed.load_state_dict(saved)
    assert resumed.engine.steps == 3
    _adam_steps(run, p_run, 1, seed=2)
    _adam_steps(resumed, p_res, 1, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(p_res, p_run))


def test_fresh_moments_restart_the_step_count():
    """``--init-fresh-moments`` zeroes the moments and steps (the authors'
    ``reset_optimizer_moments``, feat/scaling-sweeps core/optimizer/master.py, sets each group's
    step to 0): MD's engine counts the steps on the host too, and its next step is step 1."""
    from megatron.md.enable import enable_md
    from megatron.md.leaves import leaf_optimizers
    from megatron.md.train.continual import reset_moments

    dmodel, opt = _build()
    enable_md(opt, [dmodel], MDConfig())
    x = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        dmodel.zero_grad_buffer()
        cpu_demo.lm_loss(dmodel, x, x).backward()
        dmodel.finish_grad_sync()
        opt.step()
    inners = [o.optimizer for o in leaf_optimizers(opt) if hasattr(o.optimizer, "slots")]
    assert inners and all(i.engine.steps == 3 for i in inners)
    assert reset_moments(opt) > 0
    assert all(i.engine.steps == 0 for i in inners)
    opt.step()
    assert all(int(st["step"]) == 1 for i in inners for st in i.state.values())


def test_the_plain_copies_follow_a_reallocated_param_buffer():
    """ZeRO-1's main→model copy of the parameters MD does not step (norms, biases) looks their
    ranges of megatron's param buffer up once (~10 µs a parameter a step otherwise), and again
    when megatron re-allocates a bucket's param data: the copy then writes the new buffer."""
    from megatron.md import zero1
    from megatron.md.enable import enable_md
    from megatron.md.leaves import leaf_optimizers
    from megatron.md.testing import megatron_optimizer

    model = tiny_gpt(3, 32, 2, 16)
    dmodel, opt = megatron_optimizer(model, model.config, "zero1", 1, "adam", lr=1e-2,
                                     weight_decay=0.0, bf16=False)  # fmt: skip
    enable_md(opt, [dmodel], MDConfig())
    (leaf,) = leaf_optimizers(opt)
    dsts, srcs = zero1._plain_copies(leaf)
    assert dsts and zero1._plain_copies(leaf)[0] is dsts  # looked up once
    buckets = [b for buf in leaf.buffers for b in buf.buckets]
    for b in buckets:  # megatron re-allocating the param data
        b.param_data = torch.zeros_like(b.param_data)
    for s in srcs:
        s.data.uniform_()
    leaf._copy_main_params_to_model_params()
    new = zero1._plain_copies(leaf)[0]
    assert new is not dsts and len(new) == len(dsts)
    storages = {b.param_data.untyped_storage().data_ptr() for b in buckets}
    assert all(d.untyped_storage().data_ptr() in storages for d in new)
    assert all(torch.equal(d, s) for d, s in zip(new, srcs))
