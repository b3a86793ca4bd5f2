"""Slimming that never disconnects a layer gives IDENTICAL masks on torch and Keras (and core on numpy): the
per-layer cap and the even tie-break across layers live in core (compressor.core.slimming)."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import torch

import compressor.tf.pruning as tfp
import compressor.torch.pruning as thp
from compressor.core.ops import NumpyOps
from compressor.core.slimming import slim_plan

NP = NumpyOps()
WIDTHS = (4, 8, 16)


def torch_stack() -> torch.nn.Sequential:
    layers, c = [], 1
    for w in WIDTHS:
        layers += [torch.nn.Conv2d(c, w, 3, padding=1), torch.nn.BatchNorm2d(w), torch.nn.ReLU()]
        c = w
    return torch.nn.Sequential(*layers)


def keras_stack() -> keras.Model:
    inp = keras.Input((6, 6, 1))
    h = inp
    for i, w in enumerate(WIDTHS):
        h = keras.layers.Conv2D(w, 3, padding="same", name=f"conv{i}")(h)
        h = keras.layers.BatchNormalization(name=f"bn{i}")(h)
        h = keras.layers.ReLU()(h)
    return keras.Model(inp, h)


def gammas(kind: str) -> list[np.ndarray]:
    if kind == "fresh":
        return [np.ones(w, np.float32) for w in WIDTHS]
    rng = np.random.default_rng(3)  # few distinct values: ties across layers at the threshold
    return [(rng.integers(1, 4, size=w) / 4).astype(np.float32) for w in WIDTHS]


@pytest.mark.parametrize("kind", ["fresh", "ties"])
@pytest.mark.parametrize("max_layer_sparsity", [None, 0.5])
def test_slim_masks_identical_on_both_backends(kind, max_layer_sparsity):
    g = gammas(kind)
    tm, km = torch_stack(), keras_stack()
    with torch.no_grad():
        for bn, gi in zip([m for m in tm if isinstance(m, torch.nn.BatchNorm2d)], g):
            bn.weight.copy_(torch.from_numpy(gi))
    for i, gi in enumerate(g):
        km.get_layer(f"bn{i}").gamma.assign(gi)
    cfg = [{"sparsity": 0.6, "op_types": ["BatchNorm2d", "BatchNormalization"]}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the tie warning (asserted in the backend tests)
        pt = thp.SlimPruner(tm, cfg, max_layer_sparsity=max_layer_sparsity)
        pk = tfp.SlimPruner(km, cfg, max_layer_sparsity=max_layer_sparsity)
        pt.compress()
        pk.compress()
    got_t = [w.weight_mask.numpy() for w in pt.get_modules_wrapper()]
    got_k = [w.weight_mask.numpy() for w in pk.get_modules_wrapper()]
    want, info = slim_plan(NP, g, 0.6, max_layer_sparsity=max_layer_sparsity)
    for t, k, w in zip(got_t, got_k, want):
        np.testing.assert_array_equal(t, w)
        np.testing.assert_array_equal(k, w)
    assert all(m.sum() >= 1 for m in want)
    if max_layer_sparsity is None:  # floor(28 * 0.6) = 16 pruned, every layer keeps at least one channel
        assert sum(int((~m).sum()) for m in want) == 16
    else:  # at most floor(n / 2) per layer: 2 + 4 + 8 = 14 < 16
        assert [int(m.sum()) for m in want] == [2, 4, 8] and info["pruned"] == 14
    if kind == "fresh" and max_layer_sparsity is None:
        # the 16 smallest keys (2j - 1) / 2t of the 3 + 7 + 15 tied channels (key <= 19/30) are 2, 4 and 10
        # (quotas 16 * t / 25 = 1.92, 4.48, 9.6): kept 4 - 2, 8 - 4, 16 - 10
        assert [int(m.sum()) for m in want] == [2, 4, 6]
