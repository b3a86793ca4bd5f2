"""Fake quantization on torch tensors: the fused kernels where they fit, core math otherwise.

Scale and zero point always come from :mod:`compressor.core.quant`; this module only picks the
fastest torch implementation of ``scale * (clip(round(x / scale + zp), qmin, qmax) - zp)`` whose
gradient is the clipped straight-through estimator (``core.quant.ste_pass``):

* ``torch.fake_quantize_per_channel_affine`` (float zero points, see :func:`fake_quant`) when
  ``qmin``/``qmax`` fit int32 (everything but 32-bit unsigned) and ``x`` is float32;
* :func:`compressor.core.quant.fake_quantize_ste` (generic autograd) otherwise.

:func:`onnx_qdq` is the export form: ONNX QuantizeLinear/DequantizeLinear exist for 8-bit containers, so
narrower grids use the containing 8-bit type plus a clamp to the grid's real bounds (exactly the same
values); wider ones are exported as elementwise Div/Round/Clip/Mul.
"""

from __future__ import annotations

import torch

from ...core import quant as cq
from ..ops import TorchOps

_I32 = (-(2**31), 2**31 - 1)


class QuantOps(TorchOps):
    """TorchOps whose ``maximum``/``minimum`` with a Python number use ``clamp`` and whose ``asarray`` of a
    number uses ``torch.full``: no host-to-device copy of the number (``torch.as_tensor(0.0, device='cuda')`` is a blocking copy, i.e. a host sync, which
    core's ``qparams`` would otherwise do several times per quantized tensor and step)."""

    def asarray(self, x, like=None, dtype=None):
        if like is not None and dtype is None and isinstance(x, (int, float, bool)):  # a fill, not a host copy
            return torch.full((), x, dtype=like.dtype, device=like.device)
        return super().asarray(x, like=like, dtype=dtype)

    def maximum(self, a, b):
        if not torch.is_tensor(b):
            return torch.clamp(a, min=b)
        if not torch.is_tensor(a):
            return torch.clamp(b, min=a)
        return torch.maximum(a, b)

    def minimum(self, a, b):
        if not torch.is_tensor(b):
            return torch.clamp(a, max=b)
        if not torch.is_tensor(a):
            return torch.clamp(b, max=a)
        return torch.minimum(a, b)


#: the ops instance the quantizers pass to core math
ops = QuantOps()


