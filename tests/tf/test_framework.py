"""The TF compressor base: layer discovery and names, matching, validation before mutation, wrapper state,
collectors, the forward hook, weight substitution, the optimizer hook, checkpoints, unwrap/strip, layouts."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from compressor.core.errors import ConfigError, ModelError
from compressor.tf import layout
from compressor.tf.compressor import Compressor, LayerWrapper, iter_layers, wrappers_of
from compressor.tf.hooks import hooked_compressors
from compressor.tf.pruning import L1FilterPruner, LevelPruner, SlimPruner


class Recorder(Compressor):
    """Minimal compressor: plain wrappers, counts steps (eagerly, at trace time for graphs)."""

    _kind = "recorder"

    def __init__(self, *a, **kw):
        self.steps = 0
        super().__init__(*a, **kw)

    def _create_wrapper(self, layer, layer_info, config):
        return LayerWrapper(layer, layer_info, config, self)

    def step(self):
        super().step()
        self.steps += 1


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
        self.flat = keras.layers.Flatten(name="flat")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x, training=None):
        return self.head(self.flat(self.block1(x, training=training)))


def seq():
    return keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3, name="conv"),
                             keras.layers.Flatten(name="flat"), keras.layers.Dense(3, name="fc")])


def functional_nested():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="d1")], name="inner")
    inp = keras.Input((4,))
    out = keras.layers.Dense(2, name="out")(inner(inp))
    return keras.Model(inp, out)


X = np.random.default_rng(0).random((4, 6, 6, 2), dtype=np.float32)


def snapshot(model):
    return ([v.numpy().copy() for v in model.variables],
            {id(layer): dict(vars(layer)) for _, layer in iter_layers(model)})


def assert_untouched(model, snap):
    values, attrs = snap
    for v, old in zip(model.variables, values):
        np.testing.assert_array_equal(v.numpy(), old)
    for _, layer in iter_layers(model):
        assert "call" not in vars(layer)
        assert not [k for k in vars(layer) if k.startswith("_compressor_")]
        assert dict(vars(layer)).keys() == attrs[id(layer)].keys()


# ---------------------------------------------------------------- discovery and matching
def test_layer_paths_sequential_functional_subclassed():
    assert [n for n, _ in iter_layers(seq())] == ["conv", "flat", "fc"]
    assert [n for n, _ in iter_layers(functional_nested())] == ["inner", "inner/d1", "out"]
    net = Net()
    net(X[:, :, :, :1][:, :6, :6])
    assert [n for n, _ in iter_layers(net)] == ["block1", "block1/conv", "block1/bn", "flat", "head"]


@pytest.mark.parametrize("op_types", [["Conv2D", "Dense"], ["Conv2d", "Linear"], ["default"]])
def test_op_types_accept_keras_torch_and_default(op_types):
    c = Recorder(seq(), [{"op_types": op_types}])
    assert [(i.name, i.type) for i, _ in c.get_modules_to_compress()] == [("conv", "Conv2D"), ("fc", "Dense")]


def test_last_matching_entry_wins_and_exclude():
    cfg = [{"sparsity": 0.5, "op_types": ["default"]}, {"sparsity": 0.2, "op_names": ["fc"]},
           {"exclude": True, "op_names": ["conv"]}]
    c = Recorder(seq(), cfg)
    assert [(i.name, conf["sparsity"]) for i, conf in c.get_modules_to_compress()] == [("fc", 0.2)]
    assert c.get_modules_wrapper()[0].config["sparsity"] == 0.2


def test_nested_functional_names():
    c = Recorder(functional_nested(), [{"op_types": ["Dense"]}])
    assert [w.name for w in c.get_modules_wrapper()] == ["inner/d1", "out"]


# ---------------------------------------------------------------- bad input leaves the model untouched
@pytest.mark.parametrize("make, args, err", [
    (lambda: LevelPruner, ([{"sparsity": 1.5, "op_types": ["default"]}],), ConfigError),
    (lambda: LevelPruner, ([{"sparsity": 0.5, "op_typs": ["default"]}],), ConfigError),
    (lambda: LevelPruner, ([{"sparsity": 0.5, "op_types": ["LSTM"]}],), ConfigError),
    (lambda: LevelPruner, ([{"sparsity": 0.5, "op_types": "Conv2D"}],), ConfigError),
    (lambda: LevelPruner, ({"sparsity": 0.5, "op_types": ["default"]},), ConfigError),
    (lambda: LevelPruner, ([{"op_types": ["default"]}],), ConfigError),  # sparsity required
    (lambda: LevelPruner, ([{"sparsity": 0.5, "op_types": ["default"]}], "sgd"), ConfigError),
    (lambda: L1FilterPruner, ([{"sparsity": 0.5, "op_types": ["Flatten"]}],), ConfigError),
    (lambda: SlimPruner, ([{"sparsity": 0.5, "op_types": ["Conv2D"]}],), ConfigError),
])
@pytest.mark.filterwarnings("ignore::compressor.core.errors.ConfigWarning")
def test_bad_input_clear_error_model_untouched(make, args, err):
    model = seq()
    snap = snapshot(model)
    with pytest.raises(err) as e:
        make()(model, *args)
    assert "config_list" in str(e.value) or "Pruner" in str(e.value)
    assert_untouched(model, snap)


def test_not_a_keras_model():
    with pytest.raises(ModelError, match="Keras 3"):
        LevelPruner(object(), [{"sparsity": 0.5, "op_types": ["default"]}])


def test_already_wrapped_same_kind_refused_untouched():
    model = seq()
    LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    before = dict(vars(model.layers[0]))
    with pytest.raises(ConfigError, match="already wrapped"):
        LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    assert dict(vars(model.layers[0])) == before


# ---------------------------------------------------------------- wrapper state
def test_wrapper_identity_and_weights():
    model = seq()
    c = Recorder(model, [{"op_types": ["default"]}])
    w = c.get_modules_wrapper()[0]
    assert w.layer is model.layers[0] and w.name == "conv" and w.type == "Conv2D"
    assert w.weight is model.layers[0].kernel and w.bias is model.layers[0].bias
    assert wrappers_of(model.layers[0]) == [w]


def test_set_wrappers_attribute_tensor_becomes_variable_python_copied():
    c = Recorder(seq(), [{"op_types": ["default"]}])
    c.set_wrappers_attribute("count", tf.zeros([2]))
    c.set_wrappers_attribute("seen", [])
    c.set_wrappers_attribute("flag", False)
    w0, w1 = c.get_modules_wrapper()
    assert isinstance(w0.count, tf.Variable) and not w0.count.trainable and w0.count is not w1.count
    assert w0.seen is not w1.seen and w0.flag is False

    @tf.function
    def bump():
        w0.count = w0.count + 1.0  # assigning the attribute assigns the variable, in-graph
        return w0.count.read_value()

    bump()
    bump()
    np.testing.assert_array_equal(w0.count.numpy(), [2.0, 2.0])
    np.testing.assert_array_equal(w1.count.numpy(), [0.0, 0.0])


def test_activation_collector_in_graph_and_removal():
    model = seq()
    c = Recorder(model, [{"op_types": ["default"]}])
    c.set_wrappers_attribute("calls", tf.constant(0, tf.int64))
    c.set_wrappers_attribute("out_sum", tf.constant(0.0))

    def collector(wrapper, inputs, output):
        assert isinstance(inputs, tuple)
        wrapper.calls.assign_add(1)
        wrapper.out_sum.assign_add(tf.reduce_sum(output))

    cid = c.add_activation_collector(collector)
    model.predict(X, verbose=0, batch_size=2)  # graph mode: 2 batches
    conv, fc = c.get_modules_wrapper()
    assert int(conv.calls.numpy()) == 2 and int(fc.calls.numpy()) == 2
    np.testing.assert_allclose(float(fc.out_sum.numpy()), float(np.sum(model.predict(X, verbose=0))), rtol=1e-5)
    c.remove_activation_collector(cid)
    before = int(conv.calls.numpy())
    model.predict(X, verbose=0)
    assert int(conv.calls.numpy()) == before
    with pytest.raises(ValueError, match="no activation collector"):
        c.remove_activation_collector(cid)


class Doubling(LayerWrapper):
    def forward(self, call_fn, *args, **kwargs):
        return 2.0 * call_fn(*args, **kwargs)


class DoublingCompressor(Recorder):
    _kind = "doubler"

    def _create_wrapper(self, layer, layer_info, config):
        return Doubling(layer, layer_info, config, self)


def test_forward_override_traces_into_predict_and_fit():
    model = seq()
    ref = model.predict(X, verbose=0)
    DoublingCompressor(model, [{"op_names": ["fc"]}])
    np.testing.assert_allclose(model.predict(X, verbose=0), 2 * ref, rtol=1e-5)
    np.testing.assert_allclose(model(X).numpy(), 2 * ref, rtol=1e-5)


def test_call_with_weights_substitutes_with_gradients_and_keeps_bn_updates():
    inp = keras.Input((3,))
    dense = keras.layers.Dense(2, name="d")
    bn = keras.layers.BatchNormalization(name="bn", momentum=0.5)
    model = keras.Model(inp, bn(dense(inp)))
    c = Recorder(model, [{"op_types": ["Dense", "BatchNormalization"]}])
    wd, wb = c.get_modules_wrapper()
    x = tf.ones((4, 3))
    with tf.GradientTape() as tape:
        scaled = 3.0 * dense.kernel
        out = wd.call_with_weights(wd._original_call, [(dense.kernel, scaled)], x)
        loss = tf.reduce_sum(out)
    g = tape.gradient(loss, dense.kernel)
    np.testing.assert_allclose(out.numpy(), x.numpy() @ (3 * dense.kernel.numpy()) + dense.bias.numpy(), rtol=1e-5)
    np.testing.assert_allclose(g.numpy(), np.full((3, 2), 3.0 * 4), rtol=1e-6)  # through the substituted tensor
    y = tf.constant([[1.0, 3.0], [1.0, 3.0]])
    wb.call_with_weights(wb._original_call, [(bn.gamma, tf.zeros(2))], y, training=True)
    np.testing.assert_allclose(bn.moving_mean.numpy(), [0.5, 1.5], rtol=1e-6)  # the BN update was not lost


# ---------------------------------------------------------------- optimizer hook
def test_optimizer_hook_idempotent_shared_and_unhook():
    model = seq()
    opt = keras.optimizers.SGD(0.1)
    a = Recorder(model, [{"op_names": ["conv"]}], opt)
    b = DoublingCompressor(model, [{"op_names": ["fc"]}], opt)
    a.hook_optimizer(opt)  # again: no second hook
    assert hooked_compressors(opt) == [a, b]
    opt.apply_gradients([(tf.ones_like(v), v) for v in model.trainable_variables])
    assert (a.steps, b.steps) == (1, 1)
    assert int(a.step_count.numpy()) == 1 and int(b.step_count.numpy()) == 1
    a.unhook()
    assert hooked_compressors(opt) == [b] and "apply" in vars(opt)
    b.unhook()
    assert "apply" not in vars(opt) and hooked_compressors(opt) == []


def test_hook_runs_inside_tf_function_once_per_update():
    model = seq()
    opt = keras.optimizers.SGD(0.1)
    c = Recorder(model, [{"op_types": ["default"]}], opt)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def train(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    y = np.zeros((4, 3), np.float32)
    for _ in range(3):
        train(X, y)
    assert int(c.step_count.numpy()) == 3  # the counter is a graph op
    assert c.steps == 1  # step() traced once


# ---------------------------------------------------------------- unwrap, strip, checkpoints, chaining
def test_unwrap_wrap_strip_restore_layer_and_optimizer():
    model = seq()
    opt = keras.optimizers.SGD(0.1)
    ref = model.predict(X, verbose=0)
    c = DoublingCompressor(model, [{"op_names": ["fc"]}], opt)
    c._unwrap_model()
    np.testing.assert_allclose(model.predict(X, verbose=0), ref, rtol=1e-6)
    c._wrap_model()
    np.testing.assert_allclose(model.predict(X, verbose=0), 2 * ref, rtol=1e-5)
    c.strip()
    np.testing.assert_allclose(model.predict(X, verbose=0), ref, rtol=1e-6)
    assert "call" not in vars(model.layers[-1]) and "apply" not in vars(opt)


def test_two_kinds_chain_and_splice_out():
    model = seq()
    ref = model.predict(X, verbose=0)
    inner = DoublingCompressor(model, [{"op_names": ["fc"]}])
    outer = type("Tripler", (DoublingCompressor,), {"_kind": "tripler"})(model, [{"op_names": ["fc"]}])
    np.testing.assert_allclose(model.predict(X, verbose=0), 4 * ref, rtol=1e-5)
    inner.strip()  # not the outermost: spliced out of the chain
    np.testing.assert_allclose(model.predict(X, verbose=0), 2 * ref, rtol=1e-5)
    outer.strip()
    np.testing.assert_allclose(model.predict(X, verbose=0), ref, rtol=1e-6)
    assert "call" not in vars(model.layers[-1])


def test_masks_saved_with_checkpoint(tmp_path):
    model = seq()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    pruner.compress()
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    names = [n for n, _ in tf.train.list_variables(path)]
    assert any("_compressor_pruner/weight_mask" in n for n in names)

    fresh = seq()
    p2 = LevelPruner(fresh, [{"sparsity": 0.5, "op_types": ["default"]}])
    tf.train.Checkpoint(model=fresh).read(path).assert_existing_objects_matched()
    for a, b in zip(pruner.get_modules_wrapper(), p2.get_modules_wrapper()):
        np.testing.assert_array_equal(a.weight_mask.numpy(), b.weight_mask.numpy())
    assert len(fresh.weights) == len(seq().weights)  # masks are not Keras weights


# ---------------------------------------------------------------- layouts
@pytest.mark.parametrize("layer_type, shape, to_torch", [
    ("Dense", (3, 5), lambda k: k.T),
    ("Conv1D", (2, 3, 5), lambda k: k.transpose(2, 1, 0)),
    ("Conv2D", (2, 3, 4, 5), lambda k: k.transpose(3, 2, 0, 1)),
    ("Conv3D", (2, 2, 3, 4, 5), lambda k: k.transpose(4, 3, 0, 1, 2)),
    ("Conv2DTranspose", (2, 3, 5, 4), lambda k: k.transpose(3, 2, 0, 1)),  # torch: [in, out, kh, kw]
    ("DepthwiseConv2D", (2, 3, 4, 2), lambda k: k.transpose(2, 3, 0, 1).reshape(8, 1, 2, 3)),
    ("BatchNormalization", (7,), lambda k: k),
])
def test_layout_round_trip(layer_type, shape, to_torch):
    k = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    c = layout.to_canonical(layer_type, tf.constant(k)).numpy()
    np.testing.assert_array_equal(c, to_torch(k))
    np.testing.assert_array_equal(layout.from_canonical(layer_type, tf.constant(c), shape).numpy(), k)
