"""MD under megatron's tensor parallelism (TP): where each rank's piece of a matrix lies, and the
group that reduces MD's partials.

A TP-split matrix is MD's *full* matrix: gains, radius and norms are the full matrix's, held
whole on every rank; each rank adds the partials of its own rows/columns (``TPShard``), and the
sum over the TP group is folded into the one all-reduce MD makes per step: over TP × DP for
ZeRO-1, over TP for whole-matrix optimizers. A matrix megatron keeps whole on every TP rank
(the MoE router) is added once, by TP rank 0. Experts must not be TP-split
(``--expert-tensor-parallel-size 1``): their optimizer reduces over the expert-DP group only.

Reads megatron's parameter attributes ``tensor_model_parallel``, ``partition_dim``,
``partition_stride`` (core/tensor_parallel/layers.py:136, set_tensor_model_parallel_attributes)
and ``allreduce`` (False on experts, core/transformer/moe/experts.py).
"""

from __future__ import annotations

import torch.distributed as dist

from megatron.md.blocks import TPShard


def check_layout(local: tuple[int, int], whole: bool, spec, base: str, piece) -> None:
    """What MD's step supports for one rank's part of a matrix (``whole``: the rank steps all of
    its local matrix; ``piece``: its TPShard or None); raises naming what is not."""
    if piece is not None and (
        piece.axis == 1 and piece.stride != 1 or local[piece.axis] % piece.stride
    ):
        raise ValueError(f"unsupported tensor-parallel layout {piece} of a {local} matrix")
    if base == "muon" and not whole:
        raise ValueError("Muon needs whole matrices; use the layer-wise distributed optimizer")
    if spec.row_blocks and not whole:
        raise ValueError("a QKV split (Muon) needs the whole matrix")
    if piece is None:
        return
    if spec.row_blocks and (piece.axis, piece.stride) != (0, 1):
        raise ValueError(f"a QKV split needs whole query groups per TP rank, not {piece}")
    if spec.tangent_update:
        raise ValueError("Muown's per-row step needs whole rows: use TP=1")
    if base == "muon" and spec.sphere == "none" and spec.muon_scale == "sphere_rms":
        raise ValueError("the sphere_rms Muon scale without a sphere needs TP=1")


def tp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size()


def shard(param) -> TPShard | None:
    """Where ``param``'s local piece lies in the full matrix (None: held whole; experts)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "allreduce", True) or tp_size() == 1:
        return None
    if not getattr(param, "tensor_model_parallel", False):
        return None
    rank, stride = ps.get_tensor_model_parallel_rank(), getattr(param, "partition_stride", 1)
    return TPShard(int(param.partition_dim), rank, tp_size(), int(stride))


def placement(param) -> tuple[TPShard | None, bool]:
    """MD's view of ``param``: (its ``shard``, whether this rank adds its partials)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "allreduce", True) and ps.get_expert_tensor_parallel_world_size() > 1:
        raise ValueError(
            "MD with tensor-parallel experts is not supported: use --expert-tensor-parallel-size 1"
        )
    piece = shard(param)
    held_whole_by_all = piece is None and getattr(param, "allreduce", True) and tp_size() > 1
    return piece, not (held_whole_by_all and ps.get_tensor_model_parallel_rank() != 0)


def reduce_group(dp_group, expert: bool):
    """The group MD's partials are summed over: ``dp_group`` (the optimizer's data-parallel
    group, None for whole matrices) times the TP group for non-expert matrices under TP."""
    from megatron.core import parallel_state as ps

    if expert or tp_size() == 1:
        return dp_group
    tp = ps.get_tensor_model_parallel_group()
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return tp
    # megatron's TP × DP(× CP) group; it must be exactly the product of the two
    both = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    ranks = set(dist.get_process_group_ranks(both))
    want = tp_size() * dist.get_world_size(dp_group)
    inside = set(dist.get_process_group_ranks(tp)) | set(dist.get_process_group_ranks(dp_group))
    if len(ranks) != want or not inside <= ranks:
        raise RuntimeError(
            "megatron's tensor-and-data-parallel group is not TP × the optimizer's DP group "
            f"({len(ranks)} ranks, want {want}): MD cannot fold its TP reduction into it"
        )
    return both


def replica_id(dp_replica: int, expert: bool):
    """Checkpoint replica id of MD's replicated state (gains, radius): the same full tensors on
    every TP rank, so only TP rank 0 of the DP replica 0 writes them."""
    from megatron.core import parallel_state as ps

    if expert or tp_size() == 1:
        return dp_replica
    return (ps.get_tensor_model_parallel_rank(), dp_replica)


def piece_rank(param) -> int:
    """Which TP piece of ``param`` this rank holds (0 when megatron does not split it): the
    diagnostics (on every run, MD or not) tell pieces from replicas by it."""
    piece = shard(param)
    return 0 if piece is None else piece.rank


def row_parallel_group(param):
    """The TP group when ``param`` is split along its columns (a row-parallel linear, whose
    output is the sum over the group), else None."""
    from megatron.core import parallel_state as ps

    piece = shard(param)
    return ps.get_tensor_model_parallel_group() if piece and piece.axis == 1 else None


class PieceGather:
    """MuonMD's Newton–Schulz on the full matrix of a TP piece (megatron's ``--muon-tp-mode
    duplicated``): ``full`` all-gathers the pieces along the split axis in rank order (for
    SwiGLU's stride 2 a row permutation of the full matrix, which orthogonalization commutes
    with), ``own`` takes this rank's piece back out."""

    def __init__(self, piece: TPShard):
        from megatron.core import parallel_state as ps

        self.piece, self.group = piece, ps.get_tensor_model_parallel_group()

    def full(self, x):
        import torch

        parts = [torch.empty_like(x) for _ in range(self.piece.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=self.piece.axis)

    def own(self, x):
        return x.chunk(self.piece.size, dim=self.piece.axis)[self.piece.rank]
