"""QuantGrad (tf.custom_gradient) and the Keras-layout fake-quant adapters, on hand-built tensors."""

import numpy as np
import pytest
import tensorflow as tf

from compressor.core import quant as Q
from compressor.core.ops import NumpyOps
from compressor.tf.ops import ops
from compressor.tf.quantization.bnn import BNNGrad
from compressor.tf.quantization.fakequant import channel_minmax, fake_quant, fused_grid
from compressor.tf.quantization.grad import QuantGrad, QuantType

npo = NumpyOps()


def _grad(grad_cls, x, quant_type, quantize, jit=None):
    x = tf.Variable(np.asarray(x, np.float32))
    coeff = tf.constant(np.arange(1, x.shape[0] + 1, dtype=np.float32))

    def run():
        with tf.GradientTape() as tape:
            y = grad_cls.apply(x.value(), quant_type, quantize)
            loss = tf.reduce_sum(y * coeff)
        return y, tape.gradient(loss, x)

    if jit is not None:
        run = tf.function(run, jit_compile=jit)
    y, g = run()
    return y.numpy(), g.numpy()


def _int_grid(x):
    scale, zp = tf.constant(1.0), tf.constant(0.0)
    return Q.fake_quantize(ops, x, scale, zp, -3, 3), (scale, zp, -3, 3)


@pytest.mark.parametrize("jit", [None, False, True])
def test_default_backward_is_clipped_ste(jit):
    x = [-4.0, -3.4, -2.6, 0.2, 3.49, 3.51]
    y, g = _grad(QuantGrad, x, QuantType.QUANT_WEIGHT, _int_grid, jit)
    np.testing.assert_array_equal(y, [-3, -3, -3, 0, 3, 3])
    # round(x) in [-3, 3] passes: -4 and round(3.51) = 4 are clipped
    np.testing.assert_array_equal(g, [0, 2, 3, 4, 5, 0])


def test_plain_ste_without_qparams():
    _, g = _grad(QuantGrad, [-9.0, 0.4, 9.0], "output", lambda x: tf.round(x))
    np.testing.assert_array_equal(g, [1, 2, 3])


class ClipGrad(QuantGrad):
    """Seed 003's example, TensorFlow spelling."""

    @staticmethod
    def quant_backward(tensor, grad_output, quant_type):
        if quant_type == QuantType.QUANT_OUTPUT:
            grad_output = tf.where(tf.abs(tensor) > 1, tf.zeros_like(grad_output), grad_output)
        return grad_output


def test_seed_three_argument_override():
    x = [-1.5, -0.5, 0.5, 1.0, 2.0]
    _, g = _grad(ClipGrad, x, QuantType.QUANT_OUTPUT, lambda t: tf.sign(t))
    np.testing.assert_array_equal(g, [0, 2, 3, 4, 0])
    _, g = _grad(ClipGrad, x, QuantType.QUANT_WEIGHT, lambda t: tf.sign(t))
    np.testing.assert_array_equal(g, [1, 2, 3, 4, 5])


def test_keyword_override_receives_qparams():
    seen = {}

    class Spy(QuantGrad):
        @staticmethod
        def quant_backward(tensor, grad_output, quant_type, **kwargs):
            seen.update(kwargs)
            return grad_output * 2.0

    _, g = _grad(Spy, [0.2, 5.0], "weight", _int_grid)
    assert sorted(seen) == ["qmax", "qmin", "scale", "zero_point"] and (seen["qmin"], seen["qmax"]) == (-3, 3)
    np.testing.assert_array_equal(g, [2, 4])


def test_hardtanh_grad_zero_outside_unit_interval():
    x = [-1.01, -1.0, 0.0, 1.0, 1.01]
    y, g = _grad(BNNGrad, x, QuantType.QUANT_OUTPUT, lambda t: Q.binarize(ops, t))
    np.testing.assert_array_equal(y, [-1, -1, 1, 1, 1])
    np.testing.assert_array_equal(g, [0, 2, 3, 4, 0])


def test_quant_type_compares_with_config_strings():
    assert QuantType.QUANT_WEIGHT == "weight" and QuantType("input") is QuantType.QUANT_INPUT
    assert QuantType.OUTPUT is QuantType.QUANT_OUTPUT


def test_fused_grid_table():
    assert fused_grid(*Q.quant_range(8, "uint")) == (8, False)
    assert fused_grid(*Q.quant_range(8, "int")) == (8, True)
    assert fused_grid(*Q.quant_range(4, "int", narrow=False)) == (4, False)
    assert fused_grid(*Q.quant_range(1, "uint")) is None  # 1 bit: core path
    assert fused_grid(*Q.quant_range(20, "uint")) is None  # beyond 16 bits: core path


