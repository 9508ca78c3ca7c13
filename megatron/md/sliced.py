"""One matrix as MD's step sees it on a rank: ``SliceMD``, the descriptor of its geometry and
treatment. The step itself is the engine's (``megatron/md/engine``), which batches many of
them.

A ZeRO-1 rank owns an arbitrary contiguous range ``[start, end)`` of a row-major matrix's
flattened elements (cuts fall inside rows), covered by at most three rectangular blocks
(``blocks.py``); under tensor parallelism the local matrix is a piece of the full one
(``TPShard``), and the blocks are addressed in the full matrix's rows and columns, since
gains, radius and norms are the full matrix's. Cross-slice quantities (gain-gradient
row/column sums, squared norms) are *partials*, laid out per matrix as [gain gradients |
squared norms] and summed by the caller's one reduction.
"""

from __future__ import annotations

import torch

from megatron.md import tensor_parallel
from megatron.md.blocks import Block, TPShard, place_blocks, slice_blocks
from megatron.md.config import GAIN_NAMES, MatrixSpec
from megatron.md.engine.geometry import norm_count, row_to_block


class SliceMD:
    """MD bookkeeping for one matrix (or one rank's slice of it)."""

    def __init__(
        self,
        shape,
        start: int,
        end: int,
        spec: MatrixSpec,
        base: str,
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
        self.blocks: list[Block] = place_blocks(local, self.local_shape, tp)
        # the whole local matrix (under TP: a whole TP piece, which Muon gathers; tensor_parallel)
        self.whole = start == 0 and end == self.local_shape[0] * self.local_shape[1]
        tensor_parallel.check_layout(self.local_shape, self.whole, spec, base, tp)
        d_out, d_in = self.shape
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
        self.n_norm = norm_count(self.shape, spec.sphere, spec.row_blocks)

    def n_partials(self) -> int:
        return self.n_gain + self.n_norm

    def n_pre_partials(self) -> int:
        """Partials needed before the base step (tangent projection): ⟨G_Ŵ, Ŵ⟩ and ‖Ŵ‖²."""
        return 2 * self.n_norm if self.spec.tangent_grad and self.n_norm else 0

    def norm_partials(self, direction: torch.Tensor, out: torch.Tensor) -> None:
        """Add ‖Ŵ‖² of this slice along the sphere axis into ``out`` (``n_norm``), block by
        block (for checks and diagnostics; the step's are the engine's, batched)."""
        sphere, rb = self.spec.sphere, self.spec.row_blocks
        if not self.n_norm:
            return
        for blk in self.blocks:
            sq = blk.view(direction).square()
            if sphere == "row":
                out[blk.r0 : blk.r0 + blk.nr] += sq.sum(1)
            elif rb:  # each row's Q/K/V block, looked up in the full matrix's rows
                ids = row_to_block(self.shape[0], rb)[blk.r0 : blk.r0 + blk.nr].to(sq.device)
                rows = sq.sum(1, keepdim=True) if sphere == "frobenius" else sq
                per = out.view(len(rb), -1)
                (per if sphere == "frobenius" else per[:, blk.c0 : blk.c0 + blk.nc]).index_add_(
                    0, ids, rows
                )
            elif sphere == "frobenius":
                out += sq.sum()
            else:
                out[blk.c0 : blk.c0 + blk.nc] += sq.sum(0)
