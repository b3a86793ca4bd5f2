"""Built-in pluggy plugin for the PyTorch backend. Importing it does not import torch."""

from __future__ import annotations

import sys
from typing import Any

from .core.algorithms import register_builtins
from .core.hookspecs import hookimpl

DEFAULT_TYPES = ("Conv1d", "Conv2d", "Conv3d", "Linear", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")


@hookimpl
def compressor_add_backends(registry: Any) -> None:
    registry.add_backend("torch", framework="torch", description="PyTorch nn.Module models", default_types=DEFAULT_TYPES)


@hookimpl
def compressor_add_algorithms(registry: Any) -> None:
    register_builtins(registry, "torch", "compressor.torch")


@hookimpl
def compressor_add_model_families(registry: Any) -> None:
    registry.add_model_family("torch", "huggingface", "compressor.torch.hf:FAMILY")


@hookimpl
def compressor_claim_model(model: Any) -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return "torch"
    return None
