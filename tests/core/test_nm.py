"""N:M semi-structured sparsity: core math on numpy (exact masks and properties)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from compressor.core import pruning as P
from compressor.core.ops import NumpyOps

ops = NumpyOps()


def groups(x, m):
    """[out, in, k...] -> [groups, m] along the input axis (the test's own reference grouping)."""
    x = np.asarray(x)
    moved = np.moveaxis(x, 1, -1)
    return moved.reshape(-1, m)


def test_parse_sparse_pattern():
    assert P.parse_sparse_pattern("2:4") == (2, 4)
    assert P.parse_sparse_pattern(" 1:8 ") == (1, 8)
    for bad in ("4:4", "0:4", "5:4", "2-4", "2:4:8", "a:b", 2, "2:"):
        with pytest.raises(ValueError):
            P.parse_sparse_pattern(bad)
    assert P.nm_sparsity(2, 4) == 0.5


def test_two_of_four_linear_exact_with_ties():
    w = np.array([[1.0, -4.0, 3.0, 2.0, 0.5, 0.5, 0.5, 0.5]], np.float32)
    mask = P.nm_mask(ops, w, 2, 4)
    # group 1 keeps -4 and 3; group 2 is one tie: the lower indices are pruned first
    assert mask.tolist() == [[False, True, True, False, False, False, True, True]]


def test_conv_groups_run_along_input_channels():
    # [out=1, in=4, kh=1, kw=2]: for each kernel position, the 4 input channels form one group
    w = np.zeros((1, 4, 1, 2), np.float32)
    w[0, :, 0, 0] = [4.0, 3.0, 2.0, 1.0]
    w[0, :, 0, 1] = [1.0, 2.0, 3.0, 4.0]
    mask = P.nm_mask(ops, w, 2, 4)
    assert mask[0, :, 0, 0].tolist() == [True, True, False, False]
    assert mask[0, :, 0, 1].tolist() == [False, False, True, True]


def test_input_dim_must_be_multiple_of_m():
    with pytest.raises(ValueError, match="multiple of M=4"):
        P.nm_mask(ops, np.ones((3, 6), np.float32), 2, 4)
    with pytest.raises(ValueError):
        P.nm_mask(ops, np.ones(8, np.float32), 2, 4)


def test_monotone_given_old_mask():
    w = np.array([[9.0, 1.0, 2.0, 3.0]], np.float32)
    old = np.array([[False, True, True, True]])
    # 9 was pruned before (and has grown since): it goes first, then the smallest of the rest
    assert P.nm_mask(ops, w, 2, 4, mask=old).tolist() == [[False, False, True, True]]
    assert P.nm_mask(ops, w, 2, 4).tolist() == [[True, False, False, True]]


def test_ramp_prunes_exact_count_within_the_final_pattern():
    w = np.array([[8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]], np.float32)
    # the final 2:4 pattern prunes 6, 5 (group 1) and 2, 1 (group 2); at 25 % the two smallest of those
    assert P.nm_mask(ops, w, 2, 4, sparsity=0.25).tolist() == [[True, True, True, True, True, True, False, False]]
    # 37.5 %: three, never more than two in one group (4 and 3 are smaller than 5 but are kept at the end)
    assert P.nm_mask(ops, w, 2, 4, sparsity=0.375).tolist() == [[True, True, True, False, True, True, False, False]]
    assert P.nm_mask(ops, w, 2, 4, sparsity=0.5).tolist() == P.nm_mask(ops, w, 2, 4).tolist()
    with pytest.raises(ValueError, match="exceeds"):
        P.nm_mask(ops, w, 2, 4, sparsity=0.6)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(1, 2), (2, 4), (1, 4), (3, 4), (2, 8), (4, 8)]), st.integers(1, 4), st.integers(1, 3),
       st.integers(1, 3), st.data())
def test_nm_properties(nm, out, in_groups, kernel, data):
    n, m = nm
    shape = (out, in_groups * m, kernel, kernel)
    w = data.draw(hnp.arrays(np.float32, shape, elements=st.sampled_from([-3.0, -1.0, 0.0, 0.5, 1.0, 2.0])))
    mask = P.nm_mask(ops, w, n, m)
    g, gm = groups(np.abs(w), m), groups(mask, m)
    assert mask.shape == w.shape and mask.dtype == np.bool_
    assert ((~gm).sum(axis=1) == m - n).all()  # every group has exactly M - N zeros
    for row, keep in zip(g, gm):
        assert row[~keep].max() <= row[keep].min()  # the N largest |w| are kept
        # ties at the threshold: pruned ones come before kept ones within the group
        t = row[keep].min()
        tied = np.flatnonzero(row == t)
        pruned_tied = [i for i in tied if not keep[i]]
        kept_tied = [i for i in tied if keep[i]]
        if pruned_tied and kept_tied:
            assert max(pruned_tied) < min(kept_tied)
    assert bool(P.is_nm(ops, mask, n, m))
    # monotone: from a random old mask with at most M - N zeros per group, nothing pruned comes back
    old = P.nm_mask(ops, data.draw(hnp.arrays(np.float32, shape, elements=st.floats(-1, 1, width=32))), n, m)
    new = P.nm_mask(ops, w, n, m, mask=old)
    assert not (new & ~old).any()
    assert ((~groups(new, m)).sum(axis=1) == m - n).all()
    # the ramp: exact count, inside the final pattern, monotone along the schedule
    prev = None
    for s in (0.0, P.nm_sparsity(n, m) / 3, P.nm_sparsity(n, m) * 2 / 3, P.nm_sparsity(n, m)):
        cur = P.nm_mask(ops, w, n, m, sparsity=s, mask=prev)
        if s < P.nm_sparsity(n, m):
            assert (~cur).sum() == P.prune_count(w.size, s)
        if prev is not None:
            assert not (cur & ~prev).any()
        prev = cur
    assert ((~groups(prev, m)).sum(axis=1) == m - n).all()


def test_ramp_without_history_is_inside_the_final_pattern():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 16)).astype(np.float32)
    final = P.nm_mask(ops, w, 2, 4)
    for s in (0.1, 0.25, 0.4):
        cur = P.nm_mask(ops, w, 2, 4, sparsity=s)
        assert (~cur).sum() == P.prune_count(w.size, s)
        assert not (~cur & final).any()  # everything pruned now is pruned by the final pattern
