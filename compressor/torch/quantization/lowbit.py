"""Packed low-bit weights computing with PyTorch's own CPU kernels.

:class:`PackedLinear` replaces a weight-only quantized ``nn.Linear`` (or HF GPT-2 ``Conv1D``, whose weight is
stored ``[in, out]``: the codes are canonical ``[out, in]``, so both become the same module) and holds its
integer codes instead of a float weight:

* ``bits <= 4``: two codes per byte, run by ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the layout of
  ``_convert_weight_to_int4pack_for_cpu`` (0.5 byte per weight resident). The kernel computes
  ``x @ ((q - 8) * scale + zero)^T`` per group of ``kg`` input columns, ``q`` in ``0..15``, ``kg`` in {32, 64,
  128, 256} dividing ``in``, ``out`` a multiple of 16, ``x`` / scales / zeros of one float dtype. Our codes
  ``c`` dequantize as ``(c - zp) * s``; they are stored as ``u = c + 8`` (signed) or ``u = c`` (unsigned), so
  the kernel's ``zero = (8 - off - zp) * s`` (``off`` = 8 signed, 0 unsigned): 0 for symmetric codes, narrow
  (``[-7, 7]``) or full (``[-8, 7]``). A group of ours wider than ``kg`` repeats its scale (per channel: one
  scale repeated over ``in / kg`` kernel groups); ``out`` is padded to a multiple of 16 with zero rows.
* ``bits 5..8`` per output channel: ``torch.ops.aten._weight_int8pack_mm`` (``x @ (v * s)^T``, ``v`` int8).
  Unsigned codes are stored ``v = c - 128`` and the zero point enters as ``s * (128 - zp) * sum(x)``.
* anything else (grouped 5..8-bit codes, an ``in`` no kernel group divides, a non-CPU device): the reference
  path, dequantize + matmul, with a warning naming the layer and why.

``activation='dynamic'`` (per-channel signed codes of up to 8 bits): int8 activations quantized on the fly
per token (one scale per input row, as llmcompressor's W8A8 dynamic scheme) times int8 weights with
``torch.ops.quantized.linear_dynamic`` (fbgemm / x86 engine; ``torch._int_mm`` has no fast CPU kernel in torch
2.13, it is slower than float32). That kernel takes one activation scale per call, so each row is divided by
its own ``m = max|x_row|`` first and the output row multiplied by ``m`` (exact: the layer is linear in ``x``):
row ``r`` is quantized with step ``m_r * s`` (``s`` the kernel's 7-bit unsigned step of the normalized rows,
``reduce_range`` as the x86 kernel needs without VNNI, ``s <= 2 / 127``), so its error is at most ``m_r / 127``
per element whatever the other rows hold (with one scale per tensor an outlier token set every token's).
Outputs are within about 2 % (of max|y|) of the weight-only result: the activations are rounded too. Its packed weight is a TorchScript object: ``torch.compile`` runs it in a graph
break (``fullgraph=True`` refuses it).

The path follows the number of input rows M (tokens): the weight-only kernels up to :data:`DEQUANT_ROWS`
(decode), then the weight dequantized from the kernel's own resident form, in ``compute_dtype``, and the float
matmul (prefill), one layer's weight at a time (``dequant_rows`` per module; None: the kernel always). Measured
against a bf16 ``nn.Linear`` (2048 x 2048, one thread, ``benchmarks/lowbit_torch.py``): int4 g128 0.45x at M = 1,
0.8x at M = 4, 1.4-2.2x from 16 to 64 rows (the kernel is compute-bound), 1.7x at 128, 1.2-1.4x at 256-512 (the
dequantization costs a bf16 matmul of ~64 rows); int8 0.55x at M = 1, 1.1-1.8x above. So packed int4 saves memory
and decode time, not prefill time, on PyTorch's CPU kernels. The int4 unpacking knows the kernel's 64-row block
layout (checked once per width; other layouts keep the kernel). Both kernels are fast only in 16 bits: with
``float32`` activations the int4 kernel runs a scalar loop (8x the float32 ``Linear`` at one row, ~100x at 128
rows), so float32 int4 always dequantizes (6x sgemm at one row, 2-3x at 16-32, 1.1-1.4x at 128-512).
``compute_dtype`` is ``torch.bfloat16`` by default (torchao's choice; outputs within bf16 rounding of the
fake-quant model); ``torch.float32`` gives outputs equal to the fake-quant model's to float32 rounding.

AWQ: the codes quantize ``W * s`` (``s`` per input column), so the layer computes ``(x / s) @ Q(W s)^T``,
an elementwise divide of the input (``awq_scales`` kept per layer; folding ``1/s`` into the previous
LayerNorm, as AWQ's deployment does, needs the graph and is wrong when that norm feeds layers with other
scales).

State dict (portable, independent of the kernel's CPU-specific layout): ``qweight`` (uint8 ``[out,
ceil(in/2)]``, two codes per byte, the even column in the low nibble, stored ``u``; int8 / uint8 ``[out, in]``
codes for 5..8 bits), ``scale`` (float32 ``[out, groups]``), ``zero_point`` (int32 ``[out, groups]``, in the
codes' domain, 0 when symmetric), ``bias``, ``awq_scales`` and the format in ``_extra_state``. The kernel
layout is rebuilt on load and converted back on save (the canonical codes are not kept resident).

:func:`pack_weights` replaces every calibrated weight-only wrapper of a model in place.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from ...core.errors import ModelError
from ...core.interrupts import deferred_interrupts
from ...core.oneshot import stored_codes_to_full
from ..layout import canonical_shape, in_out_features, to_canonical
from ..modules import innermost_module, named_wrappers
from .grad import QuantType
from .wrapper import QuantizerModuleWrapper

__all__ = ["PackedLinear", "PackedExperts", "pack_weights", "oneshot_codes", "INT4_KERNEL_GROUPS", "DEQUANT_ROWS"]


def oneshot_codes(wrapper: nn.Module) -> torch.Tensor:
    """The ``[out, in]`` integer codes (int8 symmetric / uint8 affine, one per entry, on the buffer's device) of a
    layer quantized by :class:`GptqQuantizer` / :class:`RtnQuantizer` / :class:`AwqQuantizer`; its
    ``weight_codes`` buffer keeps codes of 4 bits or fewer two per byte. A wrapper of another quantizer, or one
    not calibrated yet, is a ModelError."""
    bufs = getattr(wrapper, "_buffers", {})
    if "weight_codes" not in bufs or "oneshot_calibrated" not in bufs:
        raise ModelError(f"oneshot_codes: {getattr(wrapper, 'name', type(wrapper).__name__)!r} holds no integer codes "
                         f"(only GptqQuantizer / RtnQuantizer / AwqQuantizer wrappers keep them)")
    if not bool(bufs["oneshot_calibrated"]):
        raise ModelError(f"oneshot_codes: layer {wrapper.name!r} is not calibrated yet; run quantizer.calibrate(...) "
                         f"first")
    stored = bufs["weight_codes"]
    bits = int(wrapper.quant_bits["weight"])
    n_in = int(canonical_shape(wrapper.layer, wrapper.layer.weight.shape)[1])
    full = stored_codes_to_full(stored.detach().cpu().numpy(), bits, n_in)
    return torch.from_numpy(full.copy()).to(stored.device)

#: the row scale of an all-zero input row under ``activation='dynamic'`` (any positive value: the row stays 0)
_TINY = float(torch.finfo(torch.float32).tiny)
#: group sizes ``_weight_int4pack_mm_for_cpu`` accepts (torch 2.13)
INT4_KERNEL_GROUPS = (256, 128, 64, 32)
_INT4_N_MULTIPLE = 16
#: ``_weight_int8pack_mm`` reads the input in chunks of 16 columns: with more than one input row and an
#: in_features that is not a multiple of 16 it crashes (segfault) on AVX-512 CPUs in bf16 (torch 2.13, found in
#: CI); the kernel's weight gets zero columns up to a multiple of 16 and the input is padded with zeros
_INT8_K_MULTIPLE = 16


#: rows of input (tokens) from which a weight-only layer dequantizes its weight and runs the float matmul instead
#: of its packed kernel, per (kernel, compute dtype). The kernels dequantize per tile and are compute-bound: in
#: 16 bits 1.4-2.7x slower than a bf16 matmul from 16 rows on; a full dequantization of the resident form (int4:
#: one byte transpose, three int8 passes, one ``addcmul``; int8: one multiply) costs about one bf16 matmul of
#: ~64 rows for int4 and of ~32 rows for int8. In float32 the int4 kernel runs a scalar loop (8x sgemm at one row,
#: ~100x at 128): the dequantized weight and sgemm win at every M; the int8 kernel ties with it at one row.
#: Crossovers measured by benchmarks/lowbit_torch.py (``sweep_table``).
DEQUANT_ROWS: dict[tuple[str, torch.dtype], int] = {
    ("int4", torch.bfloat16): 128, ("int4", torch.float16): 128, ("int4", torch.float32): 1,
    ("int8", torch.bfloat16): 32, ("int8", torch.float16): 32, ("int8", torch.float32): 4}
#: kernel row blocks whose layout :func:`_int4_block_layout` recognises (rows of the weight per block)
_INT4_BLOCK_N = 64
#: ``n -> bool``: whether ``_convert_weight_to_int4pack_for_cpu`` lays out an ``[n, k]`` weight in row blocks of 64
_BLOCK_LAYOUT: dict[int, bool] = {}


def _int4_block_layout(n: int) -> bool:
    """Whether this torch build packs an ``[n, k]`` int4 weight as ``[n / 64, k, 32]`` bytes, the low nibble of
    byte ``(b, j, i)`` holding row ``64 b + i`` and the high nibble row ``64 b + 32 + i`` of column ``j`` (the
    AVX-512 layout for n a multiple of 64). Checked once per ``n`` on an ``[n, 64]`` probe (the layout does not
    depend on k), so a build that packs otherwise runs the kernel at every size."""
    known = _BLOCK_LAYOUT.get(n)
    if known is not None:
        return known
    ok = False
    if n % _INT4_BLOCK_N == 0:
        k = 64
        src = _int4_kernel_source(n, k)
        idx = torch.arange(n * k // 2)
        half = _INT4_BLOCK_N // 2
        b, rem = idx // (k * half), idx % (k * half)
        col, i = rem // half, rem % half
        lo, hi = src[0::2], src[1::2]
        ok = bool(torch.equal(lo, (b * _INT4_BLOCK_N + i) * k + col)
                  and torch.equal(hi, (b * _INT4_BLOCK_N + half + i) * k + col))
    _BLOCK_LAYOUT[n] = ok
    return ok


def _int4_kernel_group(group_width: int, n_in: int) -> int | None:
    g = math.gcd(group_width, n_in)
    return next((k for k in INT4_KERNEL_GROUPS if g % k == 0), None)


def _pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """``[n, k]`` values 0..15 -> uint8 ``[n, ceil(k/2)]``, the even column in the low nibble."""
    u = u.to(torch.uint8)
    if u.shape[1] % 2:
        u = torch.cat([u, u.new_zeros(u.shape[0], 1)], 1)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _unpack_nibbles(p: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`_pack_nibbles` (uint8 ``[n, k]``)."""
    return torch.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1)[:, :k]


