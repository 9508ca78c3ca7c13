"""The MD step of every matrix one optimizer holds, as a fixed number of batched operations.

Matrices are grouped once (``Group``: the same block geometry — whole matrices of one shape, or
ZeRO-1 slices cut at one place of such matrices —, treatment, base, precision, parameter
group and reduction domain); their direction, base-optimizer state, gains and radius live in
the group's stacked storage, which the optimizer's and the checkpoint's dicts view. A step is
then, per group, a handful of batched operations (a gradient stack, the gains' partials,
G_Ŵ = Γ ⊙ G, the norms, the projection, the fused weight), the base step batched over groups
(one multi-tensor Adam; one Newton–Schulz call per group and Q/K/V block), the gains' Adam
once for all groups, and ONE reduction of all partials per reduction domain: how many
operations does not grow with the number of layers. Nothing is read back to the host: step
counts and hyper-parameters are Python numbers held here, layouts and index tensors are made
once.

Reduction domains: the ranks a matrix's partials are summed over (ZeRO-1: the optimizer's
data-parallel group, times TP under tensor parallelism; whole matrices: the TP or expert-TP
group of a split matrix, or none). Each has one flat buffer per step; with a global
``layout`` (ZeRO-1: every rank lays out every matrix of the optimizer, zeros where it owns
nothing) ranks owning different matrices line up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from megatron.md import maps
from megatron.md.base_steps import AdamHParams
from megatron.md.engine.gainstep import GainBatch, hp_key
from megatron.md.engine.group import Group

#: elements of Ŵ whose G_Ŵ are held at once before their base step (bounds the temporaries)
CHUNK = 1 << 26


@dataclass
class Member:
    """One matrix — or this rank's ZeRO-1 slice of it, or its tensor-parallel piece — the
    engine steps."""

    md: object
    """Its ``sliced.SliceMD``: geometry (local and full shape, slice, blocks, TP piece) and
    treatment (``spec``, base)."""
    main: torch.Tensor
    """The torch optimizer's parameter (its ``.grad`` is G): Ŵ itself, or with ``fp32_mode``
    the fp32 weight W."""
    fp32_mode: bool
    """True: ``main`` is the model's fp32 weight W and Ŵ is MD's own copy (``md_state``)."""
    state: dict
    """The torch optimizer's ``state[main]`` (the base's fields, ``step``)."""
    md_state: dict
    """MD's fields (gains and their moments, radius, the fp32 direction)."""
    param_group: int
    """Index of its parameter group (hyper-parameters)."""
    domain: object
    """Key of its reduction domain."""
    index: int | None = None
    """Position in the domain's global layout (ZeRO-1); None: in the order of members."""
    seed: int = 0
    """Seed of its lowrank factor A (the reference's)."""
    order: int = 0
    """Its place in its group (ascending): the address of its gradient or fused weight in
    megatron's flat buffers, so a group's gradients and destinations can be one strided view
    of the buffer (no stack, no copy)."""

    def direction(self) -> torch.Tensor:
        return self.md_state["direction"] if self.fp32_mode else self.main.data.view(-1)

    def set_direction(self, v: torch.Tensor) -> None:
        if self.fp32_mode:
            self.md_state["direction"] = v
        else:
            self.main.data = v.view(self.main.shape)


@dataclass
class Domain:
    """The ranks a set of matrices' partials are summed over."""

    reduce: Callable[[torch.Tensor], None] | None
    """Sums a buffer over the domain's ranks in place (None: nothing to sum)."""
    layout: list[int] | None = None
    """ZeRO-1: the partial sizes of every matrix of the optimizer, in an order every rank
    shares (``Member.index``); None: the members' own order."""
    norm_layout: list[int] | None = None
    pre_layout: list[int] | None = None
    members: list = field(default_factory=list)


