"""The seeds' clock for user subclasses of built-in pruners.

Seed 000 promises that ``calc_mask`` runs after every ``optimizer.step()``. The built-in one-shot pruners
compute each layer's mask once and then skip the per-step recomputation (their fast path). A user class
that overrides ``calc_mask`` on top of one of them wants its method called at every step, as the seeds
say; :func:`user_override` tells the two apart, the same way on both backends.
"""

from __future__ import annotations

from typing import Any

_PACKAGE = __name__.split(".")[0]  # 'compressor'
_CACHE: dict[tuple[type, str], bool] = {}


def defining_class(cls: type, name: str) -> type | None:
    """The first class in ``cls``'s MRO whose own namespace defines ``name``."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return None


def user_override(obj: Any, name: str) -> bool:
    """True when the method ``name`` of ``obj`` is defined by a class outside this package (a user's
    subclass of a built-in), False for the built-in's own method."""
    cls = type(obj)
    key = (cls, name)
    if key not in _CACHE:
        owner = defining_class(cls, name)
        module = getattr(owner, "__module__", "") or ""
        _CACHE[key] = owner is not None and module.split(".")[0] != _PACKAGE
    return _CACHE[key]
