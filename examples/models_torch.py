"""The paper models in PyTorch. Layer names match :mod:`examples.models_tf`, so one config_list with
``op_names`` serves both backends."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

__all__ = ["MODELS", "build", "lenet_300_100", "lenet_5"]


def lenet_300_100(num_classes: int = 10, image_size: int = 28) -> nn.Sequential:
    """LeNet-300-100 (LeCun et al. 1998; Han et al. 2015 Table 1): 784-300-100-10, ReLU."""
    return nn.Sequential(OrderedDict([
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(image_size * image_size, 300)), ("relu1", nn.ReLU()),
        ("fc2", nn.Linear(300, 100)), ("relu2", nn.ReLU()),
        ("fc3", nn.Linear(100, num_classes)),
    ]))


def lenet_5(num_classes: int = 10, image_size: int = 28) -> nn.Sequential:
    """Caffe's LeNet-5 as in Han et al. 2015: conv 20@5x5 - pool - conv 50@5x5 - pool - fc 500 - fc 10
    (431k weights: conv1 500, conv2 25k, fc1 400k, fc2 5k)."""
    side = ((image_size - 4) // 2 - 4) // 2
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(1, 20, 5)), ("pool1", nn.MaxPool2d(2)),
        ("conv2", nn.Conv2d(20, 50, 5)), ("pool2", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()),
        ("fc1", nn.Linear(50 * side * side, 500)), ("relu1", nn.ReLU()),
        ("fc2", nn.Linear(500, num_classes)),
    ]))


MODELS = {"lenet300": lenet_300_100, "lenet5": lenet_5}


def build(name: str, num_classes: int = 10, image_size: int = 28) -> nn.Sequential:
    """A fresh (randomly initialised) model by name: 'lenet300' or 'lenet5'."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {sorted(MODELS)}")
    return MODELS[name](num_classes, image_size)
