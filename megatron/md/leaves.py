"""Walking megatron-core's optimizer tree: the leaf optimizers (``ChainedOptimizer`` and the
layer-wise optimizer are chains) and which of them carry the MD step. Imported by the
wrappers, the checkpoint code and the training-loop patches alike."""

from __future__ import annotations


def leaf_optimizers(optimizer) -> list:
    """The non-chained megatron optimizers inside ``optimizer`` (LayerWise is a chain too)."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return [o for c in optimizer.chained_optimizers for o in leaf_optimizers(c)]
    return [optimizer]


def is_md_wrapper(opt) -> bool:
    """An MD wrapper class (``wrappers.md_wrapper``) set on a leaf by ``enable_md``."""
    return getattr(opt, "_md_wrapper", False)


def md_leaves(optimizer) -> list:
    """The leaves of ``optimizer`` that carry the MD step."""
    return [o for o in leaf_optimizers(optimizer) if is_md_wrapper(o)]
