"""The seed-004 prototype API on TensorFlow / Keras 3 (``compressor.tfCompressor``)."""

import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import compressor
from compressor import tfCompressor
from compressor.core import quant as cq
from compressor.core.ops import NumpyOps

SEED_YAML = textwrap.dedent("""\
    tfAGPruner:
      config:
        -
            start_epoch: 0
            end_epoch: 16
            frequency: 2
            initial_sparsity: 0.05
            final_sparsity: 0.60
            support_type: default
        -
            prune: False
            start_epoch: 0
            end_epoch: 20
            frequency: 2
            initial_sparsity: 0.05
            final_sparsity: 0.60
            support_type: [Linear]
            support_op: [conv1, conv2]
""")


def signed_range(n, shape):
    v = np.arange(1, n + 1, dtype=np.float32)
    return (v * np.where(v % 2 == 0, -1.0, 1.0)).astype(np.float32).reshape(shape)


def two_layer():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="d1"), keras.layers.Dense(2, name="d2")])
    model.get_layer("d1").set_weights([signed_range(16, (4, 4)), np.full(4, 0.5, np.float32)])
    model.get_layer("d2").set_weights([signed_range(8, (4, 2)), np.zeros(2, np.float32)])
    return model


def kernel(model, name):
    return model.get_layer(name).kernel.numpy()


def test_level_pruner_as_seed_004_writes_it():
    model = two_layer()
    pruner = tfCompressor.LevelPruner([{'sparsity': 0.8, 'support_type': 'default'}])
    assert pruner(model) is model
    np.testing.assert_array_equal(kernel(model, "d1") != 0, np.abs(signed_range(16, (4, 4))) > 12)
    np.testing.assert_array_equal(kernel(model, "d2") != 0, np.abs(signed_range(8, (4, 2))) > 6)
    assert type(pruner.compressor) is compressor.tf.LevelPruner


def test_fit_runs_unchanged_with_masks_applied():
    keras.utils.set_random_seed(0)
    model = two_layer()
    tfCompressor.LevelPruner([{'sparsity': 0.8, 'support_type': 'default'}])(model)
    keep1 = np.abs(signed_range(16, (4, 4))) > 12
    keep2 = np.abs(signed_range(8, (4, 2))) > 6
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9, weight_decay=0.1), loss="mse")
    x = np.random.randn(16, 4).astype(np.float32)
    model.fit(x, np.random.randn(16, 2).astype(np.float32), epochs=2, batch_size=8, verbose=0)  # no callback
    d1, d2 = model.get_layer("d1"), model.get_layer("d2")
    h = x @ np.where(keep1, d1.kernel.numpy(), 0) + d1.bias.numpy()
    want = h @ np.where(keep2, d2.kernel.numpy(), 0) + d2.bias.numpy()
    np.testing.assert_allclose(model.predict(x, verbose=0), want, rtol=1e-5, atol=1e-5)


def test_agpruner_with_seed_004_yaml_file(tmp_path):
    path = tmp_path / "agp.yaml"
    path.write_text(SEED_YAML)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10, name="conv1"),
                              keras.layers.Dense(10, name="conv2"), keras.layers.Dense(10, name="fc")])
    pruner = tfCompressor.AGPruner()
    pruner.load_configure(path)
    pruner(model)

    def pruned(name):
        return int((kernel(model, name) == 0).sum())

    assert (pruned("conv1"), pruned("conv2"), pruned("fc")) == (0, 0, 5)
    pruner.update_epoch(1)
    assert pruned("fc") == 5
    pruner.update_epoch(2)
    assert pruned("fc") == 25
    pruner.update_epoch(14)
    assert (pruned("conv1"), pruned("fc")) == (0, 60)


def test_dorefa_quantizer_with_prototype_keys():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, name="q")])
    k = kernel(model, "q")
    quantizer = tfCompressor.DoReFaQuantizer([{'q_bits': 2, 'support_type': 'default'}])
    quantizer(model)
    x = np.random.randn(4, 6).astype(np.float32)
    kq = cq.dorefa_weight(NumpyOps(), k.astype(np.float64), 2).astype(np.float32)
    np.testing.assert_allclose(model(x).numpy(), x @ kq + model.get_layer("q").bias.numpy(), atol=1e-5)


