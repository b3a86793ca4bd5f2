"""Which ops the PtqQuantizer's full-integer .tflite runs in int8 (``export_model(tflite_int8=...)``), and the
dynamic batch of recurrent models' .tflite (issue 23, Keras).

The fake-quant model quantizes the inputs, weights and outputs of its quantized layers only; the converter's
full-integer model also runs softmax, attention score matmuls, layer norms, residual adds and recurrent
gates in int8, errors the fake-quant model does not simulate. ``'auto'`` keeps those ops float for models
with attention / normalization / recurrent layers; every weighted kernel stays int8."""

from __future__ import annotations

import logging
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
CFG = {"quant_types": ["input", "weight", "output"], "quant_bits": 8}


def attention_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,), dtype="int32")
    h = L.Embedding(20, 8, name="emb")(inp)
    h = L.Dense(8, name="proj")(h)
    a = L.MultiHeadAttention(2, 4, name="mha")(h, h)
    h = L.LayerNormalization(name="ln")(L.Add(name="res")([h, a]))
    return keras.Model(inp, L.Dense(3, name="fc")(L.GlobalAveragePooling1D(name="pool")(h)))


def tokens(n: int, seq: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 20, (n, seq)).astype("int32")


def op_dtypes(path) -> dict[str, set[str]]:
    """``{op: dtypes of its first input}`` of the .tflite."""
    out: dict[str, set[str]] = {}
    for name, dts, _ in P.tflite_ops(str(path)):
        out.setdefault(name, set()).add(dts[0] if dts else "none")
    return out


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_attention_model_keeps_softmax_and_norms_float_and_agrees(tmp_path, caplog):
    model = attention_model()
    q = ctf.PtqQuantizer(model, [{**CFG, "op_types": ["Dense", "MultiHeadAttention"]}])
    x = tokens(32)
    q.calibrate(x[:16])
    want = np.asarray(model(x[16:]))
    with caplog.at_level(logging.INFO, logger="compressor.tf.ptq"):
        q.export_model(tflite_path=tmp_path / "auto.tflite")
    assert {k: sorted(v) for k, v in q.tflite_float_ops.items()} == {
        "ADD": ["ln", "res"], "BATCH_MATMUL": ["mha"], "MEAN": ["ln", "pool"], "MUL": ["ln", "mha"], "NEG": ["ln"],
        "RSQRT": ["ln"], "SOFTMAX": ["mha"], "SQUARED_DIFFERENCE": ["ln"]}
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "keeps float" in msg and "SOFTMAX (mha)" in msg and "RSQRT (ln)" in msg and "tflite_int8='all'" in msg
    dts = op_dtypes(tmp_path / "auto.tflite")
    assert dts["SOFTMAX"] == {"float32"} and dts["RSQRT"] == {"float32"} and dts["BATCH_MATMUL"] == {"float32"}
    ops = P.tflite_ops(str(tmp_path / "auto.tflite"))
    # proj, query, key, value, attention_output, fc: int8 FULLY_CONNECTED; the embedding table int8 too
    assert P.int8_weighted_ops(ops) == (6, [])
    assert dts["GATHER"] == {"int8", "int32"}
    got, _ = P.run_tflite(str(tmp_path / "auto.tflite"), x[16:])
    assert rel_error(got, want) < 0.05

    # 'all': the converter's full-integer model, softmax and norms in int8 -- far from the fake-quant model
    q.export_model(tflite_path=tmp_path / "all.tflite", tflite_int8="all", verbose=False)
    assert q.tflite_float_ops == {}
    dts = op_dtypes(tmp_path / "all.tflite")
    assert dts["SOFTMAX"] == {"int8"} and dts["RSQRT"] == {"int8"} and dts["BATCH_MATMUL"] == {"int8"}
    assert P.int8_weighted_ops(P.tflite_ops(str(tmp_path / "all.tflite"))) == (6, [])
    got, _ = P.run_tflite(str(tmp_path / "all.tflite"), x[16:])
    assert rel_error(got, want) > 0.2


