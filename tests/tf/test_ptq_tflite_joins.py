"""Issue 27 (Keras): the PtqQuantizer's full-integer .tflite runs the joins of residual nets, MobileNets and
concat / pooling / depthwise models in int8: every ADD / CONCATENATION / AVERAGE_POOL_2D / MEAN /
DEPTHWISE_CONV_2D has int8 inputs and outputs, and the only float ops are the QUANTIZE of the float input and
the DEQUANTIZE of the float output (no DEQUANTIZE / QUANTIZE pair in the middle)."""

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

sys.path.insert(0, os.path.dirname(__file__))
import _keras_pipeline as P  # noqa: E402

pytestmark = pytest.mark.tf
L = keras.layers
CFG = {"quant_types": ["input", "weight", "output"], "quant_bits": 8}
KERNELS = {"Conv2D", "DepthwiseConv2D", "Dense"}
IO = {("QUANTIZE", "float32", "int8"): 1, ("DEQUANTIZE", "int8", "float32"): 1}


def op_table(path) -> collections.Counter:
    """``{(op, dtype of its first input, dtype of its output): count}`` of the .tflite."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        it = tf.lite.Interpreter(model_path=str(path))
    dt = {d["index"]: np.dtype(d["dtype"]).name for d in it.get_tensor_details()}
    return collections.Counter((op["op_name"], dt[op["inputs"][0]], dt[op["outputs"][0]])
                               for op in it._get_ops_details())


def float_inside(path) -> list[str]:
    """Ops with a float input or output other than the input QUANTIZE (first op) and output DEQUANTIZE (last)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        it = tf.lite.Interpreter(model_path=str(path))
    dt = {d["index"]: np.dtype(d["dtype"]).name for d in it.get_tensor_details()}
    ops = it._get_ops_details()
    assert ops[0]["op_name"] == "QUANTIZE" and ops[-1]["op_name"] == "DEQUANTIZE"
    return [op["op_name"] for op in ops[1:-1]
            if any(dt[i] == "float32" for i in list(op["inputs"]) + list(op["outputs"]) if i >= 0)]


def randomize_norms(model: keras.Model) -> None:
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            c = layer.gamma.shape[0]
            layer.set_weights([rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c), rng.normal(0, 0.1, c),
                               rng.uniform(0.5, 1.5, c)])


def export(model: keras.Model, shape: tuple[int, ...], path) -> tuple[np.ndarray, np.ndarray]:
    """Calibrate on 16 inputs, export, return (the artifact's, the fake-quant model's) outputs on 16 others."""
    randomize_norms(model)
    x = np.random.default_rng(0).standard_normal((32, *shape)).astype("float32")
    q = ctf.PtqQuantizer(model, [{**CFG, "op_types": sorted(KERNELS & {type(la).__name__ for la in model.layers})}])
    q.calibrate(x[:16])
    want = np.asarray(model(x[16:], training=False))
    q.export_model(tflite_path=path, verbose=False)
    assert q.tflite_float_ops == {}
    got, _ = P.run_tflite(str(path), x[16:])
    return got, want


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def resnet_v1_block() -> keras.Model:
    """conv-relu -> conv-BN (folded) -> residual add -> ReLU (fused into the ADD) -> global average pool."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    a = L.Conv2D(4, 3, padding="same", activation="relu", name="a")(inp)
    b = L.BatchNormalization(name="bn")(L.Conv2D(4, 3, padding="same", use_bias=False, name="b")(a))
    h = L.ReLU(name="relu")(L.Add(name="res")([a, b]))
    return keras.Model(inp, L.Dense(2, name="fc")(L.GlobalAveragePooling2D(name="gap")(h)))


def resnet_v2_block() -> keras.Model:
    """ResNetV2's pre-activation: a BN that follows an add (not foldable: MUL + ADD), ReLU, conv, add."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    a = L.Conv2D(4, 3, padding="same", name="stem")(inp)
    h = L.ReLU(name="pre_relu")(L.BatchNormalization(name="pre_bn")(a))
    h = L.Add(name="res")([a, L.Conv2D(4, 3, padding="same", name="b")(h)])
    h = L.GlobalAveragePooling2D(name="gap")(L.ReLU(name="post_relu")(L.BatchNormalization(name="post_bn")(h)))
    return keras.Model(inp, L.Dense(2, name="fc")(h))


