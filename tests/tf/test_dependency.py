"""Dependency-aware filter pruning on Keras: coupled layers share one decision, BatchNorms are masked with
their convs, data criteria are refused clearly, speedup of the result equals the masked model."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import compressor.tf as ctf
from compressor.core.errors import ConfigError

pytestmark = pytest.mark.tf


def block(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 3))
    s = keras.layers.Conv2D(6, 3, padding="same", activation="relu", name="stem")(inp)
    y = keras.layers.ReLU()(keras.layers.BatchNormalization(name="bn1")(
        keras.layers.Conv2D(4, 3, padding="same", name="conv1")(s)))
    y = keras.layers.BatchNormalization(name="bn2")(keras.layers.Conv2D(6, 3, padding="same", name="conv2")(y))
    h = keras.layers.Conv2D(5, 1, activation="relu", name="head")(keras.layers.ReLU()(keras.layers.Add()([s, y])))
    model = keras.Model(inp, keras.layers.Dense(2, name="fc")(keras.layers.GlobalAveragePooling2D()(h)))
    rng = np.random.default_rng(seed)
    for name in ("bn1", "bn2"):
        bn = model.get_layer(name)
        c = bn.gamma.shape[0]
        bn.set_weights([rng.uniform(0.5, 1.5, c), rng.uniform(-1, 1, c), rng.uniform(-1, 1, c), rng.uniform(0.5, 2, c)])
    return model


def kept(pruner, layer):
    w = {w.name: w for w in pruner.get_modules_wrapper()}[layer]
    m = np.asarray(w.weight_mask)
    return m.reshape(-1, m.shape[-1]).any(0) if m.ndim > 1 else m


def test_groups_share_channels_and_norms_follow():
    model = block()
    p = ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], dependency_aware=True)
    p.compress()
    assert sorted(w.name for w in p.get_modules_wrapper()) == ["bn1", "bn2", "conv1", "conv2", "head", "stem"]
    scores = (np.abs(model.get_layer("stem").kernel.numpy()).sum((0, 1, 2))
              + np.abs(model.get_layer("conv2").kernel.numpy()).sum((0, 1, 2)))
    expected = np.ones(6, bool)
    expected[np.argsort(scores, kind="stable")[:3]] = False
    for layer in ("stem", "conv2", "bn2"):
        np.testing.assert_array_equal(kept(p, layer), expected, err_msg=layer)
    np.testing.assert_array_equal(kept(p, "conv1"), kept(p, "bn1"))
    assert kept(p, "conv1").sum() == 2
    x = np.random.default_rng(1).standard_normal((2, 8, 8, 3)).astype("float32")
    ref = np.asarray(model(x, training=False))
    small = ctf.speedup_model(p)
    out = np.asarray(small(x, training=False))
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    assert [small.get_layer(n).filters for n in ("stem", "conv1", "conv2", "head")] == [3, 2, 3, 3]


def test_data_criteria_are_refused_with_dependency_aware():
    model = block()
    with pytest.raises(ConfigError, match="weight criteria"):
        ctf.ActivationAPoZRankFilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], dependency_aware=True)
    assert not any(hasattr(layer, "_compressor_pruner") for layer in model.layers)
