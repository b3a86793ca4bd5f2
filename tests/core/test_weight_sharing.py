"""Weight sharing math (core, numpy): k-means with linear initialisation, sharing, summed gradients."""

import numpy as np
import pytest

from compressor.core.ops import NumpyOps
from compressor.core.weight_sharing import (
    cluster_gradient,
    kmeans_1d,
    linear_centroids,
    share_weights,
    tie_weights,
)


class NumpySharingOps:
    @staticmethod
    def segment_sum(data, ids, n):
        return np.bincount(ids, weights=data, minlength=n).astype(data.dtype)

    @staticmethod
    def take(params, idx):
        return params[idx]


def test_linear_initialisation_spans_min_to_max():
    np.testing.assert_allclose(linear_centroids(np.array([3.0, -1.0, 0.5]), 5), [-1.0, 0.0, 1.0, 2.0, 3.0])


def test_kmeans_exact_small_case():
    # linear init [0.1, 5.0]: boundary 2.55 -> {0.1, 0.2, 0.9, 1.0} and {5.0}; means 0.55 and 5.0; stable
    c, a = kmeans_1d(np.array([1.0, 0.1, 5.0, 0.9, 0.2]), 2)
    np.testing.assert_allclose(c, [0.55, 5.0])
    assert a.tolist() == [0, 0, 1, 0, 0]


def test_kmeans_is_order_independent_and_drops_empty_clusters():
    rng = np.random.default_rng(0)
    v = rng.normal(size=500)
    c1, a1 = kmeans_1d(v, 16)
    perm = rng.permutation(v.size)
    c2, a2 = kmeans_1d(v[perm], 16)
    np.testing.assert_array_equal(c1, c2)  # bit for bit: the same codebook on both backends
    np.testing.assert_array_equal(a1[perm], a2)
    c, a = kmeans_1d(np.array([0.0, 0.0, 10.0]), 4)  # fewer distinct values than clusters
    assert c.tolist() == [0.0, 10.0] and a.tolist() == [0, 0, 1]
    # an empty middle cluster disappears: two tight groups far apart with 3 linear centroids
    c, a = kmeans_1d(np.array([0.0, 0.01, 0.02, 9.98, 9.99, 10.0]), 3, iterations=50)
    assert c.size == 2 and sorted(set(a.tolist())) == [0, 1]


def test_share_weights_keeps_zeros_and_uses_at_most_2_pow_bits_values():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(40, 30)).astype(np.float32)
    w[rng.random(w.shape) < 0.7] = 0
    shared, assignment, centroids = share_weights(w, 3)
    assert shared.dtype == np.float32 and shared.shape == w.shape
    assert ((shared == 0) == (w == 0)).all()
    assert centroids.size <= 8 and set(np.unique(shared[shared != 0])) <= set(centroids.tolist())
    assert (assignment[w == 0] == centroids.size).all()
    np.testing.assert_array_equal(shared[w != 0], centroids[assignment[w != 0]])
    with pytest.raises(ValueError, match="1..16"):
        share_weights(w, 17)


def test_a_centroid_never_rounds_to_zero():
    w = np.array([-1e-30, 1e-30, 2.0, 2.0], np.float32)  # the lower cluster's mean is exactly 0
    shared, _, centroids = share_weights(w, 1)
    assert (shared != 0).all() and (centroids != 0).all()


def test_cluster_gradient_is_the_sum_over_members_and_zero_when_pruned():
    grad = np.array([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    assignment = np.array([[0, 1, 2], [0, 1, 0]])  # k = 2: index 2 marks a pruned weight
    g = cluster_gradient(NumpyOps(), NumpySharingOps(), grad, assignment, 2)
    np.testing.assert_array_equal(g, [[41.0, 18.0, 0.0], [41.0, 18.0, 41.0]])


def test_tie_weights_restores_exact_centroids():
    w = np.array([1.0, 1.0, 0.0, 3.0, 5.0], np.float32)
    a = np.array([0, 0, 2, 1, 1])
    tied, c = tie_weights(w, a, 2)
    np.testing.assert_array_equal(tied, [1.0, 1.0, 0.0, 4.0, 4.0])
    np.testing.assert_array_equal(c, [1.0, 4.0])
