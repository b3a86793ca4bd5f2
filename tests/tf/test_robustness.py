"""Issue 16 on Keras: layer attributes stay readable, the seeds' clock for a user calc_mask, mixed_bfloat16
with fit, atomic exports, model.save() with a quantizer attached, slimming that keeps every layer."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from compressor.core.errors import ConfigError
from compressor.tf import (
    CompressionCallback,
    DoReFaQuantizer,
    LevelPruner,
    LsqQuantizer,
    QAT_Quantizer,
    SlimPruner,
)

RNG = np.random.default_rng(0)
X = RNG.normal(size=(12, 6, 6, 1)).astype(np.float32)
Y = RNG.normal(size=(12, 2)).astype(np.float32)


def cnn(name: str = "cnn") -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(4, 3, name="conv")(inp)
    h = keras.layers.Flatten()(h)
    return keras.Model(inp, keras.layers.Dense(2, name="fc")(h), name=name)


def _listing(path):
    return sorted(p.name for p in path.iterdir())


# ---------------------------------------------------------------- 1. layer attributes stay readable
class AttributeReader(keras.Model):
    """Model code that reads its layers' attributes in call (as HF-style TF-padding code does)."""

    def __init__(self):
        super().__init__()
        self.conv = keras.layers.Conv2D(4, 3, strides=2, dilation_rate=1, padding="valid", name="conv")
        self.fc = keras.layers.Dense(3, name="fc")

    def call(self, x):
        k, s = self.conv.kernel_size[0], self.conv.strides[0]
        pad = max(k - s, 0)
        x = keras.ops.pad(x, [[0, 0], [pad // 2, pad - pad // 2], [pad // 2, pad - pad // 2], [0, 0]])
        h = self.conv(x)
        h = keras.ops.reshape(h, (-1, h.shape[1] * h.shape[2] * self.conv.filters))
        return self.fc(h) * (self.fc.units / 3.0) * (self.conv.kernel.shape[-1] / self.conv.filters)


@pytest.mark.parametrize("kind", ["pruner", "quantizer"])
def test_model_code_reads_wrapped_layer_attributes(kind):
    keras.utils.set_random_seed(0)
    model = AttributeReader()
    x = X[:2]
    dense = np.asarray(model(x))
    if kind == "pruner":
        c = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D", "Dense"]}])
    else:
        c = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 2, "op_types": ["Conv2D", "Dense"]}])
    c.compress()
    out = np.asarray(model(x))
    assert out.shape == (2, 3) and np.isfinite(out).all()
    assert np.abs(out - dense).max() > 1e-4  # compressed: the outputs moved
    conv_w, fc_w = c.get_modules_wrapper()
    # the wrapper objects read through to their layer too (as torch's wrappers do)
    assert (conv_w.strides, conv_w.kernel_size, conv_w.filters, fc_w.units) == ((2, 2), (3, 3), 4, 3)
    assert conv_w.kernel is model.conv.kernel
    with pytest.raises(AttributeError):
        _ = conv_w.no_such_attribute
    with pytest.raises(AttributeError):
        _ = conv_w._no_such_private


# ---------------------------------------------------------------- 3. the seeds' clock
class CountingLevelPruner(LevelPruner):
    """A user's subclass of a built-in one-shot pruner: calc_mask must run at every training step."""

    def __init__(self, *args, **kwargs):
        self.calls = tf.Variable(0, dtype=tf.int64, trainable=False)  # counts executions, also in the graph
        super().__init__(*args, **kwargs)

    def calc_mask(self, wrapper, wrapper_idx=None):
        self.calls.assign_add(1)
        super().calc_mask(wrapper, wrapper_idx)
        return {"weight_mask": tf.abs(wrapper.weight) > 0.05}


def dense_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a"), keras.layers.Dense(2, name="b")])


@pytest.mark.parametrize("eager", [False, True])
def test_overridden_calc_mask_runs_at_every_training_step(eager):
    model = dense_model()
    opt = keras.optimizers.SGD(0.5)
    model.compile(opt, "mse", run_eagerly=eager)
    pruner = CountingLevelPruner(model, [{"sparsity": 0.5, "op_names": ["a"]}], opt)
    pruner.compress()
    assert int(pruner.calls.numpy()) == 1  # compress(): once for the one wrapper
    model.fit(X[:, :4, 0, 0], Y, batch_size=4, epochs=1, verbose=0)  # 3 steps
    assert int(pruner.calls.numpy()) == 1 + 3
    kernel = model.get_layer("a").kernel.numpy()
    np.testing.assert_array_equal(pruner.get_modules_wrapper()[0].weight_mask.numpy(), np.abs(kernel) > 0.05)


