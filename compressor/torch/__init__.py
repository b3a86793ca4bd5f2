"""PyTorch backend of compressor. Importing it imports torch, never tensorflow."""

from .ops import TorchOps, ops

__all__ = ["TorchOps", "ops"]
