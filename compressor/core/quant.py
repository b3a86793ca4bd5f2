"""Quantization math on :class:`~compressor.core.ops.ArrayOps`.

Conventions (design doc): QAT ranges always include 0; signed ints use the narrow range
``[-(2^(b-1)-1), 2^(b-1)-1]`` (int8: [-127, 127]), unsigned ``[0, 2^b - 1]``; LSQ uses the full signed
range ``[-2^(b-1), 2^(b-1)-1]`` as its paper does. Rounding is round-half-to-even everywhere (numpy,
torch and tf agree on it), e.g. the zero point of [-1, 5] at uint8 is ``round(42.5) = 42``.
Scale and zero point are float arrays (0-d per tensor, ``[C]`` per channel).
"""

from __future__ import annotations

import math
from typing import Any

from .ops import Array, ArrayOps

EPS = 1.1920928955078125e-07  # float32 machine epsilon: the smallest scale, for all-zero tensors


def quant_range(bits: int, dtype: str = "int", narrow: bool = True) -> tuple[int, int]:
    """Integer range ``(qmin, qmax)`` of a ``bits``-wide ``dtype`` ('int' or 'uint')."""
    if not isinstance(bits, int) or not 1 <= bits <= 32:
        raise ValueError(f"bits must be an int in 1..32, got {bits!r}")
    if dtype == "uint":
        return 0, 2**bits - 1
    if dtype != "int":
        raise ValueError(f"quant dtype must be 'int' or 'uint', got {dtype!r}")
    if narrow:
        if bits < 2:
            raise ValueError("a signed narrow range needs bits >= 2 (1-bit signed is binarization: use BNN)")
        return -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def parse_scheme(scheme: str) -> tuple[bool, bool]:
    """``'per_channel_symmetric'`` -> ``(per_channel=True, symmetric=True)``."""
    parts = {
        "per_tensor_affine": (False, False),
        "per_tensor_symmetric": (False, True),
        "per_channel_affine": (True, False),
        "per_channel_symmetric": (True, True),
    }
    if scheme not in parts:
        raise ValueError(f"unknown quant_scheme {scheme!r}; allowed: {list(parts)}")
    return parts[scheme]


def minmax(ops: ArrayOps, x: Array, channel_axis: int | None = None) -> tuple[Array, Array]:
    """Min and max of ``x``: over everything, or per channel along ``channel_axis``."""
    if channel_axis is None:
        return ops.min(x), ops.max(x)
    nd = len(ops.shape(x))
    c = channel_axis % nd
    axes = tuple(a for a in range(nd) if a != c)
    return ops.min(x, axis=axes), ops.max(x, axis=axes)


