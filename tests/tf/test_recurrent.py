"""Recurrent, embedding and attention layers under Keras pruners and quantizers: one slot per weight
matrix (compressor.tf.slots), exact floor(n * s) per matrix, masks that hold through fit, quantized
matrices in the call, export / reload / mask files, TFLite of recurrent models, clear refusals."""

from __future__ import annotations

import math
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import compressor.tf as ctf
from compressor.core.errors import ConfigError
from compressor.core.matching import DefaultSkipWarning
from compressor.tf.compressor import iter_layers
from compressor.tf.pruning.export import apply_compression_results

pytestmark = pytest.mark.filterwarnings("ignore:.*match no layer:compressor.core.errors.ConfigWarning")
L = keras.layers
TYPES = ["Embedding", "LSTM", "GRU", "SimpleRNN", "MultiHeadAttention", "LSTMCell"]
T = 6


def text_model(seq=T, seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((seq,), dtype="int32")
    h = L.Embedding(30, 8, name="emb")(inp)
    h = L.MultiHeadAttention(2, 4, name="mha")(h, h)
    h = L.Bidirectional(L.LSTM(5, return_sequences=True, name="lstm"), name="bi")(h)
    h = L.GRU(4, return_sequences=True, name="gru")(h)
    h = L.RNN(L.LSTMCell(3, name="cell"), return_sequences=True, name="rnn")(h)
    h = L.SimpleRNN(3, name="srnn")(h)
    return keras.Model(inp, L.Dense(2, name="fc")(h))


def tokens(n=8, seq=T, seed=1):
    return np.random.default_rng(seed).integers(0, 30, (n, seq)).astype("int32")


def target(n=8):
    return np.random.default_rng(2).normal(size=(n, 2)).astype("float32")


def test_every_matrix_is_its_own_slot_with_exact_counts():
    m = text_model()
    p = ctf.LevelPruner(m, [{"sparsity": 0.3, "op_types": TYPES}])
    p.compress()
    names = [w.name for w in p.get_modules_wrapper()]
    rec = [f"{layer}/{k}" for layer in ("bi/forward_lstm", "bi/backward_lstm", "gru", "rnn", "srnn")
           for k in ("kernel", "recurrent_kernel")]
    assert names == ["emb", "mha/query", "mha/key", "mha/value", "mha/attention_output", *rec]
    for w in p.get_modules_wrapper():
        n = int(np.prod(w.weight.shape))
        assert int((~w.weight_mask.numpy()).sum()) == math.floor(n * 0.3), w.name
        assert int((w.weight.numpy() == 0).sum()) == math.floor(n * 0.3), w.name  # zeroed in place
    # ('SimpleRNN' ~ 'RNN' selects keras.layers.RNN too: its cell is covered, not selected twice)
    assert int((m.get_layer("rnn").cell.recurrent_kernel.numpy() == 0).sum()) == math.floor(3 * 12 * 0.3)
    assert [k for k in vars(m.get_layer("gru")) if k.startswith("_compressor")] == [
        "_compressor_pruner__kernel", "_compressor_pruner__recurrent_kernel"]


def test_an_lstm_cell_inside_rnn_prunes_both_its_kernels():
    m = text_model()
    p = ctf.LevelPruner(m, [{"sparsity": 0.5, "op_types": ["LSTMCell"]}])
    p.compress()
    names = [w.name for w in p.get_modules_wrapper()]  # the cells of the LSTM layers too
    assert names[-2:] == ["rnn/cell/kernel", "rnn/cell/recurrent_kernel"] and len(names) == 6
    cell = m.get_layer("rnn").cell
    assert int((cell.kernel.numpy() == 0).sum()) == 4 * 12 // 2
    assert int((cell.recurrent_kernel.numpy() == 0).sum()) == 3 * 12 // 2


def test_magnitude_order_in_the_canonical_layout():
    m = text_model()
    kernel = m.get_layer("gru").cell.kernel.numpy().copy()
    p = ctf.LevelPruner(m, [{"sparsity": 0.5, "op_types": ["GRU"]}])
    p.compress()
    mask = p.get_modules_wrapper()[0].weight_mask.numpy()
    assert np.abs(kernel[mask]).min() >= np.abs(kernel[~mask]).max()


def test_masks_hold_through_fit_and_mask_file_applies(tmp_path):
    m = text_model()
    m.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    p = ctf.LevelPruner(m, [{"sparsity": 0.5, "op_types": TYPES}], m.optimizer)
    p.compress()
    m.fit(tokens(), target(), epochs=2, batch_size=4, verbose=0)
    for w in p.get_modules_wrapper():
        assert not w.weight.numpy()[~w.weight_mask.numpy()].any(), w.name
    p.export_model(str(tmp_path / "m.keras"), mask_path=str(tmp_path / "masks.npz"))
    x = tokens(4, seed=3)
    reloaded = keras.saving.load_model(str(tmp_path / "m.keras"))
    np.testing.assert_array_equal(reloaded.predict(x, verbose=0), m.predict(x, verbose=0))
    with np.load(tmp_path / "masks.npz") as z:
        assert "bi/forward_lstm/recurrent_kernel" in z.files and "mha/attention_output" in z.files
    other = text_model(seed=4)
    apply_compression_results(other, str(tmp_path / "masks.npz"))
    for w in p.get_modules_wrapper():
        layer = other.get_layer(w.layer.name) if "/" not in w.layer.path else None
        if w.name == "gru/recurrent_kernel":
            got = other.get_layer("gru").cell.recurrent_kernel.numpy()
            np.testing.assert_array_equal(got == 0, ~w.weight_mask.numpy())
        if w.name == "mha/value" and layer is not None:
            np.testing.assert_array_equal(layer._value_dense.kernel.numpy() == 0, ~w.weight_mask.numpy())


@pytest.mark.parametrize("name", ["QAT_Quantizer", "DoReFaQuantizer", "LsqQuantizer"])
def test_quantizers_quantize_every_matrix_in_the_call(name, tmp_path):
    m = text_model()
    m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    q = getattr(ctf, name)(m, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": TYPES}], m.optimizer)
    q.compress()
    m.fit(tokens(), target(), epochs=1, batch_size=4, verbose=0)
    x = tokens(4, seed=3)
    out = m.predict(x, verbose=0)
    calib = q.export_model(str(tmp_path / "q.keras"))
    assert "bi/backward_lstm/recurrent_kernel" in calib and "mha/attention_output" in calib
    reloaded = keras.saving.load_model(str(tmp_path / "q.keras"))
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), out, rtol=1e-5, atol=1e-6)
    for var in (reloaded.get_layer("gru").cell.recurrent_kernel, reloaded.get_layer("mha")._key_dense.kernel,
                reloaded.get_layer("emb").embeddings):
        assert len(np.unique(var.numpy())) <= 16  # 4 bits, per tensor
    q._unwrap_model()  # the float model (the quantizer writes no weight): the call really quantizes
    assert np.abs(m.predict(x, verbose=0) - out).max() > 1e-6
    q._wrap_model()


