"""Cross-backend parity of the pruners: the same weights (Keras kernels = torch weights with the layout
transposed) and the same config_list give IDENTICAL masks on torch and tf for Level, L1, L2, FPGM, Slim and
AGP, and both equal core's masks on numpy. Weights are rounded to quarters so that magnitude ties are
common: the tie-break (canonical flat index) must agree too."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch

import compressor.tf.pruning as tfp
import compressor.torch.pruning as thp
from compressor.core.ops import NumpyOps
from compressor.core.pruning import filter_prune_masks, level_mask, slim_masks

NP = NumpyOps()
RNG = np.random.default_rng(7)


def quarters(*shape):
    return (np.round(RNG.standard_normal(shape) * 4) / 4).astype(np.float32)


def twin_models():
    """(torch model, keras model) with the same weights: Conv2d 3->10 k3 and Linear 12->6."""
    conv_w, conv_b = quarters(10, 3, 3, 3), quarters(10)
    fc_w, fc_b = quarters(6, 12), quarters(6)
    tm = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 3), torch.nn.Flatten(), torch.nn.Linear(12, 6))
    with torch.no_grad():
        tm[0].weight.copy_(torch.from_numpy(conv_w))
        tm[0].bias.copy_(torch.from_numpy(conv_b))
        tm[2].weight.copy_(torch.from_numpy(fc_w))
        tm[2].bias.copy_(torch.from_numpy(fc_b))
    inp = keras.Input((5, 5, 3))
    conv = keras.layers.Conv2D(10, 3, name="conv")
    fc = keras.layers.Dense(6, name="fc")
    km = keras.Model(inp, [conv(inp), fc(keras.layers.Flatten()(inp)[:, :12])])
    conv.kernel.assign(conv_w.transpose(2, 3, 1, 0))
    conv.bias.assign(conv_b)
    fc.kernel.assign(fc_w.T)
    fc.bias.assign(fc_b)
    return tm, km, {"conv": conv_w, "fc": fc_w}


def to_keras(mask: torch.Tensor) -> np.ndarray:
    m = mask.cpu().numpy()
    return m.transpose(2, 3, 1, 0) if m.ndim == 4 else (m.T if m.ndim == 2 else m)


def masks_of(pruner) -> list[tuple[np.ndarray, np.ndarray | None]]:
    out = []
    for w in pruner.get_modules_wrapper():
        wm, bm = w.weight_mask, w.bias_mask
        if isinstance(wm, torch.Tensor):
            out.append((to_keras(wm), None if bm is None else bm.cpu().numpy()))
        else:
            out.append((wm.numpy(), None if bm is None else bm.numpy()))
    return out


def assert_same(torch_pruner, tf_pruner):
    a, b = masks_of(torch_pruner), masks_of(tf_pruner)
    assert len(a) == len(b) > 0
    for (wa, ba), (wb, bb) in zip(a, b):
        assert wa.dtype == wb.dtype == np.bool_
        np.testing.assert_array_equal(wa, wb)
        if ba is not None and bb is not None:
            np.testing.assert_array_equal(ba, bb)


@pytest.mark.parametrize("sparsity", [0.1, 0.37, 0.5, 0.8])
def test_level_parity(sparsity):
    tm, km, w = twin_models()
    cfg = [{"sparsity": sparsity, "op_types": ["default"]}]
    pt, pk = thp.LevelPruner(tm, cfg), tfp.LevelPruner(km, cfg)
    pt.compress()
    pk.compress()
    assert_same(pt, pk)
    core = level_mask(NP, w["conv"], sparsity)
    np.testing.assert_array_equal(masks_of(pk)[0][0], core.transpose(2, 3, 1, 0))


@pytest.mark.parametrize("name, criterion", [("L1FilterPruner", "l1"), ("L2FilterPruner", "l2"), ("FPGMPruner", "fpgm")])
@pytest.mark.parametrize("sparsity", [0.2, 0.5])
def test_filter_parity(name, criterion, sparsity):
    tm, km, w = twin_models()
    cfg = [{"sparsity": sparsity, "op_types": ["Conv2d", "Linear"]}]
    pt, pk = getattr(thp, name)(tm, cfg), getattr(tfp, name)(km, cfg)
    pt.compress()
    pk.compress()
    assert_same(pt, pk)
    core, keep = filter_prune_masks(NP, w["conv"], sparsity, criterion)
    np.testing.assert_array_equal(masks_of(pk)[0][0], core.transpose(2, 3, 1, 0))
    np.testing.assert_array_equal(masks_of(pk)[0][1], keep)


def test_slim_parity():
    g1, g2 = quarters(6), quarters(4)
    tm = torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.BatchNorm1d(4))
    inp = keras.Input((6,))
    b1, b2 = keras.layers.BatchNormalization(name="b1"), keras.layers.BatchNormalization(name="b2")
    km = keras.Model(inp, [b1(inp), b2(inp[:, :4])])
    with torch.no_grad():
        tm[0].weight.copy_(torch.from_numpy(g1))
        tm[1].weight.copy_(torch.from_numpy(g2))
    b1.gamma.assign(g1)
    b2.gamma.assign(g2)
    cfg = [{"sparsity": 0.3, "op_types": ["BatchNorm1d", "BatchNormalization"]}]
    pt, pk = thp.SlimPruner(tm, cfg), tfp.SlimPruner(km, cfg)
    pt.compress()
    pk.compress()
    assert_same(pt, pk)
    for got, want in zip(masks_of(pk), slim_masks(NP, [g1, g2], 0.3)):
        np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("algorithm", ["level", "l1", "fpgm"])
def test_agp_parity_over_the_schedule(algorithm):
    tm, km, _ = twin_models()
    cfg = [{"initial_sparsity": 0.1, "final_sparsity": 0.7, "start_epoch": 0, "end_epoch": 5, "frequency": 1,
            "op_types": ["Conv2d", "Linear"]}]
    pt = thp.AGPPruner(tm, cfg, pruning_algorithm=algorithm)
    pk = tfp.AGPPruner(km, cfg, pruning_algorithm=algorithm)
    pt.compress()
    pk.compress()
    for epoch in range(6):
        pt.update_epoch(epoch)
        pk.update_epoch(epoch)
        assert_same(pt, pk)


def test_tf_masks_are_graph_ops_same_as_eager():
    """The level mask computed inside tf.function equals the eager one (the in-graph path of the hook)."""
    _, km, _ = twin_models()
    pk = tfp.LevelPruner(km, [{"sparsity": 0.45, "op_types": ["default"]}])
    w = pk.get_modules_wrapper()[0]
    masker = tfp.LevelPrunerMasker(km, pk)
    eager = masker.calc_mask(0.45, w)["weight_mask"].numpy()
    graph = tf.function(lambda: masker.calc_mask(0.45, w)["weight_mask"])().numpy()
    np.testing.assert_array_equal(eager, graph)
