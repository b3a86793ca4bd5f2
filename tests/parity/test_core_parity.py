"""The same core function gives the same result on numpy, torch and tf (and inside tf.function)."""

import numpy as np
import pytest
import tensorflow as tf
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from compressor.core import pruning as P
from compressor.core import quant as Q
from compressor.core.ops import NumpyOps
from compressor.tf.ops import ops as TF
from compressor.torch.ops import ops as TO

NP = NumpyOps()


def on_all(fn, *arrays, graph=True):
    """Run fn(ops, *arrays) on numpy, torch, tf eager and tf.function; return numpy results."""
    res = [np.asarray(fn(NP, *arrays))]
    res.append(np.asarray(fn(TO, *[torch.from_numpy(np.array(a)) for a in arrays])))
    res.append(np.asarray(fn(TF, *[tf.constant(a) for a in arrays])))
    if graph:
        g = tf.function(lambda *xs: fn(TF, *xs))
        res.append(np.asarray(g(*[tf.constant(a) for a in arrays])))
    return res


def same(results):
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 200), elements=st.sampled_from([-3.0, -1.0, 0.0, 0.25, 1.0, 2.0, 7.0])
                  | st.floats(-5, 5, width=32)), st.integers(1, 200))
def test_kth_smallest(x, k):
    k = min(k, x.size)
    same(on_all(lambda ops, a: ops.kth_smallest(a, k), x))


def test_kth_smallest_float64_and_extremes():
    x = np.array([np.finfo(np.float64).max, -np.finfo(np.float64).max, 0.0, -0.0, 1e-300, -1e-300])
    for k in range(1, 7):
        same(on_all(lambda ops, a, k=k: ops.kth_smallest(a, k), x))


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(2, 8), st.integers(1, 6)),
                  elements=st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0])), st.floats(0, 0.95))
def test_level_mask(w, s):
    same(on_all(lambda ops, a: P.level_mask(ops, a, s), w))


@pytest.mark.parametrize("criterion", ["l1", "l2", "fpgm"])
def test_filter_masks(criterion):
    w = np.random.default_rng(1).normal(size=(12, 3, 3, 3)).astype(np.float32)
    w[3] = w[5]  # a tie
    same(on_all(lambda ops, a: P.filter_prune_masks(ops, a, 0.5, criterion)[0], w))


def test_slim_and_sensitivity():
    g1 = np.array([0.5, -0.1, 0.3, 0.0], np.float32)
    g2 = np.array([0.2, -0.3, 0.05], np.float32)
    same(on_all(lambda ops, a, b: ops.concat(P.slim_masks(ops, [a, b], 0.5), 0), g1, g2))
    w = np.random.default_rng(2).normal(size=(4, 5)).astype(np.float32)
    same(on_all(lambda ops, a: P.sensitivity_mask(ops, a, 0.7), w))


def test_qparams_and_fake_quant():
    w = np.random.default_rng(3).normal(size=(4, 2, 3, 3)).astype(np.float32)
    for dtype in ("int", "uint"):
        for symmetric in (False, True):
            qmin, qmax = Q.quant_range(8, dtype)

            def fq(ops, a, qmin=qmin, qmax=qmax, symmetric=symmetric):
                lo, hi = Q.minmax(ops, a, 0)
                s, z = Q.qparams(ops, lo, hi, qmin, qmax, symmetric)
                return ops.concat([ops.reshape(s, (-1,)), ops.reshape(z, (-1,))], 0)

            same(on_all(fq, w))  # scales and zero points: bit-identical

            def fq_values(ops, a, qmin=qmin, qmax=qmax, symmetric=symmetric):
                lo, hi = Q.minmax(ops, a, 0)
                s, z = Q.qparams(ops, lo, hi, qmin, qmax, symmetric)
                return Q.fake_quantize(ops, a, Q.channel_view(ops, s, 4, 0), Q.channel_view(ops, z, 4, 0), qmin, qmax)

            res = on_all(fq_values, w)  # values: x / scale may round differently by 1 ulp
            for r in res[1:]:
                np.testing.assert_allclose(r, res[0], rtol=0, atol=1e-6)


def test_activation_stats_channels_last():
    out = np.random.default_rng(4).normal(size=(3, 4, 4, 5)).astype(np.float32)
    res = on_all(lambda ops, a: ops.stack(list(P.activation_stats(ops, a, -1)), 0), out)
    for r in res[1:]:  # zero counts and element counts exact; float sums up to summation order
        np.testing.assert_array_equal(r[[0, 2]], res[0][[0, 2]])
        np.testing.assert_allclose(r[1], res[0][1], rtol=1e-6)


def test_dorefa_and_binarize():
    w = np.random.default_rng(5).normal(size=(6, 7)).astype(np.float32)
    w[0, 0] = 0.0
    res = on_all(lambda ops, a: ops.concat([Q.dorefa_weight(ops, a, 3), Q.binarize(ops, a)], 0), w)
    for r in res[1:]:
        np.testing.assert_allclose(r, res[0], atol=1e-6)