@pytest.mark.parametrize("cls, config, match", [
    ("QAT_Quantizer", {"quant_types": ["weight", "input"], "quant_bits": 8, "op_types": ["LSTM"]},
     r"'bi/forward_lstm' \(LSTM\): quant_types \['weight', 'input'\] is not supported"),
    ("QAT_Quantizer", {"quant_types": ["input"], "quant_bits": 8, "op_types": ["Embedding"]}, "token indices"),
    ("QAT_Quantizer", {"quant_types": ["weight"], "quant_bits": 8, "op_types": ["MultiHeadAttention"],
                       "quant_scheme": "per_channel_affine"}, "per_tensor"),
    ("L1FilterPruner", {"sparsity": 0.5, "op_types": ["GRU"]}, r"'gru/kernel' \(GRU\) is not supported"),
    ("LevelPruner", {"sparsity": 0.5, "op_types": ["Bidirectional"]},
     r"'bi' \(Bidirectional\) has no weight to prune; prunable: .*LSTM / GRU / SimpleRNN .*MultiHeadAttention"),
])
def test_refusals_leave_the_model_untouched(cls, config, match):
    m = text_model()
    before = [v.numpy().copy() for v in m.weights]
    with pytest.raises(ConfigError, match=match):
        getattr(ctf, cls)(m, [config])
    assert not any(k.startswith("_compressor") for _, layer in iter_layers(m) for k in vars(layer))
    assert all((a == v.numpy()).all() for a, v in zip(before, m.weights))


