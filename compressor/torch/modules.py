"""Module-tree facts every layer of the PyTorch backend needs (the bottom layer: imports torch only).

A compressor wrapper is marked by one attribute (``_WRAPPER_FLAG``, set by the compressor that created
it); :func:`innermost_module` finds the user's layer inside nested wrappers and :func:`named_wrappers`
lists the wrappers of a model. Kept below wrappers, slots, ties and the ``Compressor`` base so that none
of them has to import another to ask "is this a wrapper?".
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
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
    """The ``torch.nn`` layer class that ``module``'s class subclasses and computes as, by name: config
    ``op_types`` (and ``'default'``) select it as that class, wrappers run it as one. That is a subclass without
    a forward of its own (HF EfficientNet's ``EfficientNetDepthwiseConv2d(nn.Conv2d)``), or a Linear / Conv
    subclass whose own forward gives the base class's output (HF Falcon's ``FalconLinear``: ``x @ W.T + b``),
    checked once per module on a small probe input. None for ``torch.nn``'s own classes and for subclasses
    that change the computation (or whose weights cannot be probed, e.g. on the meta device)."""
    cls = type(module)
    if cls.__module__.startswith("torch.nn."):
        return None
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("torch.nn.modules."):
            if base is nn.Module:
                return None
            same = all(getattr(cls, m, None) is getattr(base, m, None) for m in ("forward", "_conv_forward"))
            if same:
                return base.__name__
            return base.__name__ if _computes_as(module, base) else None
    return None


#: verdicts of :func:`_computes_as` per module (a module's class does not change)
_PROBED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _probe_input(module: nn.Module, base: type) -> torch.Tensor | None:
    """A small input for ``module`` run as ``base`` (Linear / ConvNd), or None for other classes."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.device.type == "meta" or not w.is_floating_point():
        return None
    gen = torch.Generator().manual_seed(0)
    if issubclass(base, nn.Linear):
        shape: tuple[int, ...] = (3, int(module.in_features))
    elif issubclass(base, nn.modules.conv._ConvNd) and not module.transposed and isinstance(module.padding, tuple):
        spatial = tuple(int(d) * (int(k) - 1) + int(s) + 1
                        for k, s, d in zip(module.kernel_size, module.stride, module.dilation))
        shape = (1, int(module.in_channels), *spatial)
    else:
        return None
    return torch.randn(shape, generator=gen).to(device=w.device, dtype=w.dtype)


def _computes_as(module: nn.Module, base: type) -> bool:
    """Whether ``module``'s own forward gives ``base.forward``'s output (to the dtype's rounding) on a probe."""
    known = _PROBED.get(module)
    if known is not None:
        return known
    x = _probe_input(module, base)
    verdict = False
    if x is not None:
        try:
            with torch.no_grad():
                mine = type(module).forward(module, x)  # the class's forward, without the module's hooks
                ref = base.forward(module, x)
        except Exception:  # noqa: BLE001 - a forward that cannot run as the base class does not compute as it
            mine = ref = None
        if isinstance(mine, torch.Tensor) and isinstance(ref, torch.Tensor) and mine.shape == ref.shape:
            tol = 1e-5 if ref.dtype in (torch.float32, torch.float64) else 1e-2
            scale = float(ref.detach().abs().max()) if ref.numel() else 0.0
            verdict = bool(torch.allclose(mine.float(), ref.float(), rtol=tol, atol=tol * max(scale, 1e-12),
                                          equal_nan=True))
    _PROBED[module] = verdict
    return verdict
