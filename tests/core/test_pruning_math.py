import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from compressor.core import pruning as P
from compressor.core.ops import NumpyOps

ops = NumpyOps()


def pruned(mask):
    return sorted(map(int, np.flatnonzero(~np.asarray(mask))))


def test_level_exact_count_with_ties_lowest_index_first():
    # eight equal values at sparsity 0.3125 of 16: exactly 5 pruned, the first five of the tie
    w = np.array([1, 1, 1, 1, 1, 1, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9], dtype=np.float32).reshape(4, 4)
    mask = P.level_mask(ops, w, 0.3125)
    assert mask.dtype == np.bool_ and mask.shape == (4, 4)
    assert pruned(mask) == [0, 1, 2, 3, 4]


def test_level_uses_magnitude():
    w = np.array([-5.0, 0.1, -0.2, 3.0, -0.05, 1.0], dtype=np.float32)
    assert pruned(P.level_mask(ops, w, 0.5)) == [1, 2, 4]


def test_prune_count_uses_the_decimal_the_user_wrote():
    assert 100 * 0.29 < 29  # binary float
    assert P.prune_count(100, 0.29) == 29
    assert P.prune_count(16, 0.3125) == 5
    assert P.prune_count(10, 0.0) == 0
    assert P.prune_count(7, 0.99) == 6
    with pytest.raises(ValueError):
        P.prune_count(10, 1.0)


def test_level_monotone_given_previous_mask():
    # weights that were pruned earlier (and have since grown) are pruned first
    w = np.array([9.0, 0.0, 0.0, 1.0, 2.0, 3.0], dtype=np.float32)
    prev = np.array([False, True, True, True, True, True])
    assert pruned(P.level_mask(ops, w, 0.5, prev)) == [0, 1, 2]
    assert pruned(P.level_mask(ops, w, 0.5)) == [1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 64), elements=st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0])),
       st.floats(0, 0.99))
def test_level_properties(w, s):
    k = P.prune_count(w.size, s)
    mask = P.level_mask(ops, w, s)
    assert (~mask).sum() == k  # exact count even with heavy ties
    assert np.array_equal(mask, P.level_mask(ops, w, s))  # deterministic
    kept, gone = np.abs(w)[mask], np.abs(w)[~mask]
    if kept.size and gone.size:
        assert gone.max() <= kept.min()
    # ties at the threshold: pruned ones come before kept ones in flat order
    if gone.size:
        t = gone.max()
        idx_gone = np.flatnonzero((~mask) & (np.abs(w) == t))
        idx_kept = np.flatnonzero(mask & (np.abs(w) == t))
        if idx_kept.size:
            assert idx_gone.max() < idx_kept.min()


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, st.integers(2, 50), elements=st.floats(-10, 10, width=32)),
       st.floats(0, 0.9), st.floats(0, 0.9))
def test_level_monotone_property(w, s1, s2):
    lo, hi = sorted([s1, s2])
    m1 = P.level_mask(ops, w, lo)
    w2 = w * m1 + (~m1) * 100.0  # pruned weights move (momentum) before the next mask
    m2 = P.level_mask(ops, w2, hi, m1)
    assert not np.any(m2 & ~m1)  # nothing pruned comes back
    assert (~m2).sum() == P.prune_count(w.size, hi)


def test_sensitivity_rule_q_times_std():
    w = np.array([0.0, 1.0, -1.0, 2.0, -2.0, 0.1, -0.1, 4.0], dtype=np.float64)
    std = w.std()
    mask = P.sensitivity_mask(ops, w, 0.5)
    assert np.array_equal(mask, ~(np.abs(w) < 0.5 * std))
    # second pass uses the std of the weights still kept: prunes further, never revives
    mask2 = P.sensitivity_mask(ops, w, 0.5, mask)
    kept = w[mask]
    assert np.array_equal(mask2, mask & ~(np.abs(w) < 0.5 * kept.std()))


def conv_filters(values, shape=(3, 3, 3)):
    return np.stack([np.full(shape, v, dtype=np.float32) for v in values])


