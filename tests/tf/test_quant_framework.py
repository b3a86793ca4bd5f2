"""The TF quantizer framework: custom quantizers in both calling styles, QuantGrad swap, refusal of bad
input with the model untouched, Sequential / Functional / subclassed models, graph modes (fit with and
without XLA, predict, a custom tf.function loop), export / reload / strip / TFLite."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from compressor import ConfigError
from compressor.tf import (
    BNNQuantizer,
    CompressionCallback,
    LsqQuantizer,
    NaiveQuantizer,
    QAT_Quantizer,
    QuantGrad,
    Quantizer,
    QuantType,
    TfQuantizer,
)


def dense_model(kernel):
    k = np.asarray(kernel, np.float32)
    model = keras.Sequential([keras.Input((k.shape[0],)), keras.layers.Dense(k.shape[1], use_bias=False, name="fc")])
    model.layers[0].kernel.assign(k)
    return model


def small_cnn(name=None):
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
        keras.layers.Flatten(),
        keras.layers.Dense(3, name="fc"),
    ], name=name)


QAT_ALL = [{"quant_types": ["weight", "input", "output"], "quant_bits": 8, "op_types": ["default"]}]


# ---------------------------------------------------------------- custom quantizers (seeds 002 / 003)
class ClipGrad(QuantGrad):
    @staticmethod
    def quant_backward(tensor, grad_output, quant_type):
        if quant_type == QuantType.QUANT_OUTPUT:
            grad_output = tf.where(tf.abs(tensor) > 1, tf.zeros_like(grad_output), grad_output)
        return grad_output


class YourQuantizer(Quantizer):
    """Seed 003's example: config-style methods and a swapped backward."""

    def __init__(self, model, config_list):
        super().__init__(model, config_list)
        self.quant_grad = ClipGrad

    def quantize_weight(self, weight, config, **kwargs):
        return tf.round(weight * 2.0) / 2.0

    def quantize_output(self, output, config, **kwargs):
        assert kwargs["op_type"] == "Dense" and kwargs["op_name"] == "fc"
        return tf.round(output)


def test_seed_003_custom_quantizer_and_clip_grad():
    model = dense_model(np.eye(2) * 0.8)
    q = YourQuantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["Dense"]}])
    x = tf.Variable([[0.9, 2.0]])
    with tf.GradientTape() as tape:
        y = model(x)
        loss = tf.reduce_sum(y)
    # kernel 0.8 -> 1.0; outputs round(0.9) = 1, round(2.0) = 2
    np.testing.assert_array_equal(y.numpy(), [[1.0, 2.0]])
    # ClipGrad: output gradient zero where |pre-quant output| > 1 (2.0); weight gradient straight through
    np.testing.assert_array_equal(tape.gradient(loss, x).numpy(), [[1.0, 0.0]])
    assert q.quant_grad is ClipGrad


class CountingQuantizer(TfQuantizer):
    """Wrapper-style methods with graph state from ``set_wrappers_attribute``."""

    def __init__(self, model, config_list, optimizer=None):
        super().__init__(model, config_list, optimizer)
        self.set_wrappers_attribute("calls", tf.constant(0, tf.int64))

    def quantize_input(self, *inputs, wrapper, **kwargs):
        wrapper.calls.assign_add(1)
        return tf.round(inputs[0])


def test_wrapper_style_quantizer_with_graph_state_in_fit():
    model = dense_model(np.eye(2))
    q = CountingQuantizer(model, [{"quant_types": ["input"], "quant_bits": 4, "op_types": ["Dense"]}])
    model.compile(keras.optimizers.SGD(0.0), "mse")
    model.fit(np.full((8, 2), 0.4, np.float32), np.zeros((8, 2), np.float32), batch_size=4, epochs=1, verbose=0)
    w = q.get_modules_wrapper()[0]
    assert int(w.calls.numpy()) == 2
    np.testing.assert_array_equal(model.predict(np.full((1, 2), 0.6, np.float32), verbose=0), [[1.0, 1.0]])


