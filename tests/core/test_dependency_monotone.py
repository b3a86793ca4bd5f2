"""Monotone group decisions (gradual pruning): classes a member has pruned already go first, in one group
and in the global (slimming) ranking; fixed classes stay; no ``kept`` means the plain decision."""

from __future__ import annotations

import numpy as np

from compressor.core.dependency import class_kept, dependency_keep, global_dependency_keep
from compressor.core.graph import ChannelGroup
from compressor.core.ops import NumpyOps

NP = NumpyOps()
# a conv (identity classes) and a depthwise conv whose channels are the classes in reverse order
G = ChannelGroup(members=[("a", "conv", [0, 1, 2, 3]), ("d", "depthwise", [3, 2, 1, 0])], n=4, fixed=[])


def test_already_pruned_classes_go_first():
    scores = {"a": np.array([1.0, 5.0, 2.0, 3.0], np.float32)}
    plain = dependency_keep(NP, G, scores, 0.5)
    np.testing.assert_array_equal(plain["a"], [False, True, False, True])
    np.testing.assert_array_equal(plain["d"], [True, False, True, False])
    # class 1 (the highest score) was pruned before, seen through the depthwise member's channel 2
    kept = {"d": np.array([True, True, False, True])}
    np.testing.assert_array_equal(class_kept(NP, G, kept), [True, False, True, True])
    out = dependency_keep(NP, G, scores, 0.5, kept=kept)
    np.testing.assert_array_equal(out["a"], [False, False, True, True])
    np.testing.assert_array_equal(out["d"], [True, True, False, False])
    # negative scores too: the pruned class is still the lowest
    neg = dependency_keep(NP, G, {"a": np.array([-1.0, 5.0, -7.0, 3.0], np.float32)}, 0.25, kept=kept)
    np.testing.assert_array_equal(neg["a"], [True, False, True, True])
    assert class_kept(NP, G, None) is None and class_kept(NP, G, {"other": np.ones(4, bool)}) is None


def test_fixed_classes_stay_and_global_ranking_is_monotone():
    fixed = ChannelGroup(members=[("b", "conv", [0, 1, 2])], n=3, fixed=[0])
    scores = {"a": np.array([1.0, 5.0, 2.0, 3.0], np.float32), "b": np.array([0.0, 4.0, 0.5], np.float32)}
    kept = {"a": np.array([True, True, True, False]), "b": np.array([False, True, True])}
    out = dependency_keep(NP, fixed, scores, 0.5, kept=kept)
    np.testing.assert_array_equal(out["b"], [True, True, False])  # fixed class 0 kept; 1 of 2 prunable
    # global: 3 of the 6 prunable classes; a's class 3 (score 3, pruned before) goes with the two lowest
    g = global_dependency_keep(NP, [G, fixed], scores, 0.5, kept=kept)
    np.testing.assert_array_equal(g["a"], [False, True, True, False])
    np.testing.assert_array_equal(g["b"], [True, True, False])
    plain = global_dependency_keep(NP, [G, fixed], scores, 0.5)
    np.testing.assert_array_equal(plain["a"], [False, True, False, True])
