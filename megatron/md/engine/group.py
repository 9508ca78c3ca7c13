"""A group of matrices the engine steps together: the same block geometry, treatment, base,
precision and parameter group. Its B matrices' directions, base-optimizer state, gains and
radii are stacked — ``(B, L)`` for L elements each — in storage the group owns when its
matrices are whole on this rank, or ZeRO-1 slices cut at one place of each (``own``), so each
phase of the MD step is a few batched operations for the whole group; a slice cut inside a TP
piece is a group of its own (B = 1) over views of its existing tensors.

Per matrix the arithmetic is ``reference.md_step``'s (Algorithm 2), split around the caller's
reductions: ``gain_partials`` (lines 1-6: the gains' gradient sums, G_Ŵ = Γ ⊙ G in place),
the base step (line 7, ``basesteps``), ``norm_partials`` (line 8's norms), then
``project`` (line 8) and the gains' Adam (line 9, the engine's multi-tensor batch), ``fuse``
(line 10). Partials are written into the caller's flat buffer at each matrix's positions.
"""

from __future__ import annotations

import torch

from megatron.md import maps
from megatron.md.engine.basesteps import BASE_STEPS, muon_scales
from megatron.md.engine.geometry import (
    norm_count,
    one_storage,
    qkv_slices,
    radius_shape,
    regular_pieces,
    row_to_block,
    strided_rows,
)
from megatron.md.norms import sq_sums

#: raw gains and their shapes per matrix: name -> (rows M, columns N, rank k) -> shape
GAIN_SHAPES = {
    "gain_scalar": lambda M, N, k: (),
    "gain_row": lambda M, N, k: (M,),
    "gain_col": lambda M, N, k: (N,),
    "gain_a": lambda M, N, k: (M, k),
    "gain_b": lambda M, N, k: (N, k),
}
MOMENTS = ("_exp_avg", "_exp_avg_sq")


