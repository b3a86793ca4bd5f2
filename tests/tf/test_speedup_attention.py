"""Keras MultiHeadAttention heads: an ``attention`` node (context = heads x value_dim) + its internal
output projection; heads whose value kernel and bias are zero are removed by speedup (num_heads, the
query/key/value kernels and the output kernel on the heads axis); the result reloads without compressor."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import compressor.tf as ctf
from compressor.core.graph import channel_groups
from compressor.tf import build_graph, speedup_model

pytestmark = pytest.mark.tf

L = keras.layers


def encoder(seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((6, 32), name="tokens")
    mha = L.MultiHeadAttention(4, 8, name="mha")
    y = L.LayerNormalization(name="ln1")(L.Add(name="add1")([x, mha(x, x)]))
    f = L.Dense(64, activation="gelu", name="ffn1")(y)
    f = L.Dense(32, name="ffn2")(f)
    z = L.LayerNormalization(name="ln2")(L.Add(name="add2")([y, f]))
    model = keras.Model(x, z)
    rng = np.random.default_rng(seed)
    for w in mha.weights:
        if w.path.endswith("bias"):
            w.assign(rng.uniform(-0.5, 0.5, w.shape).astype("float32"))
    return model


def kill_heads(mha, heads):
    v = mha._value_dense
    k, b = v.kernel.numpy(), v.bias.numpy()
    k[:, heads] = 0
    b[heads] = 0
    v.kernel.assign(k)
    v.bias.assign(b)


X = np.random.default_rng(1).standard_normal((3, 6, 32)).astype("float32")


def assert_same(ref, out):
    ref, out = np.asarray(ref), np.asarray(out)
    assert ref.shape == out.shape
    assert np.abs(ref - out).max() <= 1e-5 * np.abs(ref).max()


def test_graph_attention_node_and_head_group():
    graph, _ = build_graph(encoder())
    att = graph.by_name["mha"]
    assert att.kind == "attention" and att.channels == 32 and att.attrs["heads"] == 4
    assert graph.by_name["mha:output"].kind == "linear"
    g = next(g for g in channel_groups(graph) if g.layers == ["mha"])
    assert (g.n, g.unit, g.fixed) == (32, 8, [])


def test_zero_value_heads_are_removed_and_reload(tmp_path):
    model = encoder()
    kill_heads(model.get_layer("mha"), [1, 3])
    ref = model.predict(X, verbose=0)
    new, report = speedup_model(model, return_report=True)
    mha = new.get_layer("mha")
    assert mha.get_config()["num_heads"] == 2
    shapes = [tuple(w.shape) for w in mha.weights]
    assert shapes == [(32, 2, 8), (2, 8), (32, 2, 8), (2, 8), (32, 2, 8), (2, 8), (2, 8, 32), (32,)]
    assert report.removed == 16 and report.params_after < report.params_before
    out = new.predict(X, verbose=0)
    assert_same(ref, out)
    assert model.get_layer("mha").get_config()["num_heads"] == 4  # the input model is untouched
    path = tmp_path / "small.keras"
    new.save(path)
    np.save(tmp_path / "x.npy", X)
    np.save(tmp_path / "ref.npy", out)
    code = textwrap.dedent(f"""
        import sys, numpy as np, keras
        m = keras.models.load_model({str(path)!r})
        out = m.predict(np.load({str(tmp_path / 'x.npy')!r}), verbose=0)
        ref = np.load({str(tmp_path / 'ref.npy')!r})
        assert m.get_layer('mha').get_config()['num_heads'] == 2
        assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(out - ref).max()
        assert not any(k.startswith('compressor') for k in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]


def test_masks_dict_on_value_sublayer():
    model = encoder()
    mask = np.ones((32, 4, 8), bool)
    mask[:, 0] = False
    bias = np.ones((4, 8), bool)
    bias[0] = False
    ref_model = encoder()
    kill_heads(ref_model.get_layer("mha"), [0])
    new = speedup_model(model, masks={"mha/value": {"weight": mask, "bias": bias}})
    assert new.get_layer("mha").get_config()["num_heads"] == 3
    assert_same(ref_model.predict(X, verbose=0), new.predict(X, verbose=0))


def test_partial_head_and_cross_attention_keep_heads():
    model = encoder()
    v = model.get_layer("mha")._value_dense
    k = v.kernel.numpy()
    k[:, 0, :4] = 0
    v.kernel.assign(k)
    new = speedup_model(model)
    assert new.get_layer("mha").get_config()["num_heads"] == 4
    # cross attention: heads still go, the two inputs keep their channels
    keras.utils.set_random_seed(0)
    q, c = keras.Input((6, 32)), keras.Input((5, 16))
    mha = L.MultiHeadAttention(4, 8, name="xatt")
    m = keras.Model([q, c], L.Add()([q, mha(q, c)]))
    kill_heads(mha, [2])
    xs = [X, np.random.default_rng(2).standard_normal((3, 5, 16)).astype("float32")]
    ref = m.predict(xs, verbose=0)
    new = ctf.speedup_model(m)
    assert new.get_layer("xatt").get_config()["num_heads"] == 3
    assert_same(ref, new.predict(xs, verbose=0))


