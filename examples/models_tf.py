"""The paper models in Keras 3 (NHWC). Layer names match :mod:`examples.models_torch`; activations are
separate layers as there, so a layer's quantized output means the same on both backends.

Kernels and biases are initialised the way PyTorch initialises ``nn.Linear`` / ``nn.Conv2d`` (uniform in
``+-1/sqrt(fan_in)``), not with Keras' Glorot-uniform / zeros, so the two backends start from the same
distribution and the reproduction tables compare the frameworks, not their default initialisers.
"""

from __future__ import annotations

import math

import keras
from keras import layers as L

__all__ = ["MODELS", "build", "lenet_300_100", "lenet_5", "torch_like_init"]


def torch_like_init(fan_in: int) -> dict[str, keras.initializers.Initializer]:
    """Initialisers of PyTorch's default for a layer with ``fan_in`` inputs (kernel and bias U(+-1/sqrt(fan_in)))."""
    bound = 1.0 / math.sqrt(fan_in)
    return {"kernel_initializer": keras.initializers.VarianceScaling(1.0 / 3.0, "fan_in", "uniform"),
            "bias_initializer": keras.initializers.RandomUniform(-bound, bound)}


def lenet_300_100(num_classes: int = 10, image_size: int = 28) -> keras.Sequential:
    """LeNet-300-100: 784-300-100-10, ReLU."""
    return keras.Sequential([
        keras.Input((image_size, image_size, 1)), L.Flatten(name="flatten"),
        L.Dense(300, name="fc1", **torch_like_init(image_size * image_size)), L.ReLU(name="relu1"),
        L.Dense(100, name="fc2", **torch_like_init(300)), L.ReLU(name="relu2"),
        L.Dense(num_classes, name="fc3", **torch_like_init(100)),
    ], name="lenet300")


def lenet_5(num_classes: int = 10, image_size: int = 28) -> keras.Sequential:
    """Caffe's LeNet-5 as in Han et al. 2015 (see :func:`examples.models_torch.lenet_5`)."""
    side = ((image_size - 4) // 2 - 4) // 2
    return keras.Sequential([
        keras.Input((image_size, image_size, 1)),
        L.Conv2D(20, 5, name="conv1", **torch_like_init(1 * 5 * 5)), L.MaxPooling2D(2, name="pool1"),
        L.Conv2D(50, 5, name="conv2", **torch_like_init(20 * 5 * 5)), L.MaxPooling2D(2, name="pool2"),
        L.Flatten(name="flatten"), L.Dense(500, name="fc1", **torch_like_init(50 * side * side)), L.ReLU(name="relu1"),
        L.Dense(num_classes, name="fc2", **torch_like_init(500)),
    ], name="lenet5")


MODELS = {"lenet300": lenet_300_100, "lenet5": lenet_5}


def build(name: str, num_classes: int = 10, image_size: int = 28) -> keras.Sequential:
    """A fresh (randomly initialised) model by name: 'lenet300' or 'lenet5'."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {sorted(MODELS)}")
    return MODELS[name](num_classes, image_size)
