"""Issue 23 on Keras: the prune -> speedup -> fine-tune -> PTQ -> int8 TFLite pipeline on real models, and
the pieces it needed: DenseNet's norms after concatenations, keras.ops activations (MobileNetV3's
hard-sigmoid), ConvNeXt's ``Conv2D(groups=C)`` depthwise convs, 'default' = Conv + Dense without the
classifier, PTQ of token-input / attention / recurrent models, ``calibrate`` inputs, MACs of recurrent and
attention layers.

The pipeline (``tests/tf/_keras_pipeline.py``; ``python tests/tf/_keras_pipeline.py NAME`` prints the
measurements) on keras.applications at 32x32 takes 25-90 s per model: the text transformer, the LSTM and
MobileNetV3Small run in the fast suite, the other applications are ``slow``."""

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
from compressor.core.errors import ConfigWarning
from compressor.tf import build_graph, count_flops_params, speedup_model

sys.path.insert(0, os.path.dirname(__file__))
import _keras_pipeline as P  # noqa: E402

pytestmark = pytest.mark.tf
L = keras.layers


# ------------------------------------------------------------------------------------------ MACs
def test_recurrent_macs_per_sample():
    inp = keras.Input((5, 3))
    h = L.SimpleRNN(4, return_sequences=True, name="rnn")(inp)
    h = L.GRU(2, return_sequences=True, name="gru")(h)
    h = L.LSTM(3, name="lstm")(h)
    model = keras.Model(inp, L.Dense(2, name="fc")(h))
    macs, params, rows = count_flops_params(model)
    per = {r["name"]: r["macs"] for r in rows}
    # T * gates * (d * u + u * u): 5*1*(3*4+16), 5*3*(4*2+4), 5*4*(2*3+9); fc 3*2
    assert per == {"rnn": 140, "gru": 180, "lstm": 300, "fc": 6}
    assert macs == 626 and params == model.count_params()


def test_bidirectional_counts_both_directions():
    inp = keras.Input((5, 3))
    model = keras.Model(inp, L.Bidirectional(L.LSTM(4), name="bi")(inp))
    assert count_flops_params(model)[0] == 2 * 5 * 4 * (3 * 4 + 16)


def test_attention_macs_self_and_cross():
    q_in, v_in = keras.Input((4, 6)), keras.Input((7, 5))
    cross = L.MultiHeadAttention(2, 3, value_dim=4, name="cross")(q_in, v_in)
    model = keras.Model([q_in, v_in], cross)
    # projections 4*6*2*3 + 7*5*2*3 + 7*5*2*4, Q@K^T 2*4*7*3, attn@V 2*4*7*4, output 4*(2*4)*6
    assert count_flops_params(model)[0] == 144 + 210 + 280 + 168 + 224 + 192
    x = keras.Input((4, 6))
    model = keras.Model(x, L.MultiHeadAttention(2, 3, value_dim=4, name="self")(x, x))
    assert count_flops_params(model)[0] == 144 + 144 + 192 + 96 + 128 + 192


# ------------------------------------------------------------------------------------------ graph
def test_keras_ops_activations_pass_channels():
    """MobileNetV3's hard-sigmoid (``ReLU6(x + 3) * (1/6)``) and activations written as keras.ops."""
    inp = keras.Input((6, 6, 3))
    a = L.Conv2D(8, 1, name="a")(inp)
    h = L.ReLU(6.0)(a + 3.0) * (1.0 / 6.0)
    h = keras.ops.relu6(keras.ops.hard_silu(h) - a)
    out = L.Conv2D(2, 1, name="b")(h)
    graph, _ = build_graph(keras.Model(inp, out))
    kinds = {n.op: (n.kind, n.attrs.get("zero_preserving", n.attrs.get("zero"))) for n in graph.nodes}
    assert kinds["Add"] == ("activation", False)  # 0 + 3 != 0
    assert kinds["Multiply"] == ("activation", True)
    assert kinds["HardSilu"] == ("activation", True) and kinds["Relu6"] == ("activation", True)
    assert kinds["Subtract"] == ("elementwise", "all")


def test_unknown_op_warning_names_op_and_layers():
    inp = keras.Input((6, 6, 3))
    a = L.Conv2D(8, 1, name="a")(inp)
    h = keras.ops.flip(a, axis=-1)  # channel order reversed: not a per-channel op
    model = keras.Model(inp, L.Conv2D(2, 1, name="b")(h))
    with pytest.warns(ConfigWarning, match=r"'a': its channels reach Flip 'flip[^']*'") as rec:
        pruner = ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], dependency_aware=True)
    assert list(pruner.skipped) == ["a"] and not pruner.get_modules_wrapper()
    assert len([r for r in rec if "keep all their channels" in str(r.message)]) == 1


