"""Custom gradients of quantization: :class:`QuantType` and :class:`QuantGrad` (seed 003).

A quantizer's ``quant_grad`` attribute names an ``autograd.Function`` subclass; swapping it
(``self.quant_grad = ClipGrad``) changes the backward of every quantization the quantizer performs.
The forward is the quantizer's own ``quantize_*`` method run without autograd; the backward is
``quant_backward(tensor, grad_output, quant_type)``, which receives the tensor *before* quantization.

The default ``quant_backward`` is the straight-through estimator clipped to the quantization range
(:func:`compressor.core.quant.ste_pass`): gradient passes where ``round(x / scale + zp)`` lies in
``[qmin, qmax]`` and is zero elsewhere. When the quantizer recorded no quantization parameters for the
tensor (a user quantizer that only returns a tensor), it is the plain STE.

``quant_backward`` may also accept the keywords ``scale``, ``zero_point``, ``qmin``, ``qmax`` (or
``**kwargs``) to receive those parameters; seed 003's three-argument form works unchanged.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ...core import quant as cq
from .fakequant import ops

QParams = tuple[torch.Tensor, torch.Tensor, int, int]
_QP_NAMES = ("scale", "zero_point", "qmin", "qmax")


class QuantType(str, enum.Enum):
    """What a quantization applies to. Compares equal to the config's strings (``'weight'`` ...)."""

    QUANT_INPUT = "input"
    QUANT_WEIGHT = "weight"
    QUANT_OUTPUT = "output"
    INPUT = "input"  # short aliases (NNI 2.x spelling)
    WEIGHT = "weight"
    OUTPUT = "output"

    def __str__(self) -> str:
        return self.value

    __hash__ = str.__hash__  # so ``bits[QuantType.QUANT_WEIGHT]`` finds the key 'weight'


def clipped_ste(tensor: torch.Tensor, grad_output: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                qmin: int, qmax: int) -> torch.Tensor:
    """``grad_output`` where ``tensor`` quantizes inside ``[qmin, qmax]``, 0 elsewhere."""
    keep = cq.ste_pass(ops, tensor, scale, zero_point, qmin, qmax)
    return grad_output * keep.to(grad_output.dtype)


class QuantGrad(torch.autograd.Function):
    """Quantization as an autograd function whose backward is :meth:`quant_backward`."""

    @staticmethod
    def quant_backward(tensor: torch.Tensor, grad_output: torch.Tensor, quant_type: QuantType,
                       scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None,
                       qmin: int | None = None, qmax: int | None = None) -> torch.Tensor:
        """Gradient w.r.t. the tensor before quantization. Default: STE clipped to the quantization range."""
        if scale is None:
            return grad_output
        return clipped_ste(tensor, grad_output, scale, zero_point, qmin, qmax)

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, quant_type: QuantType,
                quantize: Callable[[torch.Tensor], tuple[torch.Tensor, QParams | None]]) -> torch.Tensor:
        out, qp = quantize(tensor)
        ctx.quant_type = quant_type if isinstance(quant_type, QuantType) else QuantType(quant_type)
        if qp is None:
            ctx.qrange = None
            ctx.save_for_backward(tensor)
        else:
            scale, zp, qmin, qmax = qp
            ctx.qrange = (qmin, qmax)
            # clones: the quantizer updates its buffers in place on the next forward
            ctx.save_for_backward(tensor, scale.detach().clone(), zp.detach().clone())
        return out

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "backward" not in cls.__dict__:  # a subclass may still write its own backward
            _bind_backward(cls)


def _bind_backward(cls: type[QuantGrad]) -> None:
    """Give ``cls`` a ``backward`` calling ``cls.quant_backward``.

    A staticmethod closing over the class rather than a classmethod: torch.compile (dynamo) traces an
    autograd.Function's backward as a plain ``(ctx, *grads)`` function and cannot bind a classmethod's ``cls``
    (a graph break per quantized tensor). Under compilation, whether ``quant_backward`` takes the quantization
    parameters and whether it is the default one are read from the class as it was defined (dynamo cannot
    trace ``inspect.signature``); eager backwards look them up on every call.
    """
    defined = (_accepts_qparams(cls.quant_backward), cls.quant_backward is getattr(QuantGrad, "quant_backward", None))

    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        fn = cls.quant_backward
        if torch.compiler.is_compiling():
            takes_qparams, default = defined
        else:
            takes_qparams, default = _accepts_qparams(fn), fn is QuantGrad.quant_backward
        saved = ctx.saved_tensors
        kwargs: dict[str, Any] = {}
        if ctx.qrange is not None and takes_qparams:
            kwargs = dict(zip(_QP_NAMES, (saved[1], saved[2], *ctx.qrange)))
        if not default:
            # user code may edit grad_output in place (seed 003's ClipGrad does); autograd may share it
            grad_output = grad_output.clone()
        grad = fn(saved[0], grad_output, ctx.quant_type, **kwargs)
        return grad, None, None

    backward.__qualname__ = f"{cls.__qualname__}.backward"
    cls.backward = staticmethod(backward)


_ACCEPTS: dict[Any, bool] = {}


def _accepts_qparams(fn: Callable[..., Any]) -> bool:
    """Whether a ``quant_backward`` takes the quantization parameters as keywords (cached per function)."""
    hit = _ACCEPTS.get(fn)
    if hit is None:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            params = ()
        names = {p.name for p in params}
        hit = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) or set(_QP_NAMES) <= names
        _ACCEPTS[fn] = hit
    return hit


_bind_backward(QuantGrad)
