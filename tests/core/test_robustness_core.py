"""Core pieces of issue 16: atomic artifact writes, slimming that never disconnects a layer, the seeds' clock."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compressor.core.atomic import atomic_path, atomic_paths
from compressor.core.clock import user_override
from compressor.core.errors import ConfigError
from compressor.core.ops import NumpyOps
from compressor.core.pruning import slim_masks
from compressor.core.slimming import check_max_layer_sparsity, global_keep, slim_plan, tie_warning

ops = NumpyOps()


def pruned(mask):
    return sorted(map(int, np.flatnonzero(~np.asarray(mask))))


# ---------------------------------------------------------------- atomic writes
def test_atomic_paths_commit_all_on_success(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "sub" / "b.weights.h5"
    a.write_bytes(b"old")
    with atomic_paths(a, None, b) as (ta, tn, tb):
        assert tn is None
        assert os.path.dirname(ta) == str(tmp_path) and ta.endswith("-a.bin")
        assert tb.endswith("-b.weights.h5")  # the whole file name survives: writers checking the suffix accept it
        with open(ta, "wb") as f:
            f.write(b"new")
        with open(tb, "wb") as f:
            f.write(b"B")
        assert a.read_bytes() == b"old"  # nothing moves before the block ends
    assert a.read_bytes() == b"new" and b.read_bytes() == b"B"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "sub"]


def test_atomic_paths_failure_leaves_nothing_and_keeps_old_files(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "new" / "deep" / "b.bin"
    a.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="conversion failed"), atomic_paths(a, b) as (ta, tb):
        with open(ta, "wb") as f:
            f.write(b"partial")
        with open(tb, "wb"):
            pass  # a 0-byte file, as a converter that fails after open() leaves
        raise RuntimeError("conversion failed")
    assert a.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]  # temp files and created folders gone


def test_atomic_path_swaps_a_directory(tmp_path):
    target = tmp_path / "saved"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_path(target) as tmp:
        os.mkdir(tmp)
        with open(os.path.join(tmp, "new.txt"), "w") as f:
            f.write("new")
    assert sorted(os.listdir(target)) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
    with pytest.raises(ValueError), atomic_path(target) as tmp:
        os.mkdir(tmp)
        raise ValueError("boom")
    assert sorted(os.listdir(target)) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


def test_atomic_path_nothing_written_leaves_target_alone(tmp_path):
    a = tmp_path / "a.bin"
    a.write_bytes(b"old")
    with atomic_path(a):
        pass
    assert a.read_bytes() == b"old"


# ---------------------------------------------------------------- slimming
def test_equal_gammas_spread_evenly_and_every_layer_keeps_a_channel():
    gammas = [np.ones(n, np.float32) for n in (4, 8, 16)]
    # floor(28 * 0.5) = 14 of the 25 unprotected (3 + 7 + 15) tied channels: keys (2j-1)/2t <= 1/2 in each layer
    masks, info = slim_plan(ops, gammas, 0.5)
    assert [pruned(m) for m in masks] == [[1, 2], [1, 2, 3, 4], list(range(1, 9))]
    assert (info["requested"], info["pruned"], int(info["tied"]), int(info["tied_pruned"])) == (14, 14, 25, 14)
    with pytest.warns(RuntimeWarning, match="25 channel scores tie at the global threshold and 14"):
        tie_warning(info)


def test_layer_order_no_longer_decides_ties():
    # the old rule (flat index) pruned all of layer 1 and 2 here and kept only layer 3
    masks = slim_masks(ops, [np.ones(2, np.float32), np.ones(2, np.float32), np.ones(4, np.float32)], 0.5)
    assert [int(m.sum()) for m in masks] == [1, 1, 2]


def test_cap_keeps_the_largest_channel_of_a_weak_layer():
    g1 = np.array([0.1, 0.4, 0.2, 0.3], np.float32)
    g2 = np.array([5.0, 1.0, 6.0, 2.0, 7.0, 3.0, 8.0, 4.0], np.float32)
    masks, info = slim_plan(ops, [g1, g2], 0.5)  # floor(12 * 0.5) = 6
    assert pruned(masks[0]) == [0, 2, 3]  # 0.4 stays: the layer keeps one channel
    assert pruned(masks[1]) == [1, 3, 5]  # the 3 smallest of the other layer
    assert int(info["tied_pruned"]) == 1 and int(info["tied"]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tie_warning(info) is None  # no tie split, nothing capped


def test_max_layer_sparsity_caps_each_layer_and_warns():
    gammas = [np.ones(n, np.float32) for n in (4, 8, 16)]
    masks, info = slim_plan(ops, gammas, 0.5, max_layer_sparsity=0.25)
    assert [int(m.sum()) for m in masks] == [3, 6, 12]
    assert (info["requested"], info["pruned"]) == (14, 7)
    with pytest.warns(RuntimeWarning, match="pruned 7 channels instead of 14"):
        tie_warning(info)
    assert check_max_layer_sparsity(None) is None and check_max_layer_sparsity(0.5) == 0.5
    for bad in (1.0, -0.1, "0.5", True):
        with pytest.raises(ConfigError, match=r"max_layer_sparsity must be None or a number in \[0, 1\)"):
            check_max_layer_sparsity(bad)


def test_already_pruned_channels_go_first():
    g = [np.array([3.0, 2.0, 1.0, 4.0], np.float32), np.array([1.0, 1.0], np.float32)]
    old = [np.array([True, False, True, True]), np.array([True, True])]
    masks = slim_masks(ops, g, 0.5, old)  # 3 of 6: the already pruned one, then the two smallest (ties spread)
    assert pruned(masks[0]) == [1, 2] and pruned(masks[1]) == [1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=5), st.floats(0.0, 0.95), st.integers(0, 3), st.data())
def test_global_keep_properties(sizes, sparsity, levels, data):
    scores = [np.asarray(data.draw(st.lists(st.integers(0, levels), min_size=n, max_size=n)), np.float32)
              for n in sizes]
    masks, info = slim_plan(ops, scores, sparsity)
    n = sum(sizes)
    k = int(info["requested"])
    assert info["pruned"] == min(k, n - len(sizes))
    assert sum(int((~m).sum()) for m in masks) == info["pruned"]
    assert all(m.sum() >= 1 for m in masks)  # never a disconnected layer
    flat_s, flat_m = np.concatenate(scores), np.concatenate(masks)
    if info["pruned"]:  # one global threshold: a kept score below it is its layer's one protected maximum
        v = flat_s[~flat_m].max()
        for s, m in zip(scores, masks):
            below = s[m & (s < v)]
            assert len(below) <= 1 and (len(below) == 0 or below[0] == s.max())
    assert [m.tolist() for m in masks] == [m.tolist() for m in global_keep(ops, scores, k, [1] * len(sizes))[0]]


# ---------------------------------------------------------------- the clock
class _Base:
    def calc_mask(self):
        return None


def test_user_override_sees_classes_outside_the_package():
    class Mine(_Base):
        def calc_mask(self):
            return 1

    class Inherits(Mine):
        pass

    assert user_override(Mine(), "calc_mask") and user_override(Inherits(), "calc_mask")
    assert user_override(_Base(), "calc_mask")  # a test module is outside the package too
    assert not user_override(NumpyOps(), "kth_smallest")  # defined in compressor.core
    assert not user_override(NumpyOps(), "no_such_method")
