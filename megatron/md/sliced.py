"""The MD step on a contiguous slice of a flattened matrix, or on a whole matrix.

A ZeRO-1 rank owns an arbitrary contiguous range ``[start, end)`` of ``W.view(-1)``, covered by
at most three rectangular blocks (``blocks.py``). Per step, ``step_direction`` writes the gain
gradient partials, takes the base step on Ŵ and writes the squared-norm partials;
``project_and_step_gains`` puts Ŵ back on its sphere from the reduced norms and steps the gains
(``batched.py`` drives many matrices with one reduction). Cross-slice quantities (gain-gradient
row/column sums, squared norms) are written as *partials* into one flat buffer per step for all
matrices; the caller reduces it once (identity for whole matrices, one all-reduce under ZeRO-1).

Same arithmetic as ``reference.md_step`` (tested against it); gains and radius are replicated
(full vectors on every rank), the direction and the base-optimizer moments are slices.
"""

from __future__ import annotations

import torch

from megatron.md import block_gains as bg
from megatron.md import fused as fused_k
from megatron.md import maps, reference, tensor_parallel
from megatron.md.base_steps import AdamHParams, adam_step_, muon_update
from megatron.md.blocks import Block, TPShard, place_blocks, slice_blocks
from megatron.md.config import MatrixSpec, check_radius
from megatron.md.reference import GAIN_NAMES, init_gain_state
from megatron.md.state import MatrixState


