"""Backend-agnostic core: config, layer matching, ArrayOps, algorithm math, plugins.

Imports numpy, yaml and pluggy only: never torch or tensorflow.
"""

from .config import KeySpec, key_spec, load_config, load_configs, normalize_config_list
from .errors import BackendNotAvailable, ConfigError, ConfigWarning, ModelError
from .matching import LayerInfo, match_layers
from .ops import ArrayOps, NumpyOps
from .registry import backend_for, plugin_manager, register_plugin

__all__ = [
    "ArrayOps", "BackendNotAvailable", "ConfigError", "ConfigWarning", "KeySpec", "LayerInfo", "ModelError",
    "NumpyOps", "backend_for", "key_spec", "load_config", "load_configs", "match_layers", "normalize_config_list",
    "plugin_manager", "register_plugin",
]