def test_grouped_conv_with_groups_equal_channels_is_depthwise():
    """ConvNeXt writes depthwise convs as Conv2D(groups=C); multiplier 2 here (filters = 2C)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 3))
    a = L.Conv2D(4, 1, name="a")(inp)
    d = L.Conv2D(8, 3, padding="same", groups=4, name="dw")(a)
    model = keras.Model(inp, L.GlobalAveragePooling2D()(L.Conv2D(2, 1, name="b")(d)))
    graph, _ = build_graph(model)
    assert graph.by_name["dw"].kind == "depthwise" and graph.by_name["dw"].attrs["multiplier"] == 2
    pruner = ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], dependency_aware=True)
    pruner.compress()
    assert sorted(w.name for w in pruner.get_modules_wrapper()) == ["a", "dw"]  # b: the classifier
    keep_a = np.flatnonzero(pruner.get_modules_wrapper()[0].bias_mask.numpy())
    small = speedup_model(pruner)
    dw = small.get_layer("dw")
    assert (dw.filters, dw.groups, small.get_layer("a").filters) == (4, 2, 2)
    kernel = model.get_layer("dw").get_weights()[0]
    np.testing.assert_array_equal(dw.get_weights()[0], kernel[..., np.sort(np.r_[2 * keep_a, 2 * keep_a + 1])])
    x = np.random.default_rng(0).standard_normal((2, 6, 6, 3)).astype("float32")
    np.testing.assert_allclose(small(x), pruner.bound_model(x), rtol=1e-5, atol=1e-5)


def test_norm_after_concat_densenet_block():
    """DenseNet: x -> [x, conv(relu(bn(x)))] -> bn -> conv; the norm after the concat is masked with both
    producers, each losing floor(F/2) of its own filters, and speedup removes exactly those."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 3))
    x = L.Conv2D(8, 3, padding="same", name="stem")(inp)
    for i in range(2):
        y = L.Conv2D(4, 3, padding="same", name=f"c{i}")(L.ReLU()(L.BatchNormalization(name=f"bn{i}")(x)))
        x = L.Concatenate()([x, y])
    x = L.Conv2D(6, 1, name="trans")(L.ReLU()(L.BatchNormalization(name="bnt")(x)))
    model = keras.Model(inp, L.Dense(2, name="fc")(L.GlobalAveragePooling2D()(x)))
    pruner = ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], dependency_aware=True)
    pruner.compress()
    small = speedup_model(pruner)
    got = {n: small.get_layer(n).filters for n in ("stem", "c0", "c1", "trans")}
    assert got == {"stem": 4, "c0": 2, "c1": 2, "trans": 3}
    assert [small.get_layer(f"bn{i}").gamma.shape[0] for i in range(2)] + [small.get_layer("bnt").gamma.shape[0]] \
        == [4, 6, 8]
    x = np.random.default_rng(0).standard_normal((2, 6, 6, 3)).astype("float32")
    np.testing.assert_allclose(small(x), pruner.bound_model(x), rtol=1e-4, atol=1e-5)


def test_default_is_conv_and_dense_without_the_classifier():
    inp = keras.Input((10,))
    h = L.Dense(8, activation="relu", name="fc1")(inp)
    model = keras.Model(inp, L.Dense(3, name="fc")(h))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pruner = ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    assert [w.name for w in pruner.get_modules_wrapper()] == ["fc1"]
    named = ctf.L1FilterPruner(P.lstm_classifier(), [{"sparsity": 0.5, "op_types": ["default", "Dense"]}])
    assert [w.name for w in named.get_modules_wrapper()] == ["fc1", "fc"]  # named by type: pruned


# ------------------------------------------------------------------------------------------ PTQ inputs
def _dense_model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    return keras.Model(inp, L.Dense(2, name="fc")(L.Dense(3, name="fc1")(inp)))


@pytest.mark.parametrize("kind", ["array", "tensor", "xy_tuples", "dataset_xy", "dataset_x", "list"])
def test_calibrate_accepts_what_users_hold(kind):
    x = np.random.default_rng(0).standard_normal((8, 4)).astype("float32")
    y = np.zeros((8, 2), "float32")
    data = {"array": x, "tensor": tf.constant(x), "xy_tuples": [(x[:4], y[:4]), (x[4:], y[4:])],
            "dataset_xy": tf.data.Dataset.from_tensor_slices((x, y)).batch(4),
            "dataset_x": tf.data.Dataset.from_tensor_slices(x).batch(4), "list": [x[:4], x[4:]]}[kind]
    ref = ctf.PtqQuantizer(_dense_model(), [{"op_types": ["Dense"], "quant_types": ["input", "weight", "output"], "quant_bits": 8}])
    ref.calibrate([x])
    q = ctf.PtqQuantizer(_dense_model(), [{"op_types": ["Dense"], "quant_types": ["input", "weight", "output"], "quant_bits": 8}])
    q.calibrate(data)
    for a, b in zip(ref.get_modules_wrapper(), q.get_modules_wrapper()):
        assert float(a.output_scale.numpy()) == pytest.approx(float(b.output_scale.numpy()))


