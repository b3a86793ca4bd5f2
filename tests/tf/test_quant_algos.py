"""Naive, DoReFa, BNN, LSQ (and QAT) on Keras 3: exact forward values, STE gradients reaching the float
kernels, BNN's hard-tanh output gradient, LSQ's learned scales, a few training steps lowering the loss."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from compressor.core import quant as Q
from compressor.core.ops import NumpyOps
from compressor.tf import BNNQuantizer, DoReFaQuantizer, LsqQuantizer, NaiveQuantizer, QAT_Quantizer

npo = NumpyOps()


def dense_model(kernel, bias=False):
    k = np.asarray(kernel, np.float32)  # Keras layout [in, out]
    model = keras.Sequential([keras.Input((k.shape[0],)), keras.layers.Dense(k.shape[1], use_bias=bias, name="fc")])
    model.layers[0].kernel.assign(k)
    return model


def cfg(types, bits, **extra):
    return [{"quant_types": types, "quant_bits": bits, "op_types": ["Dense"], **extra}]


def used_kernel(model):
    """The kernel the Dense layer's call used: its output on the identity matrix."""
    n = model.layers[0].kernel.shape[0]
    return model(np.eye(n, dtype=np.float32)).numpy()


def test_naive_rounds_and_keeps_a_running_max_scale():
    k = np.array([[0.26, -1.27], [0.004, 0.9]], np.float32)
    model = dense_model(k)
    q = NaiveQuantizer(model, cfg(["weight"], 8))
    w = q.get_modules_wrapper()[0]
    # scale = 1.27 / 127 = 0.01: 0.26 -> 26 steps, 0.004 -> 0 (round), 0.9 -> 90
    np.testing.assert_allclose(used_kernel(model), [[0.26, -1.27], [0.0, 0.9]], atol=1e-6)
    np.testing.assert_allclose(w.weight_scale.numpy(), 0.01, rtol=1e-6)
    model.layers[0].kernel.assign(k / 2)  # a smaller kernel keeps the running (larger) scale
    used_kernel(model)
    np.testing.assert_allclose(w.weight_scale.numpy(), 0.01, rtol=1e-6)
    model.layers[0].kernel.assign(k * 2)
    used_kernel(model)
    np.testing.assert_allclose(w.weight_scale.numpy(), 0.02, rtol=1e-6)


def test_dorefa_forward_matches_core_on_numpy():
    rng = np.random.default_rng(0)
    k = rng.normal(size=(5, 3)).astype(np.float32)
    model = dense_model(k)
    DoReFaQuantizer(model, cfg(["weight"], 3))
    expected = Q.dorefa_weight(npo, k, 3)
    np.testing.assert_allclose(used_kernel(model), expected, atol=1e-6)
    assert len(np.unique(np.round(expected, 5))) <= 2**3


def test_bnn_forward_signs_weights_and_outputs():
    k = np.array([[0.3, -0.2], [0.0, 0.7]], np.float32)
    model = dense_model(k)
    BNNQuantizer(model, cfg(["weight"], 1))
    np.testing.assert_array_equal(used_kernel(model), [[1, -1], [1, 1]])  # sign(0) = +1


def test_bnn_output_gradient_is_zero_where_abs_exceeds_one():
    model = dense_model(np.eye(4))
    BNNQuantizer(model, cfg(["output"], 1))
    x = tf.Variable([[-2.0, -0.5, 0.5, 1.5]])
    with tf.GradientTape() as tape:
        y = model(x)
        loss = tf.reduce_sum(y * tf.constant([[1.0, 2.0, 3.0, 4.0]]))
    np.testing.assert_array_equal(y.numpy(), [[-1, -1, 1, 1]])
    np.testing.assert_array_equal(tape.gradient(loss, x).numpy(), [[0, 2, 3, 0]])


def _kernel_grad(quantizer_cls, config, kernel, x):
    model = dense_model(kernel)
    quantizer_cls(model, config)
    var = model.layers[0].kernel
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=True))
    return tape.gradient(loss, var)


X = np.array([[1.0, 2.0], [0.5, -1.0]], np.float32)
K = np.array([[0.4, -0.3], [0.2, 0.8]], np.float32)


@pytest.mark.parametrize("cls,config", [
    (QAT_Quantizer, cfg(["weight"], 8)),
    (NaiveQuantizer, cfg(["weight"], 8)),
    (BNNQuantizer, cfg(["weight"], 1)),
    (LsqQuantizer, cfg(["weight"], 8)),
])
def test_straight_through_gradient_reaches_the_float_kernel(cls, config):
    # every weight lies inside its grid, so the clipped STE passes d(sum(x @ Wq))/dWq = x^T 1 unchanged
    g = _kernel_grad(cls, config, K, X)
    assert g is not None
    np.testing.assert_allclose(g.numpy(), X.T @ np.ones((2, 2), np.float32), rtol=1e-6)


