"""compressor: pruning and quantization for PyTorch and TensorFlow/Keras 3 from one config_list.

``import compressor`` imports neither torch nor tensorflow. Algorithm names at this level
(``compressor.LevelPruner(model, config_list, ...)``) pick the backend from the model's type.
Backends: ``compressor.torch``, ``compressor.tf``; seed-004 prototype API: ``compressor.torchCompressor``,
``compressor.tfCompressor``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .core.config import load_config, load_configs, normalize_config_list
from .core.errors import BackendNotAvailable, ConfigError, ConfigWarning, ModelError
from .core.registry import backend_for, register_plugin, registry

__version__ = "0.1.0"

__all__ = [
    "BackendNotAvailable", "ConfigError", "ConfigWarning", "ModelError", "available", "backend_for",
    "backends", "load_config", "load_configs", "normalize_config_list", "register_plugin",
]


def available() -> dict[str, dict[str, list[str]]]:
    """Algorithms per installed backend: ``{'torch': {'pruners': [...], 'quantizers': [...]}, ...}``."""
    return registry().available()


def backends() -> dict[str, bool]:
    """Every known backend and whether its framework is installed."""
    return {name: info.installed for name, info in sorted(registry().backends.items())}


_SUBMODULES = {"torchCompressor", "tfCompressor", "core", "torch", "tf", "cli"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name.startswith("_"):
        raise AttributeError(f"module 'compressor' has no attribute {name!r}")
    reg = registry()
    if name in reg.names():
        from .core.registry import dispatcher

        return dispatcher(name)
    raise AttributeError(f"module 'compressor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES | set(registry().names()))
