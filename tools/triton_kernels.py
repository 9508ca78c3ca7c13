"""The Triton kernels a compiled MD call launches on a GPU, counted on a machine without one.

``bench_dispatch.py`` counts a compiled MD call as one launch; on a GPU inductor splits a call
into as many Triton kernels as its scheduler makes (a reduction over another axis, a split
reduction's second pass, a group's norm partials summed per matrix: each its own kernel), each
launched from the call's Python wrapper. Inductor writes that wrapper before anything needs a
GPU: this traces a kernel's function on fake CUDA tensors laid out as its real arguments
(shapes, strides, offsets, which arguments share a storage), compiles it for an H100's
properties, keeps the wrapper inductor writes, and counts the launches in its ``call``
(``<kernel>.run(...)``, and an ``extern_kernels`` call: a cuBLAS product). Nothing is run, and
Triton compiles nothing.

The seam is inductor's, not a public API (torch 2.15.0): the device properties and Triton checks
it asks (``_seams``), its uniform-constant folding (which evaluates a constructor on the
device: on the CPU here) and ``GraphLowering.save_output_code``, the hook that sees the
wrapper's source. Each is checked before it is patched and restored after: a torch that moved
one fails here, naming it. The path is make_fx then ``compile_fx`` (AOT autograd and inductor),
not dynamo's capture: the same aten graph for these functions (plain tensor arithmetic, no
Python state); ``test_triton_kernels_match_the_cpu_compile`` holds it to torch.compile's own
C++ kernels for the same call on a CPU.

    python tools/bench_dispatch.py --fused-step on --gpu-launches [--model 181M]
"""

from __future__ import annotations

import contextlib
import re

import torch

#: an H100 SXM's properties, as torch.cuda reports them and inductor reads them
H100 = dict(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
    regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
    max_threads_per_block=1024, warp_size=32, total_memory=80 << 30, L2_cache_size=50 << 20,
    shared_memory_per_block_optin=232448, gcnArchName="sm_90",
)  # fmt: skip


class _Props:
    def __init__(self, **kw):
        self.__dict__.update(kw)


_INHERITED = object()


class _Captured(Exception):
    """Raised from the wrapper hook: the source is kept, nothing is loaded."""


def _seams() -> list[tuple[object, str, object]]:
    """(object, attribute, replacement) of each place inductor asks about the device."""
    import torch._inductor.compile_fx as cfx
    import torch._inductor.fx_passes.joint_graph as joint_graph
    import torch._inductor.scheduler as scheduler
    import torch.utils._triton as ut
    from torch._dynamo import device_interface as di
    from torch._inductor.runtime import hints

    props = _Props(**H100)
    fields = ("multi_processor_count", "major", "regs_per_multiprocessor",
              "max_threads_per_multi_processor", "max_threads_per_block", "warp_size")  # fmt: skip
    dev = hints.DeviceProperties(type="cuda", index=0, cc=10 * H100["major"] + H100["minor"],
                                 **{k: H100[k] for k in fields})  # fmt: skip
    cuda = di.CudaInterface
    return [
        (hints.DeviceProperties, "create", classmethod(lambda cls, device: dev)),
        (cuda, "get_compute_capability", staticmethod(lambda device=None: dev.cc)),
        (cuda, "is_available", staticmethod(lambda: True)),
        (cuda, "current_device", staticmethod(lambda: 0)),
        (cuda, "is_triton_capable", staticmethod(lambda device=None: True)),
        (cuda, "get_device_properties", staticmethod(lambda device=None: props)),
        (cuda.Worker, "get_device_properties", staticmethod(lambda device=None: props)),
        (torch.cuda, "get_device_capability", lambda device=None: (props.major, props.minor)),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "get_device_properties", lambda device=None: props),
        (ut, "has_triton", lambda *a, **k: True),
        (ut, "triton_hash_with_backend", lambda: "h100-offline"),
        (scheduler, "has_triton", lambda *a, **k: True),
        (cfx, "_check_triton_bf16_support", lambda graph: None),
        (joint_graph, "constant_fold_uniform_value",
         _folded_on_cpu(joint_graph.constant_fold_uniform_value)),
    ]  # fmt: skip


def _folded_on_cpu(fold):
    """Inductor's uniform-constant folding, its constants made on the CPU: it evaluates a
    constructor (``w.new_zeros(())``: ``aten.full``) on the node's device, and the graph's
    replacement takes the device from the node's fake value, not from what was evaluated."""

    def run(gm):
        moved = {}
        for n in gm.graph.nodes:
            dev = n.kwargs.get("device")
            if isinstance(dev, torch.device) and dev.type == "cuda":
                moved[n] = dev
                n.kwargs = {**n.kwargs, "device": torch.device("cpu")}
        try:
            return fold(gm)
        finally:
            for n, dev in moved.items():  # a folded node is out of the graph; the rest as before
                n.kwargs = {**n.kwargs, "device": dev}

    return run


