"""QAT_Quantizer on Keras 3: exact scales / zero points (issue 4's values in Keras layouts), EMA ranges,
inference with stored parameters, quant_start_step, calibration round trip."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from compressor import ConfigError
from compressor.tf import QAT_Quantizer


def dense(kernel_torch, bias=False):
    """A one-layer model whose Dense holds the torch-layout ``[out, in]`` weight (Keras stores ``[in, out]``)."""
    k = np.asarray(kernel_torch, np.float32).T
    model = keras.Sequential([keras.Input((k.shape[0],)), keras.layers.Dense(k.shape[1], use_bias=bias, name="fc")])
    model.layers[0].kernel.assign(k)
    return model


def weight_cfg(**extra):
    return [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Dense"], **extra}]


def test_uint8_affine_positive_weights():
    model = dense([[1, 2], [3, 5]])
    q = QAT_Quantizer(model, weight_cfg())
    w = q.get_modules_wrapper()[0]
    model(np.eye(2, dtype=np.float32))
    assert w.weight_scale.numpy() == np.float32(5.0 / 255)
    assert w.weight_zero_point.numpy() == 0


def test_uint8_affine_zero_point_rounds_half_to_even():
    # zero point = round(0 - (-1) / (6/255)) = round(42.5) = 42 (round half to even, as numpy/torch)
    model = dense([[-1, 2], [3, 5]])
    q = QAT_Quantizer(model, weight_cfg())
    w = q.get_modules_wrapper()[0]
    model(np.eye(2, dtype=np.float32))
    np.testing.assert_allclose(w.weight_scale.numpy(), 6.0 / 255, rtol=1e-6)
    assert w.weight_zero_point.numpy() == 42


def test_dequantized_weight_is_used_in_the_call():
    model = dense([[1.1287, 2.3456], [3.7814, 5.9723]])
    QAT_Quantizer(model, weight_cfg())
    # identity input: the output rows are the (Keras-layout) kernel the call used
    out = model(np.eye(2, dtype=np.float32)).numpy()
    np.testing.assert_allclose(out.T, [[1.1242, 2.3421], [3.7707, 5.9723]], atol=1e-4)
    # the float kernel itself is untouched
    np.testing.assert_allclose(model.layers[0].kernel.numpy().T, [[1.1287, 2.3456], [3.7814, 5.9723]], rtol=1e-7)


TABLE = [
    # (dtype, scheme, expected scale, expected zero point) for torch weight arange(1, 19).view(2, 1, 3, 3)
    ("int", "per_channel_symmetric", [9 / 127, 18 / 127], [0, 0]),
    ("uint", "per_tensor_affine", 18 / 255, 0),
    ("int", "per_tensor_symmetric", 18 / 127, 0),
    ("uint", "per_tensor_symmetric", 18 / 127.5, 127),
    ("uint", "per_channel_affine", [9 / 255, 18 / 255], [0, 0]),
    ("int", "per_channel_affine", [9 / 254, 18 / 254], [-127, -127]),
    ("uint", "per_channel_symmetric", [9 / 127.5, 18 / 127.5], [127, 127]),
    ("int", "per_tensor_affine", 18 / 254, -127),
]


@pytest.mark.parametrize("dtype,scheme,scale,zp", TABLE)
def test_dtype_scheme_table_on_conv2d(dtype, scheme, scale, zp):
    wt = np.arange(1, 19, dtype=np.float32).reshape(2, 1, 3, 3)  # torch [out, in, kh, kw]
    model = keras.Sequential([keras.Input((3, 3, 1)), keras.layers.Conv2D(2, 3, use_bias=False, name="conv")])
    model.layers[0].kernel.assign(wt.transpose(2, 3, 1, 0))  # Keras [kh, kw, in, out]
    q = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2d"],
                               "quant_dtype": dtype, "quant_scheme": scheme}])
    w = q.get_modules_wrapper()[0]
    model(np.zeros((1, 3, 3, 1), np.float32))
    np.testing.assert_allclose(w.weight_scale.numpy(), scale, rtol=1e-6)
    np.testing.assert_array_equal(w.weight_zero_point.numpy(), zp)


def test_per_channel_fake_quant_values_follow_the_output_channel():
    # channel 0 spans [-1, 1], channel 1 spans [-100, 100]: per-channel int8 keeps channel 0 fine-grained
    k = np.array([[0.5, 50.0], [-1.0, -100.0], [1.0, 0.3]], np.float32)  # Keras [in=3, out=2]
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, use_bias=False)])
    model.layers[0].kernel.assign(k)
    q = QAT_Quantizer(model, weight_cfg(quant_dtype="int", quant_scheme="per_channel_symmetric"))
    used = q.export_weight(q.get_modules_wrapper()[0]).numpy()
    s = np.array([1 / 127, 100 / 127], np.float32)
    np.testing.assert_allclose(used, np.clip(np.round(k / s), -127, 127) * s, rtol=1e-6)
    assert used[2, 1] == np.float32(np.round(0.3 / s[1]) * s[1])  # 0.3 rounds to 0 steps of 0.787


def act_model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, use_bias=False, name="fc")])
    model.layers[0].kernel.assign(np.eye(2, dtype=np.float32))
    return model


def test_activation_ema_first_observation_then_decay_and_inference_uses_stored():
    model = act_model()
    q = QAT_Quantizer(model, [{"quant_types": ["input"], "quant_bits": 8, "op_types": ["Dense"]}])
    w = q.get_modules_wrapper()[0]
    # never observed: inference passes activations through unchanged
    x0 = np.array([[0.123, 4.567]], np.float32)
    np.testing.assert_array_equal(model(x0).numpy(), x0)
    assert not w.input_observed.numpy()

    model(np.array([[-1.0, 3.0]], np.float32), training=True)  # first observation seeds the EMA
    assert (w.tracked_min_input.numpy(), w.tracked_max_input.numpy()) == (-1.0, 3.0)
    model(np.array([[-2.0, 5.0]], np.float32), training=True)
    np.testing.assert_allclose(w.tracked_min_input.numpy(), 0.99 * -1 + 0.01 * -2, rtol=1e-6)
    np.testing.assert_allclose(w.tracked_max_input.numpy(), 0.99 * 3 + 0.01 * 5, rtol=1e-6)
    scale = w.input_scale.numpy()
    np.testing.assert_allclose(scale, (3.02 + 1.01) / 255, rtol=1e-5)

    # inference: no update, stored scale and zero point; 10.0 clips to the top of the range
    out = model(np.array([[0.5, 10.0]], np.float32)).numpy()
    np.testing.assert_allclose(w.tracked_max_input.numpy(), 3.02, rtol=1e-6)
    zp = w.input_zero_point.numpy()
    top = (255 - zp) * scale
    np.testing.assert_allclose(out[0, 1], top, rtol=1e-5)
    np.testing.assert_allclose(out[0, 0], (np.round(0.5 / scale + zp) - zp) * scale, rtol=1e-5)


def test_predict_and_evaluate_do_not_update_ranges():
    model = act_model()
    q = QAT_Quantizer(model, [{"quant_types": ["output"], "quant_bits": 8, "op_types": ["Dense"]}])
    w = q.get_modules_wrapper()[0]
    model(np.array([[-1.0, 1.0]], np.float32), training=True)
    model.predict(np.full((4, 2), 50.0, np.float32), verbose=0)
    assert (w.tracked_min_output.numpy(), w.tracked_max_output.numpy()) == (-1.0, 1.0)


def test_quant_start_step_in_a_custom_tf_function_loop():
    model = act_model()
    opt = keras.optimizers.SGD(0.0)  # lr 0: the weights stay put, only the clock moves
    q = QAT_Quantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 2, "op_types": ["Dense"],
                               "quant_start_step": 2}], opt)
    w = q.get_modules_wrapper()[0]
    x = tf.constant([[0.35, 0.9]])

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            y = model(x, training=True)
            loss = tf.reduce_sum(y)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return y

    outs = [train_step().numpy() for _ in range(3)]
    np.testing.assert_allclose(outs[0], [[0.35, 0.9]], rtol=1e-6)  # steps 0 and 1: unquantized
    np.testing.assert_allclose(outs[1], [[0.35, 0.9]], rtol=1e-6)
    assert w.output_observed.numpy() and w.tracked_max_output.numpy() > 0  # ranges tracked meanwhile
    assert q.steps == 3
    # step 2: 2-bit uint grid on [0, 0.9] (scale 0.3): 0.35 -> 0.3
    np.testing.assert_allclose(w.output_scale.numpy(), 0.3, rtol=1e-5)
    np.testing.assert_allclose(outs[2], [[0.3, 0.9]], rtol=1e-5)


def test_calibration_round_trip_and_frozen_weight_scale(tmp_path):
    model = act_model()
    q = QAT_Quantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["Dense"]}])
    model(np.array([[-1.0, 2.0]], np.float32), training=True)
    calib = q.export_model(calibration_path=tmp_path / "calib.json")
    entry = calib["fc"]
    assert entry["output_bits"] == 8 and (entry["output_qmin"], entry["output_qmax"]) == (0, 255)
    assert entry["tracked_min_output"] == -1.0 and entry["tracked_max_output"] == 2.0

    other = act_model()
    other.layers[0].kernel.assign(2 * np.eye(2, dtype=np.float32))
    q2 = QAT_Quantizer(other, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["Dense"]}])
    q2.load_calibration_config(tmp_path / "calib.json")
    w2 = q2.get_modules_wrapper()[0]
    assert w2.output_observed.numpy() and w2.tracked_max_output.numpy() == 2.0
    # the loaded weight scale (from max 1.0) is used although this kernel's max is 2.0 ...
    out = other(np.array([[1.0, 0.0]], np.float32)).numpy()
    assert w2.weight_scale.numpy() == np.float32(entry["weight_scale"])
    np.testing.assert_allclose(out[0, 0], 1.0, atol=0.02)  # weight 2.0 clipped to the loaded grid's top, 1.0
    # ... until the next optimizer update
    q2.step()
    other(np.array([[1.0, 0.0]], np.float32))
    np.testing.assert_allclose(w2.weight_scale.numpy(), 2.0 / 255, rtol=1e-6)


def test_bad_calibration_is_refused_before_writing():
    model = act_model()
    q = QAT_Quantizer(model, [{"quant_types": ["output"], "quant_bits": 8, "op_types": ["Dense"]}])
    w = q.get_modules_wrapper()[0]
    before = w.output_scale.numpy()
    with pytest.raises(ConfigError, match="does not wrap"):
        q.load_calibration_config({"nope": {}})
    with pytest.raises(ConfigError, match="output_bits = 4"):
        q.load_calibration_config({"fc": {"output_bits": 4, "output_scale": 0.5}})
    with pytest.raises(ConfigError, match="shape"):
        q.load_calibration_config({"fc": {"output_scale": [0.5, 0.5]}})
    assert w.output_scale.numpy() == before and not w.output_observed.numpy()


def test_checkpoint_restores_the_tracked_ranges(tmp_path):
    model = act_model()
    q = QAT_Quantizer(model, [{"quant_types": ["output"], "quant_bits": 8, "op_types": ["Dense"]}])
    model(np.array([[-1.5, 4.0]], np.float32), training=True)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ck"))
    other = act_model()
    q2 = QAT_Quantizer(other, [{"quant_types": ["output"], "quant_bits": 8, "op_types": ["Dense"]}])
    tf.train.Checkpoint(model=other).restore(path).assert_existing_objects_matched()
    w, w2 = q.get_modules_wrapper()[0], q2.get_modules_wrapper()[0]
    assert w2.output_observed.numpy()
    for name in ("tracked_min_output", "tracked_max_output", "output_scale", "output_zero_point"):
        assert getattr(w2, name).numpy() == getattr(w, name).numpy(), name