class SliceMD:
    """MD bookkeeping for one matrix (or one rank's slice of it)."""

    def __init__(
        self,
        shape,
        start: int,
        end: int,
        spec: MatrixSpec,
        base: str,
        fused: bool = False,
        tp: TPShard | None = None,
        counts: bool = True,
    ):
        """``shape``: the local matrix; ``[start, end)``: the flat range of it this rank steps;
        ``tp``: where the local matrix lies in the full one (gains, radius and norms are the
        full matrix's); ``counts=False``: a replica whose partials another rank of the
        reduction group already adds (a TP-replicated matrix on TP ranks > 0)."""
        if len(shape) != 2:
            raise ValueError(f"MD needs a 2-D weight matrix; got shape {tuple(shape)}")
        self.local_shape = (int(shape[0]), int(shape[1]))
        self.shape = self.local_shape if tp is None else tp.full_shape(self.local_shape)
        self.start, self.end = start, end
        self.spec, self.base, self.tp, self.counts = spec, base, tp, counts
        local = slice_blocks(self.local_shape, start, end)
        self.blocks = place_blocks(local, self.local_shape, tp)
        # the whole local matrix (under TP: a whole TP piece, which Muon gathers; tensor_parallel)
        self.whole = start == 0 and end == self.local_shape[0] * self.local_shape[1]
        tensor_parallel.check_layout(self.local_shape, self.whole, spec, base, tp)
        d_out, d_in = self.shape
        # QKV split: block id per local row (TP: whole query groups per rank, the same pattern);
        # sphere quantities are then per block
        self.ids = reference.row_block_ids(self.local_shape[0], spec.row_blocks)
        n_blocks = len(spec.row_blocks) or 1
        k = spec.gain_rank
        self.gain_sizes = {
            "gain_scalar": 1,
            "gain_row": d_out,
            "gain_col": d_in,
            "gain_a": d_out * k,
            "gain_b": d_in * k,
        }
        self.gain_names = GAIN_NAMES[spec.gains]
        self.n_gain = sum(self.gain_sizes[n] for n in self.gain_names)
        self.n_norm = {"frobenius": n_blocks, "row": d_out, "col": n_blocks * d_in, "none": 0}[
            spec.sphere
        ]
        self._gather = self._full = None  # MuonMD under TP: made at the first step
        self._phi: dict[str, tuple] = {}  # gain name -> (ĝ, its version, φ(ĝ)); see _gains
        self._pending = (
            None  # fused: sphere rescale left for the fuse's pass (see apply_pending_rescale)
        )
        # compiled kernels (fused.py) where they apply; never with MD off (bit-identity)
        self.fused = (
            fused
            and base == "adam"
            and spec.gains in fused_k.FUSED_GAINS
            and not spec.tangent_grad
            and (spec.gains, spec.sphere) != ("none", "none")
        )

    # ---- partial-buffer layout: [gain gradients | squared norms] ----
    def n_partials(self) -> int:
        return self.n_gain + self.n_norm

    def n_pre_partials(self) -> int:
        """Partials needed before the base step (tangent projection): ⟨G_Ŵ, Ŵ⟩ and ‖Ŵ‖²."""
        return 2 * self.n_norm if self.spec.tangent_grad and self.n_norm else 0

    def _ids(self, like: torch.Tensor) -> torch.Tensor:
        if self.ids.device != like.device:
            self.ids = self.ids.to(like.device)
        return self.ids

    def _axis_sum(self, blk: Block, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add block ``x``'s sum along the sphere axis into ``out``."""
        if self.ids is not None and self.spec.sphere != "row":  # QKV split: sums per block
            out.add_(reference.axis_sum(x, self.spec.sphere, self._ids(x)).reshape(-1))
            return
        dim = {"frobenius": None, "row": 1, "col": 0}[self.spec.sphere]
        self._axis_add(blk, x.sum() if dim is None else x.sum(dim), out)

    def _axis_add(self, blk: Block, summed: torch.Tensor, out: torch.Tensor) -> None:
        """Add a block's sums along the sphere axis (a scalar, per row or per column)."""
        if self.spec.sphere == "frobenius":
            out += summed
        elif self.spec.sphere == "row":
            out[blk.r0 : blk.r0 + blk.nr].add_(summed)
        else:
            out[blk.c0 : blk.c0 + blk.nc].add_(summed)

    def _axis_bcast(self, blk: Block, v: torch.Tensor) -> torch.Tensor:
        if self.ids is not None and self.spec.sphere != "row":  # QKV split: per block
            shape = (-1,) if self.spec.sphere == "frobenius" else (len(self.spec.row_blocks), -1)
            return reference._bcast(v.view(shape), self.spec.sphere, self._ids(v))
        if self.spec.sphere == "frobenius":
            return v.view(())
        if self.spec.sphere == "row":
            return v[blk.r0 : blk.r0 + blk.nr, None]
        return v[None, blk.c0 : blk.c0 + blk.nc]

    def norm_partials(self, direction: torch.Tensor, out: torch.Tensor) -> None:
        if not self.n_norm:
            return
        for blk in self.blocks:
            w = blk.view(direction)
            if self.ids is not None and self.spec.sphere != "row":  # QKV split: per block
                self._axis_sum(blk, w * w, out)
            elif self.spec.sphere == "frobenius":  # a dot product: no temporary
                flat = w.reshape(-1)
                out += flat @ flat
            elif self.spec.sphere == "row":  # one pass, no temporary of the block's size
                out[blk.r0 : blk.r0 + blk.nr].add_(torch.linalg.vector_norm(w, dim=1).square_())
            else:
                self._axis_sum(blk, w * w, out)

    # ---- state ----
    def init_state(self, direction: torch.Tensor, seed: int = 0) -> MatrixState:
        """Gains at 1, zero moments; the radius is set by ``finish_init`` (it needs norms)."""
        st: MatrixState = {"step": torch.zeros((), dtype=torch.float32)}
        dtype = (
            torch.float32 if direction.dtype in (torch.bfloat16, torch.float16) else direction.dtype
        )
        like = torch.empty(0, dtype=dtype, device=direction.device)
        st.update(init_gain_state(self.spec, self.shape, seed, like=like))
        moments = ("exp_avg", "exp_avg_sq") if self.base == "adam" else ("momentum_buffer",)
        for name in moments:
            st[name] = torch.zeros_like(direction, dtype=dtype)
        return st

    def finish_init(
        self, direction: torch.Tensor, st: MatrixState, reduced_norms: torch.Tensor
    ) -> None:
        """Set the radius from the reduced squared norms and put the direction on the sphere."""
        spec, (d_out, d_in) = self.spec, self.shape
        if spec.sphere == "none":
            st["radius"] = None
            return
        cur = reduced_norms.sqrt()
        if spec.radius == "init":
            r = cur.clone()
        elif spec.radius == "unit":
            r = torch.ones_like(cur)
        else:
            r = reference.shape_radius((d_out, d_in), spec, cur.dtype, cur.device).reshape(-1)
        check_radius(float(r.min()), "matrix")
        if spec.sphere == "frobenius" and self.ids is None:
            r = r.view(())
        elif spec.sphere == "col" and self.ids is not None:
            r = r.view(len(spec.row_blocks), d_in)  # as reference.init_radius shapes it
        st["radius"] = r
        if spec.gain_init == "norm":  # Muown: magnitudes = the row norms, directions unit rows
            st["gain_row"].copy_(cur.view(-1))
        if spec.radius != "init":
            scale = st["radius"] / cur.view(st["radius"].shape)
            for blk in self.blocks:
                blk.view(direction).mul_(self._axis_bcast(blk, scale))

    # ---- gains ----
    def _gains(self, st: MatrixState) -> dict[str, torch.Tensor]:
        """Materialized gains (φ(ĝ), or A/B as they are for lowrank), read-only. φ(ĝ) is kept
        until ĝ changes (same tensor, same version counter): the fuse after a step and the
        next step's phase 1 share it."""
        if self.spec.gains == "lowrank":
            return {"gain_a": st["gain_a"], "gain_b": st["gain_b"]}
        out = {}
        for n in self.gain_names:
            raw, hit = st[n], self._phi.get(n)
            if hit is None or hit[0] is not raw or hit[1] != raw._version:
                hit = self._phi[n] = (raw, raw._version, maps.phi(raw, self.spec.gain_map))
            out[n] = hit[2]
        return out

    def _apply(self, blk: Block, x: torch.Tensor, g: dict) -> torch.Tensor:
        out = torch.empty_like(x)
        bg.apply_into(self.spec.gains, blk, x, g, out)
        return out

    def fuse(self, direction: torch.Tensor, st: MatrixState, out: torch.Tensor) -> None:
        """Write W = Γ ⊙ Ŵ for this slice into ``out`` (any dtype; flat like ``direction``)."""
        g = self._gains(st)
        if self.fused and (self.spec.gains != "none" or self._pending is not None):
            for blk in self.blocks:  # rescale Ŵ (if pending) and write W in one pass
                row, col = bg.row_col(blk, g, direction)
                s = None if self._pending is None else self._axis_bcast(blk, self._pending)
                fused_k.fuse(blk.view(direction), s, row, col, blk.view(out))
            self._pending = None
            return
        for (
            blk
        ) in self.blocks:  # written straight into ``out``, rounded once (block_gains.apply_into)
            bg.apply_into(self.spec.gains, blk, blk.view(direction), g, blk.view(out))

    def apply_pending_rescale(self, direction: torch.Tensor) -> None:
        """Apply a sphere rescale left pending by ``project_and_step_gains`` (fused path) if no
        fuse took it: called before anything reads the direction."""
        if self._pending is not None:
            for blk in self.blocks:
                blk.view(direction).mul_(self._axis_bcast(blk, self._pending))
            self._pending = None

    def _gain_views(self, out: torch.Tensor) -> dict[str, torch.Tensor]:
        views, off = {}, 0
        for name in self.gain_names:
            views[name] = out[off : off + self.gain_sizes[name]]
            off += self.gain_sizes[name]
        return views

    def _step_direction_fused(self, direction, grad, st, base_hp, t, g, gain_out, norm_out) -> None:
        """``step_direction`` with compiled kernels (fused.py): one fused pass per block."""
        hp = fused_k.adam_hparams(base_hp, t, direction)
        views = self._gain_views(gain_out)
        m, v = st["exp_avg"], st["exp_avg_sq"]
        need_row, need_col = "gain_row" in views, "gain_col" in views
        sphere = fused_k.kernel_sphere(self.spec.sphere, need_row, need_col)
        for blk in self.blocks:
            row, col = bg.row_col(blk, g, direction)
            gr, gc, sq = fused_k.phase1(
                blk.view(direction), blk.view(grad), blk.view(m), blk.view(v),
                row, col, hp, need_row, need_col, sphere,
            )  # fmt: skip
            if need_row:
                views["gain_row"][blk.r0 : blk.r0 + blk.nr].add_(gr)
            if need_col:
                views["gain_col"][blk.c0 : blk.c0 + blk.nc].add_(gc)
            if sphere != "none":
                self._axis_add(blk, sq, norm_out)
        if sphere != self.spec.sphere:  # norm partials the kernel leaves to us
            self.norm_partials(direction, norm_out)

    # ---- the step, in phases around the caller's reductions ----
    def pre_partials(self, direction, grad, st, out: torch.Tensor) -> None:
        """Tangent projection needs ⟨G_Ŵ, Ŵ⟩ and ‖Ŵ‖² reduced before the base step."""
        if not self.n_pre_partials():
            return
        g = self._gains(st)
        inner, sq = out[: self.n_norm], out[self.n_norm :]
        for blk in self.blocks:
            w = blk.view(direction)
            gd = self._apply(blk, blk.view(grad).to(direction.dtype), g)
            self._axis_sum(blk, gd * w, inner)
            self._axis_sum(blk, w * w, sq)

    def step_direction(
        self, direction, grad, st, base_hp, out: torch.Tensor, pre=None, batch=None
    ) -> None:
        """Gain-gradient partials, base step on Ŵ, then squared-norm partials of the new Ŵ.
        With ``batch`` (a ``DirAdamBatch``), Ŵ's Adam step and the norm partials after it are
        queued there instead (one multi-tensor Adam for many matrices)."""
        self.apply_pending_rescale(direction)
        st["step"] = st["step"] + 1  # rebind: megatron may alias one step tensor across params
        t = int(st["step"])
        g = self._gains(st)
        gain_out, norm_out = out[: self.n_gain], out[self.n_gain :]
        if self.fused:
            self._step_direction_fused(direction, grad, st, base_hp, t, g, gain_out, norm_out)
            return
        single = len(self.blocks) == 1  # the usual case: G_Ŵ is the block itself, no copy
        g_dir = None if single else torch.empty_like(direction)
        for blk in self.blocks:
            w, gb = blk.view(direction), blk.view(grad).to(direction.dtype)
            if self.n_gain:
                gd = w * gb
                bg.add_gain_partials(
                    self.spec.gains, self.spec.gain_rank, blk, gd, g, self._gain_views(gain_out)
                )
                bg.apply_into(self.spec.gains, blk, gb, g, gd)  # reuse the Ŵ⊙G buffer for G_Ŵ
            elif self.spec.gains == "none" and pre is None:
                gd = gb  # G_Ŵ = G (embeddings, LM head): read in place, no copy
            else:
                gd = self._apply(blk, gb, g)
            if pre is not None and self.n_pre_partials():
                inner, sq = pre[: self.n_norm], pre[self.n_norm :]
                gd -= self._axis_bcast(blk, inner / sq) * w
            if single:
                g_dir = gd.view(-1)
            else:
                blk.view(g_dir).copy_(gd)
        if isinstance(base_hp, AdamHParams):
            work = (direction, g_dir, st["exp_avg"], st["exp_avg_sq"])
            if batch is not None:
                batch.add(work, t, base_hp, lambda: self.norm_partials(direction, norm_out))
                return
            adam_step_(*work, t, base_hp)
        else:  # Muon: one Newton–Schulz call per block (Q, K, V when split)
            w2 = direction.view(self.local_shape)
            if self.tp is not None and self._gather is None:  # once: the TP group, the shape
                self._gather = tensor_parallel.PieceGather(self.tp)
                self._full = torch.empty(self.shape, device="meta")
            full = w2 if self.tp is None else self._full
            whole = {"direction": full, "radius": st["radius"]}  # the full matrix's scale
            scales = reference.muon_scales(whole, self.spec)  # no host sync (0-d tensors)
            mom = st["momentum_buffer"].view(self.local_shape)
            upd = muon_update(
                g_dir.view(self.local_shape), mom, base_hp, scales, self.spec.row_blocks,
                self._gather,
            )  # fmt: skip
            if self.spec.tangent_update:  # Muown: the step on the tangent space (whole matrix)
                ids = self.ids
                inner = reference.axis_sum(upd * w2, self.spec.sphere, ids)
                inner = inner / reference.sq_norms(w2, self.spec.sphere, ids)
                upd = upd - reference._bcast(inner, self.spec.sphere, ids) * w2
            w2.add_(upd, alpha=-base_hp.lr)
        if self.n_norm:
            self.norm_partials(direction, norm_out)

    def project_and_step_gains(
        self, direction, st, gain_hp: AdamHParams, out: torch.Tensor, batch=None
    ) -> None:
        """Back onto the sphere with the reduced norms; Adam step of the raw gains (queued on
        ``batch`` when given: one multi-tensor Adam for the gains of all matrices)."""
        gain_tot, norm_tot = out[: self.n_gain], out[self.n_gain :]
        if self.n_norm and self.spec.project:  # (Muown leaves the rows to grow)
            scale = st["radius"] / norm_tot.sqrt().view(st["radius"].shape)
            if self.fused:  # done by the fuse, in the same pass that writes W
                self._pending = scale
            else:
                for blk in self.blocks:
                    blk.view(direction).mul_(self._axis_bcast(blk, scale))
        off, t = 0, int(st["step"])
        for name in self.gain_names:
            raw = st[name]
            gg = gain_tot[off : off + self.gain_sizes[name]].view(raw.shape)
            off += self.gain_sizes[name]
            gain_map = self.spec.gain_map
            chain = "direct" if self.spec.gains == "lowrank" else gain_map  # lowrank: Γ = 1 + ABᵀ
            if batch is not None:  # φ′(ĝ) applied there, for all matrices at once
                work = (raw, gg, st[name + "_exp_avg"], st[name + "_exp_avg_sq"])
                batch.add(work, t, gain_hp, chain, gain_map)
                continue
            if chain in maps.CHAIN_MAPS:
                gg = gg * maps.phi_prime(raw, chain)
            adam_step_(raw, gg, st[name + "_exp_avg"], st[name + "_exp_avg_sq"], t, gain_hp)
            maps.after_step(raw, gain_map)