def test_issue_values_uint8_affine():
    w = tf.constant([[1.1287, 2.3456], [3.7814, 5.9723]])
    qmin, qmax = Q.quant_range(8, "uint")
    scale, zp = Q.qparams(ops, *Q.minmax(ops, w), qmin, qmax)
    assert zp.numpy() == 0
    for fused in (True, False):
        np.testing.assert_allclose(fake_quant(w, scale, zp, qmin, qmax, fused=fused).numpy(),
                                   [[1.1242, 2.3421], [3.7707, 5.9723]], atol=1e-4)


def _near_tie(x, scale, zp):
    v = x / scale + zp
    return np.abs(v - np.floor(v) - 0.5) < 1e-4


CASES = [(d, s, b) for d, s in [("uint", "per_tensor_affine"), ("int", "per_tensor_symmetric"),
                                 ("int", "per_channel_symmetric"), ("uint", "per_channel_affine")]
         for b in (2, 4, 8, 1, 20) if not (d == "int" and b == 1)]  # 1-bit signed is BNN; 1 and 20 bits: core path


@pytest.mark.parametrize("dtype,scheme,bits", CASES)
def test_fake_quant_matches_core_numpy(dtype, scheme, bits):
    """TF (fused where it fits, else composed) against core on numpy, Conv2D kernel layout."""
    per_channel, symmetric = Q.parse_scheme(scheme)
    rng = np.random.default_rng(bits)
    wk = rng.normal(size=(3, 3, 4, 6)).astype(np.float32)  # Keras [kh, kw, in, out]
    wt = wk.transpose(3, 2, 0, 1)  # torch / core [out, in, kh, kw]
    qmin, qmax = Q.quant_range(bits, dtype)
    axis = 0 if per_channel else None
    s_np, z_np = Q.qparams(npo, *Q.minmax(npo, wt, axis), qmin, qmax, symmetric)
    s_tf, z_tf = Q.qparams(ops, *channel_minmax(tf.constant(wk), "Conv2D", per_channel), qmin, qmax, symmetric)
    np.testing.assert_array_equal(s_tf.numpy(), s_np.astype(np.float32))
    np.testing.assert_array_equal(z_tf.numpy(), z_np)
    ref = Q.fake_quantize(npo, wt, *(Q.channel_view(npo, a, 4, 0) for a in (s_np, z_np)) if per_channel
                          else (s_np, z_np), qmin, qmax).transpose(2, 3, 1, 0)
    got = fake_quant(wk, s_tf, z_tf, qmin, qmax, axis=-1 if per_channel else None).numpy()
    tie = _near_tie(wk, s_np if not per_channel else s_np[None, None, None, :], z_np)
    np.testing.assert_allclose(got[~tie], ref[~tie], rtol=1e-6, atol=1e-6 * float(np.abs(ref).max()))  # ~ulps
    step = np.broadcast_to(s_np, wk.shape) if per_channel else np.full(wk.shape, s_np)
    assert np.all(np.abs(got[tie] - ref[tie]) <= step[tie] * 1.0001)


def test_transposed_kernel_channels_on_second_to_last_axis():
    # Conv2DTranspose kernel [kh, kw, out, in]: output channel c holds value c + 1 everywhere
    k = np.broadcast_to(np.array([1.0, 2.0, 4.0], np.float32)[:, None], (1, 1, 3, 2)).copy()
    k[0, 0, :, 1] *= -1
    lo, hi = channel_minmax(tf.constant(k), "Conv2DTranspose", per_channel=True)
    np.testing.assert_array_equal(lo.numpy(), [-1, -2, -4])
    np.testing.assert_array_equal(hi.numpy(), [1, 2, 4])
    s, z = Q.qparams(ops, lo, hi, -127, 127, symmetric=True)
    np.testing.assert_allclose(fake_quant(k, s, z, -127, 127, axis=-2).numpy(), k, rtol=1e-6)


def test_depthwise_channels_are_in_times_mult():
    # [kh, kw, in=2, mult=2]: channel i*mult+m; give each channel its own max
    k = np.zeros((1, 1, 2, 2), np.float32)
    k[0, 0] = [[1.0, 2.0], [3.0, 4.0]]
    _, hi = channel_minmax(tf.constant(k), "DepthwiseConv2D", per_channel=True)
    np.testing.assert_array_equal(hi.numpy(), [1, 2, 3, 4])