@contextlib.contextmanager
def _fake_h100(sink: list):
    """Inductor generating code for an H100 here; the wrapper's source appended to ``sink``."""
    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    seams = _seams() + [(GraphLowering, "save_output_code", None)]
    missing = [f"{getattr(o, '__name__', o)}.{a}" for o, a, _ in seams if not hasattr(o, a)]
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__}: inductor's seam moved ({', '.join(missing)} not "
            "found); tools/triton_kernels.py cannot count Triton kernels"
        )

    def save(code: str) -> None:
        sink.append(code)
        raise _Captured

    seams[-1] = (GraphLowering, "save_output_code", save)
    # an attribute a class inherits is deleted again, not set on it
    old = [(o, a, vars(o).get(a, _INHERITED)) for o, a, _ in seams]
    try:
        for o, a, v in seams:
            setattr(o, a, v)
        # a cached graph would skip the hook; compiled here, in this process
        with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False,
                                   compile_threads=1):  # fmt: skip
            yield
    finally:
        for o, a, v in old:
            if v is _INHERITED:
                delattr(o, a)
            else:
                setattr(o, a, v)


@contextlib.contextmanager
def _no_function_modes():
    """CPU mode's redirection off (it would make the fake CUDA tensors CPU ones)."""
    modes = []
    while torch._C._len_torch_function_stack() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for m in reversed(modes):
            torch._C._push_on_torch_function_stack(m)


def _fake_args(args: tuple, mode, device: str) -> tuple[list, list]:
    """``args`` with each tensor a fake one on ``device``: same dtype, shape, stride and storage
    offset, the tensors of one storage views of one fake storage (what AOT autograd sees of
    aliasing), a tensor passed twice one input (as dynamo makes it); other arguments as they
    are. And the distinct fake tensors, the traced function's inputs."""
    bases, fakes, out = {}, {}, []
    with mode:
        for a in args:
            if not isinstance(a, torch.Tensor):
                out.append(a)
                continue
            if id(a) not in fakes:
                st = a.untyped_storage()
                key = (st.data_ptr(), st.nbytes())
                if key not in bases:
                    bases[key] = torch.empty(st.nbytes(), dtype=torch.uint8, device=device)
                view = bases[key].view(a.dtype)
                fakes[id(a)] = view.as_strided(a.shape, a.stride(), a.storage_offset())
            out.append(fakes[id(a)])
    return out, list(fakes.values())


def wrapper_code(fn, args: tuple, device: str = "cuda") -> str:
    """The Python wrapper inductor writes for ``fn(*args)`` on ``device`` ("cuda": an H100's
    Triton code; "cpu": its C++ kernels, to compare with torch.compile's own)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode()
    with _no_function_modes():
        fake, tensors = _fake_args(args, mode, device)
        slot = {id(t): k for k, t in enumerate(tensors)}
        where = [(i, slot[id(a)]) for i, a in enumerate(fake) if isinstance(a, torch.Tensor)]

        def traced(*inputs):
            full = list(fake)
            for i, k in where:
                full[i] = inputs[k]
            out = fn(*full)
            outs = out if isinstance(out, tuple) else (out,)
            return tuple(o for o in outs if isinstance(o, torch.Tensor))

        with mode:
            gm = make_fx(traced)(*tensors)
        sink: list[str] = []
        ctx = _fake_h100(sink) if device == "cuda" else _capture_only(sink)
        try:
            with ctx:
                compile_fx(gm, tensors)
        except Exception:  # the hook's _Captured, wrapped by inductor
            if not sink:
                raise
    return sink[0]


@contextlib.contextmanager
def _capture_only(sink: list):
    """``_fake_h100``'s hook alone: the wrapper inductor writes for the real device."""
    import torch._inductor.config as inductor_config
    from torch._inductor.graph import GraphLowering

    def save(code: str) -> None:
        sink.append(code)
        raise _Captured

    old = GraphLowering.save_output_code
    GraphLowering.save_output_code = save
    try:
        with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False):
            yield
    finally:
        GraphLowering.save_output_code = old


_KERNEL = re.compile(r"^\s+(\w+)\.run\(", re.M)
_EXTERN = re.compile(r"extern_kernels\.(\w+)\(")
_CPP = re.compile(r"^\s+(cpp_fused_\w+)\(", re.M)


def launches(code: str) -> list[str]:
    """The kernels a wrapper's ``call`` launches, in order: Triton kernels, ``extern_kernels``
    products (cuBLAS), and on a CPU its C++ loops."""
    call = code[code.index("def call(") :]
    found = [(m.start(), m.group(1)) for r in (_KERNEL, _EXTERN, _CPP) for m in r.finditer(call)]
    return [name for _, name in sorted(found)]


def layout_key(fn, args: tuple) -> tuple:
    """What the kernels depend on: the function, each tensor's dtype, shape, stride, offset,
    which arguments share a storage and which are one tensor (``_fake_args``), and the other
    arguments."""
    stores, same, key = {}, {}, [fn]
    for a in args:
        if isinstance(a, torch.Tensor):
            sid = stores.setdefault(a.untyped_storage().data_ptr(), len(stores))
            key.append((a.dtype, tuple(a.shape), a.stride(), a.storage_offset(), sid,
                        same.setdefault(id(a), len(same))))  # fmt: skip
        else:
            key.append(a)
    return tuple(key)


_cache: dict[tuple, list[str]] = {}


def kernels_of(fn, args: tuple) -> list[str]:
    """``launches`` of ``fn(*args)`` on an H100 (cached per ``layout_key``)."""
    key = layout_key(fn, args)
    if key not in _cache:
        _cache[key] = launches(wrapper_code(fn, args))
    return _cache[key]
