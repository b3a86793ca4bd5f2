"""Export of pruned Keras models: .keras, SavedModel and TFLite load WITHOUT compressor (checked in a
subprocess) and give the same outputs; masks file; apply_compression_results; the pruner keeps working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from compressor.core.errors import ConfigError
from compressor.tf import LevelPruner, PruningCallback, apply_compression_results, load_masks

RNG = np.random.default_rng(0)
X = RNG.random((16, 8, 8, 1), dtype=np.float32)
Y = RNG.integers(0, 3, 16)


def cnn():
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(6, 3, activation="relu", name="c1"),
                             keras.layers.BatchNormalization(name="bn"), keras.layers.Flatten(),
                             keras.layers.Dense(3, name="fc")])


LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np, tensorflow as tf, keras
    d = sys.argv[1]
    x = np.load(d + "/x.npy")
    out = {}
    out["keras"] = keras.models.load_model(d + "/model.keras").predict(x, verbose=0).tolist()
    sm = tf.saved_model.load(d + "/saved")
    out["saved"] = sm.serve(tf.constant(x)).numpy().tolist()
    interp = tf.lite.Interpreter(model_path=d + "/model.tflite")
    inp, res = interp.get_input_details()[0], []
    interp.resize_tensor_input(inp["index"], [1, 8, 8, 1])
    interp.allocate_tensors()
    for row in x:
        interp.set_tensor(inp["index"], row[None])
        interp.invoke()
        res.append(interp.get_tensor(interp.get_output_details()[0]["index"])[0].tolist())
    out["tflite"] = res
    out["compressor_loaded"] = any(m == "compressor" or m.startswith("compressor.") for m in sys.modules)
    print(json.dumps(out))
""")


def test_export_keras_savedmodel_tflite_load_without_compressor(tmp_path):
    keras.utils.set_random_seed(0)
    model = cnn()
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pruner = LevelPruner(model, [{"sparsity": 0.6, "op_types": ["default"]}], opt)
    pruner.compress()
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    d = str(tmp_path)
    pruner.export_model(d + "/model.keras", d + "/masks.npz", d + "/saved", d + "/model.tflite")
    ref = model.predict(X, verbose=0)
    np.save(d + "/x.npy", X)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", LOADER, d], capture_output=True, text=True, env=env, cwd=d, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["compressor_loaded"] is False
    for kind in ("keras", "saved", "tflite"):
        np.testing.assert_allclose(np.array(out[kind]), ref, rtol=1e-4, atol=1e-5, err_msg=kind)

    # the exported weights are the masked ones, the masks file matches the pruner's masks
    masks = load_masks(d + "/masks.npz")
    assert sorted(masks) == ["c1", "fc"] and sorted(masks["c1"]) == ["bias", "weight"]
    for w in pruner.get_modules_wrapper():
        np.testing.assert_array_equal(masks[w.name]["weight"], w.weight_mask.numpy())
        assert masks[w.name]["weight"].dtype == np.bool_
    loaded = keras.models.load_model(d + "/model.keras")
    assert (loaded.get_layer("c1").kernel.numpy()[~masks["c1"]["weight"]] == 0).all()
    assert not any(k.startswith("_compressor") for k in vars(loaded.get_layer("c1")))

    # the pruner is still installed and keeps working after the export
    assert "call" in vars(model.get_layer("fc"))
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    w = pruner.get_modules_wrapper()[1]
    assert (w.weight.numpy()[~w.weight_mask.numpy()] == 0).all()


def test_apply_compression_results_to_a_plain_model(tmp_path):
    keras.utils.set_random_seed(0)
    model = cnn()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_names": ["fc"]}])
    pruner.compress()
    pruner.export_masks(str(tmp_path / "m.npz"))
    plain = cnn()
    plain.set_weights([np.ones_like(v) for v in plain.get_weights()])
    apply_compression_results(plain, str(tmp_path / "m.npz"))
    mask = pruner.get_modules_wrapper()[0].weight_mask.numpy()
    np.testing.assert_array_equal(plain.get_layer("fc").kernel.numpy(), mask.astype(np.float32))
    np.testing.assert_array_equal(plain.get_layer("c1").kernel.numpy(), 1.0)

    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="x")])
    with pytest.raises(ConfigError, match="does not have"):
        apply_compression_results(other, str(tmp_path / "m.npz"))


def test_export_subclassed_savedmodel_and_strip(tmp_path):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.conv = keras.layers.Conv2D(4, 3, name="conv")
            self.head = keras.layers.Dense(2, name="head")

        def call(self, x):
            return self.head(tf.reshape(self.conv(x), [-1, 6 * 6 * 4]))

    model = Net()
    model(X[:1])
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], keras.optimizers.SGD(0.1))
    pruner.compress()
    ref = model.predict(X, verbose=0)
    pruner.export_model(saved_model_path=str(tmp_path / "sm"))
    sm = tf.saved_model.load(str(tmp_path / "sm"))  # keep a reference: its variables die with it
    np.testing.assert_allclose(sm.serve(X).numpy(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match=".keras"):
        pruner.export_model(str(tmp_path / "model.h5"))
    plain = pruner.strip()
    assert plain is model and "call" not in vars(model.conv) and "apply" not in vars(pruner.optimizer)
    np.testing.assert_allclose(model.predict(X, verbose=0), ref, rtol=1e-5, atol=1e-6)
    assert isinstance(PruningCallback(pruner), keras.callbacks.Callback)
