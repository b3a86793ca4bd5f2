"""Keras speedup: hand-built Functional / Sequential models with dead channels become smaller plain Keras
models with the same outputs (saved, reloaded without compressor, converted to TFLite, trained); exact
channel counts, params and MACs; clear errors; real keras.applications models."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import compressor.tf as ctf
from compressor.core.errors import ModelError
from compressor.core.graph import channel_groups
from compressor.tf import build_graph, count_flops_params, speedup_model

pytestmark = pytest.mark.tf

L = keras.layers


# ---------------------------------------------------------------------------------- helpers
def randomize_bn(model, seed=0):
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            layer.set_weights([rng.uniform(0.5, 1.5, w.shape) if i != len(layer.weights) - 1
                               else rng.uniform(0.5, 2.0, w.shape) for i, w in enumerate(layer.get_weights())])
            if layer.center:
                layer.beta.assign(rng.uniform(-1, 1, layer.beta.shape))
            layer.moving_mean.assign(rng.uniform(-1, 1, layer.moving_mean.shape))
        elif isinstance(layer, (L.Conv2D, L.Dense, L.DepthwiseConv2D)) and getattr(layer, "bias", None) is not None:
            layer.bias.assign(rng.uniform(-0.5, 0.5, layer.bias.shape))


def zero_channels(layer, chans):
    """Make output channels ``chans`` of ``layer`` dead: filters + bias, BN gamma + beta, depthwise, embedding."""
    chans = list(chans)
    if not chans:
        return
    if isinstance(layer, L.BatchNormalization):
        for v in (layer.gamma if layer.scale else None, layer.beta if layer.center else None):
            if v is not None:
                a = v.numpy()
                a[chans] = 0
                v.assign(a)
        return
    if isinstance(layer, L.Embedding):
        e = layer.embeddings.numpy()
        e[:, chans] = 0
        layer.embeddings.assign(e)
        return
    k = layer.kernel.numpy()
    if isinstance(layer, (L.DepthwiseConv1D, L.DepthwiseConv2D)):
        shape = k.shape
        k = k.reshape(*shape[:-2], -1)
        k[..., chans] = 0
        k = k.reshape(shape)
    else:
        k[..., chans] = 0
    layer.kernel.assign(k)
    if getattr(layer, "bias", None) is not None:
        b = layer.bias.numpy()
        b[chans] = 0
        layer.bias.assign(b)


def kill(model, spec):
    for name, chans in spec.items():
        zero_channels(model.get_layer(name), chans)


def assert_same(ref, out):
    ref, out = np.asarray(ref), np.asarray(out)
    assert ref.shape == out.shape
    assert np.abs(out - ref).max() <= 1e-5 * max(np.abs(ref).max(), 1e-12)


def data(shape, seed=1):
    return np.random.default_rng(seed).standard_normal((3, *shape)).astype("float32")


def check(model, spec, x, expected):
    """Kill channels, speedup, compare outputs and per-layer channel counts; returns the small model."""
    kill(model, spec)
    ref = np.asarray(model(x, training=False))
    before = [w.copy() for w in model.get_weights()]
    small = speedup_model(model)
    assert_same(ref, small(x, training=False))
    for name, n in expected.items():
        layer = small.get_layer(name)
        got = layer.filters if hasattr(layer, "filters") else (
            layer.units if hasattr(layer, "units") else layer.output_dim)
        assert got == n, (name, got, n)
    after = model.get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(before, after)), "the user's model was modified"
    return small


# ---------------------------------------------------------------------------------- models
def cnn(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 3), name="image")
    x = L.ReLU()(L.BatchNormalization(name="bn1")(L.Conv2D(6, 3, padding="same", name="c1")(inp)))
    x = L.BatchNormalization(name="bn2")(L.Conv2D(8, 3, activation="relu", name="c2")(x))
    x = L.Flatten()(L.MaxPooling2D(2)(x))
    x = L.Dense(10, activation="relu", name="fc1")(x)
    model = keras.Model(inp, L.Dense(3, name="fc2")(x))
    randomize_bn(model, seed)
    return model


CNN_DEAD = {"c1": [1, 4], "bn1": [1, 4], "c2": [0, 3, 5], "bn2": [0, 3, 5], "fc1": [2, 7]}


def residual(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 4))
    s = L.Conv2D(8, 3, padding="same", activation="relu", name="stem")(inp)
    y = L.BatchNormalization(name="bn_a")(L.Conv2D(8, 3, padding="same", name="conv_a")(s))
    x = L.ReLU()(L.Add()([s, y]))
    x = L.GlobalAveragePooling2D()(L.Conv2D(4, 1, name="head")(x))
    model = keras.Model(inp, L.Dense(2, name="fc")(x))
    randomize_bn(model, seed)
    return model


def concat(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 3))
    a = L.Conv2D(4, 3, padding="same", activation="relu", name="a")(inp)
    b = L.Conv2D(6, 1, activation="relu", name="b")(inp)
    x = L.Conv2D(5, 3, name="c")(L.Concatenate()([a, b]))
    return keras.Model(inp, L.Dense(2, name="fc")(L.GlobalMaxPooling2D()(x)))


def mobile_block(seed=0, multiplier=2):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 3))
    x = L.ReLU(6.0)(L.BatchNormalization(name="bn_e")(L.Conv2D(6, 1, name="expand")(inp)))
    x = L.ZeroPadding2D(1)(x)
    x = L.DepthwiseConv2D(3, depth_multiplier=multiplier, name="dw")(x)
    x = L.ReLU(6.0)(L.BatchNormalization(name="bn_d")(x))
    x = L.BatchNormalization(name="bn_p")(L.Conv2D(4, 1, name="project")(x))
    s = L.Conv2D(4, 1, name="short")(inp)
    x = L.GlobalAveragePooling2D()(L.Add()([x, s]))
    model = keras.Model(inp, L.Dense(3, name="fc")(L.Dropout(0.2)(x)))
    randomize_bn(model, seed)
    return model


def se_block(seed=0):
    """EfficientNet-style: Rescaling, swish, depthwise, squeeze-excite (Reshape, sigmoid, Multiply)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 3))
    x = L.Rescaling(1.0 / 255.0)(inp)
    x = L.BatchNormalization(name="bn0")(L.Conv2D(8, 3, padding="same", activation="swish", name="stem")(x))
    x = L.Activation("swish")(L.BatchNormalization(name="bn1")(L.DepthwiseConv2D(3, padding="same", name="dw")(x)))
    se = L.Reshape((1, 1, 8))(L.GlobalAveragePooling2D()(x))
    se = L.Conv2D(2, 1, activation="swish", name="se_r")(se)
    se = L.Conv2D(8, 1, activation="sigmoid", name="se_e")(se)
    x = L.Multiply()([x, se])
    x = L.Dropout(0.2, noise_shape=(None, 1, 1, 1))(L.BatchNormalization(name="bn2")(L.Conv2D(4, 1, name="proj")(x)))
    model = keras.Model(inp, L.Dense(3, name="fc")(L.GlobalAveragePooling2D()(x)))
    randomize_bn(model, seed)
    return model


