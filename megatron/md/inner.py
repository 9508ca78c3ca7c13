"""The torch optimizer that megatron-core's wrappers step: AdamW/Muon with the MD step.

megatron-core wraps a plain torch optimizer (``DistributedOptimizer``, ``Float16Optimizer…``,
``FP32Optimizer``; ``LayerWiseDistributedOptimizer`` chains the latter). ``MDInner`` replaces
that inner optimizer over the same parameter groups: 1-D parameters get torch AdamW's
arithmetic (one multi-tensor Adam per group), MD-managed matrices (whole, a ZeRO-1 slice, a
TP piece) the batched step of the engine (``megatron/md/engine``) with ONE reduction of all
their partials per reduction domain.

State is split in two so megatron's checkpoint code keeps working unchanged:
``self.state[p]`` holds only what megatron expects of the base optimizer (``step``, ``exp_avg``,
``exp_avg_sq`` / ``momentum_buffer``: tensors shaped like ``p``); ``self.md_state[p]`` holds the
MD extras (raw gains and their moments, radius, and the direction when ``p`` is the fp32 model
weight itself). ``checkpoint.py`` saves the extras. Both are views of the engine's stacked
storage for whole matrices; a load that replaces them is adopted back (``rebind``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from megatron.md.base_steps import AdamHParams, MuonHParams
from megatron.md.config import MDConfig
from megatron.md.engine.engine import Domain, Engine, HParams, Member, reduced_norms
from megatron.md.engine.graph import DeviceScalars, StepGraph
from megatron.md.sliced import SliceMD
from megatron.md.state import MatrixState


@dataclass
class MDSlot:
    """MD bookkeeping for one main parameter (a matrix, or one rank's flat slice of it)."""

    md: SliceMD
    fp32_mode: bool
    """True when the main parameter is the model weight W itself (fp32 params): the direction
    is then an extra fp32 copy in ``md_state``. False: the main param *is* the direction."""
    index: int | None = None
    """Position in the instance's global partial layout (ZeRO-1); None for whole matrices."""
    name: str = ""
    """Parameter name, for messages."""
    model_param: torch.Tensor | None = None
    """The model's parameter (its checkpoint key names the MD state)."""
    replica: int | tuple[int, int] = 0
    """Checkpoint replica id of this rank's replicated MD state (gains, radius); (TP rank,
    DP replica) under tensor parallelism."""
    dir_replica: int = 0
    """Checkpoint replica id of this rank's direction (0 when no other rank holds it)."""
    domain: object = None
    """Key of the reduction domain its partials are summed in (``MDInner.domains``)."""
    order: int = 0
    """Its place among the engine's same-shape matrices (``engine.Member.order``)."""


class MDInner(torch.optim.Optimizer):
    """AdamW on 1-D params, AdamMD or MuonMD on matrices; the inner optimizer of one wrapper."""

    def __init__(self, param_groups: list[dict], md: MDConfig, muon: MuonHParams | None):
        # fp32 ZeRO-1 shards are non-leaf views, which add_param_group refuses; like
        # megatron-core's DistributedOptimizer we set param_groups directly.
        super().__init__([torch.zeros(1, requires_grad=True)], dict(lr=1e-3))
        self.param_groups = param_groups
        self.md, self.muon = md, muon  # each slot's SliceMD knows its base
        self.slots: dict[torch.Tensor, MDSlot] = {}
        self.md_state: dict[torch.Tensor, MatrixState] = {}  # MD's fields (state.py)
        self.domains: dict[object, Domain] = {}
        self.engine: Engine | None = None
        self.compiled = frozenset()  # bases the engine compiles (MDConfig.use_fused)
        self.reduce_group = None  # ZeRO-1: the group its one reduction goes over
        self.layout: list[int] | None = None  # ZeRO-1: partial sizes of every MD matrix
        self.norm_layout: list[int] | None = None
        self.pre_layout: list[int] | None = None
        self.outputs = None  # () -> {id(member): flat destination of its W}; the integration's
        self.timers = None  # megatron Timers (config.timers) when the training loop sets them
        self.n_collectives = 0
        self.last_payload = 0
        self.last_payload_bytes = 0
        self._counting = False
        # a one-element tensor: 0, or NaN once the step saw a non-finite reduced partial or
        # gain (train/nonfinite.py); the engine's
        self.probe = torch.zeros(1)
        # --md-cuda-graph (engine/graph.py): the step's changing numbers on the device, and
        # the graph (None: those numbers on the device, stepped eagerly)
        self.scalars: DeviceScalars | None = None
        self.graph: StepGraph | None = None
        self._graph_counts = (0, 0, 0)  # the collective counters a captured step adds
        self._fused_in_step = False  # the step wrote W already: the next fuse() is done
        self._in_graph_body = False

    # ---- set-up ----
    def bind(self, main: torch.Tensor, slot: MDSlot) -> None:
        self.slots[main] = slot

    def add_domain(self, key, reduce, group=None, zero1: bool = False) -> None:
        """A reduction domain: ``reduce(buffer)`` sums over its ranks (None: nothing to sum);
        ``zero1``: its matrices line up in the instance's global layout."""
        if key not in self.domains:
            lay = (self.layout, self.norm_layout, self.pre_layout) if zero1 else (None,) * 3
            self.domains[key] = Domain(reduce, *lay)
            self._groups = getattr(self, "_groups", {})
            self._groups[key] = group

    def direction_of(self, p: torch.Tensor) -> torch.Tensor:
        """The flat direction Ŵ of main param ``p`` (fp32: MD's copy; else ``p`` itself)."""
        if self.engine is not None:
            self.engine.settle()  # a compiled step's rescale not yet taken by a fuse
        slot = self.slots[p]
        return self.md_state[p]["direction"] if slot.fp32_mode else p.data.view(-1)

    def _members(self) -> list[Member]:
        out = []
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                slot = self.slots.get(p)
                if slot is None:
                    continue
                self.state.setdefault(p, {})
                st = self.md_state.setdefault(p, {})
                out.append(Member(slot.md, p, slot.fp32_mode, self.state[p], st, i,
                                  slot.domain, slot.index, order=slot.order))  # fmt: skip
        return out

    def _vectors(self):
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p not in self.slots:
                    yield i, p

    def _vector_states(self) -> list[dict]:
        return [self.state[p] for _, p in self._vectors()]

    def init_state(self, keep_base: bool = False) -> None:
        """Create all state now (megatron's checkpoint code needs it before the first step):
        zero moments, gains at 1, radii from the current weights (one reduction per domain).
        ``keep_base``: keep existing base-optimizer state (moments, step), redo only MD's."""
        for _, p in self._vectors():
            if not (keep_base and self.state.get(p)):
                self.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
        if self.engine is None:
            self.engine = Engine(self._members(), self.domains, self.compiled,
                                 fallback=self.md.fused_step == "auto")  # fmt: skip
            self.probe = self.engine.probe
        if self.graph is not None:
            self.graph.drop()
        with self._uncounted():
            self.engine.init_state(self._reduce, keep_base, self._vector_states())

    def reinit_from_weights(self) -> None:
        """MD state from the current main params, which hold W (continual training from a
        non-MD checkpoint): direction = W, gains 1, radius = its norm, so the model is
        unchanged. The base optimizer's moments are kept: with gains 1, G_Ŵ = G_W."""
        self.init_state(keep_base=True)

    def rebind(self) -> None:
        """After a load replaced state tensors (torch's load replaces the per-parameter state
        dicts themselves): into the engine's storage again."""
        if self.engine is not None:
            for m in self.engine.members:
                m.state = self.state[m.main]
                m.md_state = self.md_state[m.main]
            self.engine.rebind(self._vector_states())
            if self.graph is not None:
                self.graph.drop()

    def load_state_dict(self, state_dict) -> None:
        """torch's load (it replaces the state tensors), then adopted by the engine; megatron
        copies its loaded values into them afterwards, in place."""
        super().load_state_dict(state_dict)
        self.rebind()

    def reduced_norms(self) -> dict[torch.Tensor, torch.Tensor]:
        """Every MD matrix's squared sphere norms as they are, summed over its domain (checks
        and diagnostics; collectives not counted as the step's): main -> (n_norm,)."""
        with self._uncounted():
            by_id = reduced_norms(self.engine, self._reduce)
        return {m.main: by_id[id(m)] for m in self.engine.members if id(m) in by_id}

    # ---- the step ----
    def _timer(self, name: str):
        if self.timers is None or self._in_graph_body:  # megatron's timers synchronize
            return contextlib.nullcontext()
        t = self.timers(name, log_level=2)

        @contextlib.contextmanager
        def span():
            t.start()
            yield
            t.stop()

        return span()

    @contextlib.contextmanager
    def _uncounted(self):
        saved = self.n_collectives, self.last_payload, self.last_payload_bytes
        try:
            yield
        finally:
            self.n_collectives, self.last_payload, self.last_payload_bytes = saved

    def _reduce(self, key, buf: torch.Tensor) -> None:
        """Sum one domain's partials over its ranks, counted as the step's reductions (ZeRO-1's
        one even on a single rank, where it sums nothing)."""
        dom = self.domains[key]
        if dom.reduce is None and dom.layout is None:
            return
        if dom.reduce is not None:
            with self._timer("md-reduce"):
                dom.reduce(buf)
        self.n_collectives += 1
        self.last_payload += buf.numel()
        self.last_payload_bytes += buf.numel() * buf.element_size()

    def hyperparameters(self) -> dict[int, HParams]:
        """Each parameter group's hyper-parameters at its current LR (the schedule moves it)."""
        g1, g2 = self.md.gain_betas
        out = {}
        for i, group in enumerate(self.param_groups):
            b1, b2 = group.get("betas", (0.9, 0.999))
            eps, lr, wd = group.get("eps", 1e-8), group["lr"], group.get("weight_decay", 0.0)
            if wd and any(p in self.slots for p in group["params"]):
                name = next(self.slots[p].name for p in group["params"] if p in self.slots)
                raise ValueError(
                    f"MD keeps {name} on a sphere: its weight decay must be 0 "
                    "(use --weight-decay 0 with --md-decoupling)"
                )
            muon = None if self.muon is None else dataclasses.replace(self.muon, lr=lr)
            out[i] = HParams(
                AdamHParams(lr, b1, b2, eps, wd), muon,
                AdamHParams(self.md.gain_lr_for(group), g1, g2, self.md.gain_eps),
            )  # fmt: skip
        return out

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported")
        hps = self.hyperparameters()
        missing = [s.name for p, s in self.slots.items() if p.grad is None]
        if missing:
            raise RuntimeError(f"no gradient for MD matrix {missing[0]} (megatron sets every one)")
        self.last_payload = self.last_payload_bytes = 0
        if self.scalars is not None:
            with self._timer("md-step"):
                self._device_step(hps)
            return None
        vectors = [(i, p) for i, p in self._vectors() if p.grad is not None]
        with self._timer("md-step"):  # the 1-D parameters' Adam with the gains'
            self.engine.step(hps, self._reduce, self._vector_works(vectors, hps))
        if any(s.fp32_mode for s in self.slots.values()):  # W is the main param: now
            with self._timer("md-fuse"):
                self.engine.fuse(self.outputs(), fp32_mode=True)
        return None

    def _vector_works(self, vectors: list, hps: dict[int, HParams]) -> list[tuple]:
        """The 1-D parameters' Adam (``(group index, param)`` with a gradient) as the engine's
        ``extra`` steps: torch AdamW's arithmetic, in the gains' multi-tensor Adam."""
        out = []
        for i, p in vectors:
            st = self.state[p]
            out.append((p, p.grad, st["exp_avg"], st["exp_avg_sq"], hps[i].adam))
        return out

    # ---- the step with its changing numbers on the device (--md-cuda-graph) ----
    def use_cuda_graph(self, graph: bool = True) -> None:
        """Step with the step count and LRs read from the device (``engine/graph.py``), and
        with ``graph`` capture the step in a CUDA graph after its warm-up and replay it."""
        # the parameters' device (the probe is on the CPU where a rank holds no MD matrix)
        device = next((p.device for g in self.param_groups for p in g["params"]), self.probe.device)
        if graph and device.type != "cuda":
            raise ValueError(f"--md-cuda-graph needs the optimizer on a GPU (it is on {device})")
        dtype = self.engine.groups[0].W.dtype if self.engine and self.engine.groups else None
        self.scalars = DeviceScalars(device, dtype or torch.float32)
        self.graph = StepGraph() if graph else None

    def _device_step(self, hps: dict[int, HParams]) -> None:
        self.engine.advance()
        dev = self.scalars.write(self.engine.steps, hps)
        step = self.scalars.step
        vectors = [(i, p) for i, p in self._vectors() if p.grad is not None]
        outs = self.outputs() if self.slots else {}

        def body() -> None:
            self._in_graph_body = True
            try:
                for g in self.engine.groups:  # φ(ĝ) from this step's kernels, not a cached
                    g.settle()  # tensor the graph would outlive
                    g.gains_changed()
                self.engine.run(dev, self._reduce, step, self._vector_works(vectors, dev))
                if self.slots:
                    self.engine.fuse(outs)
            finally:
                self._in_graph_body = False

        if self.graph is None:
            body()
        else:
            before = self.n_collectives, self.last_payload, self.last_payload_bytes
            key = (self.scalars.key, tuple(id(p) for _, p in vectors))
            where = self._addresses(vectors, outs)
            how = self.graph.run(body, key, where, lambda k: self._address_name(k, vectors))
            if how == "captured":
                now = self.n_collectives, self.last_payload, self.last_payload_bytes
                self._graph_counts = tuple(b - a for a, b in zip(before, now))
            elif how == "replayed":
                c, n, nb = self._graph_counts
                self.n_collectives += c
                self.last_payload += n
                self.last_payload_bytes += nb
            for g in self.engine.groups:
                g.gains_changed()
        # megatron's main->model copy calls fuse() next, where W is not the main param
        self._fused_in_step = any(not s.fp32_mode for s in self.slots.values())

    def _addresses(self, vectors: list, outs: dict) -> list[int]:
        """Where a replay reads or writes outside the graph's pool what megatron could move:
        the MD matrices' gradients, the 1-D ones', the fused weights' destinations."""
        out = [p.grad.data_ptr() for p in self.slots]
        out += [p.grad.data_ptr() for _, p in vectors]
        return out + [outs[id(m)].data_ptr() for m in self.engine.members]

    def _address_name(self, k: int, vectors: list) -> str:
        """What the ``k``-th of ``_addresses`` is, for a message."""
        names = [s.name for s in self.slots.values()]
        if k < len(names):
            return f"the gradient of {names[k]}"
        k -= len(names)
        if k < len(vectors):
            return f"the gradient of a 1-D parameter of shape {tuple(vectors[k][1].shape)}"
        md = self.engine.members[k - len(vectors)].md
        return f"the destination of a fused weight of shape {md.shape}"

    def fuse_into(self, main: torch.Tensor, out: torch.Tensor) -> bool:
        """Write W = Γ ⊙ Ŵ of ``main`` (a direction) into ``out``; False if ``main`` is not an
        MD matrix whose main param is its direction."""
        slot = self.slots.get(main)
        if slot is None or slot.fp32_mode:
            return False
        member = next(m for m in self.engine.members if m.main is main)
        out.view(-1).copy_(self.engine.fused_weight(member))
        return True

    def fuse(self) -> None:
        """W = Γ ⊙ Ŵ of every MD matrix whose main param is its direction into its destination
        (the integration's ``outputs``: megatron's main→model copy); fp32 params' W is
        written by the step itself."""
        if self._fused_in_step:  # --md-cuda-graph: the step wrote W
            self._fused_in_step = False
            return
        if self.engine is not None and self.slots:
            with self._timer("md-fuse"):
                self.engine.fuse(self.outputs(), fp32_mode=False)