def test_builtin_one_shot_pruner_keeps_its_fast_path(monkeypatch):
    from compressor.tf.pruning.level import LevelPrunerMasker

    count = {"n": 0}
    original = LevelPrunerMasker.calc_mask

    def counting(self, *a, **k):
        count["n"] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(LevelPrunerMasker, "calc_mask", counting)
    model = dense_model()
    opt = keras.optimizers.SGD(0.5)
    model.compile(opt, "mse", run_eagerly=True)  # eager: every step would show up in the count
    LevelPruner(model, [{"sparsity": 0.5, "op_names": ["a"]}], opt).compress()
    model.fit(X[:, :4, 0, 0], Y, batch_size=4, epochs=1, verbose=0)
    assert count["n"] == 1


# ---------------------------------------------------------------- 5. mixed_bfloat16 with fit + CompressionCallback
@pytest.fixture
def bf16_policy():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_mixed_bfloat16_fit_with_pruner_and_qat(bf16_policy):
    model = cnn()
    assert model.get_layer("conv").compute_dtype == "bfloat16"
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D", "Dense"]}])
    pruner.compress()
    before = model.get_layer("fc").kernel.numpy().copy()
    hist = model.fit(X, Y, batch_size=4, epochs=2, verbose=0, callbacks=[CompressionCallback(pruner)])
    assert np.isfinite(hist.history["loss"]).all()
    for w in pruner.get_modules_wrapper():
        mask = w.weight_mask.numpy()
        assert (~mask).sum() == mask.size // 2
        assert (w.weight.numpy()[~mask] == 0).all()  # exactly 0 after momentum steps
    assert not np.array_equal(model.get_layer("fc").kernel.numpy()[pruner.get_modules_wrapper()[1].weight_mask.numpy()],
                              before[pruner.get_modules_wrapper()[1].weight_mask.numpy()])

    model = cnn("qat")
    model.compile(keras.optimizers.SGD(0.05), "mse")
    q = QAT_Quantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["Conv2D", "Dense"]}])
    q.compress()
    hist = model.fit(X, Y, batch_size=4, epochs=1, verbose=0, callbacks=[CompressionCallback(q)])
    assert np.isfinite(hist.history["loss"]).all()
    assert int(q.step_count.numpy()) == 3
    out = model.predict(X[:2], verbose=0)
    assert np.isfinite(out).all()
    for w in q.get_modules_wrapper():
        assert bool(w.output_observed.numpy()) and float(w.output_scale.numpy()) > 0


# ---------------------------------------------------------------- 7. atomic exports
class _BrokenConverter:
    def convert(self):
        raise RuntimeError("converter failed")


def test_failed_pruner_export_leaves_nothing_and_keeps_old_files(tmp_path, monkeypatch):
    model = cnn()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D", "Dense"]}])
    pruner.compress()
    (tmp_path / "m.tflite").write_bytes(b"previous export")
    monkeypatch.setattr(tf.lite.TFLiteConverter, "from_keras_model", staticmethod(lambda m: _BrokenConverter()))
    with pytest.raises(RuntimeError, match="converter failed"):
        pruner.export_model(str(tmp_path / "m.keras"), str(tmp_path / "masks.npz"), str(tmp_path / "saved"),
                            str(tmp_path / "m.tflite"))
    assert _listing(tmp_path) == ["m.tflite"]
    assert (tmp_path / "m.tflite").read_bytes() == b"previous export"
    monkeypatch.undo()
    pruner.export_model(str(tmp_path / "m.keras"), str(tmp_path / "masks.npz"))
    assert _listing(tmp_path) == ["m.keras", "m.tflite", "masks.npz"]
    np.testing.assert_allclose(keras.saving.load_model(tmp_path / "m.keras")(X[:2]), model(X[:2]), rtol=1e-6, atol=1e-6)