class Group:
    def __init__(self, members: list, own: bool):
        self.members, self.own, self.B = members, own, len(members)
        md = members[0].md
        self.md0 = md
        self.spec, self.base = md.spec, BASE_STEPS[md.base]
        self.local, self.full = md.local_shape, md.shape
        self.L = md.end - md.start
        self.blocks = md.blocks
        M, N = self.full
        self.whole_block = (
            len(self.blocks) == 1 and self.blocks[0].nr == M and self.blocks[0].nc == N
        )  # one block, the full matrix (TP = 1, whole): no slicing of gains or partials
        self.gain_names = md.gain_names
        self.gain_sizes = [md.gain_sizes[n] for n in self.gain_names]
        self.n_gain, self.n_norm = md.n_gain, md.n_norm
        self.n_partial = self.n_gain + self.n_norm
        self.n_pre = md.n_pre_partials()
        self.fp32_mode = members[0].fp32_mode
        self.gather = None  # MuonMD under TP: the pieces gathered into full matrices
        if md.tp is not None and md.base == "muon":
            from megatron.md.tensor_parallel import PieceGather

            self.gather = PieceGather(md.tp)
        self.tangent_update = self._tangent_update if self.spec.tangent_update else None
        rb = self.spec.row_blocks
        self.nb = len(rb) or 1
        self.qkv_slices = qkv_slices(rb) if rb else []
        self.period_ids = self.row_ids = self.full_ids = None
        if rb:  # whole matrices or TP pieces hold whole query groups; a ZeRO-1 slice may not
            dev = members[0].main.device
            self.period_ids = row_to_block(sum(rb), rb).to(dev)
            self.row_ids = row_to_block(self.local[0], rb).to(dev)  # of the local rows
            if not md.whole:  # a cut slice: each block's rows looked up in the full matrix's
                self.full_ids = row_to_block(M, rb).to(dev)
        self._phi_cache: dict[str, tuple] = {}
        self.pending = None  # a rescale of Ŵ left for the fuse (compiled path)
        self.kernels = None  # compiled kernels (engine.compiled) or None
        self._rows: dict[str, tuple] = {}  # kind -> (addresses, their (B, L) view or None)
        #: kind -> (storage key, a tensor over the storage): ``whole``
        self._whole: dict[str, tuple] = {}
        self.bind()

    # ---- the tensors: own storage, or views of each member's ----
    def bind(self) -> None:
        """(Re)make the stacked views from the members' current tensors. ``own``: copy any
        tensor that is not already a view of the group's storage into it and rebind the
        member's dict entry (a checkpoint load replaces tensors), so the stack is the storage."""
        M, N = self.full
        k = self.spec.gain_rank
        B, L = self.B, self.L
        gshape = {n: GAIN_SHAPES[n](M, N, k) for n in self.gain_names}
        rshape = radius_shape(self.full, self.spec.sphere, self.spec.row_blocks)
        if not self.own:  # the member's own tensors (made here the first time)
            m = self.members[0]
            d = m.direction()
            for f in self.base.fields:
                if m.state.get(f) is None:
                    m.state[f] = torch.zeros(m.main.shape, dtype=d.dtype, device=d.device)
            for n in self.gain_names:
                for s in ("", *MOMENTS):
                    if m.md_state.get(n + s) is None:
                        m.md_state[n + s] = torch.zeros(gshape[n], dtype=d.dtype, device=d.device)
            self.W = d.view(1, L)
            self.state = {f: m.state[f].view(1, L) for f in self.base.fields}
            self.gains = {n: m.md_state[n].view(1, -1) for n in self.gain_names}
            self.moments = {n + s: m.md_state[n + s].view(1, -1)
                            for n in self.gain_names for s in MOMENTS}  # fmt: skip
            r = m.md_state.get("radius")
            self.radius = None if r is None else r.view(1, -1)
            return
        if not hasattr(self, "_storage"):
            dev = self.members[0].main.device
            dt = torch.float32 if self.members[0].main.dtype != torch.float64 else torch.float64
            size = lambda n: self.gain_sizes[self.gain_names.index(n)]  # noqa: E731
            self._storage = {"W": torch.empty(B, L, device=dev, dtype=dt)}
            for f in self.base.fields:
                self._storage[f] = torch.empty(B, L, device=dev, dtype=dt)
            for n in self.gain_names:
                for s in ("", *MOMENTS):
                    self._storage[n + s] = torch.empty(B, size(n), device=dev, dtype=dt)
            if self.n_norm:
                self._storage["radius"] = torch.empty(B, self.n_norm, device=dev, dtype=dt)
        st = self._storage
        for b, m in enumerate(self.members):
            d = m.direction()
            if d.data_ptr() != st["W"][b].data_ptr():
                st["W"][b].copy_(d.reshape(-1))
                m.set_direction(st["W"][b])
            for f in self.base.fields:
                _adopt(m.state, f, st[f][b], m.main.shape)
            for n in self.gain_names:
                for s in ("", *MOMENTS):
                    _adopt(m.md_state, n + s, st[n + s][b], gshape[n])
            if self.n_norm and m.md_state.get("radius") is not None:
                _adopt(m.md_state, "radius", st["radius"][b], rshape)
        self.gains_changed()
        self.W = st["W"]
        self.state = {f: st[f] for f in self.base.fields}
        self.gains = {n: st[n] for n in self.gain_names}
        self.moments = {n + s: st[n + s] for n in self.gain_names for s in MOMENTS}
        have_radius = self.n_norm and self.members[0].md_state.get("radius") is not None
        self.radius = st["radius"] if have_radius else None

    def gains_changed(self) -> None:
        self._phi_cache.clear()

    def views3(self, x: torch.Tensor, blk) -> torch.Tensor:
        """A block of every matrix of ``x`` (B, L) as (B, nr, nc), a view."""
        if self.whole_block or (blk.lo == 0 and blk.hi == self.L):
            return x.view(self.B, blk.nr, blk.nc)
        return x[:, blk.lo : blk.hi].view(self.B, blk.nr, blk.nc)

    # ---- gains ----
    def phi(self) -> dict[str, torch.Tensor]:
        """φ(ĝ) of every gain (A and B as they are for lowrank), kept until ĝ changes: the
        engine's gain step says so (``gains_changed``; a multi-tensor in-place op under a
        torch dispatch mode leaves the version counter as it was), any other write to ĝ
        moves its version counter."""
        if self.spec.gains == "lowrank":
            return self.gains
        out = {}
        for n, raw in self.gains.items():
            hit = self._phi_cache.get(n)
            if hit is None or hit[0] is not raw or hit[1] != raw._version:
                hit = self._phi_cache[n] = (raw, raw._version, maps.phi(raw, self.spec.gain_map))
            out[n] = hit[2]
        return out

    def keep_phi(self, name: str, raw: torch.Tensor, value: torch.Tensor) -> None:
        """φ(ĝ) of gain ``name`` made by the engine for all groups at once (``phi`` finds it)."""
        self._phi_cache[name] = (raw, raw._version, value)

    def gamma(self, blk, g: dict):
        """Γ on one block as factors broadcast against (B, nr, nc): a list of tensors to
        multiply by, in the reference's order (row, then column); lowrank: [1 + A Bᵀ]."""
        B = self.B
        whole = self.whole_block
        rows = slice(blk.r0, blk.r0 + blk.nr)
        cols = slice(blk.c0, blk.c0 + blk.nc)
        gains = self.spec.gains
        if gains == "none":
            return []
        if gains == "lowrank":
            a, b = self._factors(g, rows, cols)
            one = torch.ones((), device=a.device, dtype=a.dtype)
            gamma = torch.baddbmm(one, a, b.transpose(1, 2))
            floor = self.spec.lowrank_min
            return [gamma.clamp_min_(floor) if floor > 0 else gamma]
        if gains == "scalar":
            return [g["gain_scalar"].view(B, 1, 1)]
        out = []
        if "gain_row" in g:
            out.append((g["gain_row"] if whole else g["gain_row"][:, rows]).unsqueeze(2))
        if "gain_col" in g:
            out.append((g["gain_col"] if whole else g["gain_col"][:, cols]).unsqueeze(1))
        return out

    def _factors(self, g: dict, rows: slice, cols: slice):
        """The lowrank factors A (B, nr, k) and B (B, nc, k) of a block's rows and columns."""
        k = self.spec.gain_rank
        a, b = g["gain_a"].view(self.B, -1, k), g["gain_b"].view(self.B, -1, k)
        return (a, b) if self.whole_block else (a[:, rows], b[:, cols])

    # ---- axis sums along the sphere (partials) and their broadcast back ----
    def axis_add(self, blk, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add block ``x``'s (B, nr, nc) sums along the sphere axis into ``out`` (B, n_norm)."""
        sphere, B = self.spec.sphere, self.B
        if self.full_ids is not None and sphere != "row":  # Q/K/V blocks of a cut slice
            ids = self.full_ids[blk.r0 : blk.r0 + blk.nr]
            rows = x.sum(2, keepdim=True) if sphere == "frobenius" else x
            per = out.view(B, self.nb, -1)
            (per if sphere == "frobenius" else per[:, :, blk.c0 : blk.c0 + blk.nc]).index_add_(
                1, ids, rows
            )
            return
        if self.period_ids is not None and sphere != "row":  # Q/K/V blocks: sums per block
            period = self.period_ids.numel()
            rows = x.sum(2) if sphere == "frobenius" else x
            per = rows.reshape(B, x.shape[1] // period, period, *rows.shape[2:]).sum(1)
            out.view(B, self.nb, -1).index_add_(1, self.period_ids, per.view(B, period, -1))
            return
        if sphere == "frobenius":
            out.add_(x.sum((1, 2)).unsqueeze(1))
        elif sphere == "row":
            part = x.sum(2)
            (out if self.whole_block else out[:, blk.r0 : blk.r0 + blk.nr]).add_(part)
        else:
            part = x.sum(1)
            (out if self.whole_block else out[:, blk.c0 : blk.c0 + blk.nc]).add_(part)

    def axis_bcast(self, blk, v: torch.Tensor) -> torch.Tensor:
        """A per-axis quantity ``v`` (B, n_norm) broadcast against a block (B, nr, nc)."""
        sphere, B = self.spec.sphere, self.B
        if self.full_ids is not None and sphere != "row":  # a cut slice's block rows
            per = v.view(B, self.nb, -1).index_select(1, self.full_ids[blk.r0 : blk.r0 + blk.nr])
            return per if sphere == "frobenius" else per[:, :, blk.c0 : blk.c0 + blk.nc]
        if self.period_ids is not None and sphere != "row":  # (B, M, 1) / (B, M, N)
            return v.view(B, self.nb, -1).index_select(1, self.row_ids)
        if sphere == "frobenius":
            return v.view(B, 1, 1)
        if sphere == "row":
            return (v if self.whole_block else v[:, blk.r0 : blk.r0 + blk.nr]).unsqueeze(2)
        return (v if self.whole_block else v[:, blk.c0 : blk.c0 + blk.nc]).unsqueeze(1)

    def sq_add(self, blk, w: torch.Tensor, out: torch.Tensor) -> None:
        """Add ‖w‖² along the sphere axis of block ``w`` into ``out`` (the norms' partials)."""
        if self.spec.sphere == "frobenius" and self.period_ids is None:  # one sum per matrix
            # a reduction, not the reference's dot as a (B, 1, K)·(B, K, 1) bmm: cuBLAS runs
            # that as a mat-vec with one output per matrix (H100, 1.29B: 11 ms a call, 34 ms
            # of MuonMD's 138 ms step; docs/benchmarks.md)
            out.add_(sq_sums(w, frobenius=True).unsqueeze(1))
        elif self.spec.sphere == "row" and self.period_ids is None:
            part = sq_sums(w, frobenius=False)
            (out if self.whole_block else out[:, blk.r0 : blk.r0 + blk.nr]).add_(part)
        else:
            self.axis_add(blk, w * w, out)

    # ---- the phases of one step ----
    def norm_partials(self, out: torch.Tensor) -> None:
        """‖Ŵ‖² along the sphere axis of every block into ``out`` (B, n_norm)."""
        self.settle()
        for blk in self.blocks:
            self.sq_add(blk, self.views3(self.W, blk), out)

    def rows(self, kind: str, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """``tensors`` (one per member, in order) as one (B, L) view of the storage they share
        (``geometry.strided_rows``), or None; looked up again only when an address changes
        (megatron's buffers keep them, so once)."""
        return self.placed(kind, tensors)[0]

    def placed(self, kind: str, tensors: list[torch.Tensor]) -> tuple:
        """(``rows``' view or None, where ``tensors`` lie in one storage, each contiguous, but
        are no strided view of it — an MoE model's layers and experts, two roles of one shape
        whose rows interleave — the regular grids that cover them, ``geometry.regular_pieces``,
        or None), cached as ``rows``."""
        key = tuple(t.data_ptr() for t in tensors)
        hit = self._rows.get(kind)
        if hit is None or hit[0] != key:
            view = strided_rows(tensors)
            pieces = None
            if view is None and one_storage(tensors):
                pieces = regular_pieces([t.storage_offset() for t in tensors], self.L)
            hit = self._rows[kind] = (key, view, pieces)
        return hit[1:]

    def whole(self, view: torch.Tensor, kind: str = "out") -> torch.Tensor:
        """A 1-D tensor over the whole storage ``view`` lies in (megatron's param or gradient
        buffer, ``kind``: ``view``'s ``_base`` may be one parameter of it), made again only
        when the storage changes."""
        st = view.untyped_storage()
        key = (st.data_ptr(), st.nbytes(), view.dtype)
        hit = self._whole.get(kind)
        if hit is None or hit[0] != key:
            buf = torch.empty(0, dtype=view.dtype, device=view.device)
            buf.set_(st, 0, (st.nbytes() // view.element_size(),), (1,))
            hit = self._whole[kind] = (key, buf)
        return hit[1]

    def grad_pieces(self) -> tuple[torch.Tensor, tuple] | None:
        """Where the members' gradients lie in one storage but are no strided view of it (an
        MoE model's experts: ``placed``), megatron's gradient buffer whole and the regular
        pieces they are, for a compiled call to read them in place (``grads(pieces=True)``
        gives them so); None otherwise."""
        grads = [m.main.grad for m in self.members]
        _, pieces = self.placed("grad", grads)
        return None if pieces is None else (self.whole(grads[0], "grad"), pieces)

    def grads(self, pieces: bool = False) -> tuple:
        """The members' gradients G as (B, L) in Ŵ's dtype, and whether that is a copy of the
        step's own (a stack) rather than a view of megatron's gradient buffer (only read).
        ``pieces``: for a compiled call that reads them in place, G is (megatron's gradient
        buffer whole, its regular pieces) where they are no strided view of it (``placed``;
        a stack copied every gradient of the group a step)."""
        grads = [m.main.grad for m in self.members]
        view, grid = self.placed("grad", grads)
        if view is not None and view.dtype == self.W.dtype:
            return view, False
        if pieces and grid is not None:
            return (self.whole(grads[0], "grad"), grid), False
        return torch.stack(grads).view(self.B, self.L).to(self.W.dtype), True

    def gain_partials(
        self, G: torch.Tensor, P: torch.Tensor, pre: torch.Tensor | None, own: bool, private: bool
    ) -> torch.Tensor:
        """Lines 1-6: the gains' gradient sums of every block into ``P`` (B, n_partial); returns
        G_Ŵ = Γ ⊙ G (B, L): ``G`` itself turned into it in place where ``own`` (a stack of the
        step's), else a new tensor (``G`` views megatron's gradients, which stay as they are);
        ``private``: the caller writes G_Ŵ, so it is never ``G`` unless ``own``. ``pre``: the
        tangent projection's partials ⟨G_Ŵ, Ŵ⟩ and ‖Ŵ‖², to be reduced before the base step
        (``tangent``)."""
        self.settle()
        g = self.phi()
        gains = self.spec.gains
        views = self._gain_views(P)
        out = G if own or gains == "none" else torch.empty_like(G)
        for blk in self.blocks:
            w, gb = self.views3(self.W, blk), self.views3(G, blk)
            factors = self.gamma(blk, g)
            if gains != "none":
                u = w / self._row_norms(w) if self.spec.weight_norm else w
                self._add_gain_partials(blk, u * gb, g, views)
            o = self.views3(out, blk)
            for i, f in enumerate(factors):  # G_Ŵ = Γ ⊙ G, the reference's order
                if i == 0 and not own:
                    torch.mul(gb, f, out=o)
                else:
                    o.mul_(f)
            if pre is not None:
                self.axis_add(blk, o * w, pre[:, : self.n_norm])
                self.sq_add(blk, w, pre[:, self.n_norm :])
        if out is G and private and not own:
            out = G.clone()
        return out

    def _gain_views(self, P: torch.Tensor) -> dict[str, torch.Tensor]:
        views, off = {}, 0
        for n, size in zip(self.gain_names, self.gain_sizes):
            views[n] = P[:, off : off + size]
            off += size
        return views

    def _add_gain_partials(self, blk, p: torch.Tensor, g: dict, views: dict) -> None:
        """∂L/∂Γ sums of one block (``p`` = Ŵ ⊙ G), the reference's products."""
        B, whole = self.B, self.whole_block
        rows = slice(blk.r0, blk.r0 + blk.nr)
        cols = slice(blk.c0, blk.c0 + blk.nc)
        gains = self.spec.gains
        if gains == "lowrank":
            k = self.spec.gain_rank
            a, b = self._factors(g, rows, cols)
            va = views["gain_a"].view(B, -1, k)
            vb = views["gain_b"].view(B, -1, k)
            (va if whole else va[:, rows]).add_(torch.bmm(p, b))
            (vb if whole else vb[:, cols]).add_(torch.bmm(p.transpose(1, 2), a))
            return
        if gains == "scalar":
            views["gain_scalar"].add_(p.sum((1, 2)).unsqueeze(1))
            return
        if "gain_row" in views:  # rowsum((Ŵ⊙G) diag(g_col)) = (Ŵ⊙G) g_col
            if "gain_col" in g:
                col = g["gain_col"] if whole else g["gain_col"][:, cols]
                # as g_colᵀ (Ŵ⊙G)ᵀ: on a CPU the reference's mat-vec, value for value
                part = torch.bmm(col.unsqueeze(1), p.transpose(1, 2)).squeeze(1)
            else:
                part = p.sum(2)
            (views["gain_row"] if whole else views["gain_row"][:, rows]).add_(part)
        if "gain_col" in views:  # colsum(diag(g_row) (Ŵ⊙G)) = g_row (Ŵ⊙G)
            if "gain_row" in g:
                row = g["gain_row"] if whole else g["gain_row"][:, rows]
                part = torch.bmm(row.unsqueeze(1), p).squeeze(1)
            else:
                part = p.sum(1)
            (views["gain_col"] if whole else views["gain_col"][:, cols]).add_(part)

    def tangent(self, G: torch.Tensor, pre_total: torch.Tensor) -> None:
        """G_Ŵ without its radial component, from the reduced ⟨G_Ŵ, Ŵ⟩ and ‖Ŵ‖²."""
        ratio = pre_total[:, : self.n_norm] / pre_total[:, self.n_norm :]
        norm = pre_total[:, self.n_norm :].sqrt() if self.spec.weight_norm else None
        for blk in self.blocks:
            w, gb = self.views3(self.W, blk), self.views3(G, blk)
            gb.sub_(self.axis_bcast(blk, ratio) * w)
            if norm is not None:  # weight normalization: ∂(v/‖v‖)/∂v = (I − u uᵀ)/‖v‖
                gb.div_(self.axis_bcast(blk, norm))

    @staticmethod
    def _row_norms(w: torch.Tensor) -> torch.Tensor:
        """‖Ŵ‖ of each row of a block (B, nr, nc) -> (B, nr, 1): weight normalization's divisor
        (its matrices are whole on the rank, so every row is)."""
        return sq_sums(w, frobenius=False).sqrt_().unsqueeze(2)

    def _tangent_update(self, upd: torch.Tensor) -> torch.Tensor:
        """muown-unit: the Muon update on the tangent space of each row of the (whole) Ŵ."""
        w = self.W.view(self.B, *self.local)
        return upd - ((upd * w).sum(2) / (w * w).sum(2)).unsqueeze(2) * w

    def project(self, norm_tot: torch.Tensor, defer: bool = False) -> None:
        """Line 8: Ŵ back onto its sphere from the reduced squared norms ``norm_tot``
        (B, n_norm); ``defer``: leave the rescale to the fuse's pass (compiled path)."""
        if not self.spec.project or not self.n_norm:
            return
        self.project_by(self.radius / norm_tot.sqrt(), defer)

    def project_by(self, scale: torch.Tensor, defer: bool = False) -> None:
        """Line 8 with the rescale r / ‖Ŵ‖ (B, n_norm) given (the engine's, for all groups)."""
        if defer:
            self.pending = scale
            return
        self._rescale(scale)

    def _rescale(self, scale: torch.Tensor) -> None:
        if self.spec.sphere == "frobenius" and self.period_ids is None:
            self.W.mul_(scale)
            return
        for blk in self.blocks:
            self.views3(self.W, blk).mul_(self.axis_bcast(blk, scale))

    def settle(self) -> None:
        """Apply a rescale left pending (before anything reads Ŵ)."""
        if self.pending is not None:
            scale, self.pending = self.pending, None
            self._rescale(scale)

    def fuse(self, out: torch.Tensor) -> None:
        """Line 10: W = Γ ⊙ Ŵ of every block into ``out`` (B, L), rounded once into its dtype."""
        g = self.phi()
        for blk in self.blocks:
            w, o = self.views3(self.W, blk), self.views3(out, blk)
            if self.pending is not None:
                w.mul_(self.axis_bcast(blk, self.pending))
            factors = self.gamma(blk, g)
            if self.spec.weight_norm:  # W = Γ ⊙ Ŵ/‖Ŵ‖ per row (Muown)
                factors.append(self._row_norms(w).reciprocal_())
            if not factors:
                o.copy_(w)
            elif len(factors) == 1:
                torch.mul(w, factors[0], out=o)
            elif o.dtype == w.dtype:
                torch.mul(w, factors[0], out=o)
                for f in factors[1:]:
                    o.mul_(f)
            else:  # one rounding, from the fp32 product
                t = w * factors[0]
                for f in factors[1:-1]:
                    t.mul_(f)
                torch.mul(t, factors[-1], out=o)
        self.pending = None

    def fuse_to(self, targets: list[torch.Tensor]) -> None:
        """``fuse`` into each member's destination (``targets``, in order): into their one
        strided view of megatron's param buffer where they are one (``rows``), else into a
        stack of the group's own and out by one multi-tensor copy."""
        view = self.rows("out", targets)
        if view is not None:
            self.fuse(view)
            return
        tmp = torch.empty(self.B, self.L, dtype=targets[0].dtype, device=self.W.device)
        self.fuse(tmp)
        torch._foreach_copy_(targets, [t.view(x.shape) for t, x in zip(tmp.unbind(0), targets)])

    # ---- state made once ----
    def init_state(self, like_gain_one: float) -> None:
        """Gains at 1 (lowrank: A random, B = 0), zero moments and base state."""
        self.gains_changed()
        for f in self.base.fields:
            self.state[f].zero_()
        for n, raw in self.gains.items():
            if n == "gain_a":
                for b, m in enumerate(self.members):  # the reference's seeded init, per matrix
                    gen = torch.Generator().manual_seed(m.seed)
                    a = torch.randn(raw.shape[1], generator=gen) * self.spec.lowrank_init_std
                    raw[b].copy_(a.to(raw.device, raw.dtype))
            elif n == "gain_b":
                raw.zero_()
            else:
                raw.fill_(like_gain_one)
        for t in self.moments.values():
            t.zero_()

    def finish_init(self, norm_tot: torch.Tensor, absorb: bool = False) -> None:
        """The radius from the reduced squared norms of the directions as they are; onto the
        sphere when the radius is not their norm; Muown's magnitudes from the row norms.
        ``absorb`` (MD state made from trained weights): a row sphere's rescale goes into the
        row gains, so W keeps its rows (the LM head's, with ``output_gains``)."""
        from megatron.md.config import check_radius
        from megatron.md.engine.geometry import shape_radius

        spec = self.spec
        if not self.n_norm:
            self.radius = None
            for m in self.members:
                m.md_state["radius"] = None
            self.set_muon_scale(None)
            return
        cur = norm_tot.sqrt()
        if spec.radius == "init":
            r = cur
        elif spec.radius == "unit":
            r = torch.ones_like(cur)
        else:
            one = shape_radius(self.full, spec.sphere, spec.row_blocks) * spec.init_scale
            r = one.to(cur.dtype).to(cur.device).expand_as(cur)
        check_radius(float(r.min()), "matrix")  # (once, at set-up)
        rshape = radius_shape(self.full, spec.sphere, spec.row_blocks)
        for b, m in enumerate(self.members):
            m.md_state["radius"] = r[b].clone().view(rshape)
        self.bind()  # the radius into the storage (own), or its view
        if spec.gain_init == "norm":  # Muown: magnitudes = the row norms (v: unit rows, or W)
            self.gains["gain_row"].copy_(cur)
        elif absorb and spec.sphere == "row" and spec.radius != "init" and "gain_row" in self.gains:
            self.gains["gain_row"].copy_(maps.raw_for(cur / self.radius, spec.gain_map))
            self.gains_changed()
        if spec.radius != "init":
            self._rescale(self.radius / cur)
        self.set_muon_scale(self.radius)

    def set_muon_scale(self, radius) -> None:
        """Muon's update scale of each matrix and Q/K/V block (B, blocks), kept on the device
        (the radius does not change, so neither does the scale; a load that replaces it sets
        it again: ``Engine.rebind``)."""
        self._scale_follows_norm = False
        if self.base.name != "muon":
            return
        by_radius = self.spec.muon_scale in ("sphere_rms", "hyperball")
        if by_radius and radius is None:  # no sphere: ‖Ŵ‖ now
            self._scale_follows_norm = True
            return
        fro = self._frobenius_radius(radius) if by_radius else None
        self.muon_scale = self._scales(fro)

    def current_muon_scale(self) -> torch.Tensor:
        """The Muon scale for this step: fixed, or from Ŵ's current norm (no sphere)."""
        if self._scale_follows_norm:
            return self._scales(self._current_frobenius())
        return self.muon_scale

    def _scales(self, fro) -> torch.Tensor:
        if fro is None:
            one = torch.tensor([float(s) for s in muon_scales(self.spec, self.full, None)])
            return one.expand(self.B, -1).to(self.W.device, torch.float32)
        per = muon_scales(self.spec, self.full, fro.transpose(0, 1))  # each (B,) tensor
        return torch.stack([torch.as_tensor(s) for s in per], 1).to(torch.float32)

    def _frobenius_radius(self, radius: torch.Tensor) -> torch.Tensor:
        """Each block's sphere in Frobenius norm (B, blocks), float64."""
        B, nb = self.B, self.nb
        r2 = radius.double().square()
        if self.spec.sphere == "frobenius":
            return r2.view(B, nb).sqrt()
        if self.spec.sphere == "row":  # per row of the full matrix
            if self.row_ids is None:
                return r2.sum(1, keepdim=True).sqrt()
            ids = row_to_block(self.full[0], self.spec.row_blocks).to(r2.device)
            out = torch.zeros(B, nb, dtype=torch.float64, device=r2.device)
            return out.index_add_(1, ids, r2).sqrt()
        return r2.view(B, nb, -1).sum(2).sqrt()

    def _current_frobenius(self) -> torch.Tensor:
        w = self.W.view(self.B, *self.local).double()
        if self.row_ids is None:
            return w.square().sum((1, 2)).sqrt().unsqueeze(1)
        out = torch.zeros(self.B, self.nb, dtype=torch.float64, device=w.device)
        return out.index_add_(1, self.row_ids, w.square().sum(2)).sqrt()


def _adopt(d: dict, key: str, view: torch.Tensor, shape) -> None:
    """``d[key]`` into the storage ``view`` (copied unless it already is it), shaped ``shape``."""
    t = d.get(key)
    if t is None:
        d[key] = view.view(shape)
        return
    if t.data_ptr() != view.data_ptr() or t.numel() != view.numel():
        view.copy_(t.reshape(-1))
    if t.data_ptr() != view.data_ptr() or tuple(t.shape) != tuple(shape):
        d[key] = view.view(shape)


__all__ = ["Group", "norm_count"]
