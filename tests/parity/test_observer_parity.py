"""PTQ observers give the same (rmin, rmax) and qparams, bit for bit, on numpy, torch and tf for the same
batches; the per-batch functions also inside tf.function. Observers keep their state on the device."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import torch

from compressor.core import observers as O
from compressor.core.ops import NumpyOps
from compressor.tf.ops import TfOps
from compressor.torch.ops import TorchOps

pytestmark = [pytest.mark.torch, pytest.mark.tf]

NP, TO, TF = NumpyOps(), TorchOps(), TfOps()
BACKENDS = [(NP, np.asarray), (TO, torch.from_numpy), (TF, tf.constant)]


def batches(seed, shape, n=3, dtype=np.float32):
    rng = np.random.default_rng(seed)
    out = [rng.normal(size=shape).astype(dtype) for _ in range(n)]
    out[1] = out[1] * 3 + 0.5  # batches with different ranges
    out[2] = rng.standard_t(2, size=shape).astype(dtype)  # heavy tails: clipping matters
    return out


def calibrate(method, target, data, **kwargs):
    """[(rmin, rmax, scale, zp)] as numpy, one tuple per backend."""
    res = []
    for ops, conv in BACKENDS:
        obs = O.make_observer(ops, method, target, **kwargs)
        for x in data:
            obs.observe(conv(np.array(x)))
        vals = obs.range() + obs.qparams()
        if ops is TO:
            assert all(torch.is_tensor(v) and not v.requires_grad for v in vals)
        if ops is TF:
            assert all(tf.is_tensor(v) for v in vals)
        res.append(tuple(np.asarray(v) for v in vals))
    return res


def same(results):
    for r in results[1:]:
        for u, v in zip(r, results[0], strict=True):
            assert u.dtype == v.dtype and u.shape == v.shape
            np.testing.assert_array_equal(u, v)


CASES = [
    ("minmax", {}),
    ("moving_average_minmax", {}),
    ("moving_average_minmax", {"decay": 0.9}),
    ("percentile", {}),
    ("percentile", {"percentile": 99.0}),
    ("percentile", {"percentile": 100}),
    ("mse", {"grid_size": 50}),
    ("mse", {"bits": 4, "grid_size": 32}),
]


@pytest.mark.parametrize("method, kwargs", CASES)
def test_weights_per_channel(method, kwargs):
    res = calibrate(method, "weight", batches(0, (6, 4, 3, 3)), **kwargs)
    assert res[0][0].shape == (6,)
    same(res)


@pytest.mark.parametrize("method, kwargs", CASES)
def test_activations_per_tensor(method, kwargs):
    res = calibrate(method, "activation", batches(1, (8, 5, 4, 4)), **kwargs)
    assert res[0][0].shape == ()
    same(res)
    if method in ("percentile", "mse") and kwargs.get("percentile") != 100:  # clips the heavy tails
        mm = calibrate("minmax", "activation", batches(1, (8, 5, 4, 4)))[0]
        assert res[0][1] < mm[1] and res[0][0] > mm[0]


@pytest.mark.parametrize("method", ["minmax", "percentile", "mse"])
@pytest.mark.parametrize("dtype, symmetric", [("int", False), ("uint", True), ("int", True)])
def test_other_schemes_and_channels_last(method, dtype, symmetric):
    kw = {"grid_size": 20} if method == "mse" else {}
    same(calibrate(method, "activation", batches(2, (4, 3, 3, 5)), dtype=dtype, symmetric=symmetric,
                   channel_axis=-1, **kw))


def test_float64_batches():
    for method in ("minmax", "percentile", "mse"):
        res = calibrate(method, "weight", batches(3, (5, 7), dtype=np.float64))
        assert res[0][0].dtype == np.float64
        same(res)


def test_merge_parity():
    data = batches(4, (3, 8), n=3)
    res = []
    for ops, conv in BACKENDS:
        a, b = O.MseObserver.for_weights(ops, grid_size=16), O.MseObserver.for_weights(ops, grid_size=16)
        a.observe(conv(data[0]))
        b.observe(conv(data[1]))
        b.observe(conv(data[2]))
        a.merge(b)
        res.append(tuple(np.asarray(v) for v in a.range() + a.qparams()))
    same(res)


def test_batch_functions_in_tf_function():
    x = batches(5, (6, 10))[2]
    fns = {
        "minmax": lambda ops, a: O.batch_minmax(ops, a, 0),
        "percentile": lambda ops, a: O.batch_percentile(ops, a, 95.0, 0),
        "percentile_tensor": lambda ops, a: O.batch_percentile(ops, a, 99.0),
        "mse": lambda ops, a: O.batch_mse_range(ops, a, -127, 127, True, 25, 0),
        "mse_tensor": lambda ops, a: O.batch_mse_range(ops, a, 0, 255, False, 25),
    }
    for name, fn in fns.items():
        want = [np.asarray(v) for v in fn(NP, x)]
        got = [np.asarray(v) for v in tf.function(lambda a, fn=fn: fn(TF, a))(tf.constant(x))]
        for u, v in zip(got, want, strict=True):
            np.testing.assert_array_equal(u, v, err_msg=name)


def test_torch_observer_detaches_and_keeps_dtype():
    w = torch.randn(4, 3, requires_grad=True)
    obs = O.MinMaxObserver.for_weights(TO)
    obs.observe(w * 2)
    rmin, rmax = obs.range()
    assert not rmin.requires_grad and rmin.dtype == torch.float32 and rmin.device == w.device
