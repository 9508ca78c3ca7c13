"""MD under megatron's tensor parallelism (TP): where each rank's piece of a matrix lies, and the
group that reduces MD's partials.

A TP-split matrix is MD's *full* matrix: gains, radius and norms are the full matrix's, held
whole on every rank; each rank adds the partials of its own rows/columns (``TPShard``), and the
sum over the TP group is folded into the one all-reduce MD makes per step: over TP × DP for
ZeRO-1, over TP for whole-matrix optimizers. A matrix megatron keeps whole on every TP rank
(the MoE router) is added once, by TP rank 0. Routed experts are split over megatron's
expert-TP group instead (``--expert-tensor-parallel-size``): their pieces' partials are summed
over expert-TP × expert-DP, a group megatron-core does not make (``prepare_groups``).

Reads megatron's parameter attributes ``tensor_model_parallel``, ``partition_dim``,
``partition_stride`` (core/tensor_parallel/layers.py, set_tensor_model_parallel_attributes,
set_tensor_model_parallel_attributes) and ``allreduce`` (False on routed experts,
core/tensor_parallel/layers.py, ColumnParallelLinear).
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
    if piece is None:
        return
    if spec.row_blocks and (piece.axis, piece.stride) != (0, 1):
        raise ValueError(f"a QKV split needs whole query groups per TP rank, not {piece}")
    if spec.tangent_update or spec.weight_norm:
        raise ValueError("Muown's per-row step needs whole rows: use TP=1")
    if base == "muon" and spec.sphere == "none" and spec.muon_scale in ("sphere_rms", "hyperball"):
        raise ValueError(f"the {spec.muon_scale} Muon scale without a sphere needs TP=1")


def tp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size()


def etp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_world_size()


def is_expert(param) -> bool:
    """megatron marks routed experts' parameters ``allreduce=False`` (reduced over expert
    groups, core/tensor_parallel/layers.py, ColumnParallelLinear)."""
    return not getattr(param, "allreduce", True)


def group_of(piece: TPShard):
    """The group a piece is split over: expert-TP for routed experts, else TP."""
    from megatron.core import parallel_state as ps

    if piece.expert:
        return ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_group()


def shard(param) -> TPShard | None:
    """Where ``param``'s local piece lies in the full matrix (None: held whole)."""
    from megatron.core import parallel_state as ps

    expert = is_expert(param)
    size = etp_size() if expert else tp_size()
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    if expert:
        rank = ps.get_expert_tensor_parallel_rank()
    else:
        rank = ps.get_tensor_model_parallel_rank()
    stride = int(getattr(param, "partition_stride", 1))
    return TPShard(int(param.partition_dim), rank, size, stride, expert)


def placement(param) -> tuple[TPShard | None, bool]:
    """MD's view of ``param``: (its ``shard``, whether this rank adds its partials)."""
    from megatron.core import parallel_state as ps

    piece = shard(param)
    held_whole_by_all = piece is None and not is_expert(param) and tp_size() > 1
    return piece, not (held_whole_by_all and ps.get_tensor_model_parallel_rank() != 0)


#: expert-TP × expert-DP group of this rank, made by ``prepare_groups`` (None: ETP = 1)
_EXPERT_TP_DP = None


