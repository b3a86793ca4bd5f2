"""Keras ``PtqQuantizer(activation='dynamic')`` quantizes each token's row on its own range (as TFLite's
dynamic-range kernels do): one outlier token leaves every other token's error at its own int8 level, bounded
by the row's own max |x|. The torch backend's counterpart: tests/torch/test_dynamic_per_token.py."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from compressor.tf import PtqQuantizer  # noqa: E402

pytestmark = [pytest.mark.tf]

K, N, ROWS, OUTLIER = 64, 32, 8, 3


def _x() -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((2, ROWS // 2, K)).astype("float32")
    x[OUTLIER // (ROWS // 2), OUTLIER % (ROWS // 2)] *= 1000.0
    return x


def test_each_token_keeps_its_own_int8_error_next_to_an_outlier_token():
    rng = np.random.default_rng(1)
    codes = rng.integers(-127, 128, (K, N))
    codes[0, :] = 127  # every output channel reaches 127: its int8 scale is 0.01, the weights are on the grid
    kernel = (codes * 0.01).astype("float32")
    inp = keras.Input((ROWS // 2, K))
    model = keras.Model(inp, keras.layers.Dense(N, name="fc")(inp))
    model.get_layer("fc").set_weights([kernel, rng.standard_normal(N).astype("float32")])
    x = _x()
    ref = np.asarray(model(x), dtype=np.float64).reshape(-1, N)
    PtqQuantizer(model, [{"op_types": ["Dense"], "quant_types": ["input", "weight"], "quant_bits": 8,
                          "quant_dtype": {"weight": "int"}, "quant_scheme": {"weight": "per_channel_symmetric"}}],
                 activation="dynamic").calibrate()
    got = np.asarray(model(x), dtype=np.float64).reshape(-1, N)
    xr = x.reshape(-1, K).astype(np.float64)
    m = np.abs(xr).max(1, keepdims=True)
    wabs = np.abs(kernel.astype(np.float64)).sum(0)[None, :]
    # each row on a uint8 grid over its own [min, max] (0 included): element error <= m / 255
    bound = m / 255 * wabs * (1 + 1e-5) + 1e-5 * (np.abs(xr) @ np.abs(kernel.astype(np.float64)))
    assert (np.abs(got - ref) <= bound).all()
    others = [r for r in range(ROWS) if r != OUTLIER]
    rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert rel[others].max() < 0.02
