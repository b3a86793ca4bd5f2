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


@pytest.mark.parametrize("cls", [ctf.ActivationMeanRankFilterPruner, ctf.ActivationAPoZRankFilterPruner,
                                 ctf.TaylorFOWeightFilterPruner])
def test_data_criteria_decide_per_group_inside_fit(cls):
    model = block(1)
    opt = keras.optimizers.SGD(0.0)
    model.compile(opt, "mse")
    p = cls(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], opt, statistics_batch_num=2, dependency_aware=True)
    p.compress()
    assert all(np.asarray(w.weight_mask).all() for w in p.get_modules_wrapper())  # waits for statistics
    rng = np.random.default_rng(2)
    model.fit(rng.standard_normal((4, 8, 8, 3)).astype("float32"), rng.standard_normal((4, 2)).astype("float32"),
              batch_size=1, epochs=1, verbose=0)
    p.update_epoch(1)
    assert p._all_calculated()
    np.testing.assert_array_equal(kept(p, "stem"), kept(p, "conv2"))
    np.testing.assert_array_equal(kept(p, "conv2"), kept(p, "bn2"))
    np.testing.assert_array_equal(kept(p, "conv1"), kept(p, "bn1"))
    assert kept(p, "stem").sum() == 3 and kept(p, "conv1").sum() == 2
    x = rng.standard_normal((2, 8, 8, 3)).astype("float32")
    ref = np.asarray(model(x, training=False))
    out = np.asarray(ctf.speedup_model(p)(x, training=False))
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_bad_dependency_argument_leaves_the_model_untouched():
    model = block()
    before = [w.numpy().copy() for w in model.weights]
    with pytest.raises(ConfigError, match="must be True or False"):
        ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], dependency_aware="yes")
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights))
    assert not any(k.startswith("_compressor_") for layer in model.layers for k in vars(layer))
