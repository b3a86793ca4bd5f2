"""The paper models in Keras 3 (NHWC). Layer names match :mod:`examples.models_torch`; activations are
separate layers as there, so a layer's quantized output means the same on both backends."""

from __future__ import annotations

import keras
from keras import layers as L

__all__ = ["MODELS", "build", "lenet_300_100", "lenet_5"]


def lenet_300_100(num_classes: int = 10, image_size: int = 28) -> keras.Sequential:
    """LeNet-300-100: 784-300-100-10, ReLU."""
    return keras.Sequential([
        keras.Input((image_size, image_size, 1)), L.Flatten(name="flatten"),
        L.Dense(300, name="fc1"), L.ReLU(name="relu1"), L.Dense(100, name="fc2"), L.ReLU(name="relu2"),
        L.Dense(num_classes, name="fc3"),
    ], name="lenet300")


def lenet_5(num_classes: int = 10, image_size: int = 28) -> keras.Sequential:
    """Caffe's LeNet-5 as in Han et al. 2015 (see :func:`examples.models_torch.lenet_5`)."""
    return keras.Sequential([
        keras.Input((image_size, image_size, 1)),
        L.Conv2D(20, 5, name="conv1"), L.MaxPooling2D(2, name="pool1"),
        L.Conv2D(50, 5, name="conv2"), L.MaxPooling2D(2, name="pool2"),
        L.Flatten(name="flatten"), L.Dense(500, name="fc1"), L.ReLU(name="relu1"), L.Dense(num_classes, name="fc2"),
    ], name="lenet5")


MODELS = {"lenet300": lenet_300_100, "lenet5": lenet_5}


def build(name: str, num_classes: int = 10, image_size: int = 28) -> keras.Sequential:
    """A fresh (randomly initialised) model by name: 'lenet300' or 'lenet5'."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {sorted(MODELS)}")
    return MODELS[name](num_classes, image_size)