def _int4_kernel_source(n: int, k: int) -> torch.Tensor:
    """For the kernel layout of an ``[n, k]`` weight: which canonical element (flat index) each of its nibbles
    holds (low nibble first). Found by packing the index's base-16 digits, so it follows whatever layout this
    build of torch uses (the CPU packing depends on the instruction set)."""
    idx = torch.arange(n * k, dtype=torch.int64)
    src = torch.zeros(n * k, dtype=torch.int64)
    for d in range(max(1, math.ceil(math.log(n * k, 16)))):
        probe = ((idx >> (4 * d)) & 15).to(torch.int32).reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
        src |= torch.stack([packed & 15, packed >> 4], -1).reshape(-1).to(torch.int64) << (4 * d)
    return src


class PackedLinear(nn.Module):
    """A weight-only quantized Linear holding packed integer codes (see the module docstring).

    ``bits`` 2..8, ``group_size`` (None / -1: per output channel), ``signed`` (signed codes: symmetric, zero point 0, or
    QAT's signed affine; else unsigned codes with integer zero points), ``awq`` (an ``awq_scales`` input divisor), ``compute_dtype``
    (``torch.bfloat16`` (fast) or ``torch.float32`` / ``torch.float16``), ``name`` (for warnings), ``source``
    (the replaced layer's type, e.g. ``'Linear'`` / ``'Conv1D'``; the computation is the same). A fresh module
    holds zero codes: fill it with :meth:`from_codes` or ``load_state_dict``. ``kernel`` says what runs:
    ``'int4'``, ``'int8'``, ``'int8-dynamic'`` or ``'reference'`` (and ``kernel_note`` why).
    """

    def __init__(self, in_features: int, out_features: int, bits: int = 4, group_size: int | None = None,
                 signed: bool = True, bias: bool = True, awq: bool = False, *,
                 compute_dtype: torch.dtype = torch.bfloat16, name: str = "", source: str = "Linear",
                 activation: str | None = None, device: Any = None) -> None:
        super().__init__()
        if not 2 <= int(bits) <= 8:
            raise ValueError(f"PackedLinear {name!r}: bits must be in 2..8, got {bits!r}")
        if compute_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"PackedLinear {name!r}: compute_dtype must be torch.bfloat16, torch.float16 or "
                             f"torch.float32, got {compute_dtype}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.bits, self.signed, self.name, self.source = int(bits), bool(signed), name, source
        gw = self.in_features if group_size is None or group_size == -1 or group_size >= in_features else int(group_size)
        self.group_size = gw
        self.n_groups = math.ceil(self.in_features / gw)
        self.compute_dtype = compute_dtype
        if activation not in (None, "dynamic"):
            raise ValueError(f"PackedLinear {name!r}: activation must be None (weight-only) or 'dynamic' (int8 "
                             f"activations), got {activation!r}")
        if activation == "dynamic" and (self.n_groups != 1 or not signed):
            raise ValueError(f"PackedLinear {name!r}: activation='dynamic' needs signed (symmetric) codes with one "
                             f"scale per output channel (the int8 x int8 kernel), got "
                             f"{'signed' if signed else 'unsigned'} codes with {self.n_groups} group(s)")
        self.activation = activation
        dev = torch.device("cpu") if device is None else torch.device(device)
        self.register_buffer("scale", torch.zeros(self.out_features, self.n_groups, device=dev))
        self.register_buffer("zero_point", torch.zeros(self.out_features, self.n_groups, dtype=torch.int32, device=dev))
        self.bias = nn.Parameter(torch.zeros(self.out_features, device=dev), requires_grad=False) if bias else None
        if awq:
            self.register_buffer("awq_scales", torch.ones(self.in_features, device=dev))
        else:
            self.awq_scales = None
        #: input rows (tokens) from which the weight-only kernels' weight is dequantized for a float matmul (see
        #: :data:`DEQUANT_ROWS`); None: always the kernel. Settable per module.
        self._deq_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kernel, self.kernel_note, self._kg = self._plan(dev)
        self.dequant_rows: int | None = DEQUANT_ROWS.get((self.kernel, compute_dtype))
        if self.kernel == "reference":
            warnings.warn(f"PackedLinear {name!r} ({source}, {self.in_features} -> {self.out_features}, {bits}-bit, "
                          f"group {gw}): {self.kernel_note}; it runs the reference path (dequantize + matmul, "
                          f"slower than the float layer)", UserWarning, stacklevel=2)
        self._set_codes(torch.zeros(self.out_features, self.in_features, dtype=torch.int32, device=dev))

    # ------------------------------------------------------------------ format
    @property
    def qrange(self) -> tuple[int, int]:
        b = self.bits
        return (-(2 ** (b - 1)), 2 ** (b - 1) - 1) if self.signed else (0, 2**b - 1)

    def _plan(self, dev: torch.device) -> tuple[str, str, int]:
        if dev.type != "cpu":
            if self.activation == "dynamic":
                raise ValueError(f"PackedLinear {self.name!r}: activation='dynamic' is a CPU kernel (device {dev})")
            return "reference", f"the int4 / int8 packed kernels are CPU kernels (device {dev})", 0
        if self.activation == "dynamic":
            return "int8-dynamic", f"int8 x int8 ({torch.backends.quantized.engine} engine, 7-bit activations)", 0
        if self.bits <= 4:
            kg = _int4_kernel_group(self.group_size, self.in_features)
            if kg is not None:
                pad = -self.out_features % _INT4_N_MULTIPLE
                return "int4", f"kernel groups of {kg}" + (f", out padded by {pad} rows" if pad else ""), kg
            if self.n_groups == 1:
                return "int8", ("int4 codes on the int8 kernel (1 byte per weight): no int4 kernel group "
                                f"{INT4_KERNEL_GROUPS} divides in_features={self.in_features}"), 0
            return "reference", (f"no int4 kernel: the kernel's group sizes are {INT4_KERNEL_GROUPS} and must divide "
                                 f"both the group size {self.group_size} and in_features {self.in_features}"), 0
        if self.n_groups == 1:
            return "int8", "per-channel int8 kernel", 0
        return "reference", (f"{self.bits}-bit codes with groups of {self.group_size}: the int8 kernel takes one "
                             f"scale per output channel"), 0

    def get_extra_state(self) -> dict[str, Any]:
        return {"format": "compressor.packed/1", "in_features": self.in_features, "out_features": self.out_features,
                "bits": self.bits, "group_size": self.group_size, "signed": self.signed}

    def set_extra_state(self, state: Any) -> None:
        mine = self.get_extra_state()
        if not isinstance(state, dict) or state != mine:
            raise ValueError(f"PackedLinear {self.name!r}: the state_dict was saved from a PackedLinear with format "
                             f"{state!r}; this module is {mine}; build it with the same arguments")

    # ------------------------------------------------------------------ codes <-> kernel state
    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, bits: int,
                   group_size: int | None = None, bias: torch.Tensor | None = None,
                   awq_scales: torch.Tensor | None = None, **kwargs: Any) -> PackedLinear:
        """A PackedLinear from integer ``codes`` ``[out, in]`` (int8: signed, symmetric; uint8: unsigned,
        affine; other integer dtypes: signed when any code is negative), ``scale`` / ``zero_point`` ``[out,
        groups]`` (group ``g`` = input columns ``[g * group_size, (g + 1) * group_size)``)."""
        n_out, n_in = codes.shape
        if codes.dtype == torch.uint8:
            signed = False
        elif codes.dtype == torch.int8:
            signed = True
        else:
            signed = bool((codes < 0).any())
        kwargs.setdefault("signed", signed)
        m = cls(n_in, n_out, bits, group_size, bias=bias is not None, awq=awq_scales is not None,
                device=codes.device, **kwargs)
        if tuple(scale.shape) != (n_out, m.n_groups) or tuple(zero_point.shape) != (n_out, m.n_groups):
            raise ValueError(f"PackedLinear {m.name!r}: scale / zero_point must be [{n_out}, {m.n_groups}], got "
                             f"{tuple(scale.shape)} / {tuple(zero_point.shape)}")
        with torch.no_grad():
            m.scale.copy_(scale)
            m.zero_point.copy_(zero_point.round().to(torch.int32) if zero_point.is_floating_point() else zero_point)
            if bias is not None:
                m.bias.copy_(bias.detach().reshape(-1))
            if awq_scales is not None:
                m.awq_scales.copy_(awq_scales.detach().reshape(-1))
        m._set_codes(codes.to(torch.int32))
        return m

    def _set_codes(self, c: torch.Tensor) -> None:
        """Build the resident (kernel) form from int32 codes ``[out, in]`` and the current scale / zero point."""
        qmin, qmax = self.qrange
        if c.numel() and (int(c.min()) < qmin or int(c.max()) > qmax):
            raise ValueError(f"PackedLinear {self.name!r}: codes outside the {self.bits}-bit "
                             f"{'signed' if self.signed else 'unsigned'} range [{qmin}, {qmax}]")
        n, k = self.out_features, self.in_features
        self._packed = None
        self._deq_scales = None
        if self.kernel == "int8-dynamic":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # quantized tensor creation is deprecated; its kernel is not replaced
                qw = torch._make_per_channel_quantized_tensor(c.to(torch.int8), self.scale[:, 0].double(),
                                                              torch.zeros(n, dtype=torch.long), 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, None)
            self._wq = self._sz = self._corr = None
        elif self.kernel == "int4":
            off = 8 if self.signed else 0
            u = c + off
            kg = self._kg
            n_pad = n + (-n % _INT4_N_MULTIPLE)
            sc = self.scale[:, (torch.arange(k // kg, device=c.device) * kg) // self.group_size]  # [n, k/kg]
            zp = self.zero_point[:, (torch.arange(k // kg, device=c.device) * kg) // self.group_size]
            zero = (8 - off - zp).to(torch.float64) * sc.to(torch.float64)
            if n_pad != n:
                u = torch.cat([u, u.new_full((n_pad - n, k), 8)])
                sc = torch.cat([sc, sc.new_zeros(n_pad - n, sc.shape[1])])
                zero = torch.cat([zero, zero.new_zeros(n_pad - n, zero.shape[1])])
            self._wq = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32).contiguous(), 1)
            self._sz = torch.stack([sc.t(), zero.t()], -1).to(self.compute_dtype).contiguous()
            self._corr = None
            if _int4_block_layout(n_pad):  # the kernel's [groups, n, (scale, zero)] as [groups, 1, n]
                self._deq_scales = (self._sz[..., 0].unsqueeze(1).contiguous(),
                                    self._sz[..., 1].unsqueeze(1).contiguous())
        elif self.kernel == "int8":
            off = 0 if self.signed else 128
            wq = (c - off).to(torch.int8)
            kpad = -k % _INT8_K_MULTIPLE
            if kpad:  # zero columns; forward pads the input with zeros to match
                wq = torch.cat([wq, wq.new_zeros(n, kpad)], 1)
            self._wq = wq.contiguous()
            s = self.scale[:, 0]
            self._sz = s.to(self.compute_dtype).contiguous()
            corr = s.to(torch.float64) * (off - self.zero_point[:, 0]).to(torch.float64)
            self._corr = corr.to(self.compute_dtype) if bool((corr != 0).any()) else None
        else:
            if self.bits <= 4:  # reference: the canonical codes, nibble-packed when they fit
                self._wq = _pack_nibbles(c + (8 if self.signed else 0))
            else:
                self._wq = c.to(torch.int8 if self.signed else torch.uint8)
            self._sz = None
            self._corr = None

    def codes(self) -> torch.Tensor:
        """The integer codes ``[out, in]`` (int32), read back from the resident form."""
        n, k = self.out_features, self.in_features
        if self.kernel == "int8-dynamic":
            return torch.ops.quantized.linear_unpack(self._packed)[0].int_repr().to(torch.int32)
        if self.kernel == "int4":
            wq = self._wq.cpu()
            n_pad = wq.shape[0]
            nib = torch.stack([wq & 15, wq >> 4], -1).reshape(-1)
            flat = torch.empty(n_pad * k, dtype=torch.uint8)
            flat[_int4_kernel_source(n_pad, k)] = nib
            u = flat.reshape(n_pad, k)[:n].to(torch.int32).to(self._wq.device)
            return u - (8 if self.signed else 0)
        if self.kernel == "int8":
            return self._wq[:, :k].to(torch.int32) + (0 if self.signed else 128)
        if self.bits <= 4:
            return _unpack_nibbles(self._wq, k).to(torch.int32) - (8 if self.signed else 0)
        return self._wq.to(torch.int32)

    def packed_codes(self) -> torch.Tensor:
        """``qweight`` as saved in the state_dict (see the module docstring)."""
        c = self.codes()
        if self.bits <= 4:
            return _pack_nibbles(c + (8 if self.signed else 0))
        return c.to(torch.int8 if self.signed else torch.uint8)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(codes - zero_point) * scale`` per group, ``[out, in]`` (AWQ: of ``W * s``, not divided by ``s``)."""
        gi = torch.arange(self.in_features, device=self.scale.device) // self.group_size
        c = self.codes()
        return ((c - self.zero_point[:, gi]).to(dtype) * self.scale[:, gi].to(dtype))

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "qweight"] = self.packed_codes()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        key = prefix + "qweight"
        q = state_dict.get(key)
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if q is None:
            missing_keys.append(key)
            return
        want = self.packed_codes_shape()
        want_dtype = torch.uint8 if self.bits <= 4 or not self.signed else torch.int8
        if tuple(q.shape) != want or q.dtype != want_dtype:
            error_msgs.append(f"size or dtype mismatch for {key}: checkpoint {tuple(q.shape)} {q.dtype}, this "
                              f"PackedLinear expects {want} {want_dtype}")
            return
        q = q.to(self.scale.device)
        c = (_unpack_nibbles(q, self.in_features).to(torch.int32) - (8 if self.signed else 0) if self.bits <= 4
             else q.to(torch.int32))
        try:
            with torch.no_grad():
                self._set_codes(c)
        except ValueError as e:
            error_msgs.append(str(e))

    def packed_codes_shape(self) -> tuple[int, int]:
        k = self.in_features
        return (self.out_features, (k + 1) // 2) if self.bits <= 4 else (self.out_features, k)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.awq_scales is not None:
            x2 = x2 / self.awq_scales.to(x2.dtype)
        if self.kernel == "reference":
            w = self.dequantized_weight(torch.float32)
            y = torch.nn.functional.linear(x2.to(torch.float32), w).to(x.dtype)
        else:
            if x2.device.type != "cpu":
                raise RuntimeError(f"PackedLinear {self.name!r}: its {self.kernel} kernel layout is for CPU, the "
                                   f"input is on {x2.device}; pack the model on the device it runs on")
            xin = x2.to(self.compute_dtype).contiguous()
            if self.kernel == "int8-dynamic":  # per token: each row divided by its max |x|, multiplied back
                xf = x2.to(torch.float32)
                m = torch.clamp(xf.abs().amax(-1, keepdim=True), min=_TINY)
                y = torch.ops.quantized.linear_dynamic((xf / m).contiguous(), self._packed, True) * m
            elif self._dequantizes(xin.shape[0]):  # many rows: dequantize once, then the float matmul
                y = torch.nn.functional.linear(xin, self._kernel_weight())
            elif self.kernel == "int4":
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(xin, self._wq, self._kg, self._sz)
                if y.shape[1] != self.out_features:
                    y = y[:, : self.out_features]
            else:
                if self._wq.shape[1] != self.in_features:
                    xin = torch.nn.functional.pad(xin, (0, self._wq.shape[1] - self.in_features))
                y = torch.ops.aten._weight_int8pack_mm(xin, self._wq, self._sz)
                if self._corr is not None:
                    y = y + xin.sum(-1, keepdim=True) * self._corr
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _dequantizes(self, rows: int) -> bool:
        """Whether ``rows`` input rows run the dequantize + float matmul path (see :data:`DEQUANT_ROWS`)."""
        if self.dequant_rows is None or rows < self.dequant_rows or self.kernel not in ("int4", "int8"):
            return False
        return self.kernel == "int8" or self._deq_scales is not None  # int4: a kernel layout it can unpack

    def _kernel_weight(self) -> torch.Tensor:
        """The weight ``[out, in]`` in ``compute_dtype`` as the kernel computes it, from the resident kernel form:
        int4 ``(u - 8) * s + zero`` per kernel group, int8 ``v * s`` (+ the unsigned codes' correction).
        Transient: one layer's weight at a time. Int4 is built as ``[in, out]`` and returned transposed (a view;
        ``linear`` runs it as ``x @ W^T`` without a copy): the kernel's block layout, bytes ``[block, in, 32]``
        whose low / high nibbles hold rows ``64 b + i`` / ``64 b + 32 + i``, becomes ``[in, block, 32]`` with
        one byte copy, and ``u - 8`` is the signed nibble of ``u ^ 8`` (sign-extended by shifting the int8 byte),
        so the dequantization is three passes over int8 bytes and one ``addcmul`` that reads them as integers
        (measured 3x faster than unpacking in the compute dtype and transposing the weight)."""
        n, k = self.out_features, self.in_features
        if self.kernel == "int8":
            v = self._wq[:, :k] if self._wq.shape[1] != k else self._wq
            if self._corr is None:
                return torch.mul(v, self._sz[:, None])
            return torch.addcmul(self._corr[:, None], v, self._sz[:, None])
        n_pad, kg = self._wq.shape[0], self._kg
        nb, half = n_pad // _INT4_BLOCK_N, _INT4_BLOCK_N // 2
        scale, zero = self._deq_scales
        q = (self._wq.view(nb, k, half).transpose(0, 1) ^ 0x88).view(torch.int8)  # [in, block, 32]
        u = torch.stack(((q << 4) >> 4, q >> 4), dim=2)  # [in, block, (low, high), 32]: u - 8 per nibble
        w_t = torch.addcmul(zero, u.view(k // kg, kg, n_pad), scale).view(k, n_pad)
        return (w_t if n_pad == n else w_t[:, :n]).t()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, signed={self.signed}, kernel={self.kernel!r}, "
                f"compute_dtype={self.compute_dtype}, source={self.source!r}")

    def resident_bytes(self) -> int:
        """Bytes of the tensors this module keeps (codes in the kernel's form, scales, zero points, bias)."""
        ts = [self._wq, self._sz, self._corr, self.scale, self.zero_point, self.bias, self.awq_scales,
              *(self._deq_scales or ())]
        packed = self.in_features * self.out_features if self._packed is not None else 0  # fbgemm: 1 byte / weight
        return packed + sum(t.numel() * t.element_size() for t in ts if t is not None)


# ---------------------------------------------------------------------------------------------- pack_weights
def _packable(name: str, wrapper: QuantizerModuleWrapper) -> tuple[str, Any]:
    """``(kind, problem)``: kind 'oneshot' / 'qat'; problem a string when it cannot be packed."""
    layer = innermost_module(wrapper)
    if in_out_features(layer) is None:
        return "", f"{name!r} is a {type(layer).__name__}: packed weights cover Linear and HF Conv1D layers"
    buf = wrapper._buffers
    if "oneshot_calibrated" in buf:
        if not bool(buf["oneshot_calibrated"]):
            return "", f"{name!r} has not been calibrated: call quantizer.calibrate(...) first"
        return "oneshot", None
    specs = getattr(wrapper, "qat_specs", None)
    if specs is not None and "weight" in specs:
        if set(wrapper.quant_types) != {QuantType.QUANT_WEIGHT}:
            return "", (f"{name!r} also quantizes {sorted(set(map(str, wrapper.quant_types)) - {'weight'})}: packed "
                        f"weights are weight-only (export int8 activations with export_model(onnx_path=...))")
        if "weight_observed" in buf and not bool(buf["weight_observed"]):
            return "", f"{name!r} has no weight scale yet: call quantizer.calibrate(data) first"
        if not wrapper.quant_active:
            return "", f"{name!r} is not quantizing yet (quant_start_step not reached)"
        qmin, qmax = wrapper.qranges["weight"]
        if qmin < -128 or qmax > 255 or qmax - qmin > 255:
            return "", f"{name!r} has a weight range [{qmin}, {qmax}] wider than 8 bits"
        return "qat", None
    return "", (f"{name!r} is quantized by {type(wrapper.quantizer).__name__}, which keeps no integer grid to pack "
                f"(supported: GptqQuantizer, RtnQuantizer, AwqQuantizer, PtqQuantizer / QAT_Quantizer weight-only)")


def _group_width(name: str, wrapper: QuantizerModuleWrapper, n_in: int, groups: int) -> int | None:
    """The group width of a one-shot wrapper's codes (None: per channel), from its quantization spec: the
    last group is narrower when the group size does not divide ``n_in`` (groups of 48 over 160 columns: 48,
    48, 48, 16), so it is not ``ceil(n_in / groups)``."""
    spec = getattr(wrapper, "quant_spec", None)
    g = spec.group_width(n_in) if spec is not None else wrapper.config.get("group_size")
    g = n_in if g is None or g == -1 or g >= n_in else int(g)
    if math.ceil(n_in / g) != groups:
        raise ModelError(f"pack_weights: layer {name!r} has {groups} scale groups over {n_in} input columns, which "
                         f"its group size {g} does not give (ceil({n_in} / {g}) = {math.ceil(n_in / g)})")
    return None if groups == 1 else g


def _qat_codes(wrapper: QuantizerModuleWrapper) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    q = wrapper.quantizer
    layer = innermost_module(wrapper)
    with torch.no_grad():
        fq = q._quantize(QuantType.QUANT_WEIGHT, wrapper.weight, wrapper)  # also refreshes QAT's scale buffers
        fq = to_canonical(layer, fq.detach()).float()
    n_out = fq.shape[0]
    scale = wrapper.weight_scale.detach().float().reshape(-1).expand(n_out) if wrapper.weight_scale.numel() == 1 \
        else wrapper.weight_scale.detach().float().reshape(-1)
    zp = wrapper.weight_zero_point.detach().float().reshape(-1)
    zp = zp.expand(n_out) if zp.numel() == 1 else zp
    qmin, qmax = wrapper.qranges["weight"]
    codes = torch.clamp(torch.round(fq / scale[:, None] + zp[:, None]), qmin, qmax).to(torch.int32)
    bits = max(2, math.ceil(math.log2(qmax - qmin + 1)))
    return codes, scale[:, None].contiguous(), zp.round().to(torch.int32)[:, None].contiguous(), bits, qmin < 0


class PackedExperts(nn.Module):
    """A transformers 5 fused-experts bank (``gate_up_proj`` / ``up_proj`` and ``down_proj`` of shape ``[E, ...]``)
    whose expert slices a one-shot run quantized, as one :class:`PackedLinear` per expert and projection
    (``up[e]``, ``down[e]``; biases and AWQ scales in them). Its ``forward(hidden_states, top_k_index,
    top_k_weights)`` computes what the bank computes, one expert at a time on the tokens routed to it, with the
    bank's own gate / activation (and post-expert norm) code. Made by :func:`pack_weights`."""

    def __init__(self, bank: nn.Module, ups: list[PackedLinear], downs: list[PackedLinear]):
        super().__init__()
        from ..sequential.expert_banks import up_name

        up = up_name(bank)
        # the bank's own code (gate, activation, norm) without its 3-D weights: a shallow copy, the bank itself
        # stays whole (put back if packing is interrupted)
        ref = object.__new__(type(bank))
        ref.__dict__.update(bank.__dict__)
        ref._parameters = {k: v for k, v in bank._parameters.items() if k not in (up, "down_proj", f"{up}_bias",
                                                                               "down_proj_bias")}
        object.__setattr__(self, "_bank", ref)
        for name, child in bank.named_children():  # the bank's own sub-layers (activation, norm) stay registered
            self.add_module(name, child)
        self.up, self.down = nn.ModuleList(ups), nn.ModuleList(downs)
        self._up_name = up
        from ..sequential.expert_banks import expert_loop

        self._forward = expert_loop(ref, project=self._project, experts=len(ups))

    def _project(self, e: int, param: str, x: torch.Tensor) -> torch.Tensor:
        return (self.up if param == self._up_name else self.down)[e](x)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self._forward(hidden_states, top_k_index, top_k_weights)


def _packable_banks(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """The fused-experts banks of ``model`` whose every expert slice a one-shot quantizer wrote (``(path, bank)``),
    and the problems of banks only partly quantized."""
    from ..sequential.expert_banks import fused_results, supported, up_name

    banks, problems = [], []
    for path, mod in model.named_modules():
        got = fused_results(mod) if supported(mod) else {}
        quantized = {k: r for k, r in got.items() if r.quantized is not None}
        if not quantized:
            continue
        n = int(mod._parameters[up_name(mod)].shape[0])
        want = {f"{path}.{e}.{p}" for e in range(n) for p in (up_name(mod), "down_proj")}
        bits = {int(r.quantized.spec.bits) for r in quantized.values()}
        if set(quantized) != want or len(bits) != 1:
            problems.append(f"{path!r} (fused experts: {len(quantized)} of {len(want)} expert slices quantized"
                            f"{', bits ' + str(sorted(bits)) if len(bits) > 1 else ''}; pack_weights packs a bank "
                            f"whose every slice is quantized with one bit width)")
        else:
            banks.append((path, mod))
    return banks, problems


def _packed_bank(path: str, bank: nn.Module, compute_dtype: torch.dtype, activation: str | None) -> PackedExperts:
    from ..sequential.expert_banks import fused_results, up_name

    got, up = fused_results(bank), up_name(bank)
    n = int(bank._parameters[up].shape[0])
    made: dict[str, list[PackedLinear]] = {up: [], "down_proj": []}
    for e in range(n):
        for p in (up, "down_proj"):
            r = got[f"{path}.{e}.{p}"]
            q = r.quantized
            b = getattr(bank, f"{p}_bias", None) if bank.has_bias else None
            made[p].append(PackedLinear.from_codes(
                torch.from_numpy(q.codes.astype("int32")), torch.from_numpy(q.scale).float(),
                torch.from_numpy(q.zero_point).float(), int(q.spec.bits), int(q.group_size),
                bias=None if b is None else b[e].detach().float(),
                awq_scales=None if r.scales is None else torch.from_numpy(r.scales).float(),
                signed=q.codes.dtype.kind == "i", compute_dtype=compute_dtype, name=f"{path}.{e}.{p}",
                source=type(bank).__name__, activation=activation))
    return PackedExperts(bank, made[up], made["down_proj"])


def pack_weights(model: nn.Module, *, compute_dtype: torch.dtype = torch.bfloat16,
                 activation: str | None = None) -> nn.Module:
    """Replace, in place, every weight-only quantized Linear / HF Conv1D of ``model`` by a :class:`PackedLinear`
    holding its integer codes (as torchao's ``quantize_(model, ...)`` replaces modules in place); returns
    ``model``.

    Covers the wrappers of :class:`GptqQuantizer` / :class:`RtnQuantizer` / :class:`AwqQuantizer` after
    ``calibrate`` (their ``weight_codes`` etc., grouped int2..int8) and weight-only :class:`PtqQuantizer` /
    :class:`QAT_Quantizer` (per channel or per tensor, up to 8 bits; the codes are read from the fake-quant
    weight with the current scales). Every wrapper is checked first: one that is uncalibrated, quantizes
    activations too, or belongs to another quantizer raises :class:`compressor.ModelError` naming it, and the
    model is left unchanged. The quantizer no longer drives the replaced layers afterwards. ``compute_dtype``
    and ``activation`` (``'dynamic'``: int8 activations too, per-channel signed codes only): see
    :class:`PackedLinear`.
    """
    wrappers = [(n, w) for n, w in named_wrappers(model, [QuantizerModuleWrapper])]
    # outermost quantizer wrappers only (a pruner wrapper inside is part of the layer)
    outer = [(n, w) for n, w in wrappers if not any(n.startswith(p + ".") for p, _ in wrappers if p != n)]
    banks, problems = _packable_banks(model)  # fused MoE experts quantized slice by slice
    if not outer and not banks and not problems:
        raise ModelError("pack_weights: the model has no quantized layers (wrap it with a quantizer, e.g. "
                         "GptqQuantizer(model, config).calibrate(data), first)")
    plan = [(n, b, "bank") for n, b in banks]
    for n, w in outer:
        kind, problem = _packable(n, w)
        (problems.append(problem) if problem else plan.append((n, w, kind)))
    if problems:
        raise ModelError("pack_weights: cannot pack " + "; ".join(problems) + ". Nothing was changed.")
    # reading QAT's codes refreshes its scale buffers: their values are kept first, to put back on an interrupt
    kept = [(b, b.detach().clone()) for _, w, kind in plan if kind not in ("oneshot", "bank") for b in w.buffers()]
    swapped: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, name, module before), recorded before each swap
    try:
        _pack(model, plan, compute_dtype, activation, swapped)
    except BaseException:  # a Ctrl-C too: the model as it was (a second Ctrl-C is raised once it is)
        with deferred_interrupts():
            for parent, attr, old in reversed(swapped):
                setattr(parent, attr, old)
            with torch.no_grad():
                for b, value in kept:
                    b.copy_(value)
        raise
    return model


def _pack(model: nn.Module, plan: list[tuple[str, nn.Module, str]], compute_dtype: torch.dtype,
          activation: str | None, swapped: list[tuple[nn.Module, str, nn.Module]]) -> None:
    new: list[tuple[str, nn.Module]] = []
    for n, w, kind in plan:
        if kind == "bank":
            new.append((n, _packed_bank(n, w, compute_dtype, activation)))
            continue
        layer = innermost_module(w)
        bias = w.bias.detach().float() if w.bias is not None else None
        source = type(layer).__name__
        if kind == "oneshot":
            buf = w._buffers
            codes = oneshot_codes(w)
            n_in = codes.shape[1]
            groups = buf["weight_group_scale"].shape[1]
            gs = _group_width(n, w, n_in, groups)
            awq = buf.get("awq_scales")
            m = PackedLinear.from_codes(codes.to(torch.int32), buf["weight_group_scale"], buf["weight_group_zero_point"],
                                        int(w.quant_bits["weight"]), gs, bias=bias, awq_scales=awq,
                                        signed=codes.dtype == torch.int8, compute_dtype=compute_dtype, name=n,
                                        source=source, activation=activation)
        else:
            codes, scale, zp, bits, signed = _qat_codes(w)
            m = PackedLinear.from_codes(codes, scale, zp, bits, None, bias=bias, signed=signed,
                                        compute_dtype=compute_dtype, name=n, source=source, activation=activation)
        new.append((n, m))
    for n, m in new:
        parent_name, _, attr = n.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        swapped.append((parent, attr, getattr(parent, attr)))
        setattr(parent, attr, m)
