import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from compressor.core import quant as Q
from compressor.core.ops import NumpyOps

ops = NumpyOps()
f32 = np.float32


def qp(w, bits=8, dtype="uint", symmetric=False, channel_axis=None):
    qmin, qmax = Q.quant_range(bits, dtype)
    lo, hi = Q.minmax(ops, np.asarray(w, f32), channel_axis)
    return Q.qparams(ops, lo, hi, qmin, qmax, symmetric) + (qmin, qmax)


def test_ranges():
    assert Q.quant_range(8, "int") == (-127, 127)
    assert Q.quant_range(8, "uint") == (0, 255)
    assert Q.quant_range(8, "int", narrow=False) == (-128, 127)
    assert Q.quant_range(4, "int") == (-7, 7)
    with pytest.raises(ValueError, match="1..32"):
        Q.quant_range(33)
    with pytest.raises(ValueError, match="BNN"):
        Q.quant_range(1, "int")
    with pytest.raises(ValueError, match="'int' or 'uint'"):
        Q.quant_range(8, "float")


def test_affine_uint8_positive_weight():
    scale, zp, *_ = qp([[1, 2], [3, 5]])
    assert scale == pytest.approx(5 / 255) and zp == 0


def test_affine_uint8_zero_point_rounds_half_to_even():
    scale, zp, *_ = qp([[-1, 2], [3, 5]])
    assert scale == pytest.approx(6 / 255)
    assert zp == 42  # 1 / (6/255) = 42.5 -> round half to even


def test_dequantized_weight_reference():
    w = np.array([[1.1287, 2.3456], [3.7814, 5.9723]], f32)
    scale, zp, qmin, qmax = qp(w)
    np.testing.assert_allclose(Q.fake_quantize(ops, w, scale, zp, qmin, qmax),
                               [[1.1242, 2.3421], [3.7707, 5.9723]], atol=1e-4)


W = np.arange(1, 19, dtype=f32).reshape(2, 1, 3, 3)


@pytest.mark.parametrize(
    "scheme, dtype, scale, zp",
    [
        ("per_channel_symmetric", "int", [9 / 127, 18 / 127], [0, 0]),
        ("per_tensor_symmetric", "int", 18 / 127, 0),
        ("per_tensor_affine", "uint", 18 / 255, 0),
        ("per_channel_affine", "uint", [9 / 255, 18 / 255], [0, 0]),
        ("per_tensor_symmetric", "uint", 18 / 127.5, 127),
        ("per_channel_symmetric", "uint", [9 / 127.5, 18 / 127.5], [127, 127]),
        ("per_tensor_affine", "int", 18 / 254, -127),
        ("per_channel_affine", "int", [9 / 254, 18 / 254], [-127, -127]),
    ],
)
def test_dtype_scheme_table(scheme, dtype, scale, zp):
    per_channel, symmetric = Q.parse_scheme(scheme)
    s, z, *_ = qp(W, 8, dtype, symmetric, 0 if per_channel else None)
    np.testing.assert_allclose(s, scale, rtol=1e-6)
    np.testing.assert_array_equal(z, zp)


def test_all_zero_tensor_has_a_usable_scale():
    s, z, qmin, qmax = qp(np.zeros(4))
    assert s > 0 and np.all(Q.fake_quantize(ops, np.zeros(4, f32), s, z, qmin, qmax) == 0)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float64, st.integers(1, 40), elements=st.floats(-100, 100)), st.integers(2, 16),
       st.sampled_from(["int", "uint"]), st.booleans())
def test_fake_quant_error_at_most_half_a_step_inside_range(x, bits, dtype, symmetric):
    qmin, qmax = Q.quant_range(bits, dtype)
    lo, hi = Q.minmax(ops, x)
    s, z = Q.qparams(ops, lo, hi, qmin, qmax, symmetric)
    if not symmetric:  # zero-point rounding shifts the covered range by at most half a step
        assert min(lo, 0) >= (qmin - z) * s - s / 2 - 1e-9 * s
        assert max(hi, 0) <= (qmax - z) * s + s / 2 + 1e-9 * s
    y = Q.fake_quantize(ops, x, s, z, qmin, qmax)
    inside = (x >= (qmin - z) * s) & (x <= (qmax - z) * s)
    assert np.all(np.abs(y - x)[inside] <= s / 2 + 1e-9 * max(1.0, float(np.abs(x).max())))
    assert np.any(y == 0) or not np.any(x == 0)  # zero is exactly representable
    # ste passes exactly where the code is not clipped
    q = np.round(x / s + z)
    np.testing.assert_array_equal(Q.ste_pass(ops, x, s, z, qmin, qmax), (q >= qmin) & (q <= qmax))


def test_ema():
    assert Q.ema(ops, 1.0, 2.0, 0.99) == pytest.approx(1.01)


def test_dorefa_formula():
    w = np.array([-2.0, -0.5, 0.0, 0.3, 1.5])
    t = np.tanh(w)
    x = t / (2 * np.abs(t).max()) + 0.5
    n = 2**2 - 1
    expect = 2 * (np.round(x * n) / n) - 1
    np.testing.assert_allclose(Q.dorefa_weight(ops, w, 2), expect)
    np.testing.assert_allclose(Q.dorefa_weight(ops, w, 2), [-1, -1 / 3, 1 / 3, 1 / 3, 1])


def test_binarize_zero_is_plus_one_and_hardtanh():
    np.testing.assert_array_equal(Q.binarize(ops, np.array([-0.5, 0.0, 2.0])), [-1.0, 1.0, 1.0])
    np.testing.assert_array_equal(Q.hardtanh_pass(ops, np.array([-1.5, -1.0, 0.3, 1.0, 1.01])),
                                  [False, True, True, True, False])


def test_naive_scale_running_max():
    s1 = Q.naive_scale(ops, np.array([0.5, -1.27]))
    assert s1 == pytest.approx(0.01)
    assert Q.naive_scale(ops, np.array([0.127]), s1) == pytest.approx(0.01)
    assert Q.naive_scale(ops, np.array([2.54]), s1) == pytest.approx(0.02)


def test_lsq():
    w = np.array([1.0, -3.0, 2.0, 0.0])
    assert Q.lsq_init_scale(ops, w, 127) == pytest.approx(2 * 1.5 / math.sqrt(127))
    assert Q.lsq_grad_scale(4, 127) == pytest.approx(1 / math.sqrt(4 * 127))
    qmin, qmax = Q.quant_range(8, "int", narrow=False)
    np.testing.assert_allclose(Q.lsq_quantize(ops, np.array([0.26, -9.0, 1.0]), 0.1, qmin, qmax, 0.5),
                               [0.3, -9.0, 1.0])
    np.testing.assert_allclose(Q.lsq_quantize(ops, np.array([100.0]), 0.1, qmin, qmax, 0.5), [12.7])


def test_bias_qparams_and_sizes():
    s, qmin, qmax = Q.bias_qparams(ops, 0.5, np.array([0.1, 0.2]))
    np.testing.assert_allclose(s, [0.05, 0.1])
    assert (qmin, qmax) == (-(2**31 - 1), 2**31 - 1)
    assert Q.quantized_bytes(10, 4) == 5 and Q.quantized_bytes(3, 1) == 1
    d = Q.describe(np.float32(0.5), np.float32(3.0), 0, 255)
    assert d == {"scale": 0.5, "zero_point": 3, "qmin": 0, "qmax": 255}