# ---------------------------------------------------------------------------------- pruning heads with a pruner
def expected_heads(mha, sparsity, criterion):
    """Pruned heads from numpy: per context channel the L1 / L2 norm of its value-kernel column, summed
    per head; floor(H * sparsity) lowest heads (ties by index)."""
    k = mha._value_dense.kernel.numpy()  # [hidden, heads, head_dim]
    per_channel = np.abs(k).sum(0) if criterion == "l1" else np.sqrt((k ** 2).sum(0))
    head = per_channel.sum(1)
    return sorted(np.argsort(head, kind="stable")[: int(len(head) * sparsity)].tolist())


@pytest.mark.parametrize("cls,criterion", [("L1FilterPruner", "l1"), ("L2FilterPruner", "l2")])
def test_filter_pruner_prunes_whole_heads(cls, criterion, tmp_path):
    model = encoder()
    mha = model.get_layer("mha")
    want = expected_heads(mha, 0.5, criterion)
    pruner = getattr(ctf, cls)(model, [{"sparsity": 0.5, "op_types": ["MultiHeadAttention"]}], dependency_aware=True)
    [w] = pruner.get_modules_wrapper()
    assert (w.name, w.type, w.config["heads_of"]) == ("mha/value", "EinsumDense", "mha")
    pruner.compress()
    kept = w.weight_mask.numpy().all(axis=(0, 2))
    assert sorted(np.flatnonzero(~kept).tolist()) == want and len(want) == 2
    assert not w.weight_mask.numpy()[:, want].any() and w.weight_mask.numpy()[:, kept].all()
    assert (w.bias_mask.numpy().all(axis=1) == kept).all() and not w.bias_mask.numpy()[want].any()
    v = mha._value_dense
    assert not v.kernel.numpy()[:, want].any() and not v.bias.numpy()[want].any()
    ref = model.predict(X, verbose=0)
    new, report = ctf.speedup_model(pruner, return_report=True)
    assert new.get_layer("mha").get_config()["num_heads"] == 2 and report.removed == 16
    assert_same(ref, new.predict(X, verbose=0))
    # the exported masks name the value sub-layer; speedup of the plain model from them
    mask_path = str(tmp_path / "masks.npz")
    pruner.export_model(str(tmp_path / "m.keras"), mask_path=mask_path)
    with np.load(mask_path) as data:
        assert sorted(data.files) == ["mha/value", "mha/value:bias"]
    plain = encoder()
    new2 = ctf.speedup_model(plain, masks=mask_path)
    assert new2.get_layer("mha").get_config()["num_heads"] == 2
    assert_same(ref, new2.predict(X, verbose=0))


def test_heads_per_layer_and_sparsity_floor():
    keras.utils.set_random_seed(3)
    x = keras.Input((5, 24))
    a = L.MultiHeadAttention(6, 4, name="a1")
    b = L.MultiHeadAttention(3, 8, name="a2")
    y = L.Add()([x, a(x, x)])
    y = L.Add()([y, b(y, y)])
    model = keras.Model(x, L.Dense(4, name="head")(y))
    want = {"a1": expected_heads(a, 0.4, "l1"), "a2": expected_heads(b, 0.4, "l1")}
    assert [len(want["a1"]), len(want["a2"])] == [2, 1]  # floor(6 * 0.4), floor(3 * 0.4)
    pruner = ctf.L1FilterPruner(model, [{"sparsity": 0.4, "op_types": ["MultiHeadAttention"]}], dependency_aware=True)
    pruner.compress()
    for w in pruner.get_modules_wrapper():
        pruned = np.flatnonzero(~w.weight_mask.numpy().all(axis=(0, 2))).tolist()
        assert pruned == want[w.config["heads_of"]]
    xs = np.random.default_rng(0).standard_normal((2, 5, 24)).astype("float32")
    ref = model.predict(xs, verbose=0)
    new = ctf.speedup_model(pruner)
    assert [new.get_layer(n).get_config()["num_heads"] for n in ("a1", "a2")] == [4, 2]
    assert_same(ref, new.predict(xs, verbose=0))


def test_heads_need_dependency_aware():
    from compressor.core.errors import ConfigError
    from compressor.tf.compressor import iter_layers

    model = encoder()
    before = [w.numpy().copy() for w in model.weights]
    with pytest.raises(ConfigError, match="dependency_aware=True"):
        ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["MultiHeadAttention"]}])
    # (LevelPruner prunes an attention layer matrix by matrix instead: tests/tf/test_recurrent.py)
    assert not any(k.startswith("_compressor_") for _, layer in iter_layers(model) for k in vars(layer))
    assert all((a == w.numpy()).all() for a, w in zip(before, model.weights))


def test_pruned_heads_stay_zero_through_fit():
    model = encoder()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    pruner = ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["MultiHeadAttention"]}],
                                optimizer=model.optimizer, dependency_aware=True)
    pruner.compress()
    pruned = np.flatnonzero(~pruner.get_modules_wrapper()[0].weight_mask.numpy().all(axis=(0, 2)))
    model.fit(X, np.ones((3, 6, 32), "float32"), epochs=2, verbose=0)
    v = model.get_layer("mha")._value_dense
    assert not v.kernel.numpy()[:, pruned].any() and not v.bias.numpy()[pruned].any()
    assert v.kernel.numpy().any()
    assert ctf.speedup_model(pruner).get_layer("mha").get_config()["num_heads"] == 2