def test_cnn_stays_all_int8_unless_kernels_is_asked(tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    a = L.Conv2D(4, 3, padding="same", activation="relu", name="a")(inp)
    b = L.Conv2D(4, 3, padding="same", name="b")(a)
    h = L.GlobalAveragePooling2D(name="pool")(L.Add(name="res")([a, b]))
    model = keras.Model(inp, L.Dense(2, name="fc")(h))
    q = ctf.PtqQuantizer(model, [{**CFG, "op_types": ["Conv2D", "Dense"]}])
    q.calibrate(np.random.default_rng(0).standard_normal((16, 8, 8, 3)).astype("float32"))
    q.export_model(tflite_path=tmp_path / "auto.tflite", verbose=False)
    assert q.tflite_float_ops == {}
    assert op_dtypes(tmp_path / "auto.tflite")["ADD"] == {"int8"}
    q.export_model(tflite_path=tmp_path / "kernels.tflite", tflite_int8="kernels", verbose=False)
    assert q.tflite_float_ops == {"ADD": ["res"], "MEAN": ["pool"]}
    dts = op_dtypes(tmp_path / "kernels.tflite")
    assert dts["ADD"] == {"float32"} and dts["CONV_2D"] == {"int8"} and dts["FULLY_CONNECTED"] == {"int8"}


def test_bad_tflite_int8_is_refused_before_any_file(tmp_path):
    q = ctf.PtqQuantizer(attention_model(), [{**CFG, "op_types": ["Dense"]}])
    q.calibrate(tokens(8))
    with pytest.raises(ConfigError, match=r"tflite_int8 must be one of \['auto', 'kernels', 'all'\], got 'float'"):
        q.export_model(tmp_path / "m.keras", tmp_path / "c.json", tflite_path=tmp_path / "m.tflite",
                       tflite_int8="float")
    assert os.listdir(tmp_path) == []


def run_batched(path, x: np.ndarray, batch: int) -> np.ndarray:
    """Run the .tflite at ``batch`` (resize_tensor_input + allocate_tensors); float outputs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interp = tf.lite.Interpreter(model_path=str(path), num_threads=1)
    ind = interp.get_input_details()[0]
    assert list(ind["shape_signature"][:1]) == [-1]  # the batch axis is dynamic in the artifact
    interp.resize_tensor_input(ind["index"], [batch, *ind["shape"][1:]], strict=True)
    interp.allocate_tensors()
    out = interp.get_output_details()[0]
    got = []
    for i in range(0, len(x), batch):
        interp.set_tensor(ind["index"], x[i:i + batch].astype(ind["dtype"]))
        interp.invoke()
        y = interp.get_tensor(out["index"]).astype(np.float32)
        if out["dtype"] == np.int8:
            s, z = out["quantization"]
            y = (y - z) * s
        got.append(y)
    return np.concatenate(got)


@pytest.mark.parametrize("kind", ["lstm", "bigru"])
def test_recurrent_tflite_has_a_dynamic_batch(kind, tmp_path):
    """Batch 1 and 16 on the interpreter give the same outputs, and both agree with the fake-quant model;
    a GRU inside Bidirectional is unrolled too (its while loop failed to convert: TensorListReserve)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,), dtype="int32")
    h = L.Embedding(20, 8, name="emb")(inp)
    h = L.LSTM(8, name="rnn")(h) if kind == "lstm" else L.Bidirectional(L.GRU(6), name="rnn")(h)
    model = keras.Model(inp, L.Dense(3, name="fc")(L.Dense(8, activation="relu", name="fc1")(h)))
    q = ctf.PtqQuantizer(model, [{**CFG, "op_types": ["Dense"]}])
    x = tokens(48)
    q.calibrate(x[:16])
    want = np.asarray(model(x[16:]))
    q.export_model(tflite_path=tmp_path / "m.tflite", inference_output_type=tf.int8, verbose=False)
    assert {"LOGISTIC", "TANH"} <= set(q.tflite_float_ops) and q.tflite_float_ops["LOGISTIC"] == ["rnn"]
    one, sixteen = run_batched(tmp_path / "m.tflite", x[16:], 1), run_batched(tmp_path / "m.tflite", x[16:], 16)
    np.testing.assert_array_equal(one, sixteen)
    assert rel_error(one, want) < 0.05
    assert model.get_layer("rnn").get_config().get("unroll", False) is False  # the model is left as it was


def test_without_selective_quantization_it_warns_and_converts_all_int8(tmp_path, monkeypatch):
    from tensorflow.lite.python import convert

    monkeypatch.delattr(convert, "mlir_quantize")
    q = ctf.PtqQuantizer(attention_model(), [{**CFG, "op_types": ["Dense"]}])
    q.calibrate(tokens(8))
    with pytest.warns(RuntimeWarning, match=r"no selective quantization .* every op of the \.tflite is int8"):
        q.export_model(tflite_path=tmp_path / "m.tflite", verbose=False)
    assert q.tflite_float_ops == {} and op_dtypes(tmp_path / "m.tflite")["SOFTMAX"] == {"int8"}


def bigru_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,), dtype="int32")
    h = L.Bidirectional(L.GRU(6), name="rnn")(L.Embedding(20, 8, name="emb")(inp))
    return keras.Model(inp, L.Dense(3, name="fc")(h))


def quant_tables(blob: bytes) -> dict[int, tuple[int, tuple]]:
    """``{tensor index: (position of its quantization table in the flatbuffer, (scales, zero points, axis))}``
    of the tensors with a scale."""
    from tensorflow.lite.python import schema_py_generated as schema

    sub = schema.Model.GetRootAs(bytearray(blob), 0).Subgraphs(0)
    out = {}
    for i in range(sub.TensorsLength()):
        q = sub.Tensors(i).Quantization()
        if q is not None and q.ScaleLength():
            out[i] = (q._tab.Pos, (q.ScaleAsNumpy().tobytes(), q.ZeroPointAsNumpy().tobytes(), q.QuantizedDimension()))
    return out


