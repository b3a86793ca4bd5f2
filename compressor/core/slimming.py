"""One global ranking over several layers that never disconnects a layer (network slimming).

A single threshold over the ``|gamma|`` of every BatchNorm layer (Liu et al. 2017) prunes the
``floor(N * s)`` smallest scores of all ``N`` channels. Two rules keep it safe on real models, where
scores often TIE (a freshly initialised network has every gamma = 1):

* **Per-layer cap**: a layer keeps at least ``max(1, n - floor(n * max_layer_sparsity))`` of its ``n``
  channels (default: at least one), the ones with the largest scores (ties: the lowest index), as
  Torch-Pruning's per-layer maximum pruning ratio does. A layer with no channel left outputs a constant
  and disconnects everything behind it. If the caps leave fewer than ``floor(N * s)`` prunable channels,
  all of them are pruned.
* **Even tie-breaking across layers**: entries strictly below the threshold are pruned; the ``r``
  entries still to prune are taken from those EQUAL to it, spread over the layers in proportion to each
  layer's tied count: the ``j``-th tied entry of a layer with ``t`` tied entries gets the key
  ``(2j - 1) / 2t`` and the ``r`` smallest keys are pruned (equal keys: layer order, then index). A
  layer order rule ("the first layers first") would zero whole leading layers.

Everything stays on the device; :func:`tie_warning` turns the returned counts into a warning when
called eagerly. Identical on numpy, torch and TensorFlow (the keys are exact rationals divided in
float64, correctly rounded everywhere).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from .errors import ConfigError
from .ops import Array, ArrayOps
from .selection import prune_count, smallest_k_mask

__all__ = ["global_keep", "slim_plan", "tie_warning", "layer_min_keep", "check_max_layer_sparsity"]


def check_max_layer_sparsity(value: Any, what: str = "SlimPruner") -> float | None:
    """``max_layer_sparsity`` as given (None or a float in [0, 1)), else a ConfigError naming what is allowed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise ConfigError(f"{what}: max_layer_sparsity must be None or a number in [0, 1), got {value!r}")
    return float(value)


def layer_min_keep(n: int, max_layer_sparsity: float | None = None) -> int:
    """Channels a layer of ``n`` keeps at least: ``n - floor(n * max_layer_sparsity)``, and at least 1."""
    if max_layer_sparsity is None:
        return min(1, n)
    return min(n, max(1, n - prune_count(n, max_layer_sparsity)))


def global_keep(ops: ArrayOps, scores: Sequence[Array], k: int, min_keep: Sequence[int]) -> tuple[list[Array], dict[str, Any]]:
    """Keep-masks (one per entry of ``scores``, same shapes) pruning the ``k`` smallest scores over all
    layers, layer ``l`` keeping at least ``min_keep[l]`` entries (its largest), ties at the threshold
    spread evenly over the layers (module docstring).

    Also returns ``{'requested': k, 'pruned': k', 'tied': T, 'tied_pruned': r}``: ``k'`` (python int) is
    ``k`` limited by the caps, ``T`` (0-d array) the unprotected entries equal to the threshold and ``r``
    (0-d array) how many of them were pruned; ``T > r`` means the threshold split a tie.
    """
    flats = [ops.reshape(s, (-1,)) for s in scores]
    sizes = [ops.numel(f) for f in flats]
    protected = []
    capacity = 0
    for f, n, m in zip(flats, sizes, min_keep):
        m = min(max(int(m), 0), n)
        capacity += n - m
        if m == 0:
            protected.append(ops.zeros_like(f, "bool"))
        elif m == n:
            protected.append(ops.ones_like(f, "bool"))
        else:  # the m largest (ties: lowest index): the m smallest of -score
            protected.append(ops.logical_not(smallest_k_mask(ops, -f, m)))
    kk = min(int(k), capacity)
    info: dict[str, Any] = {"requested": int(k), "pruned": kk, "tied": 0, "tied_pruned": 0}
    if kk <= 0:
        return [ops.ones_like(s, "bool") for s in scores], info
    inf = float("inf")
    ranked = [ops.where(p, ops.asarray(inf, like=f), f) for p, f in zip(protected, flats)]
    v = ops.kth_smallest(ops.concat(ranked, axis=0), kk)
    keys, n_less, n_tied = [], None, None
    for r in ranked:
        less = ops.less(r, v)
        tied = ops.equal(r, v)
        rank = ops.cast(ops.cumsum(ops.cast(tied, "int32"), 0), "float64")
        t = ops.sum(ops.cast(tied, "int32"))
        denom = 2.0 * ops.maximum(ops.cast(t, "float64"), 1.0)
        key = (2.0 * rank - 1.0) / denom  # in (0, 1)
        key = ops.where(tied, key, ops.asarray(2.0, like=key))
        keys.append(ops.where(less, ops.asarray(-1.0, like=key), key))
        nl = ops.sum(ops.cast(less, "int32"))
        n_less = nl if n_less is None else n_less + nl
        n_tied = t if n_tied is None else n_tied + t
    keep = smallest_k_mask(ops, ops.concat(keys, axis=0), kk)
    info["tied"] = n_tied
    info["tied_pruned"] = kk - n_less
    return [ops.reshape(m, ops.shape(s)) for m, s in zip(ops.split(keep, sizes, 0), scores)], info


def slim_plan(ops: ArrayOps, gammas: Sequence[Array], sparsity: float, masks: Sequence[Array] | None = None,
              max_layer_sparsity: float | None = None) -> tuple[list[Array], dict[str, Any]]:
    """Network slimming masks over ``gammas`` (one keep-mask per layer, apply to gamma and beta) and the
    tie counts of :func:`global_keep`. ``masks``: current keep-masks; already-pruned channels rank first
    (score -1), so masks are monotone unless a cap revives a layer's best channel."""
    scores = [ops.abs(g) for g in gammas]
    if masks is not None:
        scores = [ops.where(m, s, ops.asarray(-1.0, like=s)) for s, m in zip(scores, masks)]
    sizes = [ops.numel(s) for s in scores]
    k = prune_count(sum(sizes), sparsity)
    return global_keep(ops, scores, k, [layer_min_keep(n, max_layer_sparsity) for n in sizes])


def tie_warning(info: dict[str, Any], what: str = "SlimPruner") -> str | None:
    """Eagerly: warn (``RuntimeWarning``) when the threshold split a tie or the per-layer caps pruned fewer
    channels than asked; returns the message (None when nothing to say). Reads the counts to the host."""
    tied, tied_pruned = int(info["tied"]), int(info["tied_pruned"])
    parts = []
    if tied > tied_pruned > 0:
        parts.append(f"{tied} channel scores tie at the global threshold and {tied_pruned} of them are pruned: "
                     f"the choice among them is arbitrary (spread evenly over the layers). Train with the L1 "
                     f"penalty on gamma first (l1_penalty()) so the scores differ")
    if info["pruned"] < info["requested"]:
        parts.append(f"pruned {info['pruned']} channels instead of {info['requested']}: every layer keeps at "
                     f"least one channel (max_layer_sparsity)")
    if not parts:
        return None
    msg = f"{what}: " + "; ".join(parts)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return msg
