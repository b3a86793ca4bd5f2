"""The example/demo harnesses train alike on both backends: weight decay is DECOUPLED on both (Keras'
semantics, ``p -= lr * wd * p`` before the update). torch's own ``Adam(weight_decay=)`` / ``SGD(weight_decay=)``
would add ``wd * p`` to the gradient instead, which Adam then normalises away."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch

from compressor.app.demo import TfHarness, TorchHarness

LR, WD, W0 = 0.1, 0.5, 2.0


def torch_step(kind: str, grad: float, steps: int = 1) -> float:
    layer = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(W0)
    opt = TorchHarness().optimizer(layer, LR, kind, weight_decay=WD)
    for _ in range(steps):
        layer.weight.grad = torch.full_like(layer.weight, grad)
        opt.step()
    return float(layer.weight.item())


def tf_step(kind: str, grad: float, steps: int = 1) -> float:
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign([[W0]])
    opt = TfHarness().optimizer(model, LR, kind, weight_decay=WD)
    for _ in range(steps):
        opt.apply_gradients([(tf.constant([[grad]]), model.layers[0].kernel)])
    return float(np.asarray(model.layers[0].kernel)[0, 0])


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_zero_gradient_step_is_pure_decoupled_decay(kind):
    expected = W0 * (1 - LR * WD)  # 1.9: no gradient, so only the decay moves the weight
    assert torch_step(kind, 0.0) == pytest.approx(expected, abs=1e-6)
    assert tf_step(kind, 0.0) == pytest.approx(expected, abs=1e-6)


def test_sgd_steps_with_gradient_match():
    # decay first, then the momentum update (momentum 0.9, gradient 1 each step):
    # step 1: 2 * 0.95 - 0.1 * 1 = 1.8; step 2: 1.8 * 0.95 - 0.1 * (0.9 + 1) = 1.52.
    # (Coupled L2 would give 1.43 at step 2: momentum carries the decay term along.)
    assert torch_step("sgd", 1.0, steps=2) == pytest.approx(1.52, abs=1e-6)
    assert tf_step("sgd", 1.0, steps=2) == pytest.approx(1.52, abs=1e-6)


def test_adam_step_with_gradient_matches():
    # first Adam step moves by lr * sign(g) (bias-corrected m / sqrt(v) = 1), after the decay: 1.9 - 0.1 = 1.8
    # (coupled L2 would feed g + wd * p = 2 to Adam, which normalises it away: 2 - 0.1 = 1.9)
    assert torch_step("adam", 1.0) == pytest.approx(1.8, abs=1e-5)
    assert tf_step("adam", 1.0) == pytest.approx(1.8, abs=1e-5)
