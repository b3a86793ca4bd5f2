"""A group size that does not divide a layer's input width on Keras: the one-shot quantizers make groups of
``group_size`` columns with a narrower last one, and ``to_keras_quantized`` writes those groups (``g_idx`` per
row), so Keras's own quantized layers compute the fake-quant model's output."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from compressor.tf import AwqQuantizer, GptqQuantizer, RtnQuantizer, to_keras_quantized  # noqa: E402
from compressor.tf.quantization.lowbit import describe_keras_quantized, oneshot_codes  # noqa: E402

pytestmark = [pytest.mark.tf]

X = np.random.default_rng(0).normal(size=(64, 160)).astype("float32")


def _model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((160,))
    h = keras.layers.Dense(64, activation="relu", name="a")(inp)
    return keras.Model(inp, keras.layers.Dense(32, name="b")(h))


@pytest.mark.parametrize("quantizer, bits, scheme, mode", [
    (RtnQuantizer, 4, "symmetric", "int4"), (GptqQuantizer, 4, "affine", "int4"), (AwqQuantizer, 4, "symmetric", "awq"),
    (GptqQuantizer, 8, "symmetric", "gptq")])
def test_keras_layers_hold_the_narrow_last_group(quantizer, bits, scheme, mode):
    model = _model()
    q = quantizer(model, [{"quant_bits": bits, "group_size": 48, "quant_scheme": scheme, "op_types": ["Dense"]}])
    q.calibrate() if quantizer is RtnQuantizer else q.calibrate([X], progress=False)
    offsets = {}
    for w in q.get_modules_wrapper():
        codes = oneshot_codes(w).astype(np.int64)
        g = np.arange(codes.shape[1]) // 48
        assert w.weight_group_scale.shape[1] == -(-codes.shape[1] // 48)
        offsets[w.name] = codes - np.asarray(w.weight_group_zero_point.numpy()).astype(np.int64)[:, g]
    ref = np.asarray(model(X))
    rows = to_keras_quantized(q)
    assert [(r["layer"], r["mode"], r["group_size"]) for r in rows] == [("a", mode, 48), ("b", mode, 48)]
    for name in ("a", "b"):
        got = describe_keras_quantized(model.get_layer(name))["offsets"]  # Keras's [in, out] view
        assert np.array_equal(got.T, offsets[name])
    out = np.asarray(model(X))
    assert float(np.abs(out - ref).max() / np.abs(ref).max()) < 2e-6
