"""PtqQuantizer parity: twin torch / Keras models with the same weights, calibrated on the same batches
(NCHW for torch, NHWC for Keras), freeze bit-identical scales and zero points (weights per channel, inputs
and outputs per tensor) for every activation observer.

The weights and inputs are multiples of 1/4 with small magnitudes, so every conv / linear output is
exact in float32 whatever the summation order of each backend: the observers then see the same values
(as a set; the Flatten order differs, which min/max, percentile and MSE do not see) and the core
observers, bit-identical across backends, must give the same qparams."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import torch
from torch import nn

import compressor.tf as ctf
import compressor.torch as cth

pytestmark = [pytest.mark.torch, pytest.mark.tf]

H = W = 5
C_IN, C, N_OUT = 3, 8, 4
TYPES = ["input", "weight", "output"]


def quarters(rng, *shape, scale=2.0):
    return (np.round(rng.standard_normal(shape) * scale * 4) / 4).astype(np.float32)


def twins(seed=0):
    """torch Conv2d(3->8, k3) + ReLU + Flatten + Linear and the Keras twin with the same weights."""
    rng = np.random.default_rng(seed)
    tm = nn.Sequential(nn.Conv2d(C_IN, C, 3), nn.ReLU(), nn.Flatten(), nn.Linear(C * 3 * 3, N_OUT)).eval()
    inp = keras.Input((H, W, C_IN))
    x = keras.layers.Conv2D(C, 3, name="conv")(inp)
    x = keras.layers.Flatten()(keras.layers.ReLU()(x))
    km = keras.Model(inp, keras.layers.Dense(N_OUT, name="fc")(x))
    wc, bc = quarters(rng, C, C_IN, 3, 3, scale=0.5), quarters(rng, C)
    wf, bf = quarters(rng, N_OUT, C * 3 * 3, scale=0.5), quarters(rng, N_OUT)
    with torch.no_grad():
        tm[0].weight.copy_(torch.from_numpy(wc))
        tm[0].bias.copy_(torch.from_numpy(bc))
        tm[3].weight.copy_(torch.from_numpy(wf))
        tm[3].bias.copy_(torch.from_numpy(bf))
    km.get_layer("conv").set_weights([wc.transpose(2, 3, 1, 0), bc])
    # torch flattens (c, h, w), Keras (h, w, c): the Dense kernel row (h, w, c) is torch's column (c, h, w)
    km.get_layer("fc").set_weights([wf.reshape(N_OUT, C, 3, 3).transpose(2, 3, 1, 0).reshape(-1, N_OUT), bf])
    batches = [quarters(rng, 16, C_IN, H, W) for _ in range(3)]
    return tm, km, batches


def test_twins_compute_the_same_float_function_exactly():
    tm, km, batches = twins()
    for x in batches:
        with torch.no_grad():
            want = tm(torch.from_numpy(x)).numpy()
        np.testing.assert_array_equal(np.asarray(km(x.transpose(0, 2, 3, 1), training=False)), want)


def qparams_torch(q):
    out = {}
    for w in q.get_modules_wrapper():
        name = {"0": "conv", "3": "fc"}[w.name]
        for t in TYPES:
            out[(name, t)] = (w._buffers[f"{t}_scale"].numpy().reshape(-1),
                              w._buffers[f"{t}_zero_point"].numpy().reshape(-1))
    return out


def qparams_tf(q):
    out = {}
    for w in q.get_modules_wrapper():
        for t in TYPES:
            out[(w.name, t)] = (np.asarray(getattr(w, f"{t}_scale")).reshape(-1),
                                np.asarray(getattr(w, f"{t}_zero_point")).reshape(-1))
    return out


@pytest.mark.parametrize("observer", ["minmax", "moving_average_minmax", "percentile", "mse"])
def test_same_frozen_scales_and_zero_points(observer):
    tm, km, batches = twins()
    tq = cth.PtqQuantizer(tm, [{"op_types": ["Conv2d", "Linear"], "quant_types": TYPES, "quant_bits": 8}],
                          observer=observer, bn_fold=False)
    tq.calibrate([torch.from_numpy(x) for x in batches])
    kq = ctf.PtqQuantizer(km, [{"op_types": ["Conv2D", "Dense"], "quant_types": TYPES, "quant_bits": 8}],
                          observer=observer, bn_fold=False)
    kq.calibrate([x.transpose(0, 2, 3, 1) for x in batches])
    pt, pk = qparams_torch(tq), qparams_tf(kq)
    assert sorted(pt) == sorted(pk) == sorted((n, t) for n in ("conv", "fc") for t in TYPES)
    for key in pt:
        (st, zt), (sk, zk) = pt[key], pk[key]
        assert st.dtype == sk.dtype == np.float32, key
        np.testing.assert_array_equal(st, sk, err_msg=f"{observer} {key} scale")
        np.testing.assert_array_equal(zt.astype(np.int64), zk.astype(np.int64), err_msg=f"{observer} {key} zero point")
    # per output channel weight scales, per tensor activations
    assert pt[("conv", "weight")][0].shape == (C,) and pt[("fc", "weight")][0].shape == (N_OUT,)
    for name in ("conv", "fc"):
        for t in ("input", "output"):
            assert pt[(name, t)][0].size == 1
    # the conv feeds only a ReLU: fused on both backends, its output range starts at 0 (zero point 0)
    assert [w.fused_relu for w in tq.get_modules_wrapper()] == [True, False]
    assert [bool(w.fused_relu) for w in kq.get_modules_wrapper()] == [True, False]
    assert pt[("conv", "output")][1].tolist() == [0.0]
    # fc's input is conv's output through ReLU + Flatten: one grid, shared on both backends
    assert tq.shared_inputs() == {"3": "0"} and kq.shared_inputs() == {"fc": "conv"}
    for i in (0, 1):
        np.testing.assert_array_equal(pt[("fc", "input")][i], pt[("conv", "output")][i])
    # the expected weight scales: max |w| per output channel / 127 (symmetric int8 [-127, 127])
    for name, layer, n in (("conv", tm[0], C), ("fc", tm[3], N_OUT)):
        w = layer.module.weight.detach().numpy().reshape(n, -1)
        np.testing.assert_array_equal(pt[(name, "weight")][0], np.abs(w).max(1) / np.float32(127), err_msg=name)
    # the frozen fake-quant forward agrees too (same grid on both sides)
    x = batches[0]
    with torch.no_grad():
        yt = tm(torch.from_numpy(x)).numpy()
    yk = np.asarray(km(x.transpose(0, 2, 3, 1), training=False))
    np.testing.assert_allclose(yk, yt, rtol=0, atol=1e-5 * np.abs(yt).max())