def test_qat_quantizer_step_clock():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, name="q")])
    quantizer = tfCompressor.QATquantizer([{'q_bits': 8, 'support_type': 'default', 'quant_start_step': 1}])
    quantizer(model)
    assert type(quantizer.compressor).__name__ == "QAT_Quantizer"
    x = np.random.randn(4, 6).astype(np.float32)
    layer = model.get_layer("q")
    np.testing.assert_allclose(model(x).numpy(), x @ layer.kernel.numpy() + layer.bias.numpy(), atol=1e-6)
    quantizer.step()
    assert quantizer.compressor.steps == 1
    assert not np.allclose(model(x).numpy(), x @ layer.kernel.numpy() + layer.bias.numpy(), atol=1e-6)


class ThresholdPruner(tfCompressor.TfPruner):
    def __init__(self, threshold):
        self.threshold = threshold
        self.seen = []

    def calc_mask(self, layer_info, weight):
        self.seen.append((layer_info.name, layer_info.type, tuple(weight.shape)))
        return tf.abs(weight) > self.threshold

    def step(self):
        self.threshold += 2


def test_custom_pruner_gets_keras_layout_and_steps():
    model = two_layer()
    pruner = ThresholdPruner(3)
    pruner(model)
    assert pruner.seen == [("d1", "Dense", (4, 4)), ("d2", "Dense", (4, 2))]
    np.testing.assert_array_equal(kernel(model, "d1") != 0, np.abs(signed_range(16, (4, 4))) > 3)
    pruner.step()
    assert pruner.threshold == 5 and len(pruner.seen) == 4
    np.testing.assert_array_equal(kernel(model, "d1") != 0, np.abs(signed_range(16, (4, 4))) > 5)
    x = np.ones((1, 4), np.float32)
    d1 = model.get_layer("d1")
    np.testing.assert_allclose(model.get_layer("d2")(d1(x)).numpy(),
                               (x @ kernel(model, "d1") + 0.5) @ kernel(model, "d2"), atol=1e-5)


class HalfStepQuantizer(tfCompressor.TfQuantizer):
    def __init__(self, your_input):
        self.step_size = your_input

    def quantize_weight(self, layer_info, weight):
        return tf.round(weight / self.step_size) * self.step_size


def test_custom_quantizer_replaces_the_weight_and_passes_gradients():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="q")])
    HalfStepQuantizer(0.5)(model)
    layer = model.get_layer("q")
    x = tf.constant(np.random.randn(2, 4).astype(np.float32))
    with tf.GradientTape() as tape:
        out = model(x)
        loss = tf.reduce_sum(out)
    k = layer.kernel.numpy()
    np.testing.assert_allclose(out.numpy(), x.numpy() @ (np.round(k / 0.5) * 0.5) + layer.bias.numpy(), atol=1e-6)
    grad = tape.gradient(loss, layer.kernel)
    np.testing.assert_allclose(grad.numpy(), np.repeat(x.numpy().sum(0)[:, None], 3, axis=1), atol=1e-6)


def test_errors_and_no_deprecation_for_prototype_keys():
    model = two_layer()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(compressor.ConfigError, match="selects no layer of the model"), \
            pytest.warns(compressor.ConfigWarning):
        tfCompressor.LevelPruner([{'sparsity': 0.5, 'support_type': ['Conv2D']}])(model)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert "call" not in vars(model.get_layer("d1"))  # not instrumented
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        tfCompressor.LevelPruner([{'sparsity': 0.5, 'support_type': 'default', 'support_op': ['d1']}])(model)
    assert int((kernel(model, "d1") == 0).sum()) == 8 and int((kernel(model, "d2") == 0).sum()) == 0
    with pytest.raises(compressor.ModelError, match="Keras 3 model or layer"):
        tfCompressor.LevelPruner([{'sparsity': 0.5, 'support_type': 'default'}])(object())
