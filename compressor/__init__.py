"""compressor: pruning and quantization for PyTorch and TensorFlow/Keras 3 from one config_list.

``import compressor`` imports neither torch nor tensorflow. Algorithm names at this level
(``compressor.LevelPruner(model, config_list, ...)``) pick the backend from the model's type.
Backends: ``compressor.torch``, ``compressor.tf``; seed-004 prototype API: ``compressor.torchCompressor``,
``compressor.tfCompressor`` (shims over :mod:`compressor.compat`). The ``compressor`` command line, the report of
exported files and the demos are an application on top of the library: :mod:`compressor.app`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from typing import Any

from .core.cmpk import pack, unpack
from .core.config import load_config, load_configs, normalize_config_list
from .core.errors import BackendNotAvailable, CompressedFileError, ConfigError, ConfigWarning, ModelError
from .core.registry import backend_for, register_plugin, registry

__version__ = "0.1.0"

__all__ = [
    "BackendNotAvailable", "CompressedFileError", "ConfigError", "ConfigWarning", "ModelError", "available",
    "backend_for", "backends", "count_flops_params", "load_config", "load_configs", "normalize_config_list", "pack",
    "register_plugin", "speedup_model", "unpack",
]


def available() -> dict[str, dict[str, list[str]]]:
    """Algorithms per installed backend: ``{'torch': {'pruners': [...], 'quantizers': [...]}, ...}``."""
    return registry().available()


def backends() -> dict[str, bool]:
    """Every known backend and whether its framework is installed."""
    return {name: info.installed for name, info in sorted(registry().backends.items())}


def _backend_module(model: Any) -> Any:
    """The backend package (compressor.torch / compressor.tf) of a model or of a compressor's model."""
    target = getattr(model, "bound_model", model)
    return importlib.import_module(f".{backend_for(target)}", __name__)


def speedup_model(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Turn a pruned model's masks into physically smaller layers on the model's backend:
    ``compressor.torch.speedup_model(pruner_or_model, dummy_input, ...)`` or
    ``compressor.tf.speedup_model(pruner_or_model, ...)``; see those for the arguments."""
    return _backend_module(model).speedup_model(model, *args, **kwargs)


def count_flops_params(model: Any, *args: Any, **kwargs: Any) -> Any:
    """``(macs, params, per_layer)`` of a model on its backend (torch needs a dummy input, Keras does not)."""
    return _backend_module(model).count_flops_params(model, *args, **kwargs)


_SUBMODULES = {"torchCompressor", "tfCompressor", "core", "torch", "tf", "app"}
_DISPATCHERS: dict[str, Any] = {}


def _dispatcher(name: str) -> Any:
    """``compressor.<name>(model, config_list, ...)``: the backend is chosen by the plugins' claim hook
    (a torch model never imports tensorflow and vice versa)."""
    fn = _DISPATCHERS.get(name)
    if fn is not None:
        return fn
    from .core.registry import create

    def build(model: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(model, (list, tuple)) and model and all(isinstance(e, Mapping) for e in model):
            raise ModelError(
                f"compressor.{name}(model, config_list, optimizer=None) takes the model first, got a config_list; "
                f"the seed-004 style is compressor.torchCompressor.{name}(config_list)(model) "
                f"(or compressor.tfCompressor)"
            )
        return create(name, model, *args, **kwargs)

    build.__name__ = build.__qualname__ = name
    build.__module__ = __name__
    build.__doc__ = (f"Build {name}(model, config_list, optimizer=None, ...) on the backend that claims ``model`` "
                     f"(torch.nn.Module -> compressor.torch, Keras model -> compressor.tf, or a plugin's).")
    _DISPATCHERS[name] = build
    return build


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name.startswith("_"):
        raise AttributeError(f"module 'compressor' has no attribute {name!r}")
    if name in registry().names():
        return _dispatcher(name)
    if name.isidentifier() and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # e.g. compressor.app
    raise AttributeError(f"module 'compressor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBMODULES | set(registry().names()))
