"""PtqQuantizer on Keras 3 (issue 15): exact calibrated scales, observers = core observers, frozen inference =
core fake-quant math, BN folding, full-integer TFLite export, bad input."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import compressor
from compressor import ConfigError
from compressor.core import quant as cq
from compressor.core.errors import ModelError
from compressor.core.observers import OBSERVERS
from compressor.core.ops import NumpyOps
from compressor.tf import PtqQuantizer
from compressor.tf.ops import ops as tf_ops

pytestmark = pytest.mark.tf

NP = NumpyOps()
ALL = [{"quant_types": ["input", "weight", "output"], "quant_bits": 8, "op_types": ["default"]}]
KERNEL = np.array([[0.5, -2.0], [-1.25, 0.75], [0.3, 1.5]], np.float32)  # Keras layout [in=3, out=2]
BIAS = np.array([0.1, -0.2], np.float32)


def hand_dense():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fc")])
    model.layers[0].kernel.assign(KERNEL)
    model.layers[0].bias.assign(BIAS)
    return model


def hand_data():
    return np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)


def cnn(seed=0, filters=(4, 8), bn=False):
    keras.utils.set_random_seed(seed)
    i = keras.Input((8, 8, 1))
    if bn:
        x = keras.layers.Conv2D(filters[0], 3, padding="same", name="c1")(i)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization(name="bn")(x))
    else:  # ReLU fused into the conv, as TFLite fuses it: both quantize the post-ReLU tensor
        x = keras.layers.Conv2D(filters[0], 3, padding="same", activation="relu", name="c1")(i)
    x = keras.layers.Conv2D(filters[1], 3, padding="same", activation="relu", name="c2")(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(i, keras.layers.Dense(10, name="fc")(x))


def images(n, seed=1):
    return np.random.default_rng(seed).random((n, 8, 8, 1)).astype(np.float32)


def fq(x, s, z, qmin, qmax):
    return cq.fake_quantize(NP, x, s, z, qmin, qmax)


# ----------------------------------------------------------------------------------- exact values


def test_hand_dense_scales_are_exact():
    model, x = hand_dense(), hand_data()
    q = PtqQuantizer(model, ALL).calibrate(x)
    w = q.get_modules_wrapper()[0]
    # weights: per output channel (Keras column), symmetric int8 [-127, 127]
    np.testing.assert_array_equal(w.weight_scale.numpy(), (np.abs(KERNEL).max(0) / np.float32(127)).astype(np.float32))
    np.testing.assert_array_equal(w.weight_zero_point.numpy(), [0, 0])
    # activations: per tensor affine uint8 from the observed float min / max
    s, z = cq.qparams(NP, x.min(), x.max(), 0, 255)
    assert w.input_scale.numpy() == np.float32(s) and w.input_zero_point.numpy() == z
    y = x @ KERNEL + BIAS
    s, z = cq.qparams(NP, y.min(), y.max(), 0, 255)
    np.testing.assert_allclose(w.output_scale.numpy(), s, rtol=1e-6)
    assert w.output_zero_point.numpy() == z
    np.testing.assert_allclose([w.tracked_min_output.numpy(), w.tracked_max_output.numpy()], [y.min(), y.max()],
                               rtol=1e-5)
    assert q.calibrated and bool(w.frozen.numpy())


def test_inference_after_calibrate_is_core_fake_quant_math():
    model, x = hand_dense(), hand_data()
    q = PtqQuantizer(model, ALL).calibrate(x)
    w = q.get_modules_wrapper()[0]
    test = np.random.default_rng(5).normal(size=(16, 3)).astype(np.float32) * 1.5  # some values clip
    xin = fq(test, w.input_scale.numpy(), w.input_zero_point.numpy(), 0, 255)
    k = fq(KERNEL, w.weight_scale.numpy()[None, :], w.weight_zero_point.numpy()[None, :], -127, 127)
    expected = fq(xin @ k + BIAS, w.output_scale.numpy(), w.output_zero_point.numpy(), 0, 255)
    for training in (False, True):  # frozen: training calls use the stored scales too
        np.testing.assert_allclose(model(test, training=training).numpy(), expected, atol=1e-5)
    np.testing.assert_allclose(model.predict(test, verbose=0), expected, atol=1e-5)
    # the float kernel is untouched
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), KERNEL)


def test_uncalibrated_model_is_float():
    model, x = hand_dense(), hand_data()
    PtqQuantizer(model, ALL)
    np.testing.assert_allclose(model(x).numpy(), x @ KERNEL + BIAS, atol=1e-6)


def test_configured_scheme_overrides_defaults():
    model, x = hand_dense(), hand_data()
    cfg = [{**ALL[0], "quant_dtype": "uint", "quant_scheme": "per_tensor_affine"}]
    w = PtqQuantizer(model, cfg).calibrate(x).get_modules_wrapper()[0]
    s, z = cq.qparams(NP, KERNEL.min(), KERNEL.max(), 0, 255)
    assert w.weight_scale.numpy() == np.float32(s) and w.weight_zero_point.numpy() == z


@pytest.mark.parametrize("method", sorted(OBSERVERS))
def test_each_observer_gives_the_core_observer_range(method):
    model, x = hand_dense(), hand_data()
    kw = {"percentile": 99.0, "grid_size": 10}
    q = PtqQuantizer(model, ALL, observer=method, batch_size=16, **kw).calibrate(x)
    w = q.get_modules_wrapper()[0]
    core_kw = {"percentile": {"percentile": 99.0}, "mse": {"grid_size": 10},
               "moving_average_minmax": {"decay": 0.99}}.get(method, {})
    obs = OBSERVERS[method](tf_ops, **core_kw)
    for i in range(0, len(x), 16):
        obs.observe(tf.constant(x[i:i + 16]))
    lo, hi = obs.range()
    np.testing.assert_allclose([w.tracked_min_input.numpy(), w.tracked_max_input.numpy()], [lo.numpy(), hi.numpy()],
                               rtol=1e-6)
    s, z = obs.qparams()
    np.testing.assert_allclose(w.input_scale.numpy(), s.numpy(), rtol=1e-6)
    assert w.input_zero_point.numpy() == z.numpy()


def test_dataset_of_pairs_and_num_batches():
    x = hand_data()
    ds = tf.data.Dataset.from_tensor_slices((x, np.zeros(len(x)))).batch(10)
    w = PtqQuantizer(hand_dense(), ALL).calibrate(ds, num_batches=2).get_modules_wrapper()[0]
    assert w.tracked_min_input.numpy() == x[:20].min() and w.tracked_max_input.numpy() == x[:20].max()
    w2 = PtqQuantizer(hand_dense(), ALL).calibrate([x[:5], x[5:20]]).get_modules_wrapper()[0]  # an iterable
    assert w2.tracked_max_input.numpy() == x[:20].max()


def test_dispatch_through_the_registry():
    q = compressor.PtqQuantizer(hand_dense(), ALL)
    assert isinstance(q, PtqQuantizer)


# ----------------------------------------------------------------------------------- BN folding


def test_bn_folding_keeps_the_float_function():
    model = cnn(bn=True)
    bn = model.get_layer("bn")
    rng = np.random.default_rng(3)
    bn.gamma.assign(rng.random(4) + 0.5)
    bn.beta.assign(rng.normal(size=4))
    bn.moving_mean.assign(rng.normal(size=4))
    bn.moving_variance.assign(rng.random(4) + 0.5)
    x = images(32)
    ref = model(x, training=False).numpy()
    q = PtqQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2D"]}])
    q.calibrate(x)
    assert q.folded == [("bn", "c1")]
    np.testing.assert_allclose(bn.gamma.numpy(), 1)
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0)
    q.strip()  # float behaviour of the folded model (stripping writes quantized kernels: compare loosely)
    np.testing.assert_allclose(model(x, training=False).numpy(), ref, atol=0.05)


def test_bn_fold_false_leaves_bn():
    model = cnn(bn=True)
    model.get_layer("bn").gamma.assign(np.full(4, 2.0))
    q = PtqQuantizer(model, ALL, bn_fold=False).calibrate(images(8))
    assert q.folded == []
    np.testing.assert_array_equal(model.get_layer("bn").gamma.numpy(), 2.0)


# ----------------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_and_model_untouched():
    model = cnn(bn=True)
    model.get_layer("bn").gamma.assign(np.full(4, 2.0))
    before = [v.numpy().copy() for v in model.weights]
    q = PtqQuantizer(model, ALL)
    w = q.get_modules_wrapper()[0]
    with pytest.raises(ConfigError, match="calibrate with at least one batch"):
        q.calibrate([])
    with pytest.raises(ConfigError, match="calibrate with at least one batch"):
        q.calibrate(np.zeros((0, 8, 8, 1), np.float32))
    with pytest.raises(ModelError, match=r"\(None, 8, 8, 1\)"):
        q.calibrate([images(4), np.zeros((4, 5, 5, 1), np.float32)])  # second batch bad: fold is undone
    with pytest.raises(ModelError, match=r"\(None, 8, 8, 1\)"):
        q.calibrate(np.full((4, 8, 8, 1), "a"))
    for b, v in zip(before, model.weights):
        np.testing.assert_array_equal(b, v.numpy())
    assert not q.calibrated and w.input_scale.numpy() == 1 and not bool(w.frozen.numpy())
    with pytest.raises(ConfigError, match=r"calibrate\(\)|calibrate\(data\)"):
        q.export_model(tflite_path="never.tflite")
    with pytest.raises(ConfigError, match="observer"):
        PtqQuantizer(cnn(), ALL, observer="nope")


# ----------------------------------------------------------------------------------- TFLite


def test_tflite_full_integer_export(tmp_path):
    model = cnn(filters=(16, 32))
    float_path = tmp_path / "float.tflite"
    float_path.write_bytes(tf.lite.TFLiteConverter.from_keras_model(model).convert())
    q = PtqQuantizer(model, ALL).calibrate(images(128), num_batches=4)
    path = tmp_path / "int8.tflite"
    q.export_model(tflite_path=path, inference_input_type=tf.int8, inference_output_type=tf.int8)
    assert os.path.getsize(path) <= 0.35 * os.path.getsize(float_path)

    interp = tf.lite.Interpreter(model_path=str(path))
    interp.allocate_tensors()
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    assert inp["dtype"] == np.int8 and out["dtype"] == np.int8
    details = interp.get_tensor_details()
    kernels = [d for d in details if d["dtype"] == np.int8 and len(d["shape"]) in (2, 4)
               and d["shape"][0] in (10, 16, 32)]
    assert len(kernels) >= 3  # the two conv kernels and the dense kernel are int8
    assert not [d for d in details if d["dtype"] == np.float32]  # full integer

    x = images(256, seed=7)
    keras_pred = model.predict(x, verbose=0).argmax(1)
    s, z = inp["quantization"]
    preds = []
    for i in range(len(x)):
        interp.set_tensor(inp["index"], np.clip(np.round(x[i:i + 1] / s + z), -128, 127).astype(np.int8))
        interp.invoke()
        preds.append(interp.get_tensor(out["index"])[0].argmax())
    assert np.mean(np.array(preds) == keras_pred) >= 0.99
