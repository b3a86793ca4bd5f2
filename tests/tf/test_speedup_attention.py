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
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
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
