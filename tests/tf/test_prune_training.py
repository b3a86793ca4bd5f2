"""Pruning end to end in training: model.fit in graph mode (and XLA), a custom tf.function loop, predict,
subclassed models built after wrapping, nested functional models, the callback clock, forward mask mode,
checkpoint resume."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from compressor.tf import AGPPruner, LevelPruner, PruningCallback, SensitivityPruner, SlimPruner, TfPruner

RNG = np.random.default_rng(0)
X = RNG.random((32, 8, 8, 1), dtype=np.float32)
Y = RNG.integers(0, 3, 32)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CFG = [{"sparsity": 0.5, "op_types": ["default"]}]


def cnn():
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(6, 3, activation="relu", name="c1"),
                             keras.layers.Conv2D(8, 3, name="c2"), keras.layers.Flatten(), keras.layers.Dense(3, name="fc")])


def assert_masked(pruner, sparsity=0.5):
    for w in pruner.get_modules_wrapper():
        mask = w.weight_mask.numpy()
        assert abs((1 - mask.mean()) - sparsity) < 0.02, w.name
        assert (w.weight.numpy()[~mask] == 0).all(), w.name
        assert (w.weight.numpy()[mask] != 0).all(), w.name


@pytest.mark.parametrize("jit", [False, True])
def test_fit_graph_mode_keeps_masked_weights_zero(jit):
    keras.utils.set_random_seed(0)
    model = cnn()
    opt = keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=1e-3)  # both move pruned weights
    model.compile(opt, LOSS, jit_compile=jit)
    pruner = LevelPruner(model, CFG, opt)
    model = pruner.compress()
    before = [w.weight.numpy().copy() for w in pruner.get_modules_wrapper()]
    hist = model.fit(X, Y, epochs=2, batch_size=8, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    assert_masked(pruner)
    assert int(pruner.step_count.numpy()) == 8
    assert any(not np.array_equal(b, w.weight.numpy()) for b, w in zip(before, pruner.get_modules_wrapper()))
    assert model.train_function is not None


def test_custom_tf_function_loop_and_predict():
    keras.utils.set_random_seed(0)
    model = cnn()
    opt = keras.optimizers.Adam(0.01)
    pruner = LevelPruner(model, CFG, opt)
    pruner.compress()

    @tf.function(jit_compile=False)
    def train(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    for i in range(4):
        train(X[i * 8:(i + 1) * 8], Y[i * 8:(i + 1) * 8])
    assert_masked(pruner)
    # predict runs on the masked weights: equal to a plain copy of the model with the same (masked) weights
    plain = cnn()
    plain.set_weights(model.get_weights())
    np.testing.assert_allclose(model.predict(X, verbose=0), plain.predict(X, verbose=0), rtol=1e-5, atol=1e-6)


def test_callback_hooks_model_optimizer_and_drives_agp():
    keras.utils.set_random_seed(0)
    model = cnn()
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    pruner = AGPPruner(model, [{"final_sparsity": 0.75, "start_epoch": 0, "end_epoch": 3, "frequency": 1,
                                "op_types": ["default"]}])  # no optimizer: the callback hooks model.optimizer
    pruner.compress()
    seen = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            w = pruner.get_modules_wrapper()[2]
            seen.append((round(float(1 - w.weight_mask.numpy().mean()), 3),
                         bool((w.weight.numpy()[~w.weight_mask.numpy()] == 0).all())))

    model.fit(X, Y, epochs=4, batch_size=8, verbose=0, callbacks=[PruningCallback(pruner), Record()])
    # span 2: s(0) = 0, s(1) = 0.75 - 0.75 * 0.5 ** 3 = 0.656 -> floor(288 * .65625) = 189 / 288, s(2) = .75
    assert seen == [(0.0, True), (0.656, True), (0.75, True), (0.75, True)]
    assert pruner.optimizer is model.optimizer


class Block(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.conv = keras.layers.Conv2D(4, 3, name="conv")
        self.bn = keras.layers.BatchNormalization(name="bn")

    def call(self, x, training=None):
        return tf.nn.relu(self.bn(self.conv(x), training=training))


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.block1 = Block(name="block1")
        self.flat = keras.layers.Flatten()
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x, training=None):
        return self.head(self.flat(self.block1(x, training=training)))


def test_subclassed_model_built_after_wrapping():
    keras.utils.set_random_seed(0)
    model = Net()  # not built: masks are created when the layers are built
    pruner = LevelPruner(model, CFG)
    assert [(w.name, w.ready) for w in pruner.get_modules_wrapper()] == [("block1/conv", False), ("head", False)]
    pruner.compress()
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    model.fit(X, Y, epochs=2, batch_size=8, verbose=0, callbacks=[PruningCallback(pruner)])
    assert all(w.ready for w in pruner.get_modules_wrapper())
    assert_masked(pruner)


@pytest.mark.parametrize("make", [
    lambda m: LevelPruner(m, [{"sparsity": 0.5, "op_types": ["Dense"]}]),
    lambda m: SensitivityPruner(m, [{"sensitivity": 1.0, "op_types": ["Dense"]}]),
    lambda m: SlimPruner(m, [{"sparsity": 0.5, "op_types": ["BatchNormalization"]}]),
])
def test_model_first_built_inside_fit(make):
    """No Input: the layers are built inside the traced train step; masks are computed in-graph at step 1."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(6, name="d"), keras.layers.BatchNormalization(name="b1"),
                              keras.layers.Dense(4, name="e"), keras.layers.BatchNormalization(name="b2")])
    pruner = make(model)
    pruner.compress()
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    model.fit(RNG.random((16, 3), dtype=np.float32), RNG.random((16, 4), dtype=np.float32), epochs=2, verbose=0,
              callbacks=[PruningCallback(pruner)])
    pruned = 0
    for w in pruner.get_modules_wrapper():
        mask = w.weight_mask.numpy()
        pruned += int((~mask).sum())
        assert (w.weight.numpy()[~mask] == 0).all()
    assert pruned >= 5  # Level: 9 + 12, Slim: 5 of 10 channels, Sensitivity: about half
    assert not pruner._deferred


