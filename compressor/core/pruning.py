"""Pruning math, written once against :class:`~compressor.core.ops.ArrayOps`.

Conventions (design doc): masks are bool, True = keep. Weights are in the canonical layout, output
channels (filters) first. A layer with n weights at sparsity s prunes exactly ``k = floor(n * s)``
weights, the k smallest by score, ties broken by flat index (lower index pruned first). Passing the
current ``mask`` makes a new mask monotone: already-pruned weights are pruned first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import ConfigError
from .ops import Array, ArrayOps
from .selection import prune_count, smallest_k_mask  # noqa: F401  (re-exported)
from .slimming import slim_plan
from .sparse_pattern import nm_sparsity, parse_sparse_pattern, resolve_sparse_pattern  # noqa: F401

FILTER_CRITERIA = ("l1", "l2", "fpgm")


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


def slim_masks(ops: ArrayOps, gammas: Sequence[Array], sparsity: float, masks: Sequence[Array] | None = None,
               max_layer_sparsity: float | None = None) -> list[Array]:
    """Network slimming (Liu et al. 2017): one global threshold over ``|gamma|`` of all given BN layers.

    ``floor(N * sparsity)`` channels are pruned across the ``N`` channels of all layers; every layer keeps
    at least one channel and ties at the threshold are spread evenly over the layers
    (:func:`compressor.core.slimming.slim_plan`). Returns one keep-mask per layer (apply to gamma and beta).
    """
    return slim_plan(ops, gammas, sparsity, masks, max_layer_sparsity)[0]


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


# ------------------------------------------------------------------------------------------- N:M sparsity
def nm_input_dim(shape: Sequence[int]) -> int | None:
    """The length of the axis N:M groups run along (axis 1, the input channels, of the canonical layout),
    or None for a weight without one (fewer than 2 axes)."""
    return int(shape[1]) if len(shape) >= 2 else None


def _nm_perm(ndim: int) -> tuple[int, ...]:
    """Canonical ``[out, in, k...]`` -> ``[out, k..., in]``: the input axis last, so groups are contiguous."""
    return (0, *range(2, ndim), 1)


def _nm_groups(ops: ArrayOps, x: Array, m: int) -> Array:
    """``x`` (canonical layout) as ``[groups, m]``: M consecutive input channels per row."""
    return ops.reshape(ops.transpose(x, _nm_perm(len(ops.shape(x)))), (-1, m))


def _nm_ungroup(ops: ArrayOps, g: Array, shape: Sequence[int]) -> Array:
    """Inverse of :func:`_nm_groups` for a canonical ``shape``."""
    perm = _nm_perm(len(shape))
    moved = ops.reshape(g, tuple(shape[p] for p in perm))
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return ops.transpose(moved, inverse)


def nm_group_rank(ops: ArrayOps, scores: Array, m: int) -> Array:
    """Rank (0 = smallest) of every score within its group of ``m`` (``[groups, m]``), ties by index."""
    a = ops.reshape(scores, (-1, m, 1))  # the entry ranked
    b = ops.reshape(scores, (-1, 1, m))  # the entries compared with it
    idx = ops.arange(m, like=scores)
    before = ops.less(ops.reshape(idx, (1, 1, m)), ops.reshape(idx, (1, m, 1)))  # [1, m, m]: j < i
    smaller = ops.logical_or(ops.less(b, a), ops.logical_and(ops.equal(b, a), before))
    return ops.sum(ops.cast(smaller, "int32"), axis=2)


def nm_mask(ops: ArrayOps, weight: Array, n: int, m: int, sparsity: float | None = None,
            mask: Array | None = None) -> Array:
    """N:M keep-mask of ``weight`` (canonical layout, ``[out, in, k...]``, ``in`` divisible by ``m``).

    Groups are ``m`` consecutive weights along the input axis (for a conv: for each output channel and
    kernel position), so they are the same on every backend. Without ``sparsity`` (or at
    ``sparsity >= (m - n) / m``) every group keeps exactly its ``n`` largest ``|w|`` (ties: the lower index
    is pruned first). With a smaller ``sparsity`` (AGP's ramp) exactly ``floor(numel * sparsity)``
    weights are pruned, the smallest ``|w|`` among those each group's final N:M pattern would prune
    (at most ``m - n`` per group; global ties by position in group order), so every intermediate mask
    contains the final one. ``mask``: the current keep-mask; its pruned weights go first and stay pruned
    (monotone: the result is AND-ed with ``mask``, so a group that ``mask`` already prunes beyond ``m - n``
    keeps fewer than ``n``; masks made by this function never do).
    """
    shape = ops.shape(weight)
    if len(shape) < 2 or shape[1] % m:
        raise ValueError(f"N:M sparsity needs a weight whose input axis (axis 1 of {tuple(shape)}) is a multiple "
                         f"of M={m}")
    target = nm_sparsity(n, m)
    if sparsity is not None and sparsity > target + 1e-9:
        raise ValueError(f"sparsity {sparsity} exceeds the {n}:{m} pattern's {target}")
    scores = _nm_groups(ops, _with_mask(ops, ops.abs(weight), mask), m)
    eligible = ops.less(nm_group_rank(ops, scores, m), m - n)  # the m - n each group prunes at the end
    if sparsity is None or sparsity >= target - 1e-9:
        keep = ops.logical_not(eligible)
    else:
        k = prune_count(ops.numel(weight), sparsity)
        big = ops.max(scores) + 1.0  # above every eligible score: never chosen while k <= #eligible
        keep = smallest_k_mask(ops, ops.where(eligible, scores, big), k)
    keep = _nm_ungroup(ops, keep, shape)
    return keep if mask is None else ops.logical_and(keep, mask)


def is_nm(ops: ArrayOps, mask: Array, n: int, m: int) -> Any:
    """True (0-d bool array) when every N:M group of ``mask`` (canonical layout) keeps at most ``n``."""
    kept = ops.sum(ops.cast(_nm_groups(ops, mask, m), "int32"), axis=1)
    return ops.logical_not(ops.greater(ops.max(kept), n))


#: layer types whose canonical axis 1 is the input (torch and Keras names): the ones N:M applies to
NM_LAYER_TYPES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Dense", "Conv1D", "Conv2D", "Conv3D")


def nm_validate_config(config_list: list[dict[str, Any]], what: str, sparsity_key: str = "sparsity",
                       algorithm: str = "level") -> None:
    """Config checks of a pruner taking ``sparse_pattern`` (LevelPruner, AGPPruner): the pattern needs the
    magnitude criterion; its sparsity is filled in (``sparsity_key``) or must agree; LevelPruner entries
    without a pattern need ``sparsity``. Raises ConfigError; mutates the normalised entries only."""
    for i, c in enumerate(config_list):
        if "sparse_pattern" in c and not c["exclude"] and algorithm != "level":
            raise ConfigError(f"config_list[{i}]: 'sparse_pattern' needs pruning_algorithm='level' (N:M keeps the "
                              f"largest |w| of each group), not {algorithm!r}")
    resolve_sparse_pattern(config_list, sparsity_key, what)
    if sparsity_key == "sparsity":
        for i, c in enumerate(config_list):
            if not c["exclude"] and "sparsity" not in c:
                raise ConfigError(f"config_list[{i}]: without 'sparse_pattern' (e.g. '2:4'), {what} needs key(s) "
                                  f"['sparsity'] in every non-excluded entry")


def nm_check_layer(layer: str, layer_type: str | Sequence[str], canonical_shape: Sequence[int] | None,
                   config: dict[str, Any], what: str) -> None:
    """Refuse a layer that ``config['sparse_pattern']`` cannot apply to: not a Linear/Dense/Conv layer, or an
    input dimension M does not divide (``canonical_shape`` None: not built yet, checked when masked).
    ``layer_type``: the layer's type name, or its type name followed by the framework classes it computes as
    (:attr:`~compressor.core.matching.LayerInfo.bases`: a ``FalconLinear`` is a ``Linear``)."""

    pattern = config.get("sparse_pattern")
    if pattern is None:
        return
    n, m = parse_sparse_pattern(pattern)
    kinds = (layer_type,) if isinstance(layer_type, str) else tuple(layer_type)
    layer_type = kinds[0]
    if not any(k in NM_LAYER_TYPES for k in kinds):
        raise ConfigError(f"{what}: layer {layer!r} ({layer_type}) cannot take sparse_pattern {pattern!r}; N:M "
                          f"groups run along the input channels of {list(NM_LAYER_TYPES)}")
    if canonical_shape is None:
        return
    dim = nm_input_dim(canonical_shape)
    if dim is None or dim % m:
        raise ConfigError(f"{what}: layer {layer!r} ({layer_type}) has input dimension {dim} (weight "
                          f"{tuple(canonical_shape)} in [out, in, ...] layout), not a multiple of M={m} of "
                          f"sparse_pattern {pattern!r}; exclude the layer or pick an M that divides {dim}")


def level_or_nm_mask(ops: ArrayOps, weight: Array, sparsity: float, mask: Array | None, config: dict[str, Any]) -> Array:
    """The magnitude criterion of LevelPruner / AGP: :func:`nm_mask` when ``config`` has ``sparse_pattern``
    (``sparsity`` at or above the pattern's gives exactly N:M), else :func:`level_mask`."""
    pattern = config.get("sparse_pattern")
    if pattern is None:
        return level_mask(ops, weight, sparsity, mask)
    n, m = parse_sparse_pattern(pattern)
    return nm_mask(ops, weight, n, m, min(sparsity, nm_sparsity(n, m)), mask)