@dataclass
class HParams:
    """One parameter group's hyper-parameters for this step."""

    adam: AdamHParams
    """Ŵ's Adam (no weight decay), and the 1-D parameters' (with the group's)."""
    muon: object
    """Ŵ's Muon (MuonHParams), None where the leaf has no Muon."""
    gain: AdamHParams
    """The gains' Adam."""

    def base(self, name: str):
        return self.adam if name == "adam" else self.muon


class Engine:
    def __init__(self, members: list[Member], domains: dict, compiled: bool | frozenset = False,
                 fallback: bool = False):  # fmt: skip
        """``compiled``: the bases whose groups take the compiled kernels where they fit
        (``MDConfig.use_fused``; True: every base); ``fallback``: a miscompiled kernel's layout
        runs eager instead of stopping the run (``Kernels.fallback``)."""
        if compiled is True:
            compiled = frozenset({"adam", "muon"})
        self.members, self.domains, self.compiled = members, domains, frozenset(compiled or ())
        for m in members:
            domains[m.domain].members.append(m)
            if m.fp32_mode and m.md_state.get("direction") is None:  # MD's copy of W
                m.md_state["direction"] = m.main.detach().reshape(-1).clone()
        self.steps = 0
        self.step_tensor = torch.zeros((), dtype=torch.float32)  # state["step"], shared
        self.groups = _make_groups(members)
        self.by_member = {id(m): (g, b) for g in self.groups for b, m in enumerate(g.members)}
        self._index = {}  # (kind, id(group)) -> (start, None) contiguous | (None, index tensor)
        for kind, sizes in (("step", "n_partial"), ("norm", "n_norm"), ("pre", "n_pre")):
            self._place(kind, sizes)
        self.probe = torch.zeros(1, device=members[0].main.device if members else "cpu")
        # whether the probe can ever turn: partials or gains to check (MD switched off has
        # neither, and then adds nothing to megatron's gradient norm: bit for bit megatron)
        self.watches = any(g.n_partial or g.gain_names for g in self.groups)
        self.kernels = None
        self._radius_key = None  # the radii ``_radius_bufs`` holds (``_scales``)
        self._radius_bufs: dict = {}
        if self.compiled:
            from megatron.md.engine import compiled as ck

            for g in self.groups:
                if g.base.name in self.compiled:
                    g.kernels = ck.kernels_for(g, fallback)

    # ---- layout of the partial buffers ----
    def _place(self, kind: str, size_attr: str) -> None:
        """Where each group's partials lie in its domain's buffer of ``kind``."""
        self._totals = getattr(self, "_totals", {})
        for key, dom in self.domains.items():
            layout = {"step": dom.layout, "norm": dom.norm_layout, "pre": dom.pre_layout}[kind]
            groups = [g for g in self.groups if g.members[0].domain == key]
            if layout is None:  # the members' own order: each group one contiguous range
                off = 0
                for g in groups:
                    n = g.B * getattr(g, size_attr)
                    self._index[(kind, id(g))] = (off, None)
                    off += n
                self._totals[(kind, key)] = off
                continue
            offs = [0]
            for n in layout:
                offs.append(offs[-1] + n)
            self._totals[(kind, key)] = offs[-1]
            for g in groups:
                n = getattr(g, size_attr)
                starts = [offs[m.index] for m in g.members]
                if all(s == starts[0] + b * n for b, s in enumerate(starts)):
                    self._index[(kind, id(g))] = (starts[0], None)
                    continue
                idx = torch.cat([torch.arange(s, s + n) for s in starts])
                self._index[(kind, id(g))] = (None, idx.to(g.W.device))

    def _buffers(self, kind: str, dtype, device) -> dict:
        return {key: torch.zeros(self._totals[(kind, key)], dtype=dtype, device=device)
                for key in self.domains}  # fmt: skip

    def _at(self, kind: str, g: Group, bufs: dict) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """(group ``g``'s domain buffer in ``bufs``, where its ``kind`` partials start, their
        index where they are not one span)."""
        start, idx = self._index[(kind, id(g))]
        return bufs[g.members[0].domain], start, idx

    def _view(self, kind: str, g: Group, bufs: dict, n: int) -> tuple[torch.Tensor, bool]:
        """(the group's (B, n) partials to fill, whether they are the buffer itself)."""
        buf, start, idx = self._at(kind, g, bufs)
        if idx is None and g.md0.counts:
            return buf[start : start + g.B * n].view(g.B, n), True
        return torch.zeros(g.B, n, dtype=buf.dtype, device=buf.device), False

    def _write(self, kind: str, g: Group, bufs: dict, part: torch.Tensor, inplace: bool) -> None:
        if inplace or not g.md0.counts:  # a replica another rank of the group adds
            return
        buf, start, idx = self._at(kind, g, bufs)
        if idx is None:
            buf[start : start + part.numel()].add_(part.view(-1))
        else:
            buf.index_add_(0, idx, part.view(-1))

    def _read(self, kind: str, g: Group, bufs: dict, n: int) -> torch.Tensor:
        buf, start, idx = self._at(kind, g, bufs)
        if idx is None:
            return buf[start : start + g.B * n].view(g.B, n)
        return buf.index_select(0, idx).view(g.B, n)

    def norm_buffers(self, reduce_fn) -> dict:
        """The domains' buffers of every matrix's squared sphere norms as they are, reduced."""
        self.settle()
        dt = self.groups[0].W.dtype if self.groups else torch.float32
        bufs = self._buffers("norm", dt, self.probe.device)
        parts = {}
        for g in self.groups:
            if g.n_norm:
                P, inplace = self._view("norm", g, bufs, g.n_norm)
                g.norm_partials(P)
                parts[g] = (P, inplace)
        for g, (P, inplace) in parts.items():
            self._write("norm", g, bufs, P, inplace)
        self._reduce(bufs, reduce_fn)
        return bufs

    def _reduce(self, bufs: dict, reduce_fn) -> None:
        for key, buf in bufs.items():
            if buf.numel():  # the same on every rank of the domain: collective-safe
                reduce_fn(key, buf)

    # ---- state ----
    def rebind(self, others: Sequence[dict] = ()) -> None:
        """After anything replaced the members' tensors (a checkpoint load): copy them into
        the groups' storage and view them again; the step count from the loaded state of the
        members and of ``others`` (the optimizer's vectors, stepped with this count: a rank
        whose shard holds no MD matrix has only theirs). Muon's update scale from the loaded
        radius: it kept the one of the radius the state was built with (the random init's
        norm, under ``--md-radius init``), which a resume matched only when the init did —
        not after a fresh optimizer's start from trained weights (``--no-load-optim``), nor
        into a model of another seed."""
        for g in self.groups:
            g.gains_changed()
            g.pending = None
            g.bind()
            g.set_muon_scale(g.radius)
        states = [m.state for m in self.members] + list(others)
        steps = [int(s) for s in (st.get("step") for st in states) if s is not None]
        if steps:  # CPU tensors (torch's and ours): no device sync
            self.steps = max(steps)
        self.share_step(states)

    def share_step(self, states: list[dict]) -> None:
        """Every state's ``step`` is this engine's one counter (checkpoints read it)."""
        self.step_tensor.fill_(self.steps)
        for st in states:
            st["step"] = self.step_tensor

    def init_state(self, reduce_fn, keep_base: bool = False, others: Sequence[dict] = ()) -> None:
        """Gains at 1, zero moments, radii from the directions as they are (one reduction);
        ``keep_base``: the base's state and step as they are (continual training); ``others``
        share the step (``rebind``)."""
        if keep_base:  # the base's state a load just put in place: into the storage first
            self.rebind(others)
        one = {g: maps.raw_for_unit_gain(g.spec.gain_map) for g in self.groups}
        for g in self.groups:
            saved = {f: t.clone() for f, t in g.state.items()} if keep_base else None
            g.init_state(one[g])
            if saved is not None:
                for f, t in saved.items():
                    g.state[f].copy_(t)
        for m in self.members:  # fp32 params: Ŵ is MD's copy of W (continual training too)
            if m.fp32_mode:
                m.direction().copy_(m.main.data.reshape(-1))
        bufs = self.norm_buffers(reduce_fn)
        for g in self.groups:
            g.finish_init(self._read("norm", g, bufs, g.n_norm) if g.n_norm else None,
                          absorb=keep_base)  # fmt: skip
        if not keep_base:
            self.steps = 0
        self.share_step([m.state for m in self.members] + list(others))

    # ---- the step ----
    def step(self, hps: dict[int, HParams], reduce_fn, extra: Sequence[tuple] = ()) -> None:
        """One MD step of every matrix: ``hps`` by parameter-group index; ``reduce_fn(domain
        key, buffer)`` sums a domain's partials over its ranks; ``extra``: ``run``'s."""
        self.advance()
        self.run(hps, reduce_fn, self.steps, extra)

    def advance(self) -> None:
        """Count a step (the host's part of it: what checkpoints read)."""
        self.steps += 1
        self.step_tensor.fill_(self.steps)

    def run(self, hps: dict[int, HParams], reduce_fn, step, extra: Sequence[tuple] = ()) -> None:
        """The device's part of a step: ``step`` is the 1-based step count, a Python number or,
        with ``hps``' LRs, a 0-d device tensor (then nothing is read from Python numbers that
        change between steps, and a CUDA graph can replay it: ``graph.py``). ``extra``: Adam
        steps of tensors MD does not treat (the optimizer's 1-D parameters: (param, grad,
        exp_avg, exp_avg_sq, AdamHParams) each), run with the gains' (``gainstep.GainBatch``)."""
        if not self.groups:
            gains = GainBatch()
            gains.add_plain(extra)
            gains.run(step)
            return
        dev = self.probe.device
        dt = self.groups[0].W.dtype
        bufs = self._buffers("step", dt, dev)
        pre = [g for g in self.groups if g.n_pre]
        pre_bufs = self._buffers("pre", dt, dev) if pre else None
        held: dict[Group, tuple] = {}  # group -> (G_Ŵ, partials, in place)

        def flush(chunk: list[Group]) -> None:
            """The base step of ``chunk``'s groups (batched by base and hyper-parameters),
            then their norms' partials."""
            batches: dict[tuple, list[Group]] = {}
            for g in chunk:
                hp = hps[g.members[0].param_group].base(g.base.name)
                batches.setdefault((g.base.name, hp_key(hp)), (hp, []))[1].append(g)
            for hp, gs in batches.values():
                gs[0].base.step(gs, [held[g][0] for g in gs], step, hp)
            for g in chunk:
                G, P, inplace = held.pop(g)
                if g.n_norm:
                    g.norm_partials(P[:, g.n_gain :])
                self._write("step", g, bufs, P, inplace)

        chunk, size = [], 0
        compiled1 = []  # (group, P, hp): phase 1 compiled, the groups at once (G read there)
        written1 = []  # (group, P, in place): their partials to add into the buffers after
        for g in self.groups:
            P, inplace = self._view("step", g, bufs, g.n_partial)
            if g.kernels is not None and g.kernels.phase1 is not None:
                hp = hps[g.members[0].param_group].base(g.base.name)
                compiled1.append((g, P, hp))
                written1.append((g, P, inplace))
                continue
            pre_p = None
            if g.n_pre:
                pre_p, pre_in = self._view("pre", g, pre_bufs, g.n_pre)
            if g.kernels is not None and g.kernels.partials is not None:
                G = g.kernels.partials(g, P)  # G read there (no tangent projection: no pre_p)
            else:
                G, own = g.grads()
                G = g.gain_partials(G, P, pre_p, own, private=bool(g.n_pre) or g.base.writes_grads)
            if g.n_pre:
                self._write("pre", g, pre_bufs, pre_p, pre_in)
            held[g] = (G, P, inplace)
            if not pre:  # (a tangent projection needs every pre partial reduced first)
                chunk.append(g)
                size += G.numel()
                if size >= CHUNK:
                    flush(chunk)
                    chunk, size = [], 0
        if compiled1:
            from megatron.md.engine import compiled as ck

            ck.phase1_groups(compiled1, step)
            for g, P, inplace in written1:
                self._write("step", g, bufs, P, inplace)
        if pre:
            self._reduce(pre_bufs, reduce_fn)
            for g in pre:
                g.tangent(held[g][0], self._read("pre", g, pre_bufs, g.n_pre))
            chunk = [g for g in self.groups if g in held]
        if chunk:
            flush(chunk)
        self._reduce(bufs, reduce_fn)
        scales = self._scales(bufs)
        gains = GainBatch()
        gains.add_plain(extra)
        for g in self.groups:
            T = self._read("step", g, bufs, g.n_partial)
            defer = g.kernels is not None and g.kernels.fuse is not None
            if g in scales:
                g.project_by(scales[g], defer=defer)
            else:
                g.project(T[:, g.n_gain :], defer=defer)
            off = 0
            ghp = hps[g.members[0].param_group].gain
            for n, size_n in zip(g.gain_names, g.gain_sizes):
                chain = "direct" if g.spec.gains == "lowrank" else g.spec.gain_map
                gains.add(g, n, T[:, off : off + size_n], chain, g.spec.gain_map, ghp)
                off += size_n
        gains.run(step)
        self._phi_all()
        self._mark_nonfinite(list(bufs.values()) + gains.raws)

    def _mark_nonfinite(self, tensors: list[torch.Tensor]) -> None:
        """The probe NaN once any of ``tensors`` holds a NaN or ±inf: one multi-tensor norm of
        them all (NaN or inf where one is; the squares overflow only past 1.8e19, a step gone
        wrong anyway), times 0 — five launches, where an ``isfinite`` check of each tensor took
        eight."""
        ts = [t for t in tensors if t.numel()]
        if ts:
            self.probe.add_(torch.stack(torch._foreach_norm(ts)).sum().mul_(0))

    def _phi_all(self) -> None:
        """The gains moved: φ(ĝ) of every group's gains made again, one operation per map for
        all groups (``Group.phi`` then finds them; one per gain per group otherwise, 10 of
        AdamMD's launches at 12 layers)."""
        by_map: dict[str, list] = {}
        for g in self.groups:
            g.gains_changed()
            if g.spec.gains != "lowrank" and g.spec.gain_map in maps.CHAIN_MAPS:
                for n, raw in g.gains.items():
                    by_map.setdefault(g.spec.gain_map, []).append((g, n, raw))
        for gain_map, items in by_map.items():
            raws = [raw for _, _, raw in items]
            flat = maps.phi(torch.cat([r.reshape(-1) for r in raws]), gain_map)
            for (g, n, raw), v in zip(items, flat.split([r.numel() for r in raws])):
                g.keep_phi(n, raw, v.view(raw.shape))

    def _scales(self, bufs: dict) -> dict:
        """Line 8's rescale r / ‖Ŵ‖ of every group projected back, from the reduced buffers:
        two operations per domain (a square root and a division by a buffer holding each
        group's radius where its norms lie), not two per group. Groups whose radius is not
        set yet are left out (``Group.project`` then)."""
        groups = [g for g in self.groups if g.spec.project and g.n_norm and g.radius is not None]
        if not groups:
            return {}
        key = tuple((id(g.radius), g.radius._version, g.radius.data_ptr()) for g in groups)
        if self._radius_key != key:  # made again only when a radius changes
            self._radius_bufs = self._buffers("step", bufs[next(iter(bufs))].dtype,
                                              self.probe.device)  # fmt: skip
            for g in groups:
                self._put(g, self._radius_bufs, g.radius)
            self._radius_key = key
        out = {dom: self._radius_bufs[dom] / buf.sqrt() for dom, buf in bufs.items()}
        return {g: self._read("step", g, out, g.n_partial)[:, g.n_gain :] for g in groups}

    def _put(self, g: Group, bufs: dict, values: torch.Tensor) -> None:
        """``values`` (B, n_norm) where group ``g``'s norms lie in ``bufs``."""
        buf, start, idx = self._at("step", g, bufs)
        if idx is None:
            buf[start : start + g.B * g.n_partial].view(g.B, -1)[:, g.n_gain :].copy_(values)
        else:
            at = idx.view(g.B, g.n_partial)[:, g.n_gain :].reshape(-1)
            buf.index_copy_(0, at, values.reshape(-1).to(buf.dtype))

    def fuse(self, outs: dict[int, torch.Tensor], fp32_mode: bool | None = None) -> None:
        """W = Γ ⊙ Ŵ of every member (of those whose ``fp32_mode`` is the one given, if given)
        into ``outs`` (id(member) -> its flat destination, of the model's dtype)."""
        compiled = []  # (group, destinations): fused compiled, the groups at once
        for g in self.groups:
            if fp32_mode is not None and g.fp32_mode != fp32_mode:
                continue
            targets = [outs[id(m)] for m in g.members]
            if g.kernels is not None and g.kernels.fuse is not None:
                compiled.append((g, targets))
                continue
            g.fuse_to(targets)
        if compiled:
            from megatron.md.engine import compiled as ck

            ck.fuse_groups(compiled)

    def settle(self) -> None:
        for g in self.groups:
            g.settle()

    def fused_weight(self, member: Member) -> torch.Tensor:
        """W = Γ ⊙ Ŵ of one member, a new fp32 flat tensor (diagnostics)."""
        g, b = self.by_member[id(member)]
        tmp = torch.empty(g.B, g.L, dtype=torch.float32, device=g.W.device)
        g.settle()
        g.fuse(tmp)
        return tmp[b]

    def group_of(self, member: Member) -> tuple[Group, int]:
        return self.by_member[id(member)]

    def cut_groups(self) -> list[Group]:
        """The groups of ZeRO-1 slices cut inside their matrices (one place of same-kind
        matrices a group: ``_make_groups``), each with its own phase-1 kernels."""
        return [g for g in self.groups if not g.md0.whole]

    def indexed_groups(self) -> list[Group]:
        """The groups whose partials are no one span of their domain's step buffer (each then a
        zeroed temporary, an ``index_add_`` and two ``index_select``s a step: ``_place``)."""
        return [g for g in self.groups if self._index[("step", id(g))][1] is not None]


