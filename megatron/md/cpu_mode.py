"""CPU mode: run megatron-core on a machine without CUDA (device redirection, gloo).

megatron-core hard-codes CUDA in ~20 places (``device='cuda'``, ``torch.cuda.*`` calls, and
dispatch on ``tensor.type() == 'torch.cuda.FloatTensor'``). On a machine with no CUDA this
module, once activated, (1) stubs ``torch.cuda`` device/stream/memory/NVTX calls, (2) maps the
CUDA RNG onto the CPU generator, (3) rewrites CUDA device arguments to CPU through a
``TorchFunctionMode`` and makes CPU tensors report CUDA type strings, and (4) turns an NCCL
process group into gloo. It redirects devices; it replaces no megatron logic.

The entry points activate it (``start`` in ``pretrain_gpt.py``, ``maybe_activate`` in tools
and tests, before megatron is imported; importing ``megatron.md`` does not) only when
``torch.cuda.is_available()`` is False, and never when a GPU is present.
``MEGATRON_MD_CPU_MODE``: unset, CPU mode on a machine without CUDA unless the run is a GPU
job (``gpu_job``: started by the SLURM launcher, on a SLURM allocation with GPUs, or asked for
NCCL), which then stops instead of training on the CPU; ``1``, CPU mode whenever there is no
CUDA (a CPU job on purpose, e.g. on a CPU-only SLURM cluster); ``0``, never. Limits: one
process-wide mode per thread (threads other than the one that activated it see no
redirection), Python overhead on every torch call (fine for tiny models, not for
benchmarking), and no fused kernels (no TE/Apex on CPU; every ``torch.compile``'d function,
megatron's fused ones among them, runs eagerly: ``_eager_torch_compile``; MD's own compiled
step still compiles).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

from megatron.md import mkl_vml

_ACTIVE = False
_SAID = False  # the line that CPU mode is on printed (or due, on rank 0)
_OWED = b""  # owe(): printed at activate
_FLOAT_TYPES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def is_active() -> bool:
    return _ACTIVE


def _is_cuda(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True  # megatron passes torch.cuda.current_device() (an int)
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, torch.device) and dev.type == "cuda"


class _CpuRedirect(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and answers CUDA type strings for CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not kwargs and id(func) not in _SPECIAL_IDS:
            # nothing to rewrite: most calls, every tensor attribute read among them (1.87 ->
            # 1.63 us a read on a 2-core VM, 2026-12-05; 0.12 without the mode)
            return func(*args)
        kwargs = dict(kwargs or {})
        if func in _BACKWARDS and kwargs.get("inputs") is None:
            return _backward_redirected(self, func, args, kwargs)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                t = args[0]
                return (
                    _FLOAT_TYPES.get(t.dtype, t.type()) if t.device.type == "cpu" else func(*args)
                )
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
        if func is _ALL_GATHER and _uneven(args, kwargs):
            return _all_gather_uneven(*args, **kwargs)
        if func is _ALL_TO_ALL_SINGLE:
            # Expert parallelism: megatron turns the split sizes into numpy arrays only for CUDA
            # tensors (core/transformer/moe/moe_utils.py, maybe_move_tensor_to_cpu); gloo wants int
            # sequences.
            for k in ("output_split_sizes", "input_split_sizes"):
                if torch.is_tensor(kwargs.get(k)):
                    kwargs[k] = kwargs[k].tolist()
        return func(*args, **kwargs)


_ALL_TO_ALL_SINGLE = getattr(torch.distributed, "all_to_all_single", None)  # resolved once
_ALL_GATHER = getattr(torch.distributed, "all_gather", None)


def _uneven(args, kwargs) -> bool:
    """An ``all_gather(tensor_list, tensor, ...)`` call whose output tensors differ in shape."""
    out = kwargs.get("tensor_list", args[0] if args else None)
    return isinstance(out, list | tuple) and len({t.shape for t in out}) > 1


def _all_gather_uneven(tensor_list, tensor, group=None, async_op=False):
    """``all_gather`` into tensors of different sizes, which NCCL takes and gloo refuses
    ("invalid tensor size"): megatron's layer-wise optimizer gathers each rank's flat params so
    (core/optimizer/layer_wise_optimizer.py, ``allgather_params``, its path without a param
    layout). Each rank's tensor is padded to the largest, gathered, and cut back."""
    if async_op:
        raise NotImplementedError("CPU mode: an asynchronous all_gather of uneven sizes")
    n = max(t.numel() for t in tensor_list)
    flat = torch.zeros(n, dtype=tensor.dtype)
    flat[: tensor.numel()] = tensor.reshape(-1)
    got = [torch.empty_like(flat) for _ in tensor_list]
    torch.distributed.all_gather(got, flat, group=group)
    for out, g in zip(tensor_list, got):
        out.copy_(g[: out.numel()].view(out.shape))


_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward)
#: the functions ``_CpuRedirect`` may change a call of that has no keyword arguments (held
#: here, so their ids stay theirs); any other such call passes through untouched
_SPECIAL = tuple(f for f in (*_BACKWARDS, torch.Tensor.cuda, torch.Tensor.pin_memory,
                             torch.Tensor.to, torch.Tensor.type, _ALL_GATHER, _ALL_TO_ALL_SINGLE)
                 if f is not None)  # fmt: skip