def test_model_built_with_build_after_wrapping():
    model = keras.Sequential([keras.layers.Dense(6, name="d")])
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    model.build((None, 3))
    pruner.compress()
    assert pruner.report().total == {"params": 18, "pruned": 9, "sparsity": 0.5}


def test_callback_remasks_weights_written_between_fits():
    model = cnn()
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    pruner = LevelPruner(model, CFG)
    pruner.compress()
    model.set_weights([np.ones_like(v) for v in model.get_weights()])
    model.fit(X, Y, epochs=1, batch_size=32, verbose=0, callbacks=[PruningCallback(pruner)])
    assert_masked(pruner)


def test_subclassed_model_built_before_wrapping_eager_calls():
    model = Net()
    model(X[:1])
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_names": ["block1/conv"]}])
    pruner.compress()
    w = pruner.get_modules_wrapper()[0]
    assert w.layer is model.block1.conv
    assert int((~w.weight_mask.numpy()).sum()) == 18


def test_nested_functional_model():
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="d1")], name="inner")
    inp = keras.Input((6,))
    model = keras.Model(inp, keras.layers.Dense(2, name="out")(inner(inp)))
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(opt, "mse")
    pruner = LevelPruner(model, CFG, opt)
    pruner.compress()
    assert [w.name for w in pruner.get_modules_wrapper()] == ["inner/d1", "out"]
    model.fit(RNG.random((16, 6), dtype=np.float32), RNG.random((16, 2), dtype=np.float32), epochs=2, verbose=0)
    assert_masked(pruner)


class ForwardLevelPruner(LevelPruner):
    mask_mode = "forward"


def test_forward_mask_mode_masks_in_the_call():
    keras.utils.set_random_seed(0)
    model = cnn()
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(opt, LOSS)
    pruner = ForwardLevelPruner(model, CFG, opt)
    pruner.compress()
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    for w in pruner.get_modules_wrapper():  # masked weights get zero gradient; momentum is zero too
        assert (w.weight.numpy()[~w.weight_mask.numpy()] == 0).all()
    c1 = model.layers[0]
    c1.kernel.assign(c1.kernel + 1.0)  # writing the weights does not revive pruned ones in the call
    plain = cnn()
    plain.set_weights(model.get_weights())
    m = pruner.get_modules_wrapper()[0].weight_mask.numpy()
    plain.layers[0].kernel.assign(np.where(m, c1.kernel.numpy(), 0))
    np.testing.assert_allclose(model.predict(X, verbose=0), plain.predict(X, verbose=0), rtol=1e-5, atol=1e-5)


def test_bad_mask_mode():
    from compressor.core.errors import ConfigError

    with pytest.raises(ConfigError, match="mask_mode"):
        type("P", (LevelPruner,), {"mask_mode": "lazy"})(cnn(), CFG)


def test_checkpoint_resume_same_masks_and_schedule(tmp_path):
    keras.utils.set_random_seed(0)
    model = cnn()
    opt = keras.optimizers.SGD(0.1)
    model.compile(opt, LOSS)
    cfg = [{"final_sparsity": 0.6, "end_epoch": 4, "op_types": ["default"]}]
    pruner = AGPPruner(model, cfg, opt)
    pruner.compress()
    model.fit(X, Y, epochs=2, batch_size=8, verbose=0, callbacks=[PruningCallback(pruner)])
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "ck"))
    state = pruner.state_dict()

    fresh = cnn()
    opt2 = keras.optimizers.SGD(0.1)
    fresh.compile(opt2, LOSS)
    p2 = AGPPruner(fresh, cfg, opt2)
    tf.train.Checkpoint(model=fresh, optimizer=opt2).read(path).expect_partial()
    p2.load_state_dict(state)
    for a, b in zip(pruner.get_modules_wrapper(), p2.get_modules_wrapper()):
        np.testing.assert_array_equal(a.weight_mask.numpy(), b.weight_mask.numpy())
        np.testing.assert_array_equal(a.weight.numpy(), b.weight.numpy())
    assert p2.current_epoch == 1 and int(p2.step_count.numpy()) == 8
    fresh.fit(X, Y, epochs=4, initial_epoch=2, batch_size=8, verbose=0, callbacks=[PruningCallback(p2)])
    assert [r["pruned"] for r in p2.report()] == [int(r["params"] * 0.6) for r in p2.report()]  # final at epoch 3


def test_report_text_and_data():
    model = cnn()
    pruner = LevelPruner(model, CFG)
    pruner.compress()
    rep = pruner.report()
    assert [r["layer"] for r in rep] == ["c1", "c2", "fc"]
    assert rep[0]["params"] == 54 and rep[0]["pruned"] == 27
    assert "total (whole model)" in str(rep)
    assert isinstance(pruner, TfPruner)