def _make_groups(members: list[Member]) -> list[Group]:
    """Whole matrices of one kind stacked together, and so ZeRO-1 slices cut at the same place
    of same-kind matrices (megatron's buckets hold whole parameters: where a layer fills a
    bucket, its shards cut each layer's matrices alike, and each cut slice a group cost a
    step its own kernels, ~6 on a GPU); a slice cut inside a TP piece a group of its own."""
    groups: dict[tuple, list[Member]] = {}
    singles = []
    for m in members:
        md = m.md
        if not md.whole and md.tp is not None:
            singles.append([m])
            continue
        key = (
            tuple(md.blocks), md.local_shape, md.shape, md.spec, md.base, md.tp, md.counts,
            m.fp32_mode, m.main.dtype, str(m.main.device), m.param_group, m.domain,
            None if md.whole else (md.start, md.end),
        )  # fmt: skip
        groups.setdefault(key, []).append(m)
    for ms in groups.values():
        ms.sort(key=lambda m: m.order)
    return [Group(ms, own=True) for ms in groups.values()] + [
        Group(ms, own=False) for ms in singles
    ]


def reduced_norms(engine: Engine, reduce_fn) -> dict[int, torch.Tensor]:
    """Every member's squared sphere norms as they are, summed over its domain (a check's or a
    diagnostic's: one reduction per domain): id(member) -> (n_norm,)."""
    bufs = engine.norm_buffers(reduce_fn)
    out = {}
    for g in engine.groups:
        if g.n_norm:
            T = engine._read("norm", g, bufs, g.n_norm)
            for b, m in enumerate(g.members):
                out[id(m)] = T[b]
    return out
