"""pluggy hook specifications. Backends and third-party algorithm packages implement them.

A plugin is any module or object with ``@hookimpl``-decorated functions named like the specs below,
published through the setuptools entry-point group ``compressor``::

    [project.entry-points.compressor]
    my_algos = "my_package.compressor_plugin"
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "compressor"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def compressor_add_backends(registry: Any) -> None:
    """Declare backends: ``registry.add_backend(name, framework=..., default_types=...)``."""


@hookspec
def compressor_add_algorithms(registry: Any) -> None:
    """Register algorithms: ``registry.register(backend, name, target, kind=...)``.

    ``target`` is a class or a lazy ``"module:attr"`` string, so listing never imports a framework.
    """


@hookspec(firstresult=True)
def compressor_claim_model(model: Any) -> str | None:
    """Return the backend name that handles ``model``, or None. Must not import a framework that is not
    already imported (a model of that framework cannot exist otherwise)."""


@hookspec
def compressor_add_model_families(registry: Any) -> None:
    """Declare model-family adapters: ``registry.add_model_family(backend, name, target)``.

    A family adapter holds what one model family (Hugging Face ``transformers``, keras-hub, ...) needs from
    a backend, so the backend's base classes never name a family. ``target`` is an object or a lazy
    ``"module:attr"`` string; the backend documents the methods it calls (for PyTorch:
    :class:`compressor.torch.families.ModelFamily`)."""
