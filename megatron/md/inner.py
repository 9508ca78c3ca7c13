"""The torch optimizer that megatron-core's wrappers step: AdamW/Muon with the MD step.

megatron-core wraps a plain torch optimizer (``DistributedOptimizer``, ``Float16Optimizer…``,
``FP32Optimizer``; ``LayerWiseDistributedOptimizer`` chains the latter). ``MDInner`` replaces
that inner optimizer over the same parameter groups: 1-D parameters get torch AdamW's
arithmetic, MD-managed matrices (whole, or a ZeRO-1 slice) get the batched MD step of
``sliced.py`` with ONE reduction of all their partials per step (identity for whole matrices).

State is split in two so megatron's checkpoint code keeps working unchanged:
``self.state[p]`` holds only what megatron expects of the base optimizer (``step``, ``exp_avg``,
``exp_avg_sq`` / ``momentum_buffer``: tensors shaped like ``p``); ``self.md_state[p]`` holds the
MD extras (raw gains and their moments, radius, and the direction when ``p`` is the fp32 model
weight itself). ``checkpoint.py`` saves the extras.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from megatron.md.base_steps import AdamHParams, MuonHParams, adam_multi_
from megatron.md.batched import SliceItem, identity_reduce, md_init_batched, md_step_batched
from megatron.md.config import MDConfig
from megatron.md.sliced import SliceMD
from megatron.md.state import BASE_FIELDS, MatrixState


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


class MDInner(torch.optim.Optimizer):
    """AdamW on 1-D params, AdamMD or MuonMD on matrices; the inner optimizer of one wrapper."""

    def __init__(self, param_groups: list[dict], md: MDConfig, muon: MuonHParams | None):
        # fp32 ZeRO-1 shards are non-leaf views, which add_param_group refuses; like megatron-core
        # (distrib_optimizer.py:771) we set param_groups directly.
        super().__init__([torch.zeros(1, requires_grad=True)], dict(lr=1e-3))
        self.param_groups = param_groups
        self.md, self.muon = md, muon  # each slot's SliceMD knows its base
        self.slots: dict[torch.Tensor, MDSlot] = {}
        self.md_state: dict[torch.Tensor, MatrixState] = {}  # MD's fields (state.py)
        self.reduce = identity_reduce
        self.reduce_group = None  # the process group ``reduce`` sums over (None: no collective)
        # whole-matrix leaves whose matrices sum over different groups (dense TP pieces, expert-
        # TP pieces, whole matrices): each matrix's group (None: not summed), else None
        self.item_groups: dict[int, object] | None = None  # id(SliceMD) -> process group
        self.layout: list[int] | None = None  # ZeRO-1: partial sizes of every MD matrix
        self.norm_layout: list[int] | None = None
        self.pre_layout: list[int] | None = None
        self.timers = None  # megatron Timers (config.timers) when the training loop sets them
        self.n_collectives = 0
        self.last_payload = 0
        self.last_payload_bytes = 0
        # 0, or NaN once the step saw a non-finite reduced partial or gain (train/nonfinite.py)
        self.probe = torch.zeros(1)

    # ---- set-up ----
    def bind(self, main: torch.Tensor, slot: MDSlot) -> None:
        self.slots[main] = slot
        self.probe = self.probe.to(main.device)

    def direction_of(self, p: torch.Tensor) -> torch.Tensor:
        """The flat direction Ŵ of main param ``p`` (fp32: MD's copy; else ``p`` itself)."""
        slot = self.slots[p]
        d = self.md_state[p]["direction"] if slot.fp32_mode else p.data.view(-1)
        slot.md.apply_pending_rescale(d)  # a fused step's rescale not yet taken by a fuse
        return d

    def init_state(self, keep_base: bool = False) -> None:
        """Create all state now (megatron's checkpoint code needs it before the first step):
        zero moments, gains at 1, radii from the current weights (one reduction).
        ``keep_base``: keep existing base-optimizer state (moments, step), redo only MD's."""
        items, owners = [], []
        for group in self.param_groups:
            for p in group["params"]:
                slot = self.slots.get(p)
                if slot is None:
                    if not (keep_base and self.state.get(p)):
                        self.state[p] = {
                            "step": torch.zeros((), dtype=torch.float32),
                            "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p),
                        }
                    continue
                extra = {"direction": p.detach().reshape(-1).clone()} if slot.fp32_mode else {}
                self.md_state[p] = extra
                direction = self.direction_of(p)
                full = slot.md.init_state(direction)
                if not (keep_base and self.state.get(p)):  # moments shaped like p (megatron)
                    self.state[p] = {
                        k: v if k == "step" else v.view(p.shape)
                        for k, v in full.items()
                        if k in BASE_FIELDS
                    }
                extra.update({k: v for k, v in full.items() if k not in BASE_FIELDS})
                items.append(SliceItem(slot.md, direction, None, full, slot=slot.index))
                owners.append(p)
        counted = self.n_collectives, self.last_payload  # the step's collectives only
        md_init_batched(items, self._counting_reduce, self.norm_layout)
        self.n_collectives, self.last_payload = counted
        for p, it in zip(owners, items):  # finish_init set the radius on the merged dict
            self.md_state[p]["radius"] = it.state["radius"]

    def reinit_from_weights(self) -> None:
        """MD state from the current main params, which hold W (continual training from a
        non-MD checkpoint): direction = W, gains 1, radius = its norm, so the model is
        unchanged. The base optimizer's moments are kept: with gains 1, G_Ŵ = G_W."""
        self.init_state(keep_base=True)

    # ---- the step ----
    def _timer(self, name: str):
        if self.timers is None:
            return contextlib.nullcontext()
        t = self.timers(name, log_level=2)

        @contextlib.contextmanager
        def span():
            t.start()
            yield
            t.stop()

        return span()

    def _counting_reduce(self, buf: torch.Tensor, items: list, segs: list) -> None:
        if self.item_groups is not None:
            self._reduce_by_group(buf, items, segs)
            return
        self.n_collectives += 1
        self.last_payload = buf.numel()
        self.last_payload_bytes = buf.numel() * buf.element_size()
        with self._timer("md-reduce"):
            self.reduce(buf)

    def _reduce_by_group(self, buf: torch.Tensor, items: list, segs: list) -> None:
        """One all-reduce per group of the matrices' segments (in item order: the members of a
        group hold the same matrices of it, in the same order)."""
        import torch.distributed as dist

        by_group: dict[int, tuple] = {}
        for it, s in zip(items, segs):
            group = self.item_groups[id(it.md)]
            if group is not None:
                by_group.setdefault(id(group), (group, []))[1].append(s)
        self.last_payload = 0
        with self._timer("md-reduce"):
            for group, parts in by_group.values():
                flat = torch.cat([buf[s] for s in parts])
                dist.all_reduce(flat, group=group)
                for s, v in zip(parts, flat.split([s.stop - s.start for s in parts])):
                    buf[s] = v
                self.n_collectives += 1
                self.last_payload += flat.numel()
        self.last_payload_bytes = self.last_payload * buf.element_size()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported")
        items, merged = [], []
        vectors: dict[tuple, tuple] = {}  # (step, group) -> (hyper-params, Adam work of 1-D params)
        g1, g2 = self.md.gain_betas
        for group in self.param_groups:
            b1, b2 = group.get("betas", (0.9, 0.999))
            eps, lr, wd = group.get("eps", 1e-8), group["lr"], group.get("weight_decay", 0.0)
            # hyper-parameters once per group (the LR schedule changes them between steps)
            adam_hp = AdamHParams(lr, b1, b2, eps, wd)
            base_hps = {"adam": AdamHParams(lr, b1, b2, eps, 0.0)}
            if self.muon is not None:
                base_hps["muon"] = dataclasses.replace(self.muon, lr=lr)
            gain_hp = AdamHParams(self.md.gain_lr_for(group), g1, g2, self.md.gain_eps)
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                slot = self.slots.get(p)
                if slot is None:  # 1-D params: torch AdamW arithmetic, megatron's wd schedule
                    st["step"] = st["step"] + 1
                    work = vectors.setdefault((int(st["step"]), id(group)), (adam_hp, []))[1]
                    work.append((p, p.grad, st["exp_avg"], st["exp_avg_sq"]))
                    continue
                if wd:
                    raise ValueError(
                        f"MD keeps {slot.name} on a sphere: its weight decay must be 0 "
                        "(use --weight-decay 0 with --md-decoupling)"
                    )
                base_hp = base_hps[slot.md.base]
                flat = {k: v.view(-1) for k, v in st.items() if k != "step"}
                full = {**self.md_state[p], **st, **flat}
                merged.append((st, full))
                items.append(
                    SliceItem(
                        slot.md,
                        self.direction_of(p),
                        p.grad.view(-1),
                        full,
                        base_hp,
                        gain_hp,
                        slot.index,
                    )
                )
        for (t, _), (hp, works) in vectors.items():  # multi-tensor, as torch's AdamW on GPU
            adam_multi_(*map(list, zip(*works)), t, hp)
        with self._timer("md-step"):
            md_step_batched(
                items, self._counting_reduce, self.layout, self.pre_layout, probe=self.probe
            )
        for st, full in merged:
            st["step"] = full["step"]  # rebound by the step; everything else is updated in place
        with self._timer("md-fuse"):
            for p, slot in self.slots.items():
                if slot.fp32_mode and p.grad is not None:
                    slot.md.fuse(self.md_state[p]["direction"], self.md_state[p], p.data.view(-1))
        return None

    def fuse_into(self, main: torch.Tensor, out: torch.Tensor) -> bool:
        """Write W = Γ ⊙ Ŵ of ``main`` (a direction) into ``out``; False if ``main`` is not MD."""
        slot = self.slots.get(main)
        if slot is None or slot.fp32_mode:
            return False
        slot.md.fuse(main.data.view(-1), self.md_state[main], out.view(-1))
        return True