def test_strip_names_makes_the_recurrent_tflite_smaller_and_bit_identical(tmp_path):
    """The converter names each tensor of an unrolled GRU after every op fused into it; the export rewrites
    them as ``t<index>`` (issue 23: the int8 file must be smaller than the float one). Inputs, outputs,
    signatures and the weight names ``compressor report`` lists stay; the interpreter computes the same bits."""
    from compressor.app.report import read_weights
    from compressor.tf.tflite import compact_tflite

    q = ctf.PtqQuantizer(bigru_model(), [{**CFG, "op_types": ["Dense"]}])
    x = tokens(17)
    q.calibrate(x[:16])
    q.export_model(tflite_path=tmp_path / "raw.tflite", strip_names=False, verbose=False)
    q.export_model(tflite_path=tmp_path / "m.tflite", verbose=False)  # strip_names=True: the default
    raw, exported = (tmp_path / "raw.tflite").read_bytes(), (tmp_path / "m.tflite").read_bytes()
    # two conversions number the tensors differently, so the rewrite is checked on one: raw -> small
    small = compact_tflite(raw)
    (tmp_path / "small.tflite").write_bytes(small)
    assert compact_tflite(exported) == exported  # the export's file is already rewritten
    assert len(small) < 0.8 * len(raw) and len(exported) < 0.8 * len(raw)
    for batch in (1, 16):
        np.testing.assert_array_equal(run_batched(tmp_path / "small.tflite", x[:16], batch),
                                      run_batched(tmp_path / "raw.tflite", x[:16], batch))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = tf.lite.Interpreter(model_content=raw), tf.lite.Interpreter(model_content=small)
    for details in ("get_input_details", "get_output_details"):
        assert [d["name"] for d in getattr(b, details)()] == [d["name"] for d in getattr(a, details)()]
    assert b.get_signature_list() == a.get_signature_list()
    key = a.get_signature_list()["serving_default"]["inputs"][0]
    want = a.get_signature_runner()(**{key: x[16:]})
    got = b.get_signature_runner()(**{key: x[16:]})
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    # every other tensor is t<index>, but the weights of FULLY_CONNECTED, which keep their first name part
    raw_names = {t["index"]: t["name"] for t in a.get_tensor_details()}
    io = {d["index"] for d in a.get_input_details() + a.get_output_details()}
    weights = {op["inputs"][1] for op in b._get_ops_details() if op["op_name"] == "FULLY_CONNECTED"}
    assert {t["index"]: t["name"] for t in b.get_tensor_details()} == {
        i: n if i in io else n.split(";")[0] if i in weights else f"t{i}" for i, n in raw_names.items()}
    assert len(raw_names) > 250  # two directions x 6 steps unrolled
    # tensors with equal quantization parameters share one table (unrolled steps of one kernel, ...)
    before, after = quant_tables(raw), quant_tables(small)
    assert {i: c for i, (_, c) in after.items()} == {i: c for i, (_, c) in before.items()}  # same values
    assert len({p for p, _ in before.values()}) == len(before) > 40  # the converter: one table per tensor
    tables = {c: {p for i, (p, c2) in after.items() if c2 == c} for _, c in after.values()}
    assert all(len(ps) == 1 for ps in tables.values())  # ... compacted: one per distinct content
    assert len({p for p, _ in after.values()}) == len({c for _, c in before.values()}) < len(before)
    # compressor report reads the same weights under the same (shortened) names
    (wa, _), (wb, _) = read_weights(tmp_path / "raw.tflite"), read_weights(tmp_path / "small.tflite")
    assert [n for n, _ in wb] == [n.split(";")[0] for n, _ in wa]
    assert all(np.array_equal(u, v) for (_, u), (_, v) in zip(wa, wb, strict=True))


def test_strip_names_without_the_schema_module_warns_and_keeps_the_file(monkeypatch):
    from tensorflow.lite.python import schema_py_generated  # noqa: F401 (loaded, as after any conversion)

    from compressor.tf.tflite import compact_tflite

    monkeypatch.setitem(sys.modules, "tensorflow.lite.python.schema_py_generated", None)
    monkeypatch.delattr(sys.modules["tensorflow.lite.python"], "schema_py_generated")
    with pytest.warns(RuntimeWarning, match=r"not compacted \(short tensor names, shared quantization tables\): .*schema_py_generated"):
        assert compact_tflite(b"not read") == b"not read"


def test_strip_names_must_be_a_bool(tmp_path):
    q = ctf.PtqQuantizer(attention_model(), [{**CFG, "op_types": ["Dense"]}])
    q.calibrate(tokens(4))
    with pytest.raises(ConfigError, match="strip_names must be True or False, got 'yes'"):
        q.export_model(tflite_path=tmp_path / "m.tflite", strip_names="yes", verbose=False)
    assert not (tmp_path / "m.tflite").exists()
