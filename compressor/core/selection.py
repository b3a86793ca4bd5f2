"""The two ranking primitives every pruning rule is built on (bottom of ``core``: imports only ``ops``).

``prune_count`` turns a sparsity into a count the way the user wrote it; ``smallest_k_mask`` prunes the k
smallest scores with ties broken by flat index. :mod:`compressor.core.pruning` (per-layer rules) and
:mod:`compressor.core.slimming` (one global ranking) both build on them.
"""

from __future__ import annotations

from decimal import Decimal

from .ops import Array, ArrayOps

__all__ = ["prune_count", "smallest_k_mask"]


def prune_count(n: int, sparsity: float) -> int:
    """``floor(n * sparsity)``, computed on the decimal value the user wrote.

    Binary floats make ``100 * 0.29 == 28.999999999999996``; using the shortest repr of ``sparsity``
    gives 29, which is what ``sparsity: 0.29`` means.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity!r}")
    return int(Decimal(repr(float(sparsity))) * int(n))


def smallest_k_mask(ops: ArrayOps, scores: Array, k: int) -> Array:
    """Keep-mask (bool, shape of ``scores``) pruning the ``k`` smallest scores.

    O(n): one selection (``kth_smallest``) plus elementwise passes; ties at the k-th value are pruned
    in flat-index order, via a cumulative count of the tied entries. Everything stays on the device.
    """
    shape = ops.shape(scores)
    n = ops.numel(scores)
    if k <= 0:
        return ops.ones_like(scores, "bool")
    if k >= n:
        return ops.zeros_like(scores, "bool")
    flat = ops.reshape(scores, (-1,))
    v = ops.kth_smallest(flat, k)
    less = ops.less(flat, v)
    tied = ops.equal(flat, v)
    n_less = ops.sum(ops.cast(less, "int32"))
    tie_rank = ops.cumsum(ops.cast(tied, "int32"), 0)  # 1-based rank among the tied entries
    pruned = ops.logical_or(less, ops.logical_and(tied, ops.less_equal(tie_rank, k - n_less)))
    return ops.reshape(ops.logical_not(pruned), shape)
