"""Dependency-aware filter pruning on a residual model: torch and tf prune the SAME channels in every
coupled layer (the convs meeting at the add and their BatchNorms), exactly floor(C * sparsity) per group,
equal to the numpy expectation from summed scores; speedup then removes them on both backends with the
masked model's outputs."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import torch
from torch import nn

import compressor.tf as ctf
import compressor.torch as cth
from compressor.core.ops import NumpyOps
from compressor.core.pruning import filter_scores, prune_count

pytestmark = [pytest.mark.torch, pytest.mark.tf]
NP = NumpyOps()


def quarters(rng, *shape):
    return (np.round(rng.standard_normal(shape) * 4) / 4).astype(np.float32)


class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.conv3 = nn.Conv2d(8, 6, 1)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        a = torch.relu(self.bn1(self.conv1(x)))
        b = self.bn2(self.conv2(a))
        c = torch.relu(self.conv3(torch.relu(a + b)))
        return self.fc(c.mean((2, 3)))


def keras_res():
    inp = keras.Input((6, 6, 3))
    a = keras.layers.ReLU()(keras.layers.BatchNormalization(epsilon=1e-5, name="bn1")(
        keras.layers.Conv2D(8, 3, padding="same", name="conv1")(inp)))
    b = keras.layers.BatchNormalization(epsilon=1e-5, name="bn2")(keras.layers.Conv2D(8, 3, padding="same", name="conv2")(a))
    c = keras.layers.Conv2D(6, 1, activation="relu", name="conv3")(keras.layers.ReLU()(keras.layers.Add()([a, b])))
    out = keras.layers.Dense(3, name="fc")(keras.layers.GlobalAveragePooling2D()(c))
    return keras.Model(inp, out)


def twins(seed=0):
    rng = np.random.default_rng(seed)
    tm, km = Res().eval(), keras_res()
    with torch.no_grad():
        for name in ("conv1", "conv2", "conv3"):
            conv = getattr(tm, name)
            w, b = quarters(rng, *conv.weight.shape), quarters(rng, conv.out_channels)
            conv.weight.copy_(torch.from_numpy(w))
            conv.bias.copy_(torch.from_numpy(b))
            km.get_layer(name).set_weights([w.transpose(2, 3, 1, 0), b])
        for name in ("bn1", "bn2"):
            bn = getattr(tm, name)
            vals = [quarters(rng, 8) + 1, quarters(rng, 8), quarters(rng, 8), np.abs(quarters(rng, 8)) + 0.5]
            for t, v in zip((bn.weight, bn.bias, bn.running_mean, bn.running_var), vals):
                t.copy_(torch.from_numpy(v))
            km.get_layer(name).set_weights(vals)
        w, b = quarters(rng, 3, 6), quarters(rng, 3)
        tm.fc.weight.copy_(torch.from_numpy(w))
        tm.fc.bias.copy_(torch.from_numpy(b))
        km.get_layer("fc").set_weights([w.T, b])
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    return tm, km, x


CONFIG = [{"sparsity": 0.5, "op_types": ["Conv2d"]}]


def torch_keep(pruner, layer):
    w = {w.name: w for w in pruner.get_modules_wrapper()}[layer]
    return w.weight_mask.reshape(w.weight_mask.shape[0], -1).any(1).numpy()


def tf_keep(pruner, layer):
    w = {w.name: w for w in pruner.get_modules_wrapper()}[layer]
    m = np.asarray(w.weight_mask)
    return m.reshape(-1, m.shape[-1]).any(0) if m.ndim > 1 else m


@pytest.mark.parametrize("pruner_name,criterion", [("L1FilterPruner", "l1"), ("L2FilterPruner", "l2"),
                                                   ("FPGMPruner", "fpgm")])
def test_same_channels_pruned_on_both_backends(pruner_name, criterion):
    tm, km, x = twins()
    expected_scores = (filter_scores(NP, tm.conv1.weight.detach().numpy(), criterion)
                       + filter_scores(NP, tm.conv2.weight.detach().numpy(), criterion))
    expected = np.ones(8, bool)
    expected[np.argsort(expected_scores, kind="stable")[:4]] = False
    tp = getattr(cth, pruner_name)(tm, CONFIG, dependency_aware=True, dummy_input=torch.from_numpy(x))
    tp.compress()
    kp = getattr(ctf, pruner_name)(km, CONFIG, dependency_aware=True)
    kp.compress()
    assert sorted(w.name for w in tp.get_modules_wrapper()) == ["bn1", "bn2", "conv1", "conv2", "conv3"]
    assert sorted(w.name for w in kp.get_modules_wrapper()) == ["bn1", "bn2", "conv1", "conv2", "conv3"]
    for layer in ("conv1", "bn1", "conv2", "bn2"):
        np.testing.assert_array_equal(torch_keep(tp, layer), expected, err_msg=layer)
        np.testing.assert_array_equal(tf_keep(kp, layer), expected, err_msg=layer)
    np.testing.assert_array_equal(torch_keep(tp, "conv3"), tf_keep(kp, "conv3"))
    assert torch_keep(tp, "conv3").sum() == 3


def test_speedup_removes_the_group_on_both_backends():
    tm, km, x = twins(1)
    tp = cth.L1FilterPruner(tm, CONFIG, dependency_aware=True, dummy_input=torch.from_numpy(x))
    tp.compress()
    kp = ctf.L1FilterPruner(km, CONFIG, dependency_aware=True)
    kp.compress()
    with torch.no_grad():
        masked_t = tm(torch.from_numpy(x)).numpy()
    masked_k = np.asarray(km(x.transpose(0, 2, 3, 1), training=False))
    np.testing.assert_allclose(masked_t, masked_k, rtol=1e-4, atol=1e-4)
    small_t = cth.speedup_model(tp, torch.from_numpy(x))
    small_k = ctf.speedup_model(kp)
    with torch.no_grad():
        out_t = small_t(torch.from_numpy(x)).numpy()
    out_k = np.asarray(small_k(x.transpose(0, 2, 3, 1), training=False))
    scale = np.abs(masked_t).max()
    assert np.abs(out_t - masked_t).max() <= 1e-5 * scale
    assert np.abs(out_k - masked_k).max() <= 1e-5 * scale
    assert (small_t.conv1.out_channels, small_t.conv2.out_channels, small_t.conv3.out_channels) == (4, 4, 3)
    assert small_t.bn1.num_features == 4 and small_t.fc.in_features == 3
    assert small_k.get_layer("conv1").filters == 4 and small_k.get_layer("conv3").filters == 3
    assert small_k.get_layer("bn2").get_weights()[0].shape == (4,)
    assert cth.count_flops_params(small_t, torch.from_numpy(x))[:2] == ctf.count_flops_params(small_k)[:2]


def test_slim_ranks_coupled_norms_together_on_both_backends():
    tm, km, x = twins(2)
    g = np.abs(tm.bn1.weight.detach().numpy()) + np.abs(tm.bn2.weight.detach().numpy())
    expected = np.ones(8, bool)
    expected[np.argsort(g, kind="stable")[:4]] = False
    config = [{"sparsity": 0.5, "op_types": ["BatchNorm2d"]}]
    tp = cth.SlimPruner(tm, config, dependency_aware=True, dummy_input=torch.from_numpy(x))
    tp.compress()
    kp = ctf.SlimPruner(km, config, dependency_aware=True)
    kp.compress()
    for layer in ("bn1", "bn2"):
        np.testing.assert_array_equal(torch_keep(tp, layer), expected, err_msg=layer)
        np.testing.assert_array_equal(tf_keep(kp, layer), expected, err_msg=layer)
    with torch.no_grad():
        ref = tm(torch.from_numpy(x)).numpy()
    small_t = cth.speedup_model(tp, torch.from_numpy(x))
    small_k = ctf.speedup_model(kp)
    assert small_t.conv1.out_channels == small_t.conv2.out_channels == 4
    assert small_k.get_layer("conv2").filters == 4
    with torch.no_grad():
        assert np.abs(small_t(torch.from_numpy(x)).numpy() - ref).max() <= 1e-5 * np.abs(ref).max()
    out_k = np.asarray(small_k(x.transpose(0, 2, 3, 1), training=False))
    np.testing.assert_allclose(out_k, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_agp_dependency_aware_same_masks_over_the_schedule():
    """AGP (l1, dependency-aware): the same channels on both backends at every schedule epoch, equal to the
    numpy expectation from summed scores with the channels pruned before going first; new weights are
    assigned between epochs, the pruned filters the LARGEST, so monotonicity comes from the decision."""
    tm, km, x = twins(3)
    config = [{"final_sparsity": 0.75, "start_epoch": 0, "end_epoch": 4, "frequency": 1, "op_types": ["Conv2d"]}]
    kconfig = [{**config[0], "op_types": ["Conv2D"]}]
    tp = cth.AGPPruner(tm, config, pruning_algorithm="l1", dependency_aware=True, dummy_input=torch.from_numpy(x))
    kp = ctf.AGPPruner(km, kconfig, pruning_algorithm="l1", dependency_aware=True)
    tp.compress()
    kp.compress()
    rng = np.random.default_rng(7)
    expected = np.ones(8, bool)
    for epoch in range(5):
        weights = {name: quarters(rng, *getattr(tm, name).module.weight.shape) for name in ("conv1", "conv2", "conv3")}
        for name in ("conv1", "conv2"):
            weights[name][~expected] = 8.0
        with torch.no_grad():
            for name, w in weights.items():
                getattr(tm, name).module.weight.copy_(torch.from_numpy(w))
        for name, w in weights.items():
            km.get_layer(name).kernel.assign(w.transpose(2, 3, 1, 0))
        tp.update_epoch(epoch)
        kp.update_epoch(epoch)
        if epoch < 4:  # schedule epochs 0..3: the expectation, monotone under the previous decision
            scores = np.abs(weights["conv1"]).sum((1, 2, 3)) + np.abs(weights["conv2"]).sum((1, 2, 3))
            scores[~expected] = -1.0
            k = prune_count(8, tp.target_sparsity(0))
            expected = np.ones(8, bool)
            expected[np.argsort(scores, kind="stable")[:k]] = False
        for layer in ("conv1", "bn1", "conv2", "bn2", "conv3"):
            np.testing.assert_array_equal(torch_keep(tp, layer), tf_keep(kp, layer), err_msg=f"{epoch} {layer}")
        for layer in ("conv1", "bn1", "conv2", "bn2"):
            np.testing.assert_array_equal(torch_keep(tp, layer), expected, err_msg=f"{epoch} {layer}")
    assert int((~expected).sum()) == 6