def ffn(seed=0, einsum=False):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((5, 6))
    if einsum:
        h = L.EinsumDense("abc,cd->abd", output_shape=(None, 16), bias_axes="d", activation="gelu", name="up")(inp)
    else:
        h = L.Dense(16, activation="gelu", name="up")(inp)
    y = L.Dense(6, name="down")(h)
    return keras.Model(inp, L.Add()([inp, y]))


def moving_stats(model):
    """BatchNorm moving mean/variance entries: state, not parameters (torch buffers), so not counted."""
    return sum(2 * layer.moving_mean.shape[0] for layer in model._flatten_layers()
               if isinstance(layer, L.BatchNormalization))


# ---------------------------------------------------------------------------------- hand-built models
def test_cnn_flatten_dense_exact_channels_params_macs():
    model = cnn()
    x = data((8, 8, 3))
    kill(model, CNN_DEAD)
    macs0, params0, _ = count_flops_params(model)
    assert params0 == model.count_params() - moving_stats(model) == 168 + 12 + 440 + 16 + 730 + 33
    assert macs0 == 6 * 64 * 27 + 8 * 36 * 54 + 72 * 10 + 10 * 3
    small, report = speedup_model(model, return_report=True)
    assert_same(model(x, training=False), small(x, training=False))
    assert [small.get_layer(n).filters for n in ("c1", "c2")] == [4, 5]
    assert small.get_layer("fc1").kernel.shape == (3 * 3 * 5, 8)
    # Flatten -> Dense: the kept inputs are the positions of kept channels, in Keras (channels-last) order
    kept_c2 = [1, 2, 4, 6, 7]
    rows = [p * 8 + c for p in range(9) for c in kept_c2]
    np.testing.assert_array_equal(small.get_layer("fc1").kernel.numpy(),
                                  model.get_layer("fc1").kernel.numpy()[rows][:, [0, 1, 3, 4, 5, 6, 8, 9]])
    macs1, params1, _ = count_flops_params(small)
    assert params1 == small.count_params() - moving_stats(small) == 112 + 8 + 185 + 10 + 368 + 27
    assert macs1 == 4 * 64 * 27 + 5 * 36 * 36 + 45 * 8 + 8 * 3
    assert (report.params_before, report.params_after, report.macs_before, report.macs_after) == (
        params0, params1, macs0, macs1)
    assert {r["name"]: (r["out_before"], r["out_after"]) for r in report.rows}["c2"] == (8, 5)
    assert "c1" in str(report)
    assert small.get_layer("image") is not None  # input names survive


