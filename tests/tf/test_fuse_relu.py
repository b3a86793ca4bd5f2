"""Keras ``fuse_relu`` (PtqQuantizer default, QAT_Quantizer opt-in): a layer feeding only a ReLU layer
quantizes relu(output), as the torch backend does and as TFLite's fused Conv+ReLU kernels compute."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from compressor.core.errors import ConfigError
from compressor.tf import PtqQuantizer, QAT_Quantizer

TYPES = ["input", "weight", "output"]


def model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 3))
    a = keras.layers.ReLU()(keras.layers.Conv2D(4, 3, name="c1")(inp))                # fused
    b = keras.layers.Activation("relu")(keras.layers.Conv2D(4, 1, name="c2")(a))      # fused
    c = keras.layers.Conv2D(4, 1, name="c3")(b)                                        # feeds add and relu
    d = keras.layers.Add()([keras.layers.ReLU()(c), c])
    e = keras.layers.ReLU(max_value=6.0)(keras.layers.Conv2D(4, 1, name="c4")(d))     # ReLU6: not fused
    f = keras.layers.Conv2D(4, 1, activation="relu", name="c5")(e)                     # own activation
    return keras.Model(inp, keras.layers.Dense(2, name="fc")(keras.layers.Flatten()(f)))


def test_fused_layers_and_zero_based_output_range():
    m = model()
    x = np.random.default_rng(0).standard_normal((16, 6, 6, 3)).astype(np.float32)
    q = PtqQuantizer(m, [{"op_types": ["Conv2D", "Dense"], "quant_types": TYPES, "quant_bits": 8}], bn_fold=False)
    fused = {w.name: bool(w.fused_relu) for w in q.get_modules_wrapper()}
    assert fused == {"c1": True, "c2": True, "c3": False, "c4": False, "c5": False, "fc": False}
    q.calibrate([x])
    zp = {w.name: float(np.asarray(w.output_zero_point)) for w in q.get_modules_wrapper()}
    # relu outputs start at 0 (c5's own activation too); c3 and c4 see negative values
    assert zp["c1"] == zp["c2"] == zp["c5"] == 0.0 and zp["c3"] > 0 and zp["c4"] > 0
    c1 = m.get_layer("c1")
    hi = float(np.maximum(np.asarray(keras.ops.conv(x, c1.kernel) + c1.bias), 0).max())
    w1 = next(w for w in q.get_modules_wrapper() if w.name == "c1")
    np.testing.assert_allclose(float(np.asarray(w1.output_scale)), hi / 255, rtol=1e-6)


def test_qat_is_opt_in_and_checks_its_argument():
    cfg = [{"op_types": ["Conv2D", "Dense"], "quant_types": TYPES, "quant_bits": 8}]
    assert not any(bool(w.fused_relu) for w in QAT_Quantizer(model(), cfg).get_modules_wrapper())
    q = QAT_Quantizer(model(), cfg, fuse_relu=True)
    assert sorted(w.name for w in q.get_modules_wrapper() if w.fused_relu) == ["c1", "c2"]
    with pytest.raises(ConfigError, match="fuse_relu must be True or False"):
        QAT_Quantizer(model(), cfg, fuse_relu=1)


def test_shared_ranges_lenet():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from examples.models_tf import lenet_5

    keras.utils.set_random_seed(0)
    m = lenet_5(10, 28)
    x = np.random.default_rng(0).standard_normal((32, 28, 28, 1)).astype(np.float32)
    cfg = [{"op_types": ["Conv2D", "Dense"], "quant_types": TYPES, "quant_bits": 8}]
    q = PtqQuantizer(m, cfg, bn_fold=False)
    assert q.shared_inputs() == {"conv2": "conv1", "fc1": "conv2", "fc2": "fc1"}
    q.calibrate([x])
    w = {w.name: w for w in q.get_modules_wrapper()}
    for name, src in q.shared_inputs().items():
        np.testing.assert_array_equal(np.asarray(w[name].input_scale), np.asarray(w[src].output_scale))
        np.testing.assert_array_equal(np.asarray(w[name].input_zero_point), np.asarray(w[src].output_zero_point))
    assert PtqQuantizer(lenet_5(10, 28), cfg, bn_fold=False, share_ranges=False).shared_inputs() == {}
    with pytest.raises(ConfigError, match="share_ranges must be True or False"):
        PtqQuantizer(lenet_5(10, 28), cfg, share_ranges="no")


@pytest.mark.parametrize("observer", ["minmax", "percentile"])
def test_tflite_carries_our_activation_ranges(tmp_path, observer):
    """The converter calibrates activations itself (min/max). A percentile observer clips outliers; the
    exported graph clips to our ranges, so the .tflite's conv output scale is ours, not the raw max's."""
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 3))
    y = keras.layers.ReLU()(keras.layers.Conv2D(4, 3, name="c1")(inp))
    m = keras.Model(inp, keras.layers.Dense(2, name="fc")(keras.layers.Flatten()(y)))
    x = np.random.default_rng(0).standard_normal((64, 6, 6, 3)).astype(np.float32)
    x[0] *= 20  # one outlier sample: min-max follows it, the 99 % percentile does not
    q = PtqQuantizer(m, [{"op_types": ["Conv2D", "Dense"], "quant_types": TYPES, "quant_bits": 8}], bn_fold=False,
                     observer=observer, percentile=99.0)
    q.calibrate([x])
    path = tmp_path / "m.tflite"
    q.export_model(tflite_path=path)
    ours = float(np.asarray(next(w for w in q.get_modules_wrapper() if w.name == "c1").output_scale))
    it = tf.lite.Interpreter(model_path=str(path))
    it.allocate_tensors()
    ops = it._get_ops_details()
    conv = next(o for o in ops if o["op_name"] == "CONV_2D")
    details = {d["index"]: d for d in it.get_tensor_details()}
    # the conv's int8 output, or the clip that follows it: the tensor feeding the next layer carries our scale
    fc = next(o for o in ops if o["op_name"] == "FULLY_CONNECTED")
    scales = {float(details[conv["outputs"][0]]["quantization"][0]),
              float(details[fc["inputs"][0]]["quantization"][0])}
    # percentile: our range exactly (the exported graph clips to it). min-max: the converter's own min/max
    # on the same data, but through the already quantized weights, so within a fraction of a percent
    tol = 1e-6 if observer == "percentile" else 5e-3
    assert any(abs(s - ours) <= tol * ours for s in scales), (scales, ours)
    raw = float(np.maximum(np.asarray(keras.ops.conv(x, m.get_layer("c1").kernel) + m.get_layer("c1").bias), 0).max())
    assert (ours < 0.5 * raw / 255) if observer == "percentile" else (abs(ours - raw / 255) <= 1e-6 * ours)
    it.set_tensor(it.get_input_details()[0]["index"], x[1:2])
    it.invoke()
    got = it.get_tensor(it.get_output_details()[0]["index"])
    want = np.asarray(m(x[1:2], training=False))
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max() + 1e-6