# ---------------------------------------------------------------- refusal, model untouched
def _snapshot(model):
    layers = model._flatten_layers(include_self=False)
    return ([v.numpy().copy() for v in model.variables], [v.path for v in model.trainable_variables],
            [sorted(k for k in vars(layer) if k == "call" or k.startswith("_compressor_")) for layer in layers])


BAD = [
    (QAT_Quantizer, [{"quant_types": ["weight"], "quant_bits": 0, "op_types": ["default"]}], "quant_bits"),
    (QAT_Quantizer, [{"quant_types": ["weight"], "quant_bits": 33, "op_types": ["default"]}], "quant_bits"),
    (QAT_Quantizer, [{"quant_types": ["bias"], "quant_bits": 8, "op_types": ["default"]}], "quant_types"),
    (QAT_Quantizer, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"],
                      "quant_scheme": "per_row"}], "quant_scheme"),
    (QAT_Quantizer, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"], "quant_dtype": "int",
                      "quant_bitz": 3}], "did you mean"),
    (QAT_Quantizer, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]},
                     {"quant_types": ["weight"], "quant_bits": 1, "quant_dtype": "int", "op_names": ["fc"]}],
     "1-bit signed"),
    (NaiveQuantizer, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": ["default"]}], "8-bit only"),
    (NaiveQuantizer, [{"quant_types": ["output"], "quant_bits": 8, "op_types": ["default"]}], "not supported"),
    (BNNQuantizer, [{"quant_types": ["weight"], "quant_bits": 2, "op_types": ["default"]}], "use 1"),
    (QAT_Quantizer, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Flatten"]}], "no weight"),
    (QAT_Quantizer, [{"quant_types": ["weight"], "op_types": ["default"]}], "quant_bits"),
]


@pytest.mark.parametrize("cls,config,match", BAD)
def test_bad_input_raises_config_error_and_leaves_the_model_untouched(cls, config, match):
    model = small_cnn()
    before = _snapshot(model)
    with pytest.raises(ConfigError, match=match):
        cls(model, config)
    after = _snapshot(model)
    assert before[1:] == after[1:]
    for a, b in zip(before[0], after[0]):
        np.testing.assert_array_equal(a, b)


def test_lsq_refuses_an_already_built_optimizer():
    model = small_cnn()
    opt = keras.optimizers.Adam()
    opt.build(model.trainable_variables)
    before = _snapshot(model)
    with pytest.raises(ConfigError, match="fresh optimizer"):
        LsqQuantizer(model, QAT_ALL, opt)
    assert _snapshot(model)[1:] == before[1:]


def test_second_quantizer_on_the_same_layers_is_refused():
    model = small_cnn()
    QAT_Quantizer(model, QAT_ALL)
    with pytest.raises(ConfigError, match="already wrapped"):
        NaiveQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}])


# ---------------------------------------------------------------- model kinds
class Block(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.conv = keras.layers.Conv2D(4, 3, activation="relu", name="conv")
        self.pool = keras.layers.GlobalAveragePooling2D()

    def call(self, x):
        return self.pool(self.conv(x))


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = Block(name="block")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x):
        return self.head(self.block(x))


def functional():
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(inp)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(3, name="fc")(h))


def unbuilt_sequential():
    return keras.Sequential([keras.layers.Conv2D(4, 3, activation="relu", name="conv"), keras.layers.Flatten(),
                             keras.layers.Dense(3, name="fc")])