def test_residual_add_removes_only_channels_dead_on_both_branches():
    model = residual()
    kill(model, {"stem": [3]})  # dead in one branch only: the add still carries conv_a's channel 3
    check(model, {"stem": [2, 6], "conv_a": [2, 6], "bn_a": [2, 6]}, data((8, 8, 4)),
          {"stem": 6, "conv_a": 6, "head": 4, "fc": 2})


def test_concatenate_offsets():
    model = concat()
    small = check(model, {"a": [1], "b": [0, 5]}, data((8, 8, 3)), {"a": 3, "b": 4, "c": 5})
    keep = [0, 2, 3, 5, 6, 7, 8]
    np.testing.assert_array_equal(small.get_layer("c").kernel.numpy(), model.get_layer("c").kernel.numpy()[:, :, keep])


@pytest.mark.parametrize("multiplier", [1, 2])
def test_mobilenet_depthwise_block(multiplier):
    model = mobile_block(multiplier=multiplier)
    small = check(model, {"expand": [0, 4], "bn_e": [0, 4],
                          "bn_d": [m for c in (0, 4) for m in range(c * multiplier, (c + 1) * multiplier)]},
                  data((8, 8, 3)), {"expand": 4, "project": 4})
    assert small.get_layer("dw").kernel.shape == (3, 3, 4, multiplier)
    assert small.get_layer("project").kernel.shape == (1, 1, 4 * multiplier, 4)


def test_depthwise_bias_that_does_not_pass_zero_keeps_the_channel():
    model = mobile_block(multiplier=1)
    kill(model, {"expand": [0], "bn_e": [0]})
    model.get_layer("dw").bias.assign([1.0, 0, 0, 0, 0, 0])
    small = speedup_model(model)
    assert small.get_layer("expand").filters == 6


def test_squeeze_excite_block():
    model = se_block()
    spec = {n: [1, 5] for n in ("stem", "bn0", "dw", "bn1", "se_e")}
    small = check(model, spec, data((8, 8, 3)), {"stem": 6, "se_e": 6, "se_r": 2, "proj": 4})
    assert small.get_layer("se_r").kernel.shape == (1, 1, 6, 2)
    assert tuple(small.get_layer("reshape").target_shape) == (1, 1, 6)


@pytest.mark.parametrize("einsum", [False, True])
def test_ffn_gelu_on_sequences(einsum):
    model = ffn(einsum=einsum)
    small = check(model, {"up": [1, 4, 9, 12, 13]}, data((5, 6)), {"down": 6})
    assert small.get_layer("up").kernel.shape == (6, 11)
    assert small.get_layer("down").kernel.shape == (11, 6)


def test_fused_activation_with_nonzero_f0_keeps_channel():
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,))
    model = keras.Model(inp, L.Dense(2, name="out")(L.Dense(5, activation="sigmoid", name="h")(inp)))
    kill(model, {"h": [1]})  # sigmoid(0) = 0.5: not dead
    assert speedup_model(model).get_layer("h").units == 5


def test_embedding():
    keras.utils.set_random_seed(0)
    inp = keras.Input((7,), dtype="int32")
    x = L.Dense(5, activation="relu", name="d")(L.Embedding(20, 8, name="emb")(inp))
    model = keras.Model(inp, L.Dense(2, name="fc")(L.GlobalAveragePooling1D()(x)))
    x = np.random.default_rng(0).integers(0, 20, (3, 7)).astype("int32")
    small = check(model, {"emb": [0, 3]}, x, {"emb": 6, "d": 5})
    assert small.get_layer("d").kernel.shape == (6, 5)