def observe_minmax(x: torch.Tensor, axis: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of :func:`compressor.core.quant.minmax` (min and max, per channel along ``axis``), read
    in ONE pass with ``torch.aminmax`` where it applies (per tensor; channel axis 0 of a contiguous
    tensor): one kernel instead of two per observed tensor, as torch.ao's observers do."""
    if axis is None:
        return torch.aminmax(x)
    if axis % x.dim() == 0 and x.is_contiguous():
        return torch.aminmax(x.reshape(x.shape[0], -1), dim=1)
    return cq.minmax(ops, x, axis)


def fits_fused(qmin: int, qmax: int) -> bool:
    """Whether torch's fused fake-quant kernels accept the integer range ``[qmin, qmax]``."""
    return _I32[0] <= qmin and qmax <= _I32[1]


def fake_quant(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int,
               axis: int | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` (per tensor, or per channel along ``axis``) with the clipped STE gradient.

    Uses ``torch.fake_quantize_per_channel_affine`` with FLOAT zero points for both cases (a per-tensor
    scale is expanded along axis 0): that kernel computes ``round(x / scale + zp)`` exactly as core does
    (the per-tensor kernel and integer zero points compute ``round(x / scale) + zp``, which breaks ties
    differently for odd zero points), and with float zero points it does not read them on the host
    (integer ones are range-checked with ``.item()``: a device sync per call).
    """
    if fits_fused(qmin, qmax) and x.dtype == torch.float32 and x.dim() > 0:
        if axis is None:
            n = x.shape[0]
            return torch.fake_quantize_per_channel_affine(
                x, scale.reshape(1).expand(n), zero_point.reshape(1).expand(n), 0, qmin, qmax)
        return torch.fake_quantize_per_channel_affine(x, scale, zero_point, axis % x.dim(), qmin, qmax)
    if axis is not None:
        scale = cq.channel_view(ops, scale, x.dim(), axis)
        zero_point = cq.channel_view(ops, zero_point, x.dim(), axis)
    return cq.fake_quantize_ste(ops, x, scale.to(x.dtype), zero_point.to(x.dtype), qmin, qmax)


def _container(qmin: int, qmax: int) -> tuple[int, int] | None:
    if 0 <= qmin and qmax <= 255:
        return 0, 255
    if -128 <= qmin and qmax <= 127:
        return -128, 127
    return None


def onnx_qdq(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int,
             axis: int | None = None) -> torch.Tensor:
    """Fake quantization written so ``torch.onnx.export`` emits QuantizeLinear/DequantizeLinear nodes.

    ``scale``/``zero_point`` are float tensors (made constants by the caller before tracing). A grid
    narrower than its 8-bit container adds a clamp to the grid's real bounds (computed here, outside
    the traced ops' data flow, from constants).
    """
    if axis is not None:
        axis = axis % x.dim()
    box = _container(qmin, qmax)
    if box is not None and torch.compiler.is_exporting():
        return _decomposed_qdq(x, scale, zero_point, qmin, qmax, axis, box)
    if not torch.is_tensor(scale):  # host numbers of a per-tensor grid (see _decomposed_qdq)
        scale = torch.tensor(float(scale), dtype=torch.float32, device=x.device)
        zero_point = torch.tensor(float(zero_point), dtype=torch.float32, device=x.device)
    if box is None:
        if axis is not None:
            scale = cq.channel_view(ops, scale, x.dim(), axis)
            zero_point = cq.channel_view(ops, zero_point, x.dim(), axis)
        return cq.fake_quantize(ops, x, scale, zero_point, qmin, qmax)
    zp = zero_point.round().to(torch.int32)
    if axis is None:
        y = torch.fake_quantize_per_tensor_affine(x, scale, zp, box[0], box[1])
    else:
        y = torch.fake_quantize_per_channel_affine(x, scale, zp, axis, box[0], box[1])
    if (qmin, qmax) != box:
        with torch.no_grad():
            lo, hi = cq.grid_bounds(ops, scale, zero_point, qmin, qmax)
        if axis is not None:
            lo = cq.channel_view(ops, lo, x.dim(), axis)
            hi = cq.channel_view(ops, hi, x.dim(), axis)
        y = torch.clamp(y, lo, hi)
    return y


def _decomposed_qdq(x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | float, qmin: int,
                    qmax: int, axis: int | None, box: tuple[int, int]) -> torch.Tensor:
    """:func:`onnx_qdq` under ``torch.export`` (the dynamo ONNX exporter): ``quantized_decomposed`` quantize /
    dequantize ops, which have shape functions (``torch.fake_quantize_*`` have none, so a graph with them could
    only be traced on fixed shapes) and which the exporter writes as QuantizeLinear -> DequantizeLinear (plus a
    Clip for a grid narrower than its container). A per-tensor scale given as a Python number is a per-tensor
    pair; given as a tensor (its value is unknown while tracing) it is repeated along the last axis, a
    per-axis pair with the same values."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers torch.ops.quantized_decomposed

    qd = torch.ops.quantized_decomposed
    dtype = torch.uint8 if box[0] == 0 else torch.int8
    if axis is None and not torch.is_tensor(scale):
        s_, z_ = float(scale), int(round(float(zero_point)))
        q = qd.quantize_per_tensor(x, s_, z_, qmin, qmax, dtype)
        y = qd.dequantize_per_tensor(q, s_, z_, qmin, qmax, dtype, out_dtype=x.dtype)
        # the exporter's per-tensor QuantizeLinear saturates to the container only: clamp to a narrower grid
        return y if (qmin, qmax) == box else torch.clamp(y, (qmin - z_) * s_, (qmax - z_) * s_)
    s = torch.as_tensor(scale).detach().to(torch.float32)
    zp = torch.as_tensor(zero_point).detach().round().to(torch.int64)
    if axis is None:
        axis = x.dim() - 1
        s, zp = s.reshape(1).expand(x.shape[axis]), zp.reshape(1).expand(x.shape[axis])
    q = qd.quantize_per_channel(x, s, zp, axis, qmin, qmax, dtype)
    return qd.dequantize_per_channel(q, s, zp, axis, qmin, qmax, dtype, out_dtype=x.dtype)