_SPECIAL_IDS = frozenset(map(id, _SPECIAL))


def _backward_redirected(mode, func, args, kwargs):
    """``loss.backward()`` / ``torch.autograd.backward`` with the redirection on. A mode's
    handler runs with the mode popped, and autograd's engine runs the backward pass under the
    modes present when it starts, so without this every autograd function's backward ran
    unredirected: megatron's backward all-gathers allocate on ``torch.cuda.current_device()``
    (core/tensor_parallel/mappings.py, _gather_along_first_dim, expert-TP and TP > 2) and failed.
    Calling the public entry again would dispatch back here, so the engine is started directly,
    after torch's own argument handling (torch/autograd/__init__.py: ``_make_grads``);
    ``check_backward_seam`` fails at activation if those names move. Calls with ``inputs`` (not
    made by megatron or the tests) keep torch's own path, unredirected."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if func is torch.Tensor.backward:
        tensors, grads = (a["self"],), a["gradient"]
    else:
        t = a["tensors"]
        tensors, grads = ((t,) if torch.is_tensor(t) else tuple(t)), a["grad_tensors"]
    grads = _make_grads(
        tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False
    )
    retain = a["create_graph"] if a["retain_graph"] is None else a["retain_graph"]
    with mode:
        _engine_run_backward(
            tensors, grads, retain, a["create_graph"], (),
            allow_unreachable=True, accumulate_grad=True,
        )  # fmt: skip


def check_backward_seam() -> None:
    """The torch internals ``_backward_redirected`` uses, checked once at activation."""
    import torch.autograd as ag
    import torch.autograd.graph as graph

    missing = [n for n, m in (("_make_grads", ag), ("_tensor_or_tensors_to_tuple", ag),
                              ("_engine_run_backward", graph)) if not hasattr(m, n)]  # fmt: skip
    if missing:
        raise RuntimeError(
            f"CPU mode: torch {torch.__version__} lacks torch.autograd's {', '.join(missing)} "
            "(the backward pass under device redirection, cpu_mode._backward_redirected)"
        )


class _Dummy:
    """Stands in for CUDA streams/events: every method returns another dummy."""

    def __init__(self, *a, **k):
        pass

    def __getattr__(self, name):
        return lambda *a, **k: _Dummy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cpu_rng_state(*a, **k):
    return torch.default_generator.get_state()


def _set_cpu_rng_state(state, *a, **k):
    torch.default_generator.set_state(state)


class _CpuDeviceProperties:
    name, major, minor, total_memory, multi_processor_count = "cpu", 10, 0, 0, 1


def _patch_cuda() -> None:
    c = torch.cuda
    c.current_device = lambda: 0
    c.device_count = lambda: 1
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats"):
        setattr(c, name, lambda *a, **k: None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved"):
        setattr(c, name, lambda *a, **k: 0)
    # megatron reads the device architecture while validating flags (training/arguments.py,
    # validate_args, TP/CP > 1: CUDA_DEVICE_MAX_CONNECTIONS rules that end with Blackwell, major
    # 10): a CPU has none of those constraints, so it reads as one without them
    c.get_device_capability = lambda *a, **k: (10, 0)
    c.get_device_properties = lambda *a, **k: _CpuDeviceProperties()
    c.Stream = c.Event = _Dummy
    c.current_stream = c.default_stream = lambda *a, **k: _Dummy()
    c.stream = c.device = lambda *a, **k: contextlib.nullcontext()
    c.nvtx.range_push = c.nvtx.range_pop = lambda *a, **k: None
    c.get_rng_state = _cpu_rng_state
    c.set_rng_state = _set_cpu_rng_state
    # torch.manual_seed would recurse into cuda.manual_seed_all; seed the CPU generator directly.
    c.manual_seed = c.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))


def rng_get(orig, context=None):
    """megatron's tensor-parallel RNG tracker reads the CUDA RNG state: the CPU generator's."""
    return lambda *a, **k: _cpu_rng_state()


def rng_set(orig, context=None):
    return lambda state, *a, **k: _set_cpu_rng_state(state)


def _patch_process_group() -> None:
    import torch.distributed as dist

    orig = dist.init_process_group
    if getattr(orig, "_md_cpu", False):
        return

    def init_process_group(*args, **kwargs):
        if kwargs.get("backend") in (None, "nccl") and not args:
            kwargs["backend"] = "gloo"
        elif args and args[0] == "nccl":
            args = ("gloo", *args[1:])
        kwargs.pop("device_id", None)
        return orig(*args, **kwargs)

    init_process_group._md_cpu = True
    dist.init_process_group = init_process_group


def _eager_torch_compile() -> None:
    """Functions wrapped by ``torch.compile`` run eagerly (dynamo's ``force_eager`` stance,
    process-wide; forked ranks inherit it): megatron's fused functions (``jit_fuser`` =
    ``torch.compile``, megatron/core/jit.py: the MoE router's, SwiGLU's, bias-dropout-add's)
    are the same arithmetic eager, and each process traced them again with dynamo, ~4 s of a
    tiny MoE rank's 20 iterations on a 2-core VM (2026-12-03, torch 2.15.0: 14.5 s → 10.2 s).
    MD's compiled step (``--md-fused-step``, megatron/md/engine/checked.py) asks for the
    default stance around its own calls and still compiles. Megatron's JIT warm-up keeps its
    random draws (train/cpu_warmup.py): the initial weights are those of a compiled warm-up."""
    torch.compiler.set_stance("force_eager")


def activate(quiet: bool = False) -> None:
    """Install the CPU shim (idempotent), and say so once unless ``quiet`` (a process forked
    with the shim installed says it at its own first call: megatron/md/forkserver.py).
    Refuses when CUDA is available."""
    global _ACTIVE, _SAID
    if not _ACTIVE:
        if torch.cuda.is_available():
            raise RuntimeError("CPU mode must not be activated on a machine with a GPU")
        mkl_vml.warm()  # before any parallel unary op: oneMKL's first-call race (mkl_vml.py)
        check_backward_seam()
        _patch_cuda()
        _patch_process_group()
        _eager_torch_compile()
        _CpuRedirect().__enter__()  # stays pushed for the life of the process
        _ACTIVE = True
        try:
            from megatron.md import compat

            compat.apply("cpu-mode")  # megatron-core's RNG tracker (compat.SEAMS)
        except ImportError:  # megatron-core not installed: nothing of it to redirect
            pass
    if not (quiet or _SAID):
        _SAID = True
        if os.environ.get("RANK", "0") == "0":
            print(
                "[megatron-md] no CUDA device: CPU mode on (gloo, device redirection); "
                "set MEGATRON_MD_CPU_MODE=0 to disable",
                file=sys.stderr,
            )
    if _OWED:
        sys.stderr.flush()
        os.write(2, _OWED)
        owe(b"")


def owe(printed: bytes) -> None:
    """What a fork server's CPU-mode process printed after it put CPU mode on
    (megatron/md/forkserver.py): printed at this process's own ``activate``, after its line,
    where a fresh process prints it."""
    global _OWED
    _OWED = printed


def maybe_activate() -> bool:
    """Activate CPU mode when CUDA is unavailable and the env var does not forbid it."""
    if os.environ.get("MEGATRON_MD_CPU_MODE") == "0" or torch.cuda.is_available():
        return False
    activate(quiet=os.environ.get("MEGATRON_MD_QUIET") == "1")
    return True


#: SLURM's variables that say GPUs were allocated to the job or step
SLURM_GPU_VARS = ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS",
                  "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK")  # fmt: skip


def gpu_job(argv, env) -> str | None:
    """Why this run is meant for GPUs (None: nothing says so): the SLURM launcher started it
    (``MEGATRON_MD_LAUNCHER=slurm``), SLURM allocated GPUs, or the command line asks for NCCL."""
    if env.get("MEGATRON_MD_LAUNCHER") == "slurm":
        return "it was started by launch.sbatch on a SLURM allocation"
    for k in SLURM_GPU_VARS:
        if env.get(k, "") not in ("", "0", "N/A"):
            return f"SLURM allocated GPUs to it ({k}={env[k]})"
    argv = list(argv)
    for i, a in enumerate(argv):
        if a == "--distributed-backend=nccl" or (
            a == "--distributed-backend" and argv[i + 1 : i + 2] == ["nccl"]
        ):
            return "its command line asks for --distributed-backend nccl"
    return None


def starts_on(argv, env) -> bool:
    """Whether ``start`` puts CPU mode on for ``argv`` and ``env`` on a machine without CUDA
    (the fork server decides by it which ranks it forks with CPU mode on)."""
    mode = env.get("MEGATRON_MD_CPU_MODE", "")
    return mode == "1" or (mode == "" and gpu_job(argv, env) is None)


def start(argv) -> bool:
    """``pretrain_gpt.py``'s decision, before megatron is imported: CPU mode on a machine
    without CUDA (see the module docstring for ``MEGATRON_MD_CPU_MODE``); a GPU job that sees
    no GPU stops with one line instead of training on the CPU."""
    from megatron.md import errors

    mode = os.environ.get("MEGATRON_MD_CPU_MODE", "")
    if mode not in ("", "0", "1"):
        errors.exit_with(f"MEGATRON_MD_CPU_MODE={mode!r} is not one of 0, 1 (or unset)")
    if mode == "0" or torch.cuda.is_available():
        return False
    if not starts_on(argv, os.environ):
        errors.exit_with(
            f"no CUDA device is visible, but this is a GPU job ({gpu_job(argv, os.environ)}): "
            "it would train on the "
            "CPU. Check the allocation's GPUs and CUDA_VISIBLE_DEVICES (nvidia-smi on the "
            "node); to run on the CPU on purpose set MEGATRON_MD_CPU_MODE=1"
        )
    activate(quiet=os.environ.get("MEGATRON_MD_QUIET") == "1")
    return True
