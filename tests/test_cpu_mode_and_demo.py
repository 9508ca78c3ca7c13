"""CPU mode redirects megatron-core's CUDA calls; the demo trains with all four optimizers."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

from megatron.md import cpu_mode, reference
from megatron.md.config import MDConfig, spec_for
from megatron.md.optimizer import MDOptimizer, model_param_groups
from megatron.md.roles import param_role

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "md_decoupling"))
import cpu_demo  # noqa: E402

from megatron.md.testing import tiny_gpt  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU mode is for CUDA-less hosts")


def test_cpu_mode_redirects_devices_and_types():
    assert cpu_mode.is_active()
    x = torch.zeros(3, device="cuda")
    assert x.device.type == "cpu"
    assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor"
    assert x.cuda() is x
    assert torch.cuda.device_count() == 1
    # calls without keyword arguments, which skip the rewriting unless their function is one
    # it rewrites (``cpu_mode._SPECIAL``)
    assert x.to("cuda").device.type == "cpu" and x.to(0).device.type == "cpu"
    assert x.pin_memory() is x
    assert x.type("torch.cuda.DoubleTensor").dtype == torch.float64


def test_cpu_mode_resolves_onemkls_vector_math_before_any_parallel_call(monkeypatch):
    """CPU mode calls each function ATen sends to oneMKL's VML once, on one element, in
    float32 and float64, at activation (megatron/md/mkl_vml.py: oneMKL 2024.2's first-call
    race gave RoPE's first cos table an error of 1.5e-4 in 3 of 100 two-thread processes). The
    list is the installed torch's (torch/include/ATen/cpu/vml.h): a torch that sends another
    function, or no longer sends one, fails here."""
    import re

    from megatron.md import mkl_vml

    header = (Path(torch.__file__).parent / "include/ATen/cpu/vml.h").read_text()
    assert set(re.findall(r"^IMPLEMENT_VML_MKL\((\w+),", header, re.M)) == set(mkl_vml.VML_OPS)
    assert mkl_vml._WARM  # conftest activated CPU mode: warmed once, at activation
    calls = []
    for op in mkl_vml.VML_OPS:
        monkeypatch.setattr(torch, op, lambda x, op=op: calls.append((op, x.dtype, x.numel())))
    monkeypatch.setattr(mkl_vml, "_WARM", False)
    mkl_vml.warm()
    assert calls == [(op, dt, 1) for dt in (torch.float32, torch.float64) for op in mkl_vml.VML_OPS]


class _GatherLike(torch.autograd.Function):
    """Like megatron's backward all-gathers (core/tensor_parallel/mappings.py,
    _gather_along_first_dim): the backward allocates its output on
    ``torch.cuda.current_device()``."""

    @staticmethod
    def forward(ctx, x):
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        out = torch.empty(g.shape, dtype=g.dtype, device=torch.cuda.current_device())
        return out.copy_(g).mul_(2)


def test_cpu_mode_runs_megatrons_compiled_functions_eagerly_and_compiles_md_kernels():
    """CPU mode (on in this process: conftest) runs megatron's ``jit_fuser`` functions
    (torch.compile) eagerly: no frame traced by dynamo; MD's compiled step still compiles its
    kernels (``checked.Checked`` asks for the default stance)."""
    from megatron.core.fusions.fused_bias_swiglu import swiglu
    from torch._dynamo.utils import counters

    from megatron.md.engine import checked

    assert cpu_mode.is_active() and hasattr(swiglu, "_torchdynamo_orig_callable")
    before = counters["stats"]["unique_graphs"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(swiglu(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    assert counters["stats"]["unique_graphs"] == before  # megatron's: eager

    def triple(x, out):  # its own code object: a graph of its own
        out.copy_(x * 3)

    kernel = checked.Checked(triple, torch.compile(triple, dynamic=False, fullgraph=True))
    out = torch.empty(3, 8)
    kernel(x, out)
    assert torch.equal(out, x * 3) and counters["stats"]["unique_graphs"] == before + 1


def test_compiled_calls_on_two_threads_leave_cpu_modes_stance():
    """Two threads inside compiled MD calls at once (the tests' ranks), the first in leaving
    first: dynamo's stance is CPU mode's ``force_eager`` again after both (each saving and
    restoring the global stance itself, the last out restored the ``default`` it had saved:
    megatron's ``torch.compile``'d functions traced in every later test)."""
    import threading

    import torch._dynamo.eval_frame as eval_frame

    from megatron.md.engine import checked

    assert eval_frame._stance.stance == "force_eager"
    a_in, a_out, both_in = threading.Event(), threading.Event(), threading.Barrier(2)
    seen = []

    def call(first: bool):
        def compiled(x, out):  # stands for the compiled kernel: where the threads meet
            seen.append(eval_frame._stance.stance)
            if first:
                a_in.set()
            both_in.wait(timeout=30)
            if not first:
                a_out.wait(timeout=30)  # the first one out before this one leaves
            out.copy_(x * 3)

        kernel = checked.Checked(lambda x, out: out.copy_(x * 3), compiled)
        x, out = torch.randn(2, 3), torch.empty(2, 3)
        kernel(x, out)
        assert torch.equal(out, x * 3)
        if first:
            a_out.set()

    first = threading.Thread(target=call, args=(True,))
    first.start()
    assert a_in.wait(timeout=30)
    second = threading.Thread(target=call, args=(False,))
    second.start()
    first.join(30)
    second.join(30)
    assert seen == ["default", "default"]  # each compiled call under dynamo's default
    assert eval_frame._stance.stance == "force_eager"


@pytest.mark.distributed
def test_cpu_mode_gathers_uneven_sizes():
    """gloo refuses an all_gather into tensors of different sizes, which NCCL takes and
    megatron's layer-wise optimizer without its param layout makes (plain Muon's 2-rank run with
    --no-use-layer-wise-param-layout failed at its first step, "invalid tensor size"; with the
    CPU mode's padding its losses equal the default layout's, by hand, 2026-11-29)."""
    from _torchrun import torchrun

    assert torchrun("gather_check.py", 3)["gathered_right"]


@pytest.mark.parametrize("entry", ["tensor", "autograd", "autograd-grad-tensors"])
def test_cpu_mode_redirects_inside_the_backward_pass(entry):
    """The backward pass runs under the redirection whichever entry starts it (loss.backward(),
    torch.autograd.backward as megatron's schedules call it); before, autograd functions'
    backwards ran unredirected and allocating on the CUDA device index failed."""
    x = torch.arange(3.0, requires_grad=True)
    y = _GatherLike.apply(x)
    if entry == "tensor":
        y.sum().backward()
        assert torch.equal(x.grad, torch.full((3,), 2.0))
    elif entry == "autograd":
        torch.autograd.backward(y.sum())
        assert torch.equal(x.grad, torch.full((3,), 2.0))
    else:
        torch.autograd.backward([y], grad_tensors=[torch.ones(3) * 3], retain_graph=True)
        torch.autograd.backward([y], grad_tensors=[torch.ones(3)])
        assert torch.equal(x.grad, torch.full((3,), 8.0))  # retained graph, grads accumulate


WARMUP_ARGS = dict(bf16=False, fp16=False, ffn_hidden_size=96, tensor_model_parallel_size=1,
                   seq_length=16, context_parallel_size=1, micro_batch_size=2, hidden_size=32,
                   swiglu=True, sequence_parallel=False)  # fmt: skip


@pytest.mark.parametrize(
    "layout,dynamo",
    [
        ({}, "on"),
        (dict(bf16=True, swiglu=False, tensor_model_parallel_size=2, sequence_parallel=True), "on"),
        ({}, "off"),
    ],
    ids=["fp32-swiglu", "bf16-gelu-tp2-sp", "dynamo-off"],
)
def test_the_cpu_jit_warmup_leaves_the_generator_as_megatrons_does(monkeypatch, layout, dynamo):
    """CPU mode replaces megatron's JIT warm-up (four dynamo compiles, ~2 s a rank) by the draws
    it makes (megatron/md/train/cpu_warmup.py): the generator ends in the same state, so the
    weights initialized after it are megatron's, compiled (dynamo's default stance: CPU mode
    itself runs torch.compile'd functions eagerly and keeps the compiled warm-up's draws). With
    dynamo off the warm-up itself runs."""
    import megatron.training.global_vars as gv
    from megatron.training.initialize import _warmup_jit_function
    from megatron.training.training import set_jit_fusion_options

    from megatron.md.train import cpu_warmup

    monkeypatch.setattr(gv, "_GLOBAL_ARGS", argparse.Namespace(**{**WARMUP_ARGS, **layout}))
    ours = cpu_warmup.draws_only(set_jit_fusion_options)
    states = []
    off = torch._dynamo.config.patch(disable=dynamo == "off")  # as TORCH_COMPILE_DISABLE=1
    with off, torch.compiler.set_stance("default"):
        for warmup in (_warmup_jit_function, ours):
            torch.manual_seed(11)
            warmup(tp_size=2)
            states.append(torch.get_rng_state())
        assert cpu_warmup.is_compiled() == (dynamo == "on")
    assert torch.equal(states[0], states[1])
    torch.manual_seed(11)
    assert not torch.equal(torch.get_rng_state(), states[0])  # (the warm-up draws)


def _args(steps):
    return argparse.Namespace(steps=steps, hidden=32, layers=2, seq=32, batch=4, seed=3)


@pytest.mark.parametrize("run", cpu_demo.RUNS, ids=[r[0] for r in cpu_demo.RUNS])
def test_demo_optimizers_reduce_the_loss(run):
    data = torch.tensor(list(cpu_demo.TEXT.encode()), dtype=torch.long)
    name, base, md_on, lr, wd, warmup = run
    train_loss, val_loss, ms = cpu_demo.train_one(
        name, base, md_on, lr, wd, warmup, _args(25), data, data
    )
    assert train_loss < 4.6  # uniform over 256 bytes is ln 256 = 5.545
    assert ms > 0


def test_md_optimizer_invariants_on_a_megatron_gpt():
    model = tiny_gpt(5, 32, 2, 32)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = MDOptimizer(model_param_groups(model, 1e-2), md=MDConfig(), base="muon")
    data = torch.tensor(list(cpu_demo.TEXT.encode()), dtype=torch.long)
    for x, y in cpu_demo.batches(data, 4, 4, 32, 0):
        cpu_demo.lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        role = param_role(name, p)
        if role == "vector":
            continue
        st = opt.state[p]
        spec = spec_for(role, opt.md)
        torch.testing.assert_close(p.detach(), reference.fused_weight(st, spec), rtol=0, atol=0)
        if role in ("embedding", "output"):
            torch.testing.assert_close(st["direction"].norm(dim=1), torch.ones(p.shape[0]))
        else:
            r0 = init[name].norm()
            assert abs(float(st["direction"].norm() / r0) - 1) < 1e-6
            assert torch.isfinite(st["gain_row"]).all() and torch.isfinite(st["gain_col"]).all()


def test_md_with_weight_decay_is_refused():
    with pytest.raises(ValueError, match="weight-decay"):
        MDOptimizer([torch.nn.Parameter(torch.ones(2, 2))], md=MDConfig(), weight_decay=0.1)
