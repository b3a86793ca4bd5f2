"""Issue 27 (Keras): a BERT-style encoder (MultiHeadAttention, Dense / EinsumDense FFN, LayerNormalization) to
TFLite: (a) full-integer, every weighted kernel int8, softmax / norms / GELU float and reported; (b)
``activation='dynamic'``: the converter's dynamic-range model, int8 weights, activations quantized at run
time, no calibration data."""

from __future__ import annotations

import collections
import os
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import compressor.tf as ctf
from compressor.core.errors import ConfigError

sys.path.insert(0, os.path.dirname(__file__))
import _keras_pipeline as P  # noqa: E402

pytestmark = pytest.mark.tf
L = keras.layers
CFG = {"quant_types": ["input", "weight", "output"], "quant_bits": 8,
       "op_types": ["Dense", "EinsumDense", "MultiHeadAttention"]}


def encoder() -> keras.Model:
    """2 blocks: MHA (2 heads of 16) + residual + LN, Dense(64, gelu) -> EinsumDense(32) + residual + LN."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((16,), dtype="int32")
    h = L.Embedding(20, 32, name="emb")(inp)
    for i in range(2):
        a = L.MultiHeadAttention(2, 16, name=f"mha{i}")(h, h)
        h = L.LayerNormalization(name=f"ln{i}a")(L.Add(name=f"res{i}a")([h, a]))
        f = L.Dense(64, activation="gelu", name=f"ff{i}a")(h)
        f = L.EinsumDense("abc,cd->abd", (None, 32), bias_axes="d", name=f"ff{i}b")(f)
        h = L.LayerNormalization(name=f"ln{i}b")(L.Add(name=f"res{i}b")([h, f]))
    return keras.Model(inp, L.Dense(3, name="cls")(L.GlobalAveragePooling1D(name="pool")(h)))


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 20, (n, 16)).astype("int32")


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def kernels(path) -> collections.Counter:
    """``{(op, activation dtype, weight dtype): count}`` of the ops with a constant (weight) operand."""
    return collections.Counter((name, dts[0], dts[1]) for name, dts, weighted in P.tflite_ops(str(path))
                               if weighted and name in P.INT8_OPS)


def test_encoder_full_integer_kernels_int8_softmax_and_norms_float(tmp_path):
    model = encoder()
    x = tokens(48)
    want_float = np.asarray(model(x[32:]))
    q = ctf.PtqQuantizer(model, [CFG])
    q.calibrate(x[:32])
    want = np.asarray(model(x[32:]))
    q.export_model(tflite_path=tmp_path / "m.tflite", verbose=False)
    # q, k, v, attention output of 2 MHAs, 2 x 2 FFN, cls: 13 int8 x int8 FULLY_CONNECTED
    assert kernels(tmp_path / "m.tflite") == {("FULLY_CONNECTED", "int8", "int8"): 13}
    kept = q.tflite_float_ops
    assert set(kept) == {"ADD", "BATCH_MATMUL", "GELU", "MEAN", "MUL", "NEG", "RSQRT", "SOFTMAX",
                         "SQUARED_DIFFERENCE"}
    assert kept["SOFTMAX"] == kept["BATCH_MATMUL"] == ["mha0", "mha1"] and kept["GELU"] == ["ff0a", "ff1a"]
    assert kept["RSQRT"] == ["ln0a", "ln0b", "ln1a", "ln1b"]
    got, _ = P.run_tflite(str(tmp_path / "m.tflite"), x[32:])
    assert rel_error(got, want) < 0.05 and rel_error(got, want_float) < 0.06


def test_encoder_dynamic_range_int8_weights_float_activations(tmp_path):
    model = encoder()
    x = tokens(16)
    want_float = np.asarray(model(x))
    q = ctf.PtqQuantizer(model, [CFG], activation="dynamic")
    q.export_model(tflite_path=tmp_path / "m.tflite", verbose=False)  # no calibration data
    assert q.calibrated
    want = np.asarray(model(x))
    # 12 hybrid kernels (float activations x int8 per-channel weights); cls (3 x 32 = 96 weights) the converter
    # keeps float (it quantizes weights of >= 1024 elements) and the export reports it
    assert kernels(tmp_path / "m.tflite") == {("FULLY_CONNECTED", "float32", "int8"): 12,
                                              ("FULLY_CONNECTED", "float32", "float32"): 1}
    assert q.tflite_float_ops == {"FULLY_CONNECTED": ["cls"]}
    names = [name for name, _, _ in P.tflite_ops(str(tmp_path / "m.tflite"))]
    assert "QUANTIZE" not in names and names.count("SOFTMAX") == 2
    got, dtypes = P.run_tflite(str(tmp_path / "m.tflite"), x)
    assert dtypes == {"input": np.int32, "output": np.float32}
    assert rel_error(got, want) < 0.02 and rel_error(got, want_float) < 0.03


def test_dynamic_fake_quant_is_the_hybrid_kernel():
    """One Dense: the fake-quant model (int8 weights, input quantized per row at run time) computes what
    TFLite's dynamic-range FULLY_CONNECTED computes, to float rounding."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 64))
    model = keras.Model(inp, L.Dense(32, name="fc")(inp))
    x = np.random.default_rng(0).standard_normal((8, 16, 64)).astype("float32")
    float_out = np.asarray(model(x))
    q = ctf.PtqQuantizer(model, [{**CFG, "op_types": ["Dense"]}], activation="dynamic").calibrate()
    want = np.asarray(model(x))
    assert rel_error(want, float_out) > 1e-3  # quantized
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        q.export_model(tflite_path=os.path.join(d, "m.tflite"), verbose=False)
        got, _ = P.run_tflite(os.path.join(d, "m.tflite"), x)
    assert rel_error(got, want) < 1e-5