def test_calibrate_dict_inputs_of_a_multi_input_model():
    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), dtype="int32", name="b")
    h = L.Concatenate()([a, keras.ops.cast(b, "float32")])
    model = keras.Model({"a": a, "b": b}, L.Dense(2, name="fc")(h))
    q = ctf.PtqQuantizer(model, [{"op_types": ["Dense"], "quant_types": ["input", "weight", "output"], "quant_bits": 8}])
    rng = np.random.default_rng(0)
    batches = [({"a": rng.standard_normal((4, 3)).astype("float32"), "b": rng.integers(0, 3, (4, 2)).astype("int32")},
                np.zeros((4, 2))) for _ in range(2)]
    q.calibrate(batches)
    assert q.calibrated and q._samples[0]["b"].dtype == np.int32


def test_tflite_conversion_logs_its_progress(tmp_path, caplog):
    q = ctf.PtqQuantizer(_dense_model(), [{"op_types": ["Dense"], "quant_types": ["input", "weight", "output"], "quant_bits": 8}])
    q.calibrate(np.random.default_rng(0).standard_normal((8, 4)).astype("float32"))
    with caplog.at_level(logging.INFO, logger="compressor.tf.ptq"):
        q.export_model(tmp_path / "m.keras", tmp_path / "c.json", tflite_path=tmp_path / "m.tflite")
    msgs = [r.getMessage() for r in caplog.records if r.name == "compressor.tf.ptq"]
    assert len(msgs) == 2 and "converting" in msgs[0] and "done in" in msgs[1] and "bytes" in msgs[1]


def test_tflite_conversion_prints_when_nobody_logs(tmp_path, capfd):
    q = ctf.PtqQuantizer(_dense_model(), [{"op_types": ["Dense"], "quant_types": ["input", "weight", "output"],
                                           "quant_bits": 8}])
    q.calibrate(np.random.default_rng(0).standard_normal((8, 4)).astype("float32"))
    logging.getLogger("compressor.tf.ptq").setLevel(logging.WARNING)
    try:
        q.export_model(tmp_path / "m.keras", tmp_path / "c.json", tflite_path=tmp_path / "a.tflite")
        lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("PtqQuantizer:")]
        assert len(lines) == 2 and "done in" in lines[1]
        q.export_model(tmp_path / "m.keras", tmp_path / "c.json", tflite_path=tmp_path / "b.tflite", verbose=False)
        assert not [x for x in capfd.readouterr().err.splitlines() if x.startswith("PtqQuantizer:")]
    finally:
        logging.getLogger("compressor.tf.ptq").setLevel(logging.NOTSET)


def test_attention_is_quantized_through_its_projections():
    model = P.text_transformer()
    q = ctf.PtqQuantizer(model, [{"op_types": ["MultiHeadAttention", "Dense"],
                                  "quant_types": ["input", "weight", "output"], "quant_bits": 8}])
    assert [w.name for w in q.get_modules_wrapper()] == [
        "mha/query", "mha/key", "mha/value", "mha/attention_output", "ffn1", "ffn2", "fc"]
    q.calibrate([P.make_data("text", 4, seed=i) for i in range(2)])
    assert all(float(w.weight_scale.numpy().max()) > 0 for w in q.get_modules_wrapper())


# ------------------------------------------------------------------------------------------ pipeline
def check_pipeline(name, tmp_path):
    res = P.pipeline(name, str(tmp_path))
    assert res["zero_filters"] == {}, res["zero_filters"]  # strict speedup left no removable zero filter
    assert res["pruned_params"] < res["params"]
    # every Conv / Dense / EinsumDense is an int8 kernel in the artifact (the LSTM's unrolled steps add more)
    assert res["not_int8"] == [] and res["int8_weighted_ops"] >= res["weighted_layers"], res
    assert res["io_dtypes"]["output"] == np.int8
    assert res["int8_bytes"] < res["float_bytes"], (res["int8_bytes"], res["float_bytes"])
    assert res["agreement"] >= 0.9 or res["rel_err"] < 0.1, (res["agreement"], res["rel_err"])
    assert res["batch16_max_diff"] == 0.0  # a dynamic batch: 16 at once gives the outputs of 16 single runs
    return res


@pytest.mark.parametrize("name", ["text", "lstm", "MobileNetV3Small"])
def test_pipeline_fast_cases(name, tmp_path):
    """The text transformer and LSTM classifier (5 s each) and the one keras.applications case of the fast
    suite (~35 s: MobileNetV3Small, the hard-swish / squeeze-excite model of item 5). The text and LSTM
    artifacts agree with the fake-quant model as closely as the CNNs do (their softmax, norms and gates stay
    float: tflite_int8='auto'; all in int8 they were 0.19 / 0.23 relative error away)."""
    res = check_pipeline(name, tmp_path)
    if name in ("text", "lstm"):
        assert res["agreement"] >= 0.98 and res["rel_err"] <= 0.05, (res["agreement"], res["rel_err"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ResNet50", "MobileNetV2", "EfficientNetB0", "DenseNet121", "ConvNeXtTiny"])
def test_pipeline_real_models(name, tmp_path):
    check_pipeline(name, tmp_path)
