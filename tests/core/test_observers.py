"""PTQ range observers on numpy: hand-computed exact values, properties, argument checks."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from compressor.core import quant as Q
from compressor.core.errors import ConfigError
from compressor.core.observers import (
    OBSERVERS,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MseObserver,
    PercentileObserver,
    batch_minmax,
    batch_mse_range,
    batch_percentile,
    channel_rows,
    make_observer,
    percentile_rank,
)
from compressor.core.ops import NumpyOps
from compressor.core.quant_config import base_spec

ops = NumpyOps()
f32 = np.float32


def arr(*v):
    return np.asarray(v, f32)


def rng_of(x):
    return tuple(np.asarray(v) for v in x)


def assert_range(obs, lo, hi):
    rmin, rmax = obs.range()
    np.testing.assert_array_equal(rmin, np.asarray(lo, f32))
    np.testing.assert_array_equal(rmax, np.asarray(hi, f32))
    assert np.asarray(rmin).dtype == f32 and np.asarray(rmax).dtype == f32


# ------------------------------------------------------------------------------------------- min-max


def test_minmax_per_tensor_over_batches():
    o = MinMaxObserver(ops)
    o.observe(arr(1, -2, 3))
    assert_range(o, -2, 3)
    o.observe(arr([0.5, 4]))
    assert_range(o, -2, 4)
    assert np.shape(o.range()[0]) == ()
    scale, zp = o.qparams()  # uint8 affine: scale 6/255, zp = round(2 / (6/255)) = round(85.0)
    assert scale == f32(6) * f32(1 / 255) and zp == 85


def test_minmax_per_channel_weights():
    o = MinMaxObserver.for_weights(ops)
    assert (o.channel_axis, o.dtype, o.symmetric, o.qmin, o.qmax) == (0, "int", True, -127, 127)
    o.observe(arr([1, -2], [3, 0]))
    o.observe(arr([-1, 5], [2, 2]))
    assert_range(o, [-2, 0], [5, 3])
    scale, zp = o.qparams()
    np.testing.assert_array_equal(scale, arr(5, 3) * f32(2 / 254))
    np.testing.assert_array_equal(zp, [0, 0])


def test_minmax_channel_axis_last_of_activations():
    x = np.arange(24, dtype=f32).reshape(2, 3, 4) - 10  # channels along the last axis
    o = MinMaxObserver(ops, channel_axis=-1)
    o.observe(x)
    assert_range(o, [-10, -9, -8, -7], [10, 11, 12, 13])
    np.testing.assert_array_equal(batch_minmax(ops, x, 2)[0], x.min(axis=(0, 1)))
    np.testing.assert_array_equal(channel_rows(ops, x, -1), np.moveaxis(x, -1, 0).reshape(4, -1))


def test_minmax_one_dimensional_per_channel():
    o = MinMaxObserver(ops, channel_axis=0)
    o.observe(arr(-1, 2, 0.5))
    assert_range(o, [-1, 2, 0.5], [-1, 2, 0.5])


def test_minmax_qparams_same_as_core():
    w = np.random.default_rng(0).normal(size=(4, 3, 2, 2)).astype(f32)
    o = MinMaxObserver.for_weights(ops)
    o.observe(w)
    lo, hi = Q.minmax(ops, w, 0)
    for got, want in zip(o.qparams(), Q.qparams(ops, lo, hi, -127, 127, True), strict=True):
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------ moving average


def test_moving_average_first_value_then_ema():
    o = MovingAverageMinMaxObserver(ops, decay=0.5)
    o.observe(arr(-1, 2))
    assert_range(o, -1, 2)  # seeded with the first observation
    o.observe(arr(-3, 4))
    assert_range(o, -2, 3)
    o.observe(arr(0, 1))
    assert_range(o, -1, 2)


def test_moving_average_default_decay():
    o = MovingAverageMinMaxObserver(ops)
    assert o.decay == 0.99
    o.observe(arr(0, 1))
    o.observe(arr(0, 2))
    assert_range(o, 0, f32(1) * f32(0.99) + f32(2) * f32(1 - 0.99))


def test_moving_average_per_channel_and_decay_zero():
    o = MovingAverageMinMaxObserver.for_weights(ops, decay=0.0)
    o.observe(arr([1, -2], [3, 0]))
    o.observe(arr([-1, 5], [2, 2]))
    assert_range(o, [-1, 2], [5, 2])  # decay 0: the last batch


def test_moving_average_cannot_merge():
    a, b = MovingAverageMinMaxObserver(ops), MovingAverageMinMaxObserver(ops)
    with pytest.raises(ConfigError, match="order of the batches"):
        a.merge(b)


# ---------------------------------------------------------------------------------------- percentile


def test_percentile_rank_exact_decimal():
    assert percentile_rank(10000, 99.99) == 9999
    assert percentile_rank(100, 7) == 7  # 0.07 * 100 = 7.000000000000001 in floats
    assert percentile_rank(10, 90) == 9
    assert percentile_rank(10, 91) == 10
    assert percentile_rank(10, 100) == 10
    assert percentile_rank(10, 0.001) == 1


def test_percentile_per_tensor_hand_values():
    x = np.arange(1, 11, dtype=f32)[::-1].copy()  # 10 values, unsorted
    o = PercentileObserver(ops, percentile=90)
    o.observe(x)
    assert_range(o, 2, 9)  # 9th smallest / 9th largest
    o.observe(x * 10)
    assert_range(o, (2 + 20) / 2, (9 + 90) / 2)  # mean of the per-batch percentiles


def test_percentile_default_99_99():
    x = np.random.default_rng(1).permutation(np.arange(1, 10001)).astype(f32)
    o = PercentileObserver(ops)
    assert o.percentile == 99.99
    o.observe(x)
    assert_range(o, 2, 9999)


def test_percentile_per_channel_hand_values():
    x = np.stack([np.arange(1, 11), -np.arange(1, 11)]).astype(f32)
    x = x[:, ::-1].copy()
    o = PercentileObserver.for_weights(ops, percentile=90)
    o.observe(x)
    assert_range(o, [2, -9], [9, -2])
    o = PercentileObserver(ops, percentile=100, channel_axis=1)  # channels in columns
    o.observe(x.T.copy())
    assert_range(o, [1, -10], [10, -1])


@pytest.mark.parametrize("p", [50, 75, 87.5, 100])
def test_percentile_upper_matches_numpy_inverted_cdf(p):
    x = np.random.default_rng(2).normal(size=(8, 9)).astype(f32)
    _, hi = batch_percentile(ops, x, p)
    assert hi == np.percentile(x, p, method="inverted_cdf")
    lo, _ = batch_percentile(ops, x, p)
    assert lo == -np.percentile(-x, p, method="inverted_cdf")


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(f32, st.tuples(st.integers(1, 5), st.integers(1, 7)), elements=st.floats(-100, 100, width=32)),
       st.sampled_from([None, 0, 1, -1]))
def test_percentile_100_is_minmax(x, axis):
    a, b = PercentileObserver(ops, percentile=100, channel_axis=axis), MinMaxObserver(ops, channel_axis=axis)
    a.observe(x)
    b.observe(x)
    for u, v in zip(a.range() + a.qparams(), b.range() + b.qparams(), strict=True):
        np.testing.assert_array_equal(u, v)


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(f32, st.tuples(st.integers(1, 4), st.integers(1, 30)), elements=st.floats(-100, 100, width=32)),
       st.floats(0.01, 100), st.sampled_from([None, 0]))
def test_percentile_is_a_sorted_element(x, p, axis):
    lo, hi = batch_percentile(ops, x, p, axis)
    rows = x.reshape(1, -1) if axis is None else x
    s = np.sort(rows, axis=1)
    n = s.shape[1]
    k = percentile_rank(n, p)
    assert abs(k - p / 100 * n) < 1 + 1e-9 and 1 <= k <= n
    np.testing.assert_array_equal(np.reshape(hi, -1), s[:, k - 1])
    np.testing.assert_array_equal(np.reshape(lo, -1), s[:, n - k])


# ------------------------------------------------------------------------------------------------ MSE

A = arr(*([-1] * 5 + [1] * 5 + [4]))  # clipping to 1 wins at 2 bits: squared errors 10, 11, 14, 9
B = arr(*([-1, 1] + [4] * 9))  # min-max wins: 2, 2 + 9, ...


def test_mse_hand_values_2bit_symmetric():
    # int2 narrow = {-1, 0, 1} * scale, scale = a * 4 for a = 1, 3/4, 1/2, 1/4
    o = MseObserver(ops, bits=2, dtype="int", symmetric=True, grid_size=4)
    o.observe(A)
    assert_range(o, -0.25, 1.0)
    scale, zp = o.qparams()
    assert scale == 1.0 and zp == 0
    o.observe(B)
    assert_range(o, (-0.25 - 1) / 2, (1 + 4) / 2)  # mean of per-batch optima
    np.testing.assert_array_equal(rng_of(batch_mse_range(ops, B, -1, 1, True, 4)), (-1, 4))


def test_mse_per_channel_hand_values():
    o = MseObserver.for_weights(ops, bits=2, grid_size=4)
    o.observe(np.stack([A, B]))
    assert_range(o, [-0.25, -1], [1, 4])
    o = MseObserver(ops, bits=2, dtype="int", symmetric=True, grid_size=4, channel_axis=-1)
    o.observe(np.stack([A, B], axis=1))
    assert_range(o, [-0.25, -1], [1, 4])


def test_mse_all_zero_and_ties_keep_the_widest_range():
    o = MseObserver(ops, grid_size=5)
    o.observe(np.zeros((3, 3), f32))
    assert_range(o, 0, 0)
    # 8-bit uint affine on {0, 1}: every candidate represents both exactly -> tie -> a = 1
    o = MseObserver(ops, grid_size=8)
    o.observe(arr(0, 1, 1, 0))
    assert_range(o, 0, 1)


def sq_err(x, scale, zp, qmin, qmax):
    fq = Q.fake_quantize(ops, x, scale, zp, qmin, qmax)
    return float(np.sum(np.square(fq.astype(np.float64) - x.astype(np.float64))))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(f32, st.integers(1, 60), elements=st.floats(-50, 50, width=32)),
       st.integers(2, 8), st.sampled_from(["int", "uint"]), st.booleans(), st.integers(2, 40))
def test_mse_never_worse_than_minmax(x, bits, dtype, symmetric, n):
    kw = {"bits": bits, "dtype": dtype, "symmetric": symmetric}
    m, mm = MseObserver(ops, grid_size=n, **kw), MinMaxObserver(ops, **kw)
    m.observe(x)
    mm.observe(x)
    e_mse = sq_err(x, *m.qparams(), m.qmin, m.qmax)
    e_mm = sq_err(x, *mm.qparams(), mm.qmin, mm.qmax)
    assert e_mse <= e_mm * (1 + 1e-12)
    lo, hi = mm.range()
    rmin, rmax = m.range()  # one of the candidates a * (lo, hi)
    assert any(rmin == lo * f32(i / n) and rmax == hi * f32(i / n) for i in range(1, n + 1))


@settings(max_examples=30, deadline=None)
@given(hnp.arrays(f32, st.tuples(st.integers(1, 4), st.integers(1, 20)), elements=st.floats(-10, 10, width=32)),
       st.integers(2, 8))
def test_mse_per_channel_never_worse_than_minmax(w, bits):
    m, mm = MseObserver.for_weights(ops, bits=bits, grid_size=16), MinMaxObserver.for_weights(ops, bits=bits)
    m.observe(w)
    mm.observe(w)
    (s1, z1), (s2, z2) = m.qparams(), mm.qparams()
    for c in range(w.shape[0]):
        assert sq_err(w[c], s1[c], z1[c], -m.qmax, m.qmax) <= sq_err(w[c], s2[c], z2[c], -m.qmax, m.qmax) * (1 + 1e-12)


def test_mse_improves_on_heavy_tails():
    x = np.random.default_rng(3).standard_t(2, size=4000).astype(f32)
    m, mm = MseObserver(ops, bits=4, dtype="int", symmetric=True), MinMaxObserver(ops, bits=4, dtype="int",
                                                                                  symmetric=True)
    m.observe(x)
    mm.observe(x)
    assert sq_err(x, *m.qparams(), -7, 7) < 0.9 * sq_err(x, *mm.qparams(), -7, 7)
    assert m.range()[1] < mm.range()[1]


# ------------------------------------------------------------------------------ state, merge, reset


def test_reset_and_uncalibrated():
    for cls in OBSERVERS.values():
        o = cls(ops)
        assert not o.calibrated
        with pytest.raises(RuntimeError, match="calibrate with at least one batch"):
            o.range()
        with pytest.raises(RuntimeError, match="calibrate with at least one batch"):
            o.qparams()
        o.observe(arr(1, 2))
        assert o.calibrated and o.count == 1
        o.reset()
        assert o.count == 0 and o.channels is None
        with pytest.raises(RuntimeError, match="calibrate with at least one batch"):
            o.range()


@pytest.mark.parametrize("cls", list(OBSERVERS.values()))
def test_empty_batch_is_refused(cls):
    o = cls(ops)
    with pytest.raises(ValueError, match="empty batch.*calibrate with at least one batch"):
        o.observe(np.zeros((0, 3), f32))
    assert not o.calibrated


def test_channel_count_must_not_change():
    o = MinMaxObserver.for_weights(ops)
    o.observe(np.ones((3, 2), f32))
    with pytest.raises(ValueError, match="4 channels along axis 0, earlier batches had 3"):
        o.observe(np.ones((4, 2), f32))
    assert o.count == 1 and o.channels == 3  # a refused batch leaves the state as it was
    assert_range(o, [1, 1, 1], [1, 1, 1])
    with pytest.raises(ValueError, match="channel_axis 2 is out of range"):
        MinMaxObserver(ops, channel_axis=2).observe(np.ones((3, 2), f32))


QUARTERS = hnp.arrays(f32, st.tuples(st.integers(1, 3), st.integers(1, 6)),
                      elements=st.integers(-40, 40).map(lambda v: v / 4))


@settings(max_examples=30, deadline=None)
@given(st.lists(QUARTERS, min_size=2, max_size=5), st.integers(1, 4),
       st.sampled_from(["minmax", "percentile", "mse"]), st.sampled_from([None, 0]))
def test_merge_equals_observing_everything(batches, split, method, axis):
    split = min(split, len(batches) - 1)
    rows = batches[0].shape[0]
    batches = [np.resize(b, (rows, b.shape[1])) for b in batches]  # the same channel count along axis 0
    kw = {"channel_axis": axis, "grid_size": 8} if method == "mse" else {"channel_axis": axis}
    whole, a, b = (make_observer(ops, method, **kw) for _ in range(3))
    for x in batches:
        whole.observe(x)
    for x in batches[:split]:
        a.observe(x)
    for x in batches[split:]:
        b.observe(x)
    a.merge(b)
    assert a.count == whole.count == len(batches)
    for u, v in zip(a.range() + a.qparams(), whole.range() + whole.qparams(), strict=True):
        np.testing.assert_array_equal(u, v)  # quarters: every sum is exact


def test_merge_checks_kind_and_settings():
    a = MinMaxObserver(ops)
    with pytest.raises(ConfigError, match="same kind and settings"):
        a.merge(PercentileObserver(ops))
    with pytest.raises(ConfigError, match="same kind and settings"):
        a.merge(MinMaxObserver(ops, bits=4))
    b = MinMaxObserver(ops)
    b.observe(arr(1, 2))
    a.merge(MinMaxObserver(ops))  # nothing to add
    assert not a.calibrated
    a.merge(b)
    assert_range(a, 1, 2)


def test_int_inputs_are_cast():
    o = MinMaxObserver(ops)
    o.observe(np.array([1, -3, 2], np.int64))  # cast to float32
    assert_range(o, -3, 2)


# -------------------------------------------------------------------------------------- construction


def test_make_observer_defaults():
    w = make_observer(ops, "mse", "weight")
    assert isinstance(w, MseObserver) and (w.channel_axis, w.dtype, w.symmetric, w.grid_size) == (0, "int", True, 100)
    a = make_observer(ops, "percentile")
    assert isinstance(a, PercentileObserver)
    assert (a.channel_axis, a.dtype, a.symmetric, a.qmin, a.qmax) == (None, "uint", False, 0, 255)
    assert make_observer(ops, "moving_average_minmax", "weight", channel_axis=1).channel_axis == 1
    assert "MseObserver(bits=8" in repr(w)
    with pytest.raises(ConfigError, match="unknown observer 'kl'; allowed"):
        make_observer(ops, "kl")
    with pytest.raises(ConfigError, match="'weight' or 'activation', got 'bias'"):
        make_observer(ops, "minmax", "bias")


def test_from_spec():
    cfg = {"quant_bits": {"weight": 4}, "quant_dtype": "int", "quant_scheme": "per_channel_symmetric"}
    spec, per_channel = base_spec(cfg, "weight", "fc")
    o = MseObserver.from_spec(ops, spec, grid_size=10)
    assert (o.bits, o.qmin, o.qmax, o.symmetric, o.channel_axis, o.grid_size) == (4, -7, 7, True, None, 10)


@pytest.mark.parametrize("kwargs, match", [
    ({"bits": 1}, "bits must be an int in 2..16, got 1"),
    ({"bits": 17}, "bits must be an int in 2..16, got 17"),
    ({"bits": 8.0}, "bits must be an int in 2..16, got 8.0"),
    ({"bits": True}, "bits must be an int in 2..16, got True"),
    ({"dtype": "float"}, "'int' or 'uint', got 'float'"),
    ({"channel_axis": "0"}, "channel_axis must be an int or None"),
])
def test_common_argument_checks(kwargs, match):
    for cls in OBSERVERS.values():
        with pytest.raises(ConfigError, match=match):
            cls(ops, **kwargs)


@pytest.mark.parametrize("cls, kwargs, match", [
    (PercentileObserver, {"percentile": 0}, r"percentile must be a number in \(0, 100\] \(e.g. 99.99\), got 0"),
    (PercentileObserver, {"percentile": 100.5}, r"percentile must be a number in \(0, 100\].*got 100.5"),
    (PercentileObserver, {"percentile": math.nan}, r"percentile must be.*got nan"),
    (PercentileObserver, {"percentile": "99"}, r"percentile must be.*got '99'"),
    (MovingAverageMinMaxObserver, {"decay": 1.0}, r"decay must be a number in \[0, 1\).*got 1.0"),
    (MovingAverageMinMaxObserver, {"decay": -0.1}, r"decay must be a number in \[0, 1\).*got -0.1"),
    (MseObserver, {"grid_size": 1}, "grid_size must be an int >= 2.*got 1"),
    (MseObserver, {"grid_size": 10.0}, "grid_size must be an int >= 2.*got 10.0"),
])
def test_method_argument_checks(cls, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        cls(ops, **kwargs)


def test_ops_must_be_array_ops():
    with pytest.raises(ConfigError, match="must implement ArrayOps"):
        MinMaxObserver(object())
