"""The integer grid of weight-only quantization (:class:`QuantSpec`), a quantized weight
(:class:`QuantizedWeight`), and the layout the quantizer wrappers keep the codes in (two per byte at 4 bits or
fewer: :func:`store_codes`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import quant as _q
from .arrays import _NP


@dataclass(frozen=True)
class QuantSpec:
    """Weight-only integer grid: ``bits`` (2..8), ``symmetric`` (signed, zero point 0) or affine (unsigned,
    integer zero point), ``group_size`` (None or -1: one group per output row = per channel; else groups of
    that many consecutive input columns, the last one shorter when it does not divide ``in``), ``narrow``
    (symmetric only: ``[-(2^(b-1)-1), 2^(b-1)-1]``, the project's convention; False: ``[-2^(b-1),
    2^(b-1)-1]``, compressed-tensors' symmetric int4)."""

    bits: int
    symmetric: bool = True
    group_size: int | None = None
    narrow: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, np.integer)) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be an int in 2..8 (weight-only: 2, 3, 4 or 8 are the usual), got {self.bits!r}")
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, np.integer)) or (g < 1 and g != -1)):
            raise ValueError(f"group_size must be None or -1 (per output channel) or a positive int, got {g!r}")

    @property
    def qrange(self) -> tuple[int, int]:
        """``(qmin, qmax)`` of the codes."""
        if self.symmetric:
            return _q.quant_range(self.bits, "int", narrow=self.narrow)
        return _q.quant_range(self.bits, "uint")

    @property
    def code_dtype(self) -> np.dtype:
        """The smallest integer dtype that holds every code: int8 (symmetric) / uint8 (affine); bits <= 8."""
        return np.dtype(np.int8 if self.symmetric else np.uint8)

    def group_width(self, n_in: int) -> int:
        """Columns per group for a weight with ``n_in`` input columns."""
        g = self.group_size
        return n_in if g is None or g == -1 or g >= n_in else int(g)

    def params(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Scale and zero point per row of ``values`` ``[rows, cols]`` from the row's min / max
        (:func:`compressor.core.quant.qparams`, range widened to contain 0)."""
        qmin, qmax = self.qrange
        return self.params_from_range(values.min(axis=1), values.max(axis=1), qmin, qmax)

    def params_from_range(self, rmin: np.ndarray, rmax: np.ndarray, qmin: int, qmax: int) -> tuple[np.ndarray, np.ndarray]:
        scale, zp = _q.qparams(_NP, rmin, rmax, qmin, qmax, symmetric=self.symmetric)
        scale = np.asarray(scale, dtype=np.float64)
        zp = np.asarray(zp, dtype=np.float64)
        if self.symmetric and not self.narrow:
            zp = np.zeros_like(scale)  # the full signed range is centred on 0, not on (qmin + qmax) // 2
        return scale, zp

    def quantize(self, w: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(codes, dequantized)`` of ``w`` on the grid (codes as float64 integers)."""
        qmin, qmax = self.qrange
        codes = np.asarray(_q.quantize(_NP, w, scale, zp, qmin, qmax))
        return codes, np.asarray(_q.dequantize(_NP, codes, scale, zp))


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight-only quantized ``[out, in]`` weight.

    ``codes``: ``[out, in]`` in ``spec.code_dtype`` (int8 symmetric / uint8 affine: 1 byte per weight); ``scale`` / ``zero_point``: float64 ``[out, n_groups]`` (zero points are
    integers; 0 for symmetric); group ``g`` is input columns ``[g * group_size, (g + 1) * group_size)``
    (original column order, also with ``act_order``: no ``g_idx`` needed); ``dequantized``: ``(codes -
    zp) * scale`` per group, float64, exactly the values the algorithm settled on (None where the caller
    asked not to keep them: :func:`awq_quantize`). ``error``: GPTQ's OBS
    proxy loss (0 for RTN). ``perm``: the sweep order (``act_order``) or None.
    """

    codes: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    group_size: int
    spec: QuantSpec
    dequantized: np.ndarray | None
    error: float = 0.0
    perm: np.ndarray | None = None
    dead: np.ndarray | None = field(default=None)

    def group_index(self) -> np.ndarray:
        """Group of each input column, ``j // group_size``."""
        return np.arange(self.codes.shape[1]) // self.group_size


#: codes of this many bits or fewer are kept two per byte by the quantizer wrappers (:func:`store_codes`)
NIBBLE_BITS = 4


def stored_code_width(n_in: int, bits: int) -> int:
    """Bytes per output row of the codes as the wrappers keep them: ``ceil(n_in / 2)`` for ``bits <=`` 4 (two codes
    per byte), ``n_in`` otherwise."""
    return (int(n_in) + 1) // 2 if bits <= NIBBLE_BITS else int(n_in)


def store_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """``[out, in]`` codes (int8 symmetric / uint8 affine) in the wrappers' form: for ``bits <=`` 4 two per byte,
    column ``2k`` in the low nibble and ``2k + 1`` in the high one (an odd last column pairs with 0), in the
    same dtype (a symmetric code's nibble is its two's complement, sign-extended back by
    :func:`stored_codes_to_full`); wider codes as they are. Half the bytes of int4 codes in memory: 17 MiB of a
    34 M-parameter Llama's quantizer state."""
    c = np.asarray(codes)
    if c.ndim != 2 or c.dtype not in (np.int8, np.uint8):
        raise ValueError(f"codes must be a 2-D int8 / uint8 array, got {c.dtype} of shape {c.shape}")
    if bits > NIBBLE_BITS:
        return c
    u = c.view(np.uint8)
    lo = u[:, 0::2]
    hi = np.zeros_like(lo)
    hi[:, :u.shape[1] // 2] = u[:, 1::2]
    return ((lo & 0x0F) | (hi << 4)).view(c.dtype)


def stored_codes_to_full(stored: np.ndarray, bits: int, n_in: int) -> np.ndarray:
    """Inverse of :func:`store_codes`: the ``[out, n_in]`` codes (int8 sign-extended / uint8)."""
    s = np.asarray(stored)
    if bits > NIBBLE_BITS:
        return s
    if s.ndim != 2 or s.shape[1] != stored_code_width(n_in, bits):
        raise ValueError(f"stored {bits}-bit codes for {n_in} input columns must be [out, {stored_code_width(n_in, bits)}], "
                         f"got shape {s.shape}")
    if s.dtype == np.int8:  # arithmetic shifts sign-extend each nibble
        lo, hi = (s << 4) >> 4, s >> 4
    else:
        lo, hi = s & 0x0F, s >> 4
    out = np.empty((s.shape[0], 2 * s.shape[1]), dtype=s.dtype)
    out[:, 0::2], out[:, 1::2] = lo, hi
    return out[:, :n_in]