def joins_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    a = L.Conv2D(4, 3, padding="same", activation="relu", name="a")(inp)
    d = L.DepthwiseConv2D(3, padding="same", activation="relu", name="dw")(a)
    h = L.AveragePooling2D(2, name="avg")(L.Concatenate(name="cat")([a, d]))
    h = L.GlobalAveragePooling2D(name="gap")(L.Conv2D(6, 1, name="pw")(h))
    return keras.Model(inp, L.Dense(2, name="fc")(h))


def test_residual_add_and_pooling_run_int8(tmp_path):
    got, want = export(resnet_v1_block(), (8, 8, 3), tmp_path / "v1.tflite")
    assert op_table(tmp_path / "v1.tflite") == {
        **IO, ("CONV_2D", "int8", "int8"): 2, ("ADD", "int8", "int8"): 1, ("MEAN", "int8", "int8"): 1,
        ("FULLY_CONNECTED", "int8", "int8"): 1}
    assert float_inside(tmp_path / "v1.tflite") == []
    assert (got.argmax(1) == want.argmax(1)).all() and rel_error(got, want) < 0.03


def test_pre_activation_batchnorm_runs_int8(tmp_path):
    got, want = export(resnet_v2_block(), (8, 8, 3), tmp_path / "v2.tflite")
    # each unfolded BN is an int8 MUL + ADD (its ReLU fused into the ADD); one more ADD is the residual
    assert op_table(tmp_path / "v2.tflite") == {
        **IO, ("CONV_2D", "int8", "int8"): 2, ("MUL", "int8", "int8"): 2, ("ADD", "int8", "int8"): 3,
        ("MEAN", "int8", "int8"): 1, ("FULLY_CONNECTED", "int8", "int8"): 1}
    assert float_inside(tmp_path / "v2.tflite") == []
    assert (got.argmax(1) == want.argmax(1)).all() and rel_error(got, want) < 0.03


def test_concat_average_pool_and_depthwise_run_int8(tmp_path):
    got, want = export(joins_model(), (8, 8, 3), tmp_path / "joins.tflite")
    assert op_table(tmp_path / "joins.tflite") == {
        **IO, ("CONV_2D", "int8", "int8"): 2, ("DEPTHWISE_CONV_2D", "int8", "int8"): 1,
        ("CONCATENATION", "int8", "int8"): 1, ("AVERAGE_POOL_2D", "int8", "int8"): 1, ("MEAN", "int8", "int8"): 1,
        ("FULLY_CONNECTED", "int8", "int8"): 1}
    assert float_inside(tmp_path / "joins.tflite") == []
    assert (got.argmax(1) == want.argmax(1)).all() and rel_error(got, want) < 0.03


@pytest.mark.slow
def test_keras_applications_mobilenet_v2_runs_int8(tmp_path):
    """keras.applications.MobileNetV2 (alpha 0.35, 32x32): 17 depthwise convs, 10 residual adds, ReLU6 fused."""
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2((32, 32, 3), alpha=0.35, weights=None, classes=10)
    got, want = export(model, (32, 32, 3), tmp_path / "mnv2.tflite")
    assert op_table(tmp_path / "mnv2.tflite") == {
        **IO, ("CONV_2D", "int8", "int8"): 35, ("DEPTHWISE_CONV_2D", "int8", "int8"): 17,
        ("ADD", "int8", "int8"): 10, ("MEAN", "int8", "int8"): 1, ("FULLY_CONNECTED", "int8", "int8"): 1,
        ("SOFTMAX", "int8", "int8"): 1}
    assert float_inside(tmp_path / "mnv2.tflite") == []
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9 and rel_error(got, want) < 0.05