def test_sequential():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(6, 3, name="c"), L.BatchNormalization(name="bn"),
                              L.ReLU(), L.GlobalAveragePooling2D(), L.Dense(4, name="fc")])
    randomize_bn(model)
    small = check(model, {"c": [0, 2, 3], "bn": [0, 2, 3]}, data((8, 8, 3)), {"c": 3, "fc": 4})
    assert isinstance(small, keras.Sequential)


def test_nested_functional_is_flattened():
    keras.utils.set_random_seed(0)
    inner_in = keras.Input((8, 8, 6))
    inner = keras.Model(inner_in, L.Conv2D(4, 1, name="pw")(inner_in), name="inner")
    inp = keras.Input((8, 8, 3))
    x = inner(L.Conv2D(6, 3, padding="same", activation="relu", name="c")(inp))
    model = keras.Model(inp, L.Dense(2, name="fc")(L.GlobalAveragePooling2D()(x)))
    graph, layers = build_graph(model)
    assert "inner/pw" in layers
    kill(model, {"c": [1, 2]})
    x = data((8, 8, 3))
    small = speedup_model(model)
    assert_same(model(x), small(x))
    assert small.get_layer("inner").get_layer("pw").kernel.shape == (1, 1, 4, 4)


def test_nested_sequential_keras_ops_and_identity_like_layers():
    keras.utils.set_random_seed(0)
    seq = keras.Sequential([L.Conv2D(4, 1, name="pw"), L.BatchNormalization(name="sbn")], name="seqblock")
    inp = keras.Input((8, 8, 3))
    x = seq(L.Conv2D(6, 3, padding="same", activation="relu", name="c")(inp))
    x = L.Cropping2D(1)(L.UpSampling2D()(x))
    z = L.Concatenate(axis=1)([x, L.Permute((2, 1, 3))(x)])  # not the channel axis: channels couple
    # a keras.ops add of a scalar passes channels; a channel flip is an op the graph does not know: fixed
    z = L.Conv2D(5, 1, name="d")(keras.ops.flip(z + 0.0, axis=-1))
    model = keras.Model(inp, L.GlobalAveragePooling2D()(z))
    graph, layers = build_graph(model)
    kinds = {n.op: n.kind for n in graph.nodes}  # auto-generated names depend on what ran before
    assert (kinds["BatchNormalization"], kinds["Concatenate"], kinds["Permute"], kinds["Cropping2D"]) == (
        "norm", "elementwise", "identity", "identity")
    assert graph.by_name["seqblock/pw"].kind == "conv"
    for name, chans in {"c": [1, 2], "seqblock/pw": [0], "seqblock/sbn": [0]}.items():
        zero_channels(layers[name], chans)
    assert kinds["Add"] == "activation" and kinds["Flip"] == "other"
    with pytest.raises(ModelError, match="Flip 'flip"):
        speedup_model(model)
    small, report = speedup_model(model, strict=False, return_report=True)
    x = data((8, 8, 3))
    assert_same(model(x), small(x))
    assert small.get_layer("c").filters == 4
    assert small.get_layer("seqblock").get_layer("pw").kernel.shape == (1, 1, 4, 4)
    assert report.removed == 2 and report.notes


def test_conv1d_depthwise1d():
    keras.utils.set_random_seed(0)
    inp = keras.Input((10, 3))
    x = L.DepthwiseConv1D(3, padding="same", name="dw")(L.Conv1D(6, 3, activation="relu6", name="c")(inp))
    model = keras.Model(inp, L.Dense(2, name="fc")(L.GlobalMaxPooling1D()(L.Conv1D(4, 1, name="pw")(x))))
    small = check(model, {"c": [0, 5], "dw": [0, 5]}, data((10, 3)), {"c": 4, "pw": 4})
    assert small.get_layer("pw").kernel.shape == (1, 4, 4)