@pytest.mark.parametrize("make,names", [
    (functional, ["conv", "fc"]),
    (lambda: (lambda m: (m(np.zeros((1, 8, 8, 1), np.float32)), m)[1])(Net()), ["block/conv", "head"]),
    (unbuilt_sequential, ["conv", "fc"]),
])
def test_model_kinds_train_in_graph_mode(make, names):
    keras.utils.set_random_seed(0)
    model = make()
    cfg = [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["default"],
            "quant_dtype": {"weight": "int", "output": "uint"},
            "quant_scheme": {"weight": "per_channel_symmetric", "output": "per_tensor_affine"}}]
    q = QAT_Quantizer(model, cfg)
    assert [w.name for w in q.get_modules_wrapper()] == names
    x = np.random.rand(16, 8, 8, 1).astype(np.float32)
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, np.zeros(16, np.int32), batch_size=8, epochs=1, verbose=0, callbacks=[CompressionCallback(q)])
    assert q.steps == 2
    for w in q.get_modules_wrapper():
        assert w.ready and w.output_observed.numpy()
        assert w.weight_scale.shape == (w.weight.shape[-1],)  # per output channel
    model.predict(x[:2], verbose=0)


@pytest.mark.parametrize("jit", [False, True])
def test_fit_with_and_without_xla_matches_eager_forward(jit):
    keras.utils.set_random_seed(1)
    model = small_cnn()
    opt = keras.optimizers.SGD(0.05)
    cfg = [dict(QAT_ALL[0], quant_dtype={"weight": "int"}, quant_scheme={"weight": "per_channel_symmetric"})]
    q = QAT_Quantizer(model, cfg, opt)
    x = np.random.rand(16, 8, 8, 1).astype(np.float32)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
    model.fit(x, np.arange(16) % 3, batch_size=8, epochs=2, verbose=0)
    assert q.steps == 4
    graph = model.predict(x, verbose=0)
    eager = model(x).numpy()  # inference: stored activation parameters, no update
    np.testing.assert_allclose(graph, eager, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- export
def trained_qat(weight_only=False):
    keras.utils.set_random_seed(2)
    model = small_cnn()
    types = ["weight"] if weight_only else ["weight", "input", "output"]
    q = QAT_Quantizer(model, [{"quant_types": types, "quant_bits": 8, "op_types": ["default"],
                               "quant_dtype": {t: "int" if t == "weight" else "uint" for t in types},
                               "quant_scheme": {t: "per_channel_symmetric" if t == "weight" else "per_tensor_affine"
                                                for t in types}}])
    x = np.random.rand(32, 8, 8, 1).astype(np.float32)
    model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, np.arange(32) % 3, batch_size=16, epochs=1, verbose=0, callbacks=[CompressionCallback(q)])
    return model, q, x


def test_export_keras_file_reloads_without_compressor_and_gives_the_same_outputs(tmp_path):
    model, q, x = trained_qat(weight_only=True)
    expected = model.predict(x, verbose=0)
    kernel = model.layers[0].kernel.numpy().copy()
    calib = q.export_model(tmp_path / "m.keras", tmp_path / "calib.json")
    assert json.loads((tmp_path / "calib.json").read_text()) == calib
    assert set(calib) == {"conv", "fc"} and len(calib["conv"]["weight_scale"]) == 4
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), kernel)  # live model restored
    reloaded = keras.models.load_model(tmp_path / "m.keras")
    assert all("call" not in vars(layer) for layer in reloaded.layers)
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-6)
    # the exported conv kernel lies on the recorded per-channel grid
    s = np.asarray(calib["conv"]["weight_scale"], np.float32)
    k = reloaded.layers[0].kernel.numpy() / s
    np.testing.assert_allclose(k, np.round(k), atol=1e-3)
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, rtol=1e-6)  # still quantizing


