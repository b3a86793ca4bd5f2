"""QAT on torch and on TF/Keras 3 given the same weights (kernels transposed to Keras layouts) and the same
config_list: identical scales and zero points (also against core on numpy), fake-quantized values within
float rounding, identical tracked activation ranges and calibration records."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch

from compressor.core import quant as Q
from compressor.core.ops import NumpyOps
from compressor.tf import QAT_Quantizer as TfQAT
from compressor.torch import QAT_Quantizer as TorchQAT

NP = NumpyOps()

# torch layout -> Keras layout
TO_KERAS = {"Linear": (1, 0), "Conv2d": (2, 3, 1, 0), "ConvTranspose2d": (2, 3, 1, 0), "Depthwise": None}
MULT = 2  # depthwise channel multiplier
SCHEMES = [("uint", "per_tensor_affine"), ("int", "per_tensor_symmetric"), ("int", "per_channel_symmetric"),
           ("uint", "per_channel_affine"), ("uint", "per_tensor_symmetric"), ("int", "per_channel_affine")]


def torch_model(kind, w):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if kind == "Linear":
                self.layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            elif kind == "Conv2d":
                self.layer = torch.nn.Conv2d(w.shape[1], w.shape[0], w.shape[2], bias=False)
            elif kind == "Depthwise":
                self.layer = torch.nn.Conv2d(w.shape[0] // MULT, w.shape[0], w.shape[2], groups=w.shape[0] // MULT,
                                             bias=False)
            else:
                self.layer = torch.nn.ConvTranspose2d(w.shape[0], w.shape[1], w.shape[2], bias=False)
            with torch.no_grad():
                self.layer.weight.copy_(torch.from_numpy(w))

        def forward(self, x):
            return self.layer(x)

    return Net()


def to_keras(kind, w):
    if kind == "Depthwise":  # torch [in*mult, 1, kh, kw] -> Keras [kh, kw, in, mult]
        return np.ascontiguousarray(w.reshape(-1, MULT, *w.shape[2:]).transpose(2, 3, 0, 1))
    return np.ascontiguousarray(w.transpose(TO_KERAS[kind]))


def from_keras(kind, k):
    if kind == "Depthwise":
        return k.transpose(2, 3, 0, 1).reshape(-1, 1, *k.shape[:2])
    return k.transpose(np.argsort(TO_KERAS[kind]))


def keras_model(kind, w):
    k = to_keras(kind, w)
    if kind == "Linear":
        layer, shape = keras.layers.Dense(w.shape[0], use_bias=False, name="layer"), (w.shape[1],)
    elif kind == "Conv2d":
        layer, shape = keras.layers.Conv2D(w.shape[0], w.shape[2], use_bias=False, name="layer"), (6, 6, w.shape[1])
    elif kind == "Depthwise":
        layer = keras.layers.DepthwiseConv2D(w.shape[2], depth_multiplier=MULT, use_bias=False, name="layer")
        shape = (6, 6, w.shape[0] // MULT)
    else:
        layer = keras.layers.Conv2DTranspose(w.shape[1], w.shape[2], use_bias=False, name="layer")
        shape = (6, 6, w.shape[0])
    model = keras.Sequential([keras.Input(shape), layer])
    layer.kernel.assign(k)
    return model


def weights(kind, seed):
    rng = np.random.default_rng(seed)
    shape = {"Linear": (5, 7), "Conv2d": (4, 3, 3, 3), "ConvTranspose2d": (3, 4, 3, 3), "Depthwise": (6, 1, 3, 3)}[kind]
    w = rng.normal(size=shape).astype(np.float32)
    return w * np.linspace(0.2, 3.0, w.shape[0], dtype=np.float32).reshape((-1,) + (1,) * (w.ndim - 1))


def config(types, dtype, scheme, bits=8):
    return [{"quant_types": types, "quant_bits": bits, "op_names": ["layer"], "quant_dtype": dtype,
             "quant_scheme": scheme}]


def to_nhwc(x):
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if x.ndim == 4 else x


@pytest.mark.parametrize("kind", list(TO_KERAS))
@pytest.mark.parametrize("dtype,scheme", SCHEMES)
@pytest.mark.parametrize("bits", [8, 4])
def test_weight_scale_and_zero_point_identical(kind, dtype, scheme, bits):
    w = weights(kind, bits)
    tm = torch_model(kind, w)
    tq = TorchQAT(tm, config(["weight"], dtype, scheme, bits))
    km = keras_model(kind, w)
    kq = TfQAT(km, config(["weight"], dtype, scheme, bits))
    tw, kw = tq.get_modules_wrapper()[0], kq.get_modules_wrapper()[0]
    t_out = tq.export_weight(tw)[0].numpy()
    k_out = kq.export_weight(kw).numpy()

    # core on numpy, canonical layout (output channels first; torch ConvTranspose: axis 1)
    per_channel, symmetric = Q.parse_scheme(scheme)
    axis = (1 if kind == "ConvTranspose2d" else 0) if per_channel else None
    qmin, qmax = Q.quant_range(bits, dtype)
    s_np, z_np = Q.qparams(NP, *Q.minmax(NP, w, axis), qmin, qmax, symmetric)
    for s, z in ((tw.weight_scale.numpy(), tw.weight_zero_point.numpy()),
                 (kw.weight_scale.numpy(), kw.weight_zero_point.numpy())):
        np.testing.assert_array_equal(s, np.asarray(s_np, np.float32))
        np.testing.assert_array_equal(z, z_np)

    # fake-quantized values: equal up to float rounding; an element lying on a rounding boundary (within
    # float error) may land one step apart between the fused kernels
    k_as_torch = from_keras(kind, k_out)
    step = np.broadcast_to(Q.channel_view(NP, s_np, w.ndim, axis) if per_channel else s_np, w.shape)
    diff = np.abs(k_as_torch - t_out)
    near_tie = np.abs(np.abs(w / step - np.floor(w / step)) - 0.5) < 1e-4
    assert np.all(diff[~near_tie] <= 4 * np.finfo(np.float32).eps * np.abs(t_out[~near_tie]).max())
    assert np.all(diff[near_tie] <= step[near_tie] * 1.0001)


@pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
@pytest.mark.parametrize("dtype,scheme", [("uint", "per_tensor_affine"), ("int", "per_channel_symmetric")])
def test_activation_ranges_and_calibration_identical(kind, dtype, scheme):
    w = weights(kind, 7)
    tm = torch_model(kind, w)
    km = keras_model(kind, w)
    cfg = config(["input", "weight", "output"], dtype, scheme)
    tq, kq = TorchQAT(tm, cfg), TfQAT(km, cfg)
    rng = np.random.default_rng(11)
    shape = (4, 7) if kind == "Linear" else (4, 3, 6, 6)
    tm.train()
    for i in range(3):
        x = (rng.normal(size=shape) * (i + 1)).astype(np.float32)
        t_y = tm(torch.from_numpy(x)).detach().numpy()
        k_y = km(tf.constant(to_nhwc(x)), training=True).numpy()
    tw, kw = tq.get_modules_wrapper()[0], kq.get_modules_wrapper()[0]
    # inputs are identical on both sides: EMA ranges, scales and zero points are bit-identical
    for name in ("tracked_min_input", "tracked_max_input", "input_scale", "input_zero_point"):
        np.testing.assert_array_equal(getattr(kw, name).numpy(), getattr(tw, name).numpy(), err_msg=name)
    # outputs come from each framework's own matmul / convolution: equal up to summation-order rounding
    for name in ("tracked_min_output", "tracked_max_output", "output_scale"):
        np.testing.assert_allclose(getattr(kw, name).numpy(), getattr(tw, name).numpy(), rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(to_nhwc(t_y), k_y, rtol=1e-4, atol=2 * float(np.max(tw.output_scale.numpy())))

    t_cal = tq.calibration(tw)
    k_cal = kq.calibration(kw)
    assert set(t_cal) == set(k_cal)
    for key in t_cal:
        if key == "module_type":
            assert (t_cal[key], k_cal[key]) == ({"Linear": "Linear", "Conv2d": "Conv2d"}[kind],
                                                 {"Linear": "Dense", "Conv2d": "Conv2D"}[kind])
        elif key.startswith(("input_", "weight_", "tracked_min_input", "tracked_max_input")) or key == "quant_types":
            assert t_cal[key] == k_cal[key], key
        else:
            np.testing.assert_allclose(k_cal[key], t_cal[key], rtol=1e-5, err_msg=key)