def test_masks_dict_and_npz_leave_the_model_untouched(tmp_path):
    model = cnn()
    masks = {"c1": np.ones((3, 3, 3, 6), bool), "c1:bias": np.ones(6, bool)}
    masks["c1"][..., [0, 5]] = False
    masks["c1:bias"][[0, 5]] = False
    masks["bn1"] = {"weight": np.array([0, 1, 1, 1, 1, 0], bool), "bias": np.array([0, 1, 1, 1, 1, 0], bool)}
    before = [w.copy() for w in model.get_weights()]
    small, report = speedup_model(model, masks=masks, return_report=True)
    assert small.get_layer("c1").filters == 4
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    ref = cnn()
    kill(ref, {"c1": [0, 5], "bn1": [0, 5]})
    x = data((8, 8, 3))
    assert_same(ref(x, training=False), small(x, training=False))
    np.savez(tmp_path / "m.npz", **{"c1": masks["c1"], "c1:bias": masks["c1:bias"], "bn1": masks["bn1"]["weight"],
                                    "bn1:bias": masks["bn1"]["bias"]})
    assert speedup_model(model, masks=str(tmp_path / "m.npz")).get_layer("c1").filters == 4
    assert not any("fine-grained" in n for n in report.notes)


def test_pruner_input_and_fine_grained_note():
    model = cnn()
    pruner = ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], dependency_aware=True)
    pruner.compress()
    x = data((8, 8, 3))
    ref = np.asarray(model(x, training=False))
    wrapped = [w.name for w in pruner.get_modules_wrapper()]
    small = speedup_model(pruner)
    assert_same(ref, small(x, training=False))
    assert [small.get_layer(n).filters for n in ("c1", "c2")] == [3, 4]
    assert [w.name for w in pruner.get_modules_wrapper()] == wrapped and all(
        w.installed for w in pruner.get_modules_wrapper())
    level = ctf.LevelPruner(cnn(), [{"sparsity": 0.5, "op_types": ["Dense"]}])
    level.compress()
    _, report = speedup_model(level, return_report=True)
    assert any("fine-grained masks left in place" in n for n in report.notes)


LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np, keras
    d = sys.argv[1]
    x = np.load(d + "/x.npy")
    out = keras.models.load_model(d + "/small.keras").predict(x, verbose=0).tolist()
    import tensorflow as tf
    loaded = tf.saved_model.load(d + "/small_savedmodel")  # keep a reference: it owns the variables
    served = loaded.serve(tf.constant(x)).numpy().tolist()
    print(json.dumps({"out": out, "served": served,
                      "compressor": any(m.split(".")[0] == "compressor" for m in sys.modules)}))