def qparams(ops: ArrayOps, rmin: Array, rmax: Array, qmin: int, qmax: int, symmetric: bool = False) -> tuple[Array, Array]:
    """Scale and zero point for a real range (Jacob et al. 2018), 0 always representable.

    affine: ``scale = (rmax - rmin) / (qmax - qmin)``, ``zp = clip(round(qmin - rmin / scale))``;
    symmetric: ``scale = max(|rmin|, |rmax|) / ((qmax - qmin) / 2)``, ``zp = (qmin + qmax) // 2``
    (0 for signed ints, 127 for uint8).
    """
    rmin = ops.minimum(rmin, 0.0)
    rmax = ops.maximum(rmax, 0.0)
    # Bit-identical on every backend: multiply by a reciprocal rounded once in Python (torch turns
    # division by a scalar into such a multiply anyway, numpy and tf do not), and compute the zero
    # point in float64 so no backend's division rounding can flip round(); rounding is half to even.
    if symmetric:
        bound = ops.maximum(ops.abs(rmin), ops.abs(rmax))
        scale = ops.maximum(bound * (2.0 / (qmax - qmin)), EPS)
        zp = ops.zeros_like(scale) + float((qmin + qmax) // 2)
        return scale, zp
    scale = ops.maximum((rmax - rmin) * (1.0 / (qmax - qmin)), EPS)
    dt = ops.dtype_name(scale)
    zp64 = qmin - ops.cast(rmin, "float64") / ops.cast(scale, "float64")
    zp = ops.cast(ops.clip(ops.round(zp64), qmin, qmax), dt)
    return scale, zp


def channel_view(ops: ArrayOps, v: Array, ndim: int, channel_axis: int) -> Array:
    """Reshape a per-channel vector so it broadcasts against an ``ndim`` array along ``channel_axis``."""
    c = channel_axis % ndim
    shape = [1] * ndim
    shape[c] = -1
    return ops.reshape(v, shape)


def quantize(ops: ArrayOps, x: Array, scale: Array, zero_point: Array, qmin: int, qmax: int) -> Array:
    """Integer codes (as floats): ``clip(round(x / scale + zp), qmin, qmax)``."""
    return ops.clip(ops.round(x / scale + zero_point), qmin, qmax)


def dequantize(ops: ArrayOps, q: Array, scale: Array, zero_point: Array) -> Array:
    return (q - zero_point) * scale


def fake_quantize(ops: ArrayOps, x: Array, scale: Array, zero_point: Array, qmin: int, qmax: int) -> Array:
    """``scale * (clip(round(x / scale + zp), qmin, qmax) - zp)``: forward value of fake quantization."""
    return dequantize(ops, quantize(ops, x, scale, zero_point, qmin, qmax), scale, zero_point)


def ste_pass(ops: ArrayOps, x: Array, scale: Array, zero_point: Array, qmin: int, qmax: int) -> Array:
    """Where the clipped straight-through estimator passes gradient: ``qmin <= round(x/scale + zp) <= qmax``."""
    q = ops.round(x / scale + zero_point)
    return ops.logical_and(ops.less_equal(float(qmin), q), ops.less_equal(q, float(qmax)))


def ema(ops: ArrayOps, old: Array, observed: Array, decay: float = 0.99) -> Array:
    """Exponential moving average ``decay * old + (1 - decay) * observed`` (callers seed it with the first value)."""
    return old * decay + observed * (1.0 - decay)


def dorefa_weight(ops: ArrayOps, w: Array, bits: int) -> Array:
    """DoReFa-Net weights: ``2 * q_k(tanh(w) / (2 * max|tanh w|) + 1/2) - 1`` with ``q_k(x) = round(x n) / n``, ``n = 2^k - 1``."""
    n = float(2**bits - 1)
    t = ops.tanh(w)
    t = t / (2.0 * ops.maximum(ops.max(ops.abs(t)), EPS)) + 0.5
    return 2.0 * (ops.round(t * n) / n) - 1.0


def binarize(ops: ArrayOps, x: Array) -> Array:
    """BNN sign with ``sign(0) = +1`` (Courbariaux/Hubara 2016)."""
    return ops.where(ops.less(x, 0.0), ops.asarray(-1.0, like=x), ops.asarray(1.0, like=x))


def hardtanh_pass(ops: ArrayOps, x: Array) -> Array:
    """Where BNN's hard-tanh STE passes gradient: ``|x| <= 1``."""
    return ops.less_equal(ops.abs(x), 1.0)


def naive_scale(ops: ArrayOps, w: Array, running: Array | None = None) -> Array:
    """NaiveQuantizer: scale = running max of ``max|w| / 127`` (8-bit symmetric)."""
    s = ops.maximum(ops.max(ops.abs(w)) / 127.0, EPS)
    return s if running is None else ops.maximum(running, s)


def lsq_init_scale(ops: ArrayOps, x: Array, qmax: int) -> Array:
    """LSQ (Esser et al. 2020) initial step size ``2 * mean|x| / sqrt(qmax)``."""
    return ops.maximum(2.0 * ops.mean(ops.abs(x)) / math.sqrt(qmax), EPS)


def lsq_grad_scale(numel: int, qmax: int) -> float:
    """LSQ gradient scale ``g = 1 / sqrt(numel * qmax)``."""
    return 1.0 / math.sqrt(max(numel, 1) * qmax)


def scale_gradient(ops: ArrayOps, x: Array, g: float) -> Array:
    """Identity forward (bit-exact), gradient multiplied by ``g``."""
    return ops.stop_gradient(x) + (x - ops.stop_gradient(x)) * g


def round_ste(ops: ArrayOps, x: Array) -> Array:
    """``round`` forward, identity gradient."""
    return ops.stop_gradient(ops.round(x) - x) + x


def lsq_quantize(ops: ArrayOps, x: Array, scale: Array, qmin: int, qmax: int, g: float) -> Array:
    """LSQ fake quantization ``round(clip(x / s, qmin, qmax)) * s`` with the paper's gradients.

    Gradients w.r.t. ``x`` are the clipped STE; w.r.t. ``s`` the LSQ step-size gradient scaled by ``g``.
    Works on any autograd backend through ``ops.stop_gradient``.
    """
    s = scale_gradient(ops, scale, g)
    return round_ste(ops, ops.clip(x / s, qmin, qmax)) * s


def bias_qparams(ops: ArrayOps, input_scale: Array, weight_scale: Array) -> tuple[Array, int, int]:
    """Bias at 32 bits with ``scale = input_scale * weight_scale``, zero point 0 (Jacob et al. 2018)."""
    qmin, qmax = quant_range(32, "int", narrow=True)
    return input_scale * weight_scale, qmin, qmax


def quantized_bytes(numel: int, bits: int) -> int:
    """Storage of ``numel`` values at ``bits`` bits, packed."""
    return (numel * bits + 7) // 8


def describe(scale: Any, zero_point: Any, qmin: int, qmax: int) -> dict[str, Any]:
    """A JSON-friendly record of quantization parameters (host values, for export only)."""
    import numpy as np

    s = np.asarray(scale, dtype=np.float64)
    z = np.asarray(zero_point, dtype=np.float64)
    return {
        "scale": s.tolist(),
        "zero_point": np.rint(z).astype(np.int64).tolist(),
        "qmin": int(qmin),
        "qmax": int(qmax),
    }


def grid_bounds(ops: ArrayOps, scale: Array, zero_point: Array, qmin: int, qmax: int) -> tuple[Array, Array]:
    """Real values of the grid's ends, ``((qmin - zp) * scale, (qmax - zp) * scale)``.

    Fused fake-quant kernels (TF's ``fake_quant_with_min_max_vars``) take these bounds instead of
    scale and zero point; given them, they rebuild this grid (scale up to float rounding).
    """
    return (float(qmin) - zero_point) * scale, (float(qmax) - zero_point) * scale


def fake_quantize_ste(ops: ArrayOps, x: Array, scale: Array, zero_point: Array, qmin: int, qmax: int) -> Array:
    """:func:`fake_quantize` forward with the clipped straight-through gradient (:func:`ste_pass`).

    The generic autograd form, for backends or ranges without a fused fake-quant kernel.
    """
    fq = fake_quantize(ops, x, scale, zero_point, qmin, qmax)
    keep = ops.cast(ste_pass(ops, x, scale, zero_point, qmin, qmax), ops.dtype_name(x))
    return ops.stop_gradient(fq) + (x - ops.stop_gradient(x)) * keep


def dorefa_weight_ste(ops: ArrayOps, w: Array, bits: int) -> Array:
    """:func:`dorefa_weight` whose gradient follows the paper: STE on the rounding only, exact through
    the tanh normalisation (same forward values)."""
    n = float(2**bits - 1)
    t = ops.tanh(w)
    t = t / (2.0 * ops.maximum(ops.max(ops.abs(t)), EPS)) + 0.5
    return 2.0 * (round_ste(ops, t * n) / n) - 1.0
