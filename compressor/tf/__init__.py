"""TensorFlow / Keras 3 backend of compressor. Importing it imports tensorflow, never torch."""

from .ops import TfOps, ops

__all__ = ["TfOps", "ops"]
