"""The paper-reproduction pipelines of examples/ on real MNIST with Keras 3, reduced (a few hundred steps
on a subset, loose accuracy bounds); exact per-layer pruned counts of the exported ``.keras`` model."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

from compressor.app.data import load_mnist
from compressor.app.demo import get_harness
from examples import reproduce_agp, reproduce_han2015, reproduce_quant
from examples.common import Train, dense_baseline

pytestmark = pytest.mark.mnist

DENSE = Train(2, 2e-3, 64)
SIZES = {"fc1": 784 * 300, "fc2": 300 * 100, "fc3": 100 * 10}


@pytest.fixture(scope="module")
def setup(mnist_dir):
    ds = load_mnist(mnist_dir).subset(4000, 1000)
    h = get_harness("tf")
    dense = dense_baseline(h, "lenet300", ds, DENSE, seed=0, progress=False)
    return h, ds, dense, h.evaluate(dense, ds.x_test, ds.y_test)


def test_dense_baseline_learns(setup):
    assert setup[3] > 0.85


def test_han_level_iterative_hits_paper_fractions_exactly(setup):
    h, ds, dense, dense_acc = setup
    before = [np.array(w) for w in dense.get_weights()]
    recipe = reproduce_han2015.Recipe(DENSE, rounds=2, retrain=Train(1, 2e-4, 64))
    r = reproduce_han2015.run_level(h, "lenet300", dense, ds, recipe, seed=0, progress=False)
    for layer, kept in reproduce_han2015.PAPER["lenet300"]["kept"].items():
        n = SIZES[layer]
        assert r["kept_per_layer"][layer] == (n - math.floor(n * round(1.0 - kept, 6))) / n
    assert r["acc"] > dense_acc - 0.10
    assert abs(r["acc_exported"] - r["acc"]) <= 0.001  # the exported plain model predicts as the pruned one
    for a, b in zip(before, dense.get_weights()):  # the dense model is untouched
        np.testing.assert_array_equal(a, b)


def test_han_sensitivity_calibrated_rounds(setup):
    h, ds, dense, dense_acc = setup
    recipe = reproduce_han2015.Recipe(DENSE, rounds=2, retrain=Train(1, 2e-4, 64))
    r = reproduce_han2015.run_sensitivity(h, "lenet300", dense, ds, recipe, seed=0, progress=False)
    assert len(r["sensitivity"]) == 2  # one q per layer and round, calibrated on the current weights
    assert all(0.1 < q < 5.0 for qs in r["sensitivity"] for q in qs.values())
    for layer, kept in reproduce_han2015.PAPER["lenet300"]["kept"].items():
        # q is rounded to 4 decimals, so the q * std threshold lands within a few weights of the target
        assert r["kept_per_layer"][layer] == pytest.approx(kept, abs=0.003)
    assert r["acc"] > dense_acc - 0.15


def test_agp_pipeline(setup):
    h, ds, dense, dense_acc = setup
    recipe = reproduce_agp.Recipe(DENSE, Train(3, 2e-4, 64), ramp=2)
    r = reproduce_agp.run_agp(h, dense, ds, recipe, 0.8, seed=0, progress=False)
    for layer, n in SIZES.items():
        assert r["kept_per_layer"][layer] == (n - math.floor(n * 0.8)) / n
    assert r["acc"] > dense_acc - 0.05
    assert abs(r["acc_exported"] - r["acc"]) <= 0.001


@pytest.mark.parametrize("method, floor", [("qat", 0.03), ("dorefa", 0.05), ("bnn", 0.2), ("bnn_act", 0.45)])
def test_quantization_pipelines(setup, method, floor):
    h, ds, dense, dense_acc = setup
    r = reproduce_quant.run_method(h, method, dense, ds, Train(1, 2e-4, 64), seed=0, progress=False)
    assert r["acc"] > dense_acc - floor


def test_models_match_torch_layer_names():
    from examples import models_tf

    for name, layers in (("lenet300", ["fc1", "fc2", "fc3"]), ("lenet5", ["conv1", "conv2", "fc1", "fc2"])):
        m = models_tf.build(name)
        weighted = [layer.name for layer in m.layers if getattr(layer, "kernel", None) is not None]
        assert weighted == layers
    assert keras.Model  # keras 3 models
    assert models_tf.build("lenet5").count_params() == 500 + 20 + 25000 + 50 + 400000 + 500 + 5000 + 10