def test_failed_quantizer_export_leaves_nothing(tmp_path, monkeypatch):
    model = cnn()
    q = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2D", "Dense"]}])
    q.compress()
    model(X[:2])
    (tmp_path / "calib.json").write_text("old")
    monkeypatch.setattr(tf.lite.TFLiteConverter, "from_saved_model", staticmethod(lambda d: _BrokenConverter()))
    with pytest.raises(RuntimeError, match="converter failed"):
        q.export_model(str(tmp_path / "q.keras"), str(tmp_path / "calib.json"), str(tmp_path / "q.tflite"))
    assert _listing(tmp_path) == ["calib.json"] and (tmp_path / "calib.json").read_text() == "old"
    model(X[:2])  # the quantizer is reinstalled and still works


# ---------------------------------------------------------------- 8. model.save() with a quantizer attached
def dw_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(3, 3, name="conv")(inp)
    h = keras.layers.DepthwiseConv2D(3, name="dw")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(inp, keras.layers.Dense(2, name="fc")(h))


@pytest.mark.parametrize("Q", [DoReFaQuantizer, LsqQuantizer])
def test_keras_save_refused_with_a_quantizer_and_export_reproduces(Q, tmp_path):
    model = dw_model()
    model.compile(keras.optimizers.SGD(0.01), "mse")
    q = Q(model, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": ["default"]}], model.optimizer)
    q.compress()
    model.fit(X, Y, batch_size=4, epochs=1, verbose=0)
    want = np.asarray(model(X[:4]))
    (tmp_path / "old.keras").write_bytes(b"previous")
    for call in (lambda: model.save(tmp_path / "old.keras"), lambda: model.save(tmp_path / "new.keras"),
                 lambda: model.save_weights(tmp_path / "w.weights.h5")):
        with pytest.raises(RuntimeError, match=rf"refused: its layers are quantized by {Q.__name__}.*export_model"):
            call()
    assert _listing(tmp_path) == ["old.keras"] and (tmp_path / "old.keras").read_bytes() == b"previous"
    ckpt = keras.callbacks.ModelCheckpoint(str(tmp_path / "ck.keras"))
    with pytest.raises(RuntimeError, match="refused"):
        model.fit(X, Y, batch_size=4, epochs=1, verbose=0, callbacks=[ckpt])
    assert _listing(tmp_path) == ["old.keras"]
    # the quantized model goes through export_model: a plain Keras file that reproduces it
    want = np.asarray(model(X[:4]))
    q.export_model(str(tmp_path / "q.keras"))
    loaded = keras.saving.load_model(tmp_path / "q.keras")
    np.testing.assert_allclose(np.asarray(loaded(X[:4])), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="refused"):  # still guarded after the export
        model.save(tmp_path / "new.keras")
    # nested in an outer model, the quantized layers save their float weights (a loadable file) and warn
    outer = keras.Sequential([keras.Input((6, 6, 1)), model])
    with pytest.warns(RuntimeWarning, match="holds its float weights"):
        outer.save(tmp_path / "outer.keras")
    keras.saving.load_model(tmp_path / "outer.keras")
    q.strip()
    model.save(tmp_path / "float.keras")  # the float model saves normally once the quantizer is gone
    np.testing.assert_allclose(np.asarray(keras.saving.load_model(tmp_path / "float.keras")(X[:4])),
                               np.asarray(model(X[:4])), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- 9. slimming keeps every layer
def conv_bn_stack(widths=(4, 8, 16)) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 1))
    h = inp
    for i, w in enumerate(widths):
        h = keras.layers.Conv2D(w, 3, padding="same", name=f"conv{i}")(h)
        h = keras.layers.BatchNormalization(name=f"bn{i}")(h)
        h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(2, name="fc")(h))


def test_slim_on_fresh_batchnorms_keeps_every_layer_and_warns():
    model = conv_bn_stack()
    with pytest.warns(RuntimeWarning, match="25 channel scores tie at the global threshold and 14 of them"):
        pruner = SlimPruner(model, [{"sparsity": 0.5, "op_types": ["BatchNormalization"]}])
        pruner.compress()
    masks = [w.weight_mask.numpy() for w in pruner.get_modules_wrapper()]
    assert [int(m.sum()) for m in masks] == [2, 4, 8]
    assert [np.flatnonzero(~m).tolist() for m in masks] == [[1, 2], [1, 2, 3, 4], list(range(1, 9))]
    out = model.predict(X[:4], verbose=0)
    assert np.abs(out - out[0]).max() > 0  # not disconnected
    with pytest.raises(ConfigError, match="max_layer_sparsity"):
        SlimPruner(conv_bn_stack(), [{"sparsity": 0.5, "op_types": ["BatchNormalization"]}], max_layer_sparsity=-1)