def test_export_saved_model_and_weights_of_a_subclassed_model(tmp_path):
    keras.utils.set_random_seed(4)
    net = Net()
    x = np.random.rand(4, 8, 8, 1).astype(np.float32)
    net(x)
    q = QAT_Quantizer(net, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}])
    expected = net(x).numpy()
    q.export_model(tmp_path / "sm")
    loaded = tf.saved_model.load(str(tmp_path / "sm"))
    np.testing.assert_allclose(loaded.serve(tf.constant(x)).numpy(), expected, rtol=1e-5, atol=1e-6)
    q.export_model(tmp_path / "w.weights.h5")
    fresh = Net()
    fresh(x)
    fresh.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_allclose(fresh(x).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_strip_leaves_a_plain_model_with_quantized_weights_and_no_lsq_variables():
    keras.utils.set_random_seed(5)
    model = small_cnn()
    plain_vars = [v.path for v in model.variables]
    q = LsqQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": ["default"]}])
    assert len(model.trainable_variables) == 6
    x = np.random.rand(4, 8, 8, 1).astype(np.float32)
    expected = model(x).numpy()
    stripped = q.strip()
    assert stripped is model and [v.path for v in model.variables] == plain_vars
    assert all("call" not in vars(layer) and "_compressor_quantizer" not in vars(layer) for layer in model.layers)
    np.testing.assert_allclose(model(x).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_tflite_int8_conversion_of_the_exported_model(tmp_path):
    model, q, x = trained_qat()
    expected = model.predict(x[:8], verbose=0)

    def representative():
        for i in range(8):
            yield [x[i:i + 1]]

    q.export_model(tflite_path=tmp_path / "m.tflite", representative_dataset=representative)
    interp = tf.lite.Interpreter(model_path=str(tmp_path / "m.tflite"))
    interp.allocate_tensors()
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    kinds = {d["dtype"] for d in interp.get_tensor_details()}
    assert np.int8 in kinds
    got = []
    for i in range(8):
        interp.set_tensor(inp["index"], x[i:i + 1])
        interp.invoke()
        got.append(interp.get_tensor(out["index"])[0])
    spread = float(np.ptp(expected))
    np.testing.assert_allclose(np.array(got), expected, atol=0.1 * spread)


# ---------------------------------------------------------------- composition
def test_top_level_name_dispatches_to_the_tf_quantizer():
    import compressor

    q = compressor.QAT_Quantizer(small_cnn(), [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}])
    assert isinstance(q, QAT_Quantizer)


def test_quantizer_over_a_pruner_keeps_pruned_weights_at_zero():
    from compressor.tf import LevelPruner

    keras.utils.set_random_seed(6)
    model = small_cnn()
    opt = keras.optimizers.Adam(1e-2)
    LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], opt).compress()
    q = QAT_Quantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["default"]}], opt)
    x = np.random.rand(16, 8, 8, 1).astype(np.float32)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, np.arange(16) % 3, batch_size=8, epochs=1, verbose=0)
    for w in q.get_modules_wrapper():
        kernel = w.weight.numpy()
        assert np.mean(kernel == 0) == 0.5
        np.testing.assert_array_equal(q.export_weight(w).numpy()[kernel == 0], 0.0)  # 0 is on every QAT grid


@pytest.mark.parametrize("cls", [QAT_Quantizer, LsqQuantizer])
def test_mixed_float16_policy_trains(cls):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = small_cnn()
        q = cls(model, QAT_ALL)
        x = np.random.rand(16, 8, 8, 1).astype(np.float32)
        model.compile(keras.optimizers.Adam(1e-2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, np.arange(16) % 3, batch_size=8, epochs=1, verbose=0, callbacks=[CompressionCallback(q)])
        out = model.predict(x[:2], verbose=0)
        assert out.dtype == np.float16 and np.all(np.isfinite(out)) and q.steps == 2
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_manual_step_advances_the_counter_like_torch():
    """With an unhooked optimizer the user calls step() after each update; quant_start_step must see it."""
    import keras

    from compressor.tf import QAT_Quantizer

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    q = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "quant_start_step": 2,
                               "op_types": ["Dense"]}])
    q.compress()
    assert q.steps == 0
    q.step()
    q.step()
    assert q.steps == 2