def test_default_says_what_it_leaves_out():
    m = text_model()
    total = sum(int(np.prod(v.shape)) for v in m.weights)

    def size(path):
        layers = dict(iter_layers(m))
        return sum(int(np.prod(v.shape)) for v in layers[path].weights)

    with pytest.warns(DefaultSkipWarning) as rec:
        p = ctf.LevelPruner(m, [{"sparsity": 0.5, "op_types": ["default"]}])
    assert [w.name for w in p.get_modules_wrapper()] == ["fc"]
    msg = str(rec[0].message)
    lstm = size("bi/forward_lstm") + size("bi/backward_lstm")
    assert f"LSTM (2 layers, {lstm / total:.1%} of the parameters)" in msg
    assert f"MultiHeadAttention (1 layer, {size('mha') / total:.1%} of the parameters)" in msg
    assert f"Embedding (1 layer, {size('emb') / total:.1%} of the parameters)" in msg
    assert "RNN (1 layer" in msg and "SimpleRNN (1 layer" in msg and "GRU (1 layer" in msg


# ------------------------------------------------------------------------------------------ TFLite
def conv_lstm(seq=12):
    keras.utils.set_random_seed(0)
    inp = keras.Input((seq,), dtype="int32")
    h = L.Embedding(40, 8, name="emb")(inp)
    h = L.Conv1D(8, 3, padding="same", activation="relu", name="conv")(h)
    h = L.LSTM(6, name="lstm")(h)
    return keras.Model(inp, L.Dense(2, name="fc")(h))


def tflite_run(path, x):
    interp = tf.lite.Interpreter(model_path=str(path))
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    interp.resize_tensor_input(inp["index"], list(x.shape))
    interp.allocate_tensors()
    interp.set_tensor(inp["index"], x.astype(inp["dtype"]))
    interp.invoke()
    y = interp.get_tensor(out["index"])
    if out["dtype"] == np.int8:
        scale, zero = out["quantization"]
        y = (y.astype(np.float32) - zero) * scale
    return y, {d["dtype"] for d in interp.get_tensor_details()}


def test_tflite_of_a_pruned_conv_lstm_runs_builtin_and_matches(tmp_path):
    m = conv_lstm()
    m.compile(optimizer="adam", loss="mse")
    p = ctf.LevelPruner(m, [{"sparsity": 0.5, "op_types": ["default", "LSTM", "Embedding"]}], m.optimizer)
    p.compress()
    x = tokens(6, seq=12)
    m.fit(x, target(6), epochs=1, verbose=0)
    p.export_model(tflite_path=str(tmp_path / "m.tflite"))
    got, _ = tflite_run(tmp_path / "m.tflite", x)
    np.testing.assert_allclose(got, m.predict(x, verbose=0), rtol=1e-4, atol=1e-5)
    assert m.get_layer("lstm").unroll is False  # the model is left as it was


def test_tflite_int8_of_a_qat_conv_lstm(tmp_path):
    m = conv_lstm()
    m.compile(optimizer="adam", loss="mse")
    q = ctf.QAT_Quantizer(m, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default", "LSTM"],
                               "quant_dtype": "int", "quant_scheme": "per_tensor_symmetric"}], m.optimizer)
    q.compress()
    x = tokens(8, seq=12)
    m.fit(x, target(), epochs=1, verbose=0)
    q.export_model(tflite_path=str(tmp_path / "q.tflite"),
                   representative_dataset=lambda: ([x[i:i + 1]] for i in range(8)))
    got, dtypes = tflite_run(tmp_path / "q.tflite", x)
    expected = m.predict(x, verbose=0)
    assert np.int8 in dtypes
    np.testing.assert_allclose(got, expected, atol=0.1 * float(np.ptp(expected)))


def test_tflite_of_a_variable_length_lstm(tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((None,), dtype="int32")
    m = keras.Model(inp, L.LSTM(4, name="lstm")(L.Embedding(40, 8)(inp)))
    q = ctf.QAT_Quantizer(m, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["LSTM"]}])
    q.compress()
    x = tokens(4, seq=5)
    with pytest.raises(ConfigError, match=r"full-integer int8 .* needs a fixed sequence length: \['lstm'\]"):
        q.export_model(tflite_path=str(tmp_path / "q.tflite"),
                       representative_dataset=lambda: ([x[i:i + 1]] for i in range(4)))
    assert os.listdir(tmp_path) == []  # nothing left behind
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        q.export_model(tflite_path=str(tmp_path / "q.tflite"))  # dynamic-range weights, select TF ops
    assert any("Flex delegate" in str(w.message) for w in rec)
    assert (tmp_path / "q.tflite").stat().st_size > 0
