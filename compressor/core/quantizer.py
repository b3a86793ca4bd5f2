"""The framework-free part of the quantizer base classes (``TorchQuantizer`` / ``TfQuantizer``).

A quantizer overrides ``quantize_weight`` / ``quantize_input`` / ``quantize_output`` in one of two calling
styles, read from each method's signature: seed 002's ``(tensor, wrapper, **kwargs)`` or seed 003's
``(tensor, config, **kwargs)``. Methods may be marked :func:`builtin_ste` (their own gradient already is
the clipped straight-through one) or :func:`builtin_autograd` (their gradients are their own). This
module reads those facts, checks a config entry's ``quant_types`` against them and calls a method in
its style; the backends add tensors, wrappers and gradient functions. :class:`QuantizerBaseMixin` holds
what both backends' quantizer bases declare the same way (class attributes, override points, dispatch).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from . import quant as cq
from .config import QUANT_TYPES
from .errors import ConfigError

__all__ = [
    "NAIVE_QRANGE", "NaiveQuantizerRules", "QuantizerBaseMixin", "builtin_autograd", "builtin_ste", "call_quantize", "call_style", "calls_directly", "check_quant_types",
    "method_styles",
]


def builtin_ste(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a ``quantize_*`` method whose own gradient is the intended (clipped) straight-through one: with
    the default ``quant_grad`` it is called directly (no extra custom-gradient function)."""
    fn._quant_autograd = "ste"
    return fn


def builtin_autograd(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a ``quantize_*`` method whose gradients are its own (e.g. LSQ's learned scales):
    ``quant_grad`` is never applied to it."""
    fn._quant_autograd = "own"
    return fn


def call_style(fn: Callable[..., Any]) -> tuple[str, bool]:
    """('wrapper' | 'config', takes **kwargs) from a ``quantize_*`` signature."""
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "config" in params and "wrapper" not in params:
        return "config", var_kw
    return "wrapper", var_kw


def method_styles(cls: type) -> tuple[dict[str, tuple[str, bool]], dict[str, str | None]]:
    """``({quant_type: call_style}, {quant_type: autograd mark or None})`` of ``cls``'s ``quantize_*``."""
    styles: dict[str, tuple[str, bool]] = {}
    autograd: dict[str, str | None] = {}
    for t in QUANT_TYPES:
        fn = getattr(cls, f"quantize_{t}")
        styles[t] = call_style(fn)
        autograd[t] = getattr(fn, "_quant_autograd", None)
    return styles, autograd


def calls_directly(mode: str | None, default_grad: bool) -> bool:
    """Whether a method with autograd mark ``mode`` runs without the ``quant_grad`` wrapper: always for
    ``'own'``, for ``'ste'`` while ``quant_grad`` is the default one."""
    return mode == "own" or (mode == "ste" and default_grad)


def check_quant_types(cls: type, base: type, layer_name: str, types: Iterable[str],
                      supported: Iterable[str]) -> None:
    """Refuse quant types the algorithm ``cls`` does not support, or whose ``quantize_*`` it does not
    override (``base``: the backend's quantizer base class, whose methods only raise)."""
    what = cls.__name__
    supported = list(supported)
    bad = [t for t in types if t not in supported]
    if bad:
        raise ConfigError(f"{what}: layer {layer_name!r}: quant_types {bad} are not supported; "
                          f"{what} quantizes {supported}")
    missing = [t for t in types if getattr(cls, f"quantize_{t}") is getattr(base, f"quantize_{t}")]
    if missing:
        raise ConfigError(f"{what}: layer {layer_name!r}: quant_types {missing} need "
                          f"{', '.join('quantize_' + t for t in missing)}(), which {what} does not define")


def call_quantize(fn: Callable[..., Any], style: tuple[str, bool], tensor: Any, wrapper: Any) -> Any:
    """Call ``quantize_*`` method ``fn`` on ``tensor`` in its ``style`` (see :func:`call_style`); a tuple
    result (``quantize_input(*inputs)``) gives its first element."""
    kind, var_kw = style
    if kind == "wrapper":
        out = fn(tensor, wrapper=wrapper)
    elif var_kw:
        out = fn(tensor, config=wrapper.config, op=wrapper.layer, op_type=wrapper.type, op_name=wrapper.name)
    else:
        out = fn(tensor, config=wrapper.config)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out


class QuantizerBaseMixin:
    """The framework-free part of ``TorchQuantizer`` / ``TfQuantizer``: put it before the backend's
    ``Compressor`` base. Config keys: ``quant_types`` (list of 'input' / 'weight' / 'output'),
    ``quant_bits`` (int or ``{type: bits}``, 1..32), optional ``quant_start_step``; subclasses add their own.
    """

    _kind = "quantizer"
    required_keys: tuple[str, ...] = ("quant_types", "quant_bits")
    #: the quant types this algorithm implements (others are refused before the model is touched)
    supported_quant_types: tuple[str, ...] = QUANT_TYPES
    #: True: ``quantize_*`` run (and track ranges) before ``quant_start_step``; the base discards their
    #: result until then. False: the base does not call them before the start step.
    handles_start_step: bool = False

    def _read_method_styles(self) -> None:
        """Read the calling style and autograd mark of this class's ``quantize_*`` (construction)."""
        self._styles, self._autograd = method_styles(type(self))

    def _check_quant_types(self, layer_name: str, types: Iterable[str]) -> None:
        """Refuse a layer's ``quant_types`` this algorithm does not support or does not override."""
        check_quant_types(type(self), QuantizerBaseMixin, layer_name, types, self.supported_quant_types)

    # ------------------------------------------------------------------ override points
    def quantize_weight(self, weight: Any, wrapper: Any, **kwargs: Any) -> Any:
        """Return the quantized ``weight`` of ``wrapper``'s layer (in the backend's layout: torch
        ``[out, in, ...]``, Keras ``[in, out]`` / ``[kh, kw, in, out]``)."""
        raise NotImplementedError(f"{type(self).__name__} must override quantize_weight()")

    def quantize_input(self, *inputs: Any, wrapper: Any, **kwargs: Any) -> Any:
        """Return the quantized input of ``wrapper``'s layer."""
        raise NotImplementedError(f"{type(self).__name__} must override quantize_input()")

    def quantize_output(self, output: Any, wrapper: Any, **kwargs: Any) -> Any:
        """Return the quantized output of ``wrapper``'s layer."""
        raise NotImplementedError(f"{type(self).__name__} must override quantize_output()")

    def _call_method(self, quant_type: str, tensor: Any, wrapper: Any) -> Any:
        """Call this quantizer's ``quantize_<quant_type>`` on ``tensor`` in its calling style."""
        return call_quantize(getattr(self, f"quantize_{quant_type}"), self._styles[quant_type], tensor, wrapper)


#: NaiveQuantizer's integer range: symmetric int8, narrow ([-127, 127])
NAIVE_QRANGE: tuple[int, int] = cq.quant_range(8, "int")


class NaiveQuantizerRules:
    """What both backends' ``NaiveQuantizer`` declare the same way: weights only, 8 bits only (range
    :data:`NAIVE_QRANGE`). Put it before the backend's quantizer base."""

    supported_quant_types: tuple[str, ...] = ("weight",)

    def validate_layer(self, layer_info: Any, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)  # type: ignore[misc]
        bits = config["quant_bits"].get("weight")
        if bits != 8:
            raise ConfigError(f"NaiveQuantizer: layer {layer_info.name!r}: quant_bits = {bits}; "
                              f"NaiveQuantizer is 8-bit only (use QAT_Quantizer for other widths)")
