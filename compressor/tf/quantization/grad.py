"""Custom gradients of quantization ops on TensorFlow: ``QuantType`` and the ``QuantGrad`` hook.

The forward of a fake-quant op is piecewise constant, so its true gradient is zero almost everywhere.
``QuantGrad.apply`` runs any forward function under ``tf.custom_gradient`` and routes the backward
through the overridable static ``quant_backward(tensor, grad_output, quant_type, ...)``, exactly as
``torch.autograd.Function`` does on the torch backend, so a user's gradient rule reads the same on both
(only the tensor library differs: write ``tf.where(tf.abs(tensor) > 1, 0.0, grad_output)`` where torch
code writes ``grad_output[tensor.abs() > 1] = 0``).

``quant_backward`` may take the seed's three arguments ``(tensor, grad_output, quant_type)`` or also
``(scale, zero_point, qmin, qmax)``; ``apply`` inspects the override's signature once and passes what it
accepts. The default is the straight-through estimator clipped to the quantization range
(:func:`compressor.core.quant.ste_pass`), or the plain STE when the op has no range (scale ``None``).
Everything traces inside ``tf.function`` (and XLA).
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from ...core import quant as Q
from ..ops import ops

__all__ = ["QuantGrad", "QuantType"]


class QuantType(str, enum.Enum):
    """What a quantization op acts on. Members compare equal to the config strings ('weight', ...)."""

    QUANT_INPUT = "input"
    QUANT_WEIGHT = "weight"
    QUANT_OUTPUT = "output"

    # short aliases (NNI 2.x spelling)
    INPUT = "input"
    WEIGHT = "weight"
    OUTPUT = "output"

    def __str__(self) -> str:
        return self.value


QParams = tuple[Any, Any, int, int]
_QP_NAMES = ("scale", "zero_point", "qmin", "qmax")
_ACCEPTS: dict[Any, bool] = {}


def _accepts_qparams(fn: Callable[..., Any]) -> bool:
    """Whether a ``quant_backward`` takes ``scale, zero_point, qmin, qmax`` as keywords (cached)."""
    hit = _ACCEPTS.get(fn)
    if hit is None:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        names = {p.name for p in params}
        hit = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) or set(_QP_NAMES) <= names
        _ACCEPTS[fn] = hit
    return hit


class QuantGrad:
    """Gradient rule of a fake-quant op. Subclass and override :meth:`quant_backward`, then set
    ``quantizer.quant_grad = YourGrad`` (an instance attribute, as in seed 003)."""

    @staticmethod
    def quant_backward(tensor: tf.Tensor, grad_output: tf.Tensor, quant_type: QuantType, scale: Any = None,
                       zero_point: Any = None, qmin: int | None = None, qmax: int | None = None) -> tf.Tensor:
        """Gradient w.r.t. the op's input ``tensor`` given the gradient of its output.

        Default: straight-through estimator clipped to the integer range, i.e. ``grad_output`` where
        ``qmin <= round(tensor / scale + zero_point) <= qmax`` and 0 elsewhere; plain STE without a range.
        """
        if scale is None:
            return grad_output
        scale = tf.convert_to_tensor(scale)
        if tensor.dtype != scale.dtype:  # mixed precision: decide on the float32 grid
            tensor = tf.cast(tensor, scale.dtype)
        keep = Q.ste_pass(ops, tensor, scale, zero_point, qmin, qmax)
        return tf.where(keep, grad_output, tf.zeros_like(grad_output))

    @classmethod
    def apply(cls, tensor: tf.Tensor, quant_type: QuantType | str,
              quantize: Callable[[tf.Tensor], tuple[tf.Tensor, QParams | None]]) -> tf.Tensor:
        """``quantize(tensor)`` forward, :meth:`quant_backward` backward (the torch ``Function.apply`` twin).

        ``quantize`` returns ``(output, (scale, zero_point, qmin, qmax) or None)`` or just the output; it may read and assign
        variables (range trackers). Scale and zero point must broadcast against ``tensor``; they get no
        gradient here (a learned-scale method such as LSQ builds its gradient into the forward instead).
        """
        qt = quant_type if isinstance(quant_type, QuantType) else QuantType(quant_type)
        backward = cls.quant_backward
        with_qparams = _accepts_qparams(backward)

        @tf.custom_gradient
        def _op(x: tf.Tensor) -> tuple[tf.Tensor, Callable[..., Any]]:
            out = quantize(x)
            y, qp = out if isinstance(out, tuple) else (out, None)

            def grad(dy: tf.Tensor, variables: Any = None) -> Any:
                kwargs = dict(zip(_QP_NAMES, qp)) if qp is not None and with_qparams else {}
                g = tf.convert_to_tensor(backward(x, dy, qt, **kwargs), dtype=dy.dtype)
                if variables:
                    return g, [None] * len(variables)  # read-only state (scales, trackers): no gradient
                return g

            return y, grad

        return _op(tensor)
