"""Pruning math, written once against :class:`~compressor.core.ops.ArrayOps`.

Conventions (design doc): masks are bool, True = keep. Weights are in the canonical layout, output
channels (filters) first. A layer with n weights at sparsity s prunes exactly ``k = floor(n * s)``
weights, the k smallest by score, ties broken by flat index (lower index pruned first). Passing the
current ``mask`` makes a new mask monotone: already-pruned weights are pruned first.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from .ops import Array, ArrayOps

FILTER_CRITERIA = ("l1", "l2", "fpgm")


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


def _with_mask(ops: ArrayOps, scores: Array, mask: Array | None) -> Array:
    """Give already-pruned entries the lowest score (-1 < any |w|), so they are pruned first."""
    if mask is None:
        return scores
    return ops.where(mask, scores, ops.asarray(-1.0, like=scores))


def level_mask(ops: ArrayOps, weight: Array, sparsity: float, mask: Array | None = None) -> Array:
    """Magnitude pruning: prune the ``floor(n * sparsity)`` smallest ``|w|`` (monotone given ``mask``)."""
    scores = _with_mask(ops, ops.abs(weight), mask)
    return smallest_k_mask(ops, scores, prune_count(ops.numel(weight), sparsity))


def sensitivity_mask(ops: ArrayOps, weight: Array, sensitivity: float, mask: Array | None = None) -> Array:
    """Han et al. 2015: prune ``|w| < sensitivity * std(w)``.

    The std is the population std (ddof=0) of the weights still kept, so repeating the rule after
    retraining prunes further, as in the paper's iterative prune/retrain. Monotone given ``mask``.
    """
    w = weight
    if mask is None:
        keep = ops.ones_like(w, "bool")
    else:
        keep = mask
    kf = ops.cast(keep, ops.dtype_name(w))
    count = ops.maximum(ops.sum(kf), 1.0)
    mean = ops.sum(w * kf) / count
    std = ops.sqrt(ops.sum(ops.square((w - mean) * kf)) / count)
    return ops.logical_and(keep, ops.logical_not(ops.less(ops.abs(w), sensitivity * std)))


def _filters(ops: ArrayOps, weight: Array) -> Array:
    f = ops.shape(weight)[0]
    return ops.reshape(weight, (f, -1))


def l1_filter_scores(ops: ArrayOps, weight: Array) -> Array:
    """``sum |W_f|`` per output channel."""
    return ops.sum(ops.abs(_filters(ops, weight)), axis=1)


def l2_filter_scores(ops: ArrayOps, weight: Array) -> Array:
    """``sqrt(sum W_f^2)`` per output channel."""
    return ops.sqrt(ops.sum(ops.square(_filters(ops, weight)), axis=1))


def fpgm_filter_scores(ops: ArrayOps, weight: Array) -> Array:
    """FPGM (He et al. 2019): ``sum_g ||W_f - W_g||_2``; the smallest is nearest the geometric median.

    Vectorised through the Gram matrix (``|a-b|^2 = |a|^2 + |b|^2 - 2 a.b``) in float64 to keep the
    cancellation error far below the gaps between real scores.
    """
    w = ops.cast(_filters(ops, weight), "float64")
    sq = ops.sum(ops.square(w), axis=1)
    gram = ops.matmul(w, ops.transpose(w, (1, 0)))
    f = ops.shape(sq)[0]
    d2 = ops.reshape(sq, (f, 1)) + ops.reshape(sq, (1, f)) - 2.0 * gram
    dist = ops.sqrt(ops.maximum(d2, 0.0))
    return ops.cast(ops.sum(dist, axis=1), ops.dtype_name(weight))


def filter_scores(ops: ArrayOps, weight: Array, criterion: str) -> Array:
    """Per-filter importance of a weight in canonical layout by ``criterion`` (l1, l2, fpgm)."""
    fns = {"l1": l1_filter_scores, "l2": l2_filter_scores, "fpgm": fpgm_filter_scores}
    if criterion not in fns:
        raise ValueError(f"unknown filter criterion {criterion!r}; allowed: {list(fns)}")
    return fns[criterion](ops, weight)


def filter_keep_from_mask(ops: ArrayOps, mask: Array) -> Array:
    """Per-filter bool: True where any weight of the filter is still kept."""
    f = ops.shape(mask)[0]
    return ops.greater(ops.sum(ops.cast(ops.reshape(mask, (f, -1)), "int32"), axis=1), 0)


def filter_mask(ops: ArrayOps, scores: Array, sparsity: float, kept: Array | None = None) -> Array:
    """Keep-mask over filters: prune ``floor(F * sparsity)`` lowest scores; nothing when F < 2."""
    f = ops.numel(scores)
    k = prune_count(f, sparsity) if f >= 2 else 0
    return smallest_k_mask(ops, _with_mask(ops, scores, kept), k)


def expand_filter_mask(ops: ArrayOps, keep: Array, shape: Sequence[int]) -> Array:
    """Broadcast a per-filter keep mask ``[F]`` to a weight of ``shape`` (filters first)."""
    f = ops.shape(keep)[0]
    return ops.broadcast_to(ops.reshape(keep, (f,) + (1,) * (len(shape) - 1)), shape)


def filter_prune_masks(
    ops: ArrayOps, weight: Array, sparsity: float, criterion: str, mask: Array | None = None
) -> tuple[Array, Array]:
    """(weight keep-mask, per-filter keep-mask) for an L1/L2/FPGM filter pruner. Bias uses the second."""
    kept = None if mask is None else filter_keep_from_mask(ops, mask)
    keep = filter_mask(ops, filter_scores(ops, weight, criterion), sparsity, kept)
    return expand_filter_mask(ops, keep, ops.shape(weight)), keep


def importance_filter_masks(
    ops: ArrayOps, scores: Array, sparsity: float, mask: Array, shape: Sequence[int]
) -> tuple[Array, Array]:
    """(weight keep-mask of ``shape``, per-filter keep-mask) for a filter pruner ranking filters by
    ``scores`` (data criteria: APoZ, mean activation, Taylor); monotone under the current ``mask``."""
    kept = filter_keep_from_mask(ops, mask)
    keep = filter_mask(ops, scores, sparsity, kept)
    return expand_filter_mask(ops, keep, shape), keep


def activation(ops: ArrayOps, x: Array, kind: str) -> Array:
    """The activation the statistics are taken after: 'relu' or 'relu6'."""
    if kind == "relu":
        return ops.maximum(x, 0.0)
    if kind == "relu6":
        return ops.clip(x, 0.0, 6.0)
    raise ValueError(f"unknown activation {kind!r}; allowed: ['relu', 'relu6']")


def _other_axes(ndim: int, channel_axis: int) -> tuple[int, ...]:
    c = channel_axis % ndim
    return tuple(a for a in range(ndim) if a != c)


def activation_stats(ops: ArrayOps, output: Array, channel_axis: int, kind: str = "relu") -> tuple[Array, Array, Array]:
    """Per-channel ``(zeros, sum, count)`` of ``act(output)`` for one batch, to add to running sums.

    APoZ importance is ``1 - zeros / count``; mean activation is ``sum / count`` (see
    :func:`apoz_importance`, :func:`mean_activation_importance`). Running sums keep the statistics on
    the device with a fixed size, whatever the number of batches.
    """
    a = activation(ops, output, kind)
    axes = _other_axes(len(ops.shape(a)), channel_axis)
    dt = ops.dtype_name(a)
    zeros = ops.sum(ops.cast(ops.equal(a, 0.0), dt), axis=axes)
    total = ops.sum(a, axis=axes)
    count = ops.sum(ops.ones_like(a, dt), axis=axes)
    return zeros, total, count


def apoz_importance(ops: ArrayOps, zeros: Array, count: Array) -> Array:
    """APoZ (Hu et al. 2016) as an importance: ``1 - mean(act == 0)``; low = pruned first."""
    return 1.0 - zeros / ops.maximum(count, 1.0)


def mean_activation_importance(ops: ArrayOps, total: Array, count: Array) -> Array:
    """Mean activation (Molchanov et al. 2017) per channel."""
    return total / ops.maximum(count, 1.0)


def taylor_fo_contribution(ops: ArrayOps, weight: Array, grad: Array) -> Array:
    """Taylor first-order contribution of one batch per filter: ``sum((w * dL/dw)^2)`` over the filter.

    (NNI's form, which the issue pins; the paper's group form squares the sum instead.)
    """
    return ops.sum(ops.square(_filters(ops, weight * grad)), axis=1)


def slim_masks(ops: ArrayOps, gammas: Sequence[Array], sparsity: float, masks: Sequence[Array] | None = None) -> list[Array]:
    """Network slimming (Liu et al. 2017): one global threshold over ``|gamma|`` of all given BN layers.

    ``floor(N * sparsity)`` channels are pruned across the ``N`` channels of all layers, ties broken
    by (layer order, channel index). Returns one keep-mask per layer (apply to gamma and beta).
    """
    scores = [ops.abs(g) for g in gammas]
    if masks is not None:
        scores = [_with_mask(ops, s, m) for s, m in zip(scores, masks)]
    sizes = [ops.numel(s) for s in scores]
    flat = ops.concat([ops.reshape(s, (-1,)) for s in scores], axis=0)
    keep = smallest_k_mask(ops, flat, prune_count(sum(sizes), sparsity))
    return [ops.reshape(m, ops.shape(g)) for m, g in zip(ops.split(keep, sizes, 0), gammas)]


def sparsity_of(ops: ArrayOps, mask: Array) -> Any:
    """Fraction of pruned entries of a keep-mask, as a 0-d array (no host sync)."""
    return 1.0 - ops.sum(ops.cast(mask, "float32")) / float(max(ops.numel(mask), 1))


def slim_l1_penalty(ops: ArrayOps, gammas: Sequence[Array], scale: float) -> Array:
    """Network-slimming sparsity term ``scale * sum_l sum |gamma_l|`` to add to the training loss
    (differentiable: built from ops on the live tensors)."""
    total = None
    for g in gammas:
        s = ops.sum(ops.abs(g))
        total = s if total is None else total + s
    if total is None:
        raise ValueError("slim_l1_penalty needs at least one gamma")
    return scale * total


def filter_masks(weight_mask: Array, filter_keep: Array, has_bias: bool) -> dict[str, Array]:
    """Masks dict of a filter decision: ``weight_mask``, and ``filter_keep`` as the bias mask when the layer
    has a bias (a pruned filter's bias entry is pruned with it)."""
    out = {"weight_mask": weight_mask}
    if has_bias:
        out["bias_mask"] = filter_keep
    return out