def test_dorefa_gradient_follows_the_tanh_normalisation():
    g = _kernel_grad(DoReFaQuantizer, cfg(["weight"], 4), K, X)
    k = tf.constant(K)
    with tf.GradientTape() as tape:  # reference: the paper's transform with round replaced by identity
        tape.watch(k)
        t = tf.tanh(k)
        t = t / (2.0 * tf.reduce_max(tf.abs(t))) + 0.5
        loss = tf.reduce_sum(X @ (2.0 * t - 1.0))
    np.testing.assert_allclose(g.numpy(), tape.gradient(loss, k).numpy(), rtol=1e-5, atol=1e-7)


def test_clipped_ste_zeroes_the_gradient_of_clipped_inputs():
    model = dense_model(np.eye(2))
    q = QAT_Quantizer(model, cfg(["input"], 8))
    model(tf.constant([[0.0, 1.0]]), training=True)  # range [0, 1]
    w = q.get_modules_wrapper()[0]
    x = tf.Variable([[0.5, 3.0]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=False))  # inference: stored range, 3.0 is clipped
    np.testing.assert_array_equal(tape.gradient(loss, x).numpy(), [[1.0, 0.0]])
    assert w.tracked_max_input.numpy() == 1.0


def test_lsq_scales_are_trainable_model_variables_with_the_paper_gradient():
    rng = np.random.default_rng(1)
    k = rng.normal(size=(4, 3)).astype(np.float32)
    k[0, 0] = 40.0  # far outside the initial grid: clipped
    model = dense_model(k)
    q = LsqQuantizer(model, cfg(["weight", "output"], 4))
    w = q.get_modules_wrapper()[0]
    scales = q.scale_variables()
    assert len(scales) == 2 and all(any(s is v for v in model.trainable_variables) for s in scales)
    qmin, qmax = -8, 7
    s0 = np.float32(2 * np.abs(k).mean() / math.sqrt(qmax))
    np.testing.assert_allclose(w.weight_scale.numpy(), s0, rtol=1e-6)

    weight = tf.convert_to_tensor(model.layers[0].kernel)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(q._quantize("weight", weight, w))
    # d sum(round(clip(k/s)) * s) / ds = g * sum(round(v) - v inside the grid, the bound outside)
    v = k / s0
    inner = np.where(v <= qmin, qmin, np.where(v >= qmax, qmax, np.round(v) - v))
    expected = inner.sum() / math.sqrt(k.size * qmax)
    np.testing.assert_allclose(tape.gradient(loss, w.weight_scale).numpy(), expected, rtol=1e-4)


def test_lsq_activation_scale_initialised_from_the_first_training_batch():
    model = dense_model(np.eye(2))
    q = LsqQuantizer(model, cfg(["input"], 8, quant_dtype="uint"))
    w = q.get_modules_wrapper()[0]
    model(tf.constant([[1.0, 3.0]]))  # inference does not initialise
    assert w.input_scale.numpy() == 1.0 and not w.input_observed.numpy()
    model(tf.constant([[1.0, 3.0]]), training=True)
    np.testing.assert_allclose(w.input_scale.numpy(), 2 * 2.0 / math.sqrt(255), rtol=1e-6)
    model(tf.constant([[10.0, 30.0]]), training=True)  # only the first batch initialises
    np.testing.assert_allclose(w.input_scale.numpy(), 2 * 2.0 / math.sqrt(255), rtol=1e-6)


def small_cnn():
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
        keras.layers.Flatten(),
        keras.layers.Dense(3, name="fc"),
    ])


@pytest.mark.parametrize("cls,config", [
    (QAT_Quantizer, [{"quant_types": ["weight", "input", "output"], "quant_bits": 8, "op_types": ["default"]}]),
    (NaiveQuantizer, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}]),
    (DoReFaQuantizer, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": ["default"]}]),
    (BNNQuantizer, [{"quant_types": ["weight", "output"], "quant_bits": 1, "op_types": ["Conv2D"]}]),
    (LsqQuantizer, [{"quant_types": ["weight", "input", "output"], "quant_bits": 8, "op_types": ["default"]}]),
])
def test_a_few_fit_steps_lower_the_loss(cls, config):
    keras.utils.set_random_seed(3)
    x = np.random.rand(64, 8, 8, 1).astype(np.float32)
    y = (x.reshape(64, -1)[:, :3].argmax(1)).astype(np.int32)  # learnable labels
    model = small_cnn()
    opt = keras.optimizers.Adam(1e-2)
    q = cls(model, config, opt)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = model.evaluate(x, y, verbose=0)
    scales = [v.numpy().copy() for v in q.scale_variables()] if cls is LsqQuantizer else []
    model.fit(x, y, epochs=4, batch_size=16, verbose=0)
    after = model.evaluate(x, y, verbose=0)
    assert after < before, (before, after)
    assert q.steps == 16
    for old, var in zip(scales, q.scale_variables() if scales else []):
        assert var.numpy() != old, var.name  # the optimizer trained LSQ's step sizes
