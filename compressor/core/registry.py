"""The algorithm registry and the plugin manager that fills it.

The registry maps ``(backend, algorithm name)`` to a class; entries can be lazy ``"module:attr"``
strings so ``compressor.available()`` never imports torch or tensorflow.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import hookspecs
from .errors import BackendNotAvailable, ConfigError, ModelError

KINDS = ("pruner", "quantizer")
BUILTIN_PLUGINS = {"torch": "compressor.torch_plugin", "tf": "compressor.tf_plugin"}


@dataclass
class BackendInfo:
    name: str
    framework: str  # importable module name of the framework (torch, tensorflow)
    description: str = ""
    default_types: tuple[str, ...] = ()

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.framework) is not None


@dataclass
class AlgorithmEntry:
    backend: str
    name: str
    target: Any
    kind: str
    plugin: str = ""
    _cls: Any = field(default=None, repr=False)

    def load(self) -> type:
        if self._cls is None:
            if isinstance(self.target, str):
                mod, _, attr = self.target.partition(":")
                self._cls = getattr(importlib.import_module(mod), attr)
            else:
                self._cls = self.target
        return self._cls


class Registry:
    """``(backend, name) -> class``; filled through the ``compressor_*`` pluggy hooks."""

    def __init__(self) -> None:
        self.backends: dict[str, BackendInfo] = {}
        self._algos: dict[tuple[str, str], AlgorithmEntry] = {}
        self._families: dict[tuple[str, str], AlgorithmEntry] = {}
        self._current_plugin = ""

    def add_backend(self, name: str, framework: str, description: str = "", default_types: tuple[str, ...] = ()) -> None:
        self.backends[name] = BackendInfo(name, framework, description, tuple(default_types))

    def register(self, backend: str, name: str, target: Any, kind: str = "pruner") -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not name.isidentifier():
            raise ValueError(f"algorithm name must be a Python identifier, got {name!r}")
        self._algos[(backend, name)] = AlgorithmEntry(backend, name, target, kind, self._current_plugin)

    def add_model_family(self, backend: str, name: str, target: Any) -> None:
        """A model-family adapter for ``backend`` (an object or a lazy ``"module:attr"`` string)."""
        self._families[(backend, name)] = AlgorithmEntry(backend, name, target, "family", self._current_plugin)

    def model_families(self, backend: str) -> list[Any]:
        """The family adapters of ``backend`` (imported on first use), in name order."""
        return [e.load() for (b, _), e in sorted(self._families.items()) if b == backend]

    def names(self, backend: str | None = None) -> list[str]:
        return sorted({n for (b, n) in self._algos if backend is None or b == backend})

    def entries(self) -> list[AlgorithmEntry]:
        return [self._algos[k] for k in sorted(self._algos)]

    def has(self, backend: str, name: str) -> bool:
        return (backend, name) in self._algos

    def get(self, backend: str, name: str) -> type:
        entry = self._algos.get((backend, name))
        if entry is None:
            names = self.names(backend)
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"no algorithm {name!r} for backend {backend!r}{hint}; available: {names}")
        info = self.backends.get(backend)
        if info is not None and not info.installed:
            raise BackendNotAvailable(
                f"backend {backend!r} needs {info.framework!r}, which is not installed "
                f"(pip install 'compressor[{backend}]')"
            )
        return entry.load()

    def available(self) -> dict[str, dict[str, list[str]]]:
        """Algorithms per installed backend, grouped by kind."""
        out: dict[str, dict[str, list[str]]] = {}
        for name, info in sorted(self.backends.items()):
            if not info.installed:
                continue
            out[name] = {k + "s": sorted(e.name for e in self._algos.values() if e.backend == name and e.kind == k)
                         for k in KINDS}
        return out


_PM: pluggy.PluginManager | None = None
_REGISTRY: Registry | None = None


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager: built-in backends plus the ``compressor`` entry points."""
    global _PM
    if _PM is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        for name, modname in BUILTIN_PLUGINS.items():
            pm.register(importlib.import_module(modname), name=name)
        pm.load_setuptools_entrypoints(hookspecs.PROJECT)  # skips names already registered
        _PM = pm
    return _PM


def registry() -> Registry:
    """The registry, built from all plugins on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        reg = Registry()
        pm = plugin_manager()
        _fill(reg, pm)
        _REGISTRY = reg
    return _REGISTRY


def _fill(reg: Registry, pm: pluggy.PluginManager) -> None:
    for hook_name in ("compressor_add_backends", "compressor_add_algorithms", "compressor_add_model_families"):
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            reg._current_plugin = pm.get_name(impl.plugin) or ""
            impl.function(registry=reg)
    reg._current_plugin = ""


def register_plugin(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object/module at run time (what an entry point does at start-up)."""
    global _REGISTRY
    plugin_manager().register(plugin, name=name)
    _REGISTRY = None  # rebuilt on next use, with the new plugin's algorithms


def unregister_plugin(plugin: Any) -> None:
    """Remove a plugin and rebuild the registry without it."""
    global _REGISTRY
    plugin_manager().unregister(plugin)
    _REGISTRY = None


def backend_for(model: Any) -> str:
    """The backend that claims ``model`` (first plugin to answer), or a ModelError listing the backends."""
    name = plugin_manager().hook.compressor_claim_model(model=model)
    if name is None:
        reg = registry()
        installed = [b for b, i in reg.backends.items() if i.installed]
        raise ModelError(
            f"no installed backend handles a model of type {type(model).__module__}.{type(model).__qualname__}; "
            f"installed backends: {installed} (torch: torch.nn.Module, tf: keras.Model)"
        )
    return name


def create(name: str, model: Any, *args: Any, **kwargs: Any) -> Any:
    """Instantiate algorithm ``name`` on the backend that claims ``model``."""
    return registry().get(backend_for(model), name)(model, *args, **kwargs)


def dispatcher(name: str) -> Callable[..., Any]:
    """A callable ``f(model, config_list, ...)`` that builds ``name`` for the model's backend."""

    def build(model: Any, *args: Any, **kwargs: Any) -> Any:
        return create(name, model, *args, **kwargs)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"Build {name} for the backend of ``model`` (torch or tf), chosen through the plugin hook."
    return build
