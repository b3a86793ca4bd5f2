"""Weight sharing ("trained quantization", Han et al. 2016, Deep Compression section 3).

Each layer's kept (non-zero) weights are clustered into ``k = 2**bits`` centroids by 1-D k-means with
**linear initialisation** (centroids evenly spaced between the smallest and the largest kept weight,
which the paper found best because it keeps the few large weights represented); every kept weight is
replaced by its centroid, pruned weights stay zero. During fine-tuning the gradient of a centroid is the
SUM of its members' gradients (the paper's figure 3); the backends apply it by giving every member that
summed gradient (:func:`cluster_gradient`), so any optimizer moves all members of a cluster identically
and they stay equal to one (moving) centroid, and pruned weights get zero gradient.

:func:`kmeans_1d` / :func:`share_weights` run once per layer on the host (numpy), when a
``WeightSharingQuantizer`` is built; :func:`cluster_gradient` runs in every backward pass on the device,
through ``ops`` plus two gather/scatter primitives the backend provides (:class:`SharingOps`).
:func:`tie_weights` re-derives exact centroids from (possibly drifted) weights before export.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .ops import Array, ArrayOps

__all__ = ["SharingOps", "check_bits", "cluster_gradient", "kmeans_1d", "linear_centroids", "share_weights", "tie_weights"]


class SharingOps(Protocol):
    """The two indexing primitives weight sharing needs besides :class:`~compressor.core.ops.ArrayOps`."""

    def segment_sum(self, data: Array, segment_ids: Array, num_segments: int) -> Array:
        """``out[j] = sum(data[i] for i where segment_ids[i] == j)`` (1-D data and ids)."""
        ...

    def take(self, params: Array, indices: Array) -> Array:
        """``params[indices]`` (1-D params)."""
        ...


def check_bits(layer: str, bits: int) -> None:
    """ConfigError unless ``bits`` (the weight bit width of ``layer``) is 1..16 (2 to 65536 shared values)."""
    from .errors import ConfigError

    if bits > 16:
        raise ConfigError(f"WeightSharingQuantizer: layer {layer!r}: quant_bits = {bits} is invalid; "
                          f"allowed: 1..16 (2 to 65536 shared values per layer)")


def linear_centroids(values: np.ndarray, k: int) -> np.ndarray:
    """``k`` centroids evenly spaced over ``[min(values), max(values)]`` (the paper's linear initialisation)."""
    v = np.asarray(values, np.float64)
    return np.linspace(v.min(), v.max(), k) if k > 1 else np.array([v.mean()])


def kmeans_1d(values: np.ndarray, k: int, iterations: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """1-D k-means (Lloyd) of ``values`` into at most ``k`` clusters from :func:`linear_centroids`.

    Returns ``(centroids, assignment)``: centroids (float64, ascending) and, per value, the index of its
    centroid. Runs on the sorted values (so the result does not depend on their order: both backends get
    the same centroids from the same weights), stops when no assignment changes; clusters that end up empty
    are dropped. With ``k`` at least the number of distinct values every value is its own centroid.
    """
    v = np.asarray(values, np.float64).reshape(-1)
    if v.size == 0:
        return np.zeros(0), np.zeros(0, np.int64)
    distinct = np.unique(v)
    if distinct.size <= k:
        return distinct, np.searchsorted(distinct, v)
    order = np.argsort(v, kind="stable")
    s = v[order]
    c = linear_centroids(s, k)
    assign = None
    for _ in range(iterations):
        new = np.searchsorted((c[1:] + c[:-1]) / 2, s, side="right")  # nearest centroid (ties: the upper one)
        if assign is not None and np.array_equal(new, assign):
            break
        assign = new
        counts = np.bincount(assign, minlength=c.size)
        sums = np.bincount(assign, weights=s, minlength=c.size)
        c = np.where(counts > 0, sums / np.maximum(counts, 1), c)
    used = np.unique(assign)
    c = c[used]
    remap = np.full(int(used.max()) + 1, -1, np.int64)
    remap[used] = np.arange(used.size)
    out = np.empty(v.size, np.int64)
    out[order] = remap[assign]
    return c, out


def share_weights(weight: np.ndarray, bits: int, iterations: int = 100) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cluster the non-zero entries of ``weight`` into at most ``2**bits`` centroids.

    Returns ``(shared, assignment, centroids)``: ``shared`` has ``weight``'s shape and dtype, each kept entry
    replaced by its centroid (cast to the dtype; a centroid that would round to exactly 0 is moved to the
    smallest non-zero value of its sign, so a kept weight never reads as pruned) and pruned entries 0;
    ``assignment`` (int64, same shape) holds each kept entry's centroid index and ``len(centroids)`` for
    pruned ones (an extra, always-zero cluster); ``centroids`` is the codebook in ``weight``'s dtype.
    """
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16 (2 to 65536 centroids), got {bits}")
    w = np.asarray(weight)
    keep = w != 0
    c64, idx = kmeans_1d(w[keep], 2**bits, iterations)
    centroids = c64.astype(w.dtype)
    tiny = np.nextafter(np.zeros((), w.dtype), np.ones((), w.dtype))
    zero = centroids == 0
    centroids[zero] = np.where(c64[zero] < 0, -tiny, tiny)
    assignment = np.full(w.shape, centroids.size, np.int64)
    assignment[keep] = idx
    shared = np.zeros_like(w)
    shared[keep] = centroids[idx]
    return shared, assignment, centroids


def tie_weights(weight: np.ndarray, assignment: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tied weight, centroids)``: each of the ``k`` clusters' members set to their mean (float64, cast
    back; exact when they are already equal), the extra cluster ``k`` (pruned entries) to 0."""
    w = np.asarray(weight)
    a = np.asarray(assignment).reshape(-1)
    flat = w.reshape(-1).astype(np.float64)
    counts = np.bincount(a, minlength=k + 1)
    sums = np.bincount(a, weights=flat, minlength=k + 1)
    centroids = (sums / np.maximum(counts, 1)).astype(w.dtype)[:k]
    full = np.concatenate([centroids, np.zeros(1, w.dtype)])
    return full[a].reshape(w.shape), centroids


def cluster_gradient(ops: ArrayOps, sops: SharingOps, grad: Array, assignment: Array, k: int) -> Array:
    """The gradient every weight gets under sharing: the sum of its cluster's gradients (the centroid's
    gradient), zero for pruned weights (``assignment == k``). Same shape as ``grad``; on the device."""
    shape = ops.shape(grad)
    ids = ops.reshape(assignment, (-1,))
    sums = sops.segment_sum(ops.reshape(grad, (-1,)), ids, k + 1)
    live = ops.less(ops.arange(k + 1, like=sums), k)
    sums = ops.where(live, sums, ops.zeros_like(sums))
    return ops.reshape(sops.take(sums, ids), shape)