""")


def test_result_saves_reloads_without_compressor_tflite_and_trains(tmp_path):
    model = se_block()
    kill(model, {n: [1, 5] for n in ("stem", "bn0", "dw", "bn1", "se_e")})
    x = data((8, 8, 3))
    small = speedup_model(model)
    ref = np.asarray(small(x, training=False))
    small.save(tmp_path / "small.keras")
    small.export(str(tmp_path / "small_savedmodel"), verbose=False)  # SavedModel
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run([sys.executable, "-c", LOADER, str(tmp_path)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["compressor"] is False
    assert_same(ref, res["out"])
    assert_same(ref, res["served"])
    # TFLite
    interp = tf.lite.Interpreter(model_content=tf.lite.TFLiteConverter.from_keras_model(small).convert())
    inp = interp.get_input_details()[0]
    interp.resize_tensor_input(inp["index"], list(x.shape))
    interp.allocate_tensors()
    interp.set_tensor(inp["index"], x)
    interp.invoke()
    lite = interp.get_tensor(interp.get_output_details()[0]["index"])
    assert np.abs(lite - ref).max() <= 1e-4 * max(np.abs(ref).max(), 1.0)
    # one training step
    small.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    w0 = small.get_layer("stem").kernel.numpy().copy()
    small.fit(x, np.array([0, 1, 2]), epochs=1, verbose=0)
    assert not np.allclose(w0, small.get_layer("stem").kernel.numpy())


# ---------------------------------------------------------------------------------- errors
def test_dead_channel_blocked_by_other_layer():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    x = L.LayerNormalization(name="ln")(L.Conv2D(4, 3, name="c")(inp))
    model = keras.Model(inp, L.Dense(2, name="fc")(L.GlobalAveragePooling2D()(L.Conv2D(3, 1, name="d")(x))))
    kill(model, {"c": [1]})
    with pytest.raises(ModelError, match="LayerNormalization 'ln'"):
        speedup_model(model)
    small, report = speedup_model(model, strict=False, return_report=True)
    assert small.get_layer("c").filters == 4 and any("ln" in n for n in report.notes)


def test_subclassed_model_is_refused_with_the_way_out():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.c = L.Conv2D(4, 3)

        def call(self, x):
            return self.c(x)

    net = Net()
    net(np.zeros((1, 8, 8, 3), "float32"))
    with pytest.raises(ModelError, match="Net.*Functional API"):
        speedup_model(net)
    with pytest.raises(ModelError, match="Functional API"):
        build_graph(net)


def test_shared_layer_is_never_cut():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 4))
    conv = L.Conv2D(4, 1, name="shared")
    y = conv(L.ReLU()(conv(inp)))
    model = keras.Model(inp, L.GlobalAveragePooling2D()(y))
    graph, _ = build_graph(model)
    assert [n.kind for n in graph.nodes if n.layer == "shared"] == ["other", "other"]


# ---------------------------------------------------------------------------------- real models
def zero_half_of_every_group(model, seed=0):
    """Zero ~50 % of the channels of every group that can be pruned, consistently in every member."""
    randomize_bn(model, seed)
    graph, layers = build_graph(model)
    pruned_groups = 0
    for group in channel_groups(graph):
        prunable = [i for i in range(group.n) if i not in set(group.fixed)]
        if len(prunable) < 2:
            continue
        gone = set(prunable[1::2])
        pruned_groups += 1
        for name, _kind, index in group.members:
            zero_channels(layers[name], [j for j, c in enumerate(index) if c in gone])
    return pruned_groups


@pytest.mark.parametrize("arch", ["ResNet50", "MobileNetV2", "EfficientNetB0"])
def test_keras_applications(arch):
    keras.utils.set_random_seed(0)
    kwargs = {"alpha": 0.35} if arch == "MobileNetV2" else {}
    model = getattr(keras.applications, arch)(weights=None, input_shape=(32, 32, 3), classes=10, **kwargs)
    assert zero_half_of_every_group(model) > 10
    x = np.random.default_rng(0).uniform(0, 255 if arch == "EfficientNetB0" else 1, (2, 32, 32, 3)).astype("float32")
    ref = np.asarray(model(x, training=False))
    small, report = speedup_model(model, return_report=True)
    assert_same(ref, small(x, training=False))
    assert report.params_after < 0.6 * report.params_before
    assert report.macs_after < 0.6 * report.macs_before
    assert count_flops_params(small)[1] == small.count_params() - moving_stats(small) == report.params_after


def test_separable_conv_consumers_take_the_kept_input_channels():
    """NASNet / Xception: a conv feeding SeparableConv2D / SeparableConv1D (not pruned themselves) loses its
    pruned filters; the separable layer's depthwise slice and the pointwise rows ``c * m + j`` of the kept
    inputs go with them, and the outputs do not change."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="c1")(inp)
    h = keras.layers.SeparableConv2D(6, 3, depth_multiplier=2, padding="same", name="sep")(h)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.SeparableConv1D(5, 3, padding="same", name="sep1")(keras.layers.Reshape((64, 6))(h))
    model = keras.Model(inp, keras.layers.Dense(2, name="fc")(keras.layers.Flatten()(h)))
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype("float32")
    # 'default' leaves the separable layers out, and the advice does not tell to name a type the pruner refuses
    with pytest.warns(UserWarning, match=r"SeparableConv2D .*add them to op_types only if filter pruning takes them"):
        pruner = ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], dependency_aware=True)
    pruner.compress()
    ref = np.asarray(model(x))
    small = speedup_model(pruner)
    shapes = {lay.name: [tuple(w.shape) for w in lay.get_weights()] for lay in small.layers if lay.get_weights()}
    assert shapes["c1"] == [(3, 3, 3, 4), (4,)]
    assert shapes["sep"] == [(3, 3, 4, 2), (1, 1, 8, 6), (6,)]  # 4 kept inputs x multiplier 2 pointwise rows
    assert shapes["sep1"] == [(3, 6, 1), (1, 6, 5), (5,)]  # nothing upstream of it pruned (bn keeps 6)
    keep = np.flatnonzero(np.asarray(pruner.get_modules_wrapper()[0].weight_mask).reshape(-1, 8).any(axis=0))
    dw_old = model.get_layer("sep").get_weights()[0]
    pw_old = model.get_layer("sep").get_weights()[1]
    dw_new, pw_new, _ = small.get_layer("sep").get_weights()
    np.testing.assert_array_equal(dw_new, dw_old[:, :, keep, :])
    np.testing.assert_array_equal(pw_new, pw_old[:, :, (keep[:, None] * 2 + np.arange(2)).reshape(-1), :])
    np.testing.assert_allclose(np.asarray(small(x)), ref, rtol=0, atol=1e-5)