def prepare_groups() -> None:
    """Make the expert-TP × expert-DP group MD's expert partials are summed over in one
    all-reduce (megatron-core 0.19.2 makes expert-TP, expert-DP and expert-TP × EP groups,
    core/parallel_state.py, but not this product). Collective: every rank calls it, once per
    ``enable_md`` (torch's ``new_group`` must be called by the whole world, in one order);
    the ranks of one group share their EP and PP ranks."""
    global _EXPERT_TP_DP
    from megatron.core import parallel_state as ps

    _EXPERT_TP_DP = None
    if not ps.model_parallel_is_initialized() or etp_size() == 1:
        return
    key = (ps.get_expert_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
    keys = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    members = {}
    for rank, k in enumerate(keys):
        members.setdefault(tuple(k), []).append(rank)
    for k in sorted(members):
        group = dist.new_group(members[k])
        if k == key:
            _EXPERT_TP_DP = group
    ranks = set(members[key])
    edp = ps.get_expert_data_parallel_group()
    want = set(dist.get_process_group_ranks(edp)) | set(
        dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group())
    )
    if len(ranks) != etp_size() * dist.get_world_size(edp) or not want <= ranks:
        raise RuntimeError(
            f"the ranks sharing this rank's EP and PP ranks ({sorted(ranks)}) are not "
            "expert-TP × expert-DP: MD cannot sum its expert partials over them"
        )


def reduce_group(dp_group, expert: bool):
    """The group MD's partials are summed over: ``dp_group`` (the optimizer's data-parallel
    group, None for whole matrices) times the TP group for non-expert matrices under TP, times
    the expert-TP group for routed experts under expert TP."""
    from megatron.core import parallel_state as ps

    if expert:
        if etp_size() == 1:
            return dp_group
        if dp_group is None or dist.get_world_size(dp_group) == 1:
            return ps.get_expert_tensor_parallel_group()
        if _EXPERT_TP_DP is None:
            raise RuntimeError("expert TP × DP group missing: enable_md calls prepare_groups")
        if etp_size() * dist.get_world_size(dp_group) != dist.get_world_size(_EXPERT_TP_DP):
            raise RuntimeError(  # e.g. several distributed-optimizer instances
                f"the expert optimizer's data-parallel group ({dist.get_world_size(dp_group)} "
                "ranks) is not megatron's whole expert-DP group: MD cannot sum its expert "
                "partials over expert-TP × it in one all-reduce"
            )
        return _EXPERT_TP_DP
    if tp_size() == 1:
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
    every (expert-)TP rank, so only its rank 0 of the DP replica 0 writes them. Under TP the
    id is megatron's (PP, TP, DP) triple, as its models' own (PP 0: a stage's keys are its own):
    megatron's layer-wise optimizer asserts an int or a triple
    (core/optimizer/layer_wise_optimizer.py:943; a pair stopped every layer-wise MuonMD run
    under TP at its first save)."""
    from megatron.core import parallel_state as ps

    if expert:
        if etp_size() == 1:
            return dp_replica
        return (0, ps.get_expert_tensor_parallel_rank(), dp_replica)
    if tp_size() == 1:
        return dp_replica
    return (0, ps.get_tensor_model_parallel_rank(), dp_replica)


def piece_rank(param) -> int:
    """Which TP piece of ``param`` this rank holds (0 when megatron does not split it): the
    diagnostics (on every run, MD or not) tell pieces from replicas by it."""
    piece = shard(param)
    return 0 if piece is None else piece.rank


def row_parallel_group(param):
    """The (expert-)TP group when ``param`` is split along its columns (a row-parallel linear,
    whose output is the sum over the group), else None."""
    piece = shard(param)
    return group_of(piece) if piece and piece.axis == 1 else None


class PieceGather:
    """MuonMD's Newton–Schulz on the full matrix of a TP piece (megatron's ``--muon-tp-mode
    duplicated``): ``full`` all-gathers the pieces along the split axis in rank order (for
    SwiGLU's stride 2 a row permutation of the full matrix, which orthogonalization commutes
    with), ``own`` takes this rank's piece back out. A leading batch dimension (a stack of
    same-placed pieces) is gathered in the same one collective."""

    def __init__(self, piece: TPShard):
        self.piece, self.group = piece, group_of(piece)

    def full(self, x):
        import torch

        parts = [torch.empty_like(x) for _ in range(self.piece.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=self.piece.axis + x.ndim - 2)

    def own(self, x):
        return x.chunk(self.piece.size, dim=self.piece.axis + x.ndim - 2)[self.piece.rank]
