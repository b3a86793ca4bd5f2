"""Built-in pluggy plugin for the TensorFlow / Keras 3 backend. Importing it does not import tensorflow."""

from __future__ import annotations

import sys
from typing import Any

from .core.algorithms import register_builtins
from .core.hookspecs import hookimpl

DEFAULT_TYPES = ("Conv1D", "Conv2D", "Conv3D", "Dense", "DepthwiseConv2D", "Conv1DTranspose", "Conv2DTranspose",
                 "Conv3DTranspose")


@hookimpl
def compressor_add_backends(registry: Any) -> None:
    registry.add_backend("tf", framework="tensorflow", description="TensorFlow / Keras 3 models",
                         default_types=DEFAULT_TYPES)


@hookimpl
def compressor_add_algorithms(registry: Any) -> None:
    register_builtins(registry, "tf", "compressor.tf")


@hookimpl
def compressor_claim_model(model: Any) -> str | None:
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(model, keras.layers.Layer):
        return "tf"
    return None