def test_activation_is_validated_before_the_model_changes(tmp_path):
    model = encoder()
    before = [type(la).__name__ for la in model.layers]
    with pytest.raises(ConfigError, match=r"activation must be one of \['static', 'dynamic'\], got 'int8'"):
        ctf.PtqQuantizer(model, [CFG], activation="int8")
    assert [type(la).__name__ for la in model.layers] == before
    q = ctf.PtqQuantizer(model, [CFG], activation="dynamic")
    with pytest.raises(ConfigError, match="inference_input_type must be tf.float32 with activation='dynamic'"):
        q.export_model(tflite_path=tmp_path / "m.tflite", inference_input_type=tf.int8, verbose=False)
    with pytest.raises(ConfigError, match="tflite_int8='all' .* leave tflite_int8 out"):
        q.export_model(tflite_path=tmp_path / "m.tflite", tflite_int8="all", verbose=False)
    assert not q.calibrated and os.listdir(tmp_path) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        static = ctf.PtqQuantizer(encoder(), [CFG])
    with pytest.raises(ConfigError, match="calibrate with at least one batch"):
        static.calibrate()


def test_dynamic_range_export_warns_about_excluded_layers_it_quantizes_anyway(tmp_path):
    """The converter's dynamic-range mode has no per-layer switch: an excluded Dense of >= 1024 weights comes out
    int8 all the same, so the export says which layer (and a quantized one is not named)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((64,))
    h = L.Dense(64, name="body")(inp)
    model = keras.Model(inp, L.Dense(32, name="head")(h))
    q = ctf.PtqQuantizer(model, [{**CFG, "op_types": ["Dense"]}, {"exclude": True, "op_names": ["head"]}],
                         activation="dynamic").calibrate()
    with pytest.warns(UserWarning, match=r"layers the config does not quantize .*FULLY_CONNECTED \(head\)\.") as rec:
        q.export_model(tflite_path=os.path.join(tmp_path, "m.tflite"), verbose=False)
    assert not [w for w in rec if "body" in str(w.message)]