def test_fpgm_prunes_the_middle_filters():
    w = conv_filters(range(1, 11))  # filter i = ones * (i + 1)
    wm, fm = P.filter_prune_masks(ops, w, 0.2, "fpgm")
    assert pruned(fm) == [4, 5]
    assert wm.shape == w.shape and not wm[4].any() and not wm[5].any() and wm[[0, 1, 2, 3, 6, 7, 8, 9]].all()


def test_fpgm_scores_are_sum_of_distances():
    w = np.random.default_rng(0).normal(size=(6, 2, 3, 3))
    flat = w.reshape(6, -1)
    expect = np.array([sum(np.linalg.norm(flat[f] - flat[g]) for g in range(6)) for f in range(6)])
    np.testing.assert_allclose(P.fpgm_filter_scores(ops, w), expect, rtol=1e-7)


def test_l1_keeps_the_largest_filters():
    w = conv_filters(range(10))
    _, fm = P.filter_prune_masks(ops, w, 0.6, "l1")
    assert pruned(fm) == [0, 1, 2, 3, 4, 5]
    np.testing.assert_array_equal(P.l1_filter_scores(ops, w), np.arange(10) * 27)
    np.testing.assert_allclose(P.l2_filter_scores(ops, w), np.arange(10) * np.sqrt(27), rtol=1e-6)


def test_filter_mask_needs_two_filters_and_is_monotone():
    assert pruned(P.filter_mask(ops, np.array([1.0]), 0.9)) == []
    scores = np.array([5.0, 1.0, 3.0, 2.0])
    first = P.filter_mask(ops, scores, 0.25)
    assert pruned(first) == [1]
    again = P.filter_mask(ops, np.array([5.0, 9.0, 3.0, 2.0]), 0.5, first)
    assert pruned(again) == [1, 3]
    with pytest.raises(ValueError, match="allowed"):
        P.filter_scores(ops, scores, "l3")


def test_slim_global_threshold_over_layers():
    g1 = np.arange(5, dtype=np.float32)
    g2 = -np.arange(5, dtype=np.float32)
    m1, m2 = P.slim_masks(ops, [g1, g2], 0.2)
    assert pruned(m1) == [0] and pruned(m2) == [0]
    m1, m2 = P.slim_masks(ops, [np.array([5.0, 6.0, 7.0]), np.array([0.1, 9.0, 0.2, 8.0])], 0.4)
    assert pruned(m1) == [] and pruned(m2) == [0, 2]  # floor(7 * 0.4) = 2, both in layer 2


def test_activation_stats_and_importances():
    out = np.array([[[[1.0, -1.0]], [[0.0, 2.0]]], [[[-3.0, 4.0]], [[5.0, 7.0]]]])  # N=2, C=2, H=1, W=2
    zeros, total, count = P.activation_stats(ops, out, channel_axis=1)
    np.testing.assert_array_equal(zeros, [2, 1])
    np.testing.assert_array_equal(total, [5, 14])
    np.testing.assert_array_equal(count, [4, 4])
    np.testing.assert_allclose(P.apoz_importance(ops, zeros, count), [0.5, 0.75])
    np.testing.assert_allclose(P.mean_activation_importance(ops, total, count), [1.25, 3.5])
    _, total6, _ = P.activation_stats(ops, out, channel_axis=1, kind="relu6")
    np.testing.assert_array_equal(total6, [5, 13])
    # channels-last (Keras) gives the same numbers
    z2, t2, c2 = P.activation_stats(ops, np.moveaxis(out, 1, -1), channel_axis=-1)
    np.testing.assert_array_equal(z2, zeros) and np.testing.assert_array_equal(t2, total)
    with pytest.raises(ValueError, match="relu6"):
        P.activation(ops, out, "gelu")


def test_taylor_contribution():
    w = np.array([[1.0, 2.0], [3.0, -1.0]])
    g = np.array([[0.5, 0.5], [1.0, 2.0]])
    np.testing.assert_allclose(P.taylor_fo_contribution(ops, w, g), [0.25 + 1.0, 9.0 + 4.0])


def test_sparsity_of():
    assert float(P.sparsity_of(ops, np.array([True, False, False, True]))) == 0.5