# ---------------------------------------------------------------- issue 29: one transaction per export
def test_pruner_export_with_a_later_target_a_directory_changes_no_file(tmp_path):
    pruner = LevelPruner(cnn(), [{"sparsity": 0.5, "op_types": ["Conv2D", "Dense"]}])
    pruner.compress()
    (tmp_path / "m.keras").write_bytes(b"old model")
    (tmp_path / "masks.npz").write_bytes(b"old masks")
    (tmp_path / "m.tflite").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        pruner.export_model(str(tmp_path / "m.keras"), str(tmp_path / "masks.npz"), tflite_path=str(tmp_path / "m.tflite"))
    assert info.value.filename == str(tmp_path / "m.tflite")
    assert (tmp_path / "m.keras").read_bytes() == b"old model" and (tmp_path / "masks.npz").read_bytes() == b"old masks"
    assert _listing(tmp_path) == ["m.keras", "m.tflite", "masks.npz"]
    with pytest.raises(ConfigError, match="model_path and compressed_path are the same file"):
        pruner.export_model(str(tmp_path / "m.keras"), compressed_path=str(tmp_path / "m.keras"))
    assert (tmp_path / "m.keras").read_bytes() == b"old model"


def test_pruner_export_with_saved_model_path_an_existing_file_changes_no_file(tmp_path):
    pruner = LevelPruner(cnn(), [{"sparsity": 0.5, "op_types": ["Conv2D", "Dense"]}])
    pruner.compress()
    (tmp_path / "m.keras").write_bytes(b"old model")
    (tmp_path / "masks.npz").write_bytes(b"old masks")
    (tmp_path / "sm").write_bytes(b"old file")  # a SavedModel is a directory: it cannot replace this file
    with pytest.raises(NotADirectoryError) as info:
        pruner.export_model(str(tmp_path / "m.keras"), str(tmp_path / "masks.npz"), saved_model_path=str(tmp_path / "sm"))
    assert info.value.filename == str(tmp_path / "sm")
    assert (tmp_path / "m.keras").read_bytes() == b"old model" and (tmp_path / "masks.npz").read_bytes() == b"old masks"
    assert (tmp_path / "sm").read_bytes() == b"old file" and _listing(tmp_path) == ["m.keras", "masks.npz", "sm"]


def test_ptq_export_with_tflite_path_a_directory_changes_no_file(tmp_path):
    from compressor.tf import PtqQuantizer

    model = cnn()
    q = PtqQuantizer(model, [{"quant_types": ["weight", "input", "output"], "quant_bits": 8, "op_types": ["Conv2D"]}])
    q.compress()
    q.calibrate(X, num_batches=1)
    (tmp_path / "calib.json").write_text("old")
    (tmp_path / "q.tflite").mkdir()
    with pytest.raises(IsADirectoryError):
        q.export_model(calibration_path=str(tmp_path / "calib.json"), tflite_path=str(tmp_path / "q.tflite"))
    assert (tmp_path / "calib.json").read_text() == "old" and _listing(tmp_path) == ["calib.json", "q.tflite"]
    with pytest.raises(ConfigError, match="PtqQuantizer: bn_fold must be True or False, got 'no'"):
        PtqQuantizer(cnn(), [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2D"]}], bn_fold="no")


def test_masks_of_layers_named_like_np_savez_arguments_round_trip(tmp_path):
    from compressor.tf.pruning.export import load_masks

    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, name="file")(inp)
    h = keras.layers.Dense(4, name="allow_pickle")(h)
    model = keras.Model(inp, keras.layers.Dense(2, name="args")(h))
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Dense"]}])
    pruner.compress()
    pruner.export_model(mask_path=str(tmp_path / "masks.npz"))
    masks = load_masks(str(tmp_path / "masks.npz"))
    assert sorted(masks) == ["allow_pickle", "args", "file"]
    for w in pruner.get_modules_wrapper():
        np.testing.assert_array_equal(masks[w.name]["weight"], w.weight_mask.numpy())
        assert int((~masks[w.name]["weight"]).sum()) == w.weight_mask.numpy().size // 2


def test_speedup_strict_of_the_wrong_type_is_refused():
    from compressor.tf import speedup_model

    with pytest.raises(ConfigError, match="speedup_model: strict must be True or False, got 'no'"):
        speedup_model(cnn(), strict="no")
