"""Module-tree facts every layer of the PyTorch backend needs (the bottom layer: imports torch only).

A compressor wrapper is marked by one attribute (``_WRAPPER_FLAG``, set by the compressor that created
it); :func:`innermost_module` finds the user's layer inside nested wrappers and :func:`named_wrappers`
lists the wrappers of a model. Kept below wrappers, slots, ties and the ``Compressor`` base so that none
of them has to import another to ask "is this a wrapper?".
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["is_wrapper", "innermost_module", "named_wrappers"]

_WRAPPER_FLAG = "_compressor_wrapper_kind"


def is_wrapper(module: nn.Module) -> bool:
    """True for a module created by a compressor's ``_create_wrapper``."""
    return getattr(module, _WRAPPER_FLAG, None) is not None


def innermost_module(module: nn.Module) -> nn.Module:
    """The original layer inside (possibly nested) compressor wrappers."""
    while is_wrapper(module):
        module = module.module
    return module


def named_wrappers(model: nn.Module, kinds: Iterable[type] = (nn.Module,)) -> list[tuple[str, nn.Module]]:
    """``(path, wrapper)`` of the compressor wrappers in ``model`` that are instances of ``kinds``."""
    kinds = tuple(kinds)
    return [(n, m) for n, m in model.named_modules() if is_wrapper(m) and isinstance(m, kinds)]
