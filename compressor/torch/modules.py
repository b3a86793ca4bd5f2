"""Module-tree facts every layer of the PyTorch backend needs (the bottom layer: imports torch only).

A compressor wrapper is marked by one attribute (``_WRAPPER_FLAG``, set by the compressor that created
it); :func:`innermost_module` finds the user's layer inside nested wrappers and :func:`named_wrappers`
lists the wrappers of a model. Kept below wrappers, slots, ties and the ``Compressor`` base so that none
of them has to import another to ask "is this a wrapper?".
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["is_wrapper", "innermost_module", "named_wrappers", "torch_base_type"]

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


def torch_base_type(module: nn.Module) -> str | None:
    """The ``torch.nn`` layer class that ``module``'s class subclasses WITHOUT a forward of its own (HF
    EfficientNet's ``EfficientNetDepthwiseConv2d(nn.Conv2d)``), by name: config ``op_types`` (and
    ``'default'``) select it as that class, wrappers run it as one. None for ``torch.nn``'s own classes and
    for subclasses that change the computation."""
    cls = type(module)
    if cls.__module__.startswith("torch.nn."):
        return None
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("torch.nn.modules."):
            same = all(getattr(cls, m, None) is getattr(base, m, None) for m in ("forward", "_conv_forward"))
            return base.__name__ if same and base is not nn.Module else None
    return None
