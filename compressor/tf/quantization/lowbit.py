"""One-shot-quantized Keras layers as the layers Keras 3 itself runs in low bit.

:func:`to_keras_quantized` turns every calibrated ``GptqQuantizer`` / ``RtnQuantizer`` / ``AwqQuantizer`` layer
(``Dense`` / ``EinsumDense``, at any depth) into the layer Keras builds with ``layer.quantize(mode)``, with OUR
integer codes, group scales and zero points written into its variables. Keras's own quantized call computes
with them, and ``model.save('x.keras')`` reloads with ``keras.saving.load_model`` in a process without
compressor. Which Keras layout holds which codes (exact re-encodings of the same integers, the smallest that
fits; every mode below is stock Keras 3.15):

=====================================  =============  ===============================================
our codes                              Keras mode     Keras variables (``w`` as Keras computes it)
=====================================  =============  ===============================================
5..8 bit, symmetric, per channel       ``int8``       ``kernel`` int8 = q, ``kernel_scale`` = 1 / s:
                                                      ``x @ q / kernel_scale`` (weight-only: no
                                                      activation quantizer)
2..4 bit, symmetric, per channel       ``int4/-1``    packed q, ``kernel_scale`` = 1 / s (as int8)
2..4 bit, grouped or affine            ``int4/<g>``   packed q (affine: q - 8), ``kernel_scale`` = s,
                                                      ``kernel_zero`` = zp (affine: zp - 8), ``g_idx``;
                                                      ``w = (q - zp) s`` per group
AWQ, 2..4 bit                          ``awq/4/<g>``  codes of ``W s`` (unsigned), scales, zero points,
                                                      ``awq_scales`` = ``s``: ``w = (q - zp) s_g / s``
5..8 bit, grouped or affine            ``gptq/8/<g>`` unsigned byte codes (symmetric: q + 2^(b-1)),
                                                      scales, zero points, ``g_idx``
=====================================  =============  ===============================================

Keras views a kernel as 2-D by reshaping it, without a transpose (int4: ``[product of the contracted dims, the
rest]``; GPTQ / AWQ: a 3-D kernel split where its largest axis is). For Dense and kernels whose contracted axes
come first (``'abc,cde->abde'``) rows are input columns and columns output channels. keras-hub Gemma's query /
key / value kernels are ``[heads, d, head_dim]`` (``'btd,ndh->btnh'``): the reshape mixes heads into the rows, so
no per-column scale fits. Those layers go into Keras's grouped layouts with one Keras group per set of view rows
that take the same (output channel, group) in every column, ``g_idx`` sending each row to its group (per
channel: one group per head); the integers and scales are still ours exactly, and the layer's ``group_size`` is
Keras's block size for that view (:func:`_plan_mixed`). Keras's int8 layer quantizes along the contracted axes
wherever they are and needs nothing of this.

Keras names the container, not the grid: 2- and 3-bit codes sit in ``int4`` layers (half a byte per weight;
Keras's GPTQ layer would store them a byte each and runs slower), 5..7-bit ones in ``int8`` / ``gptq/8``
layers. AWQ codes wider than 4 bits have no Keras layout (a ``ConfigError``).

``fast=True`` stores per-channel symmetric codes of any width (e.g. int4 RTN / GPTQ with ``group_size``
-1) in Keras's ``int8`` layer instead: one byte per weight instead of half, and Keras's int8 call (one cast and
a float matmul) instead of its int4 call, which unpacks the nibbles on every call (4x faster at M=1 on TF,
see ``benchmarks/lowbit_tf.py``). Grouped codes have no faster stock layout: Keras's ``int4/<g>`` call
unpacks and dequantizes the whole kernel on every call.

Keras 3.15 bug worked around: its ``save_own_variables`` drops ``kernel_zero`` of GPTQ / AWQ-mode layers, so
the files it writes for them (also for its own ``quantize('gptq')``) do not load; the converted layers get a
saver on the instance that writes every variable (the file is what stock Keras's loader expects; a reloaded
model saved again by plain Keras 3.15 hits the bug again).

Exactness: the integers are the same; Keras's dequantization rounds once more in float32 than our fake-quant
kernel (``float32((q - zp) * s)`` in float64): grouped modes multiply by ``float32(s)``, per-channel modes
divide by ``float32(1 / s)``; the outputs differ from the fake-quant model's by float32 rounding (measured
in ``tests/tf/test_keras_lowbit.py``: relative 1e-6 of the output scale).

The conversion is final, like ``quantizer.strip()``: every compressor wrapper of the model is removed (the
quantizer object is done). Everything is checked and every array computed before the model changes.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ...core.errors import ConfigError, ModelError
from ...core.oneshot import stored_codes_to_full
from ..compressor import iter_layers, strip_model, wrappers_of
from ..kernel_layout import KernelLayout, kernel_layout

__all__ = ["to_keras_quantized", "keras_quantized_variables", "describe_keras_quantized", "KerasLowbitPlan", "oneshot_codes"]

@dataclass
class KerasLowbitPlan:
    """What :func:`to_keras_quantized` does to one layer: ``mode`` (``'int8'``, ``'int4'``, ``'gptq'``,
    ``'awq'``), the Keras config, and the values of the variables it writes (name -> array)."""

    name: str
    layer: Any
    mode: str
    bits: int
    group_size: int  # -1: per output channel
    symmetric: bool
    config: Any
    values: dict[str, np.ndarray]

    def row(self) -> dict[str, Any]:
        return {"layer": self.name, "type": type(self.layer).__name__, "mode": self.mode, "bits": self.bits,
                "group_size": self.group_size, "symmetric": self.symmetric}


# ------------------------------------------------------------------------------------------- layouts
def _keras_view(plan: KernelLayout, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Keras's 2-D ``[rows, cols]`` view of the kernel in ``mode``, as ``(in_of, out_of)``: the canonical input and
    output index of every element. Keras reshapes the kernel (C order, no transpose): its int4 layer to
    ``[product of the contracted dims, the rest]``, its GPTQ / AWQ layers a 3-D kernel by where its largest axis
    is (``[d0, d1 * d2]`` when it is first, else ``[d0 * d1, d2]``). Kernels whose contracted axes come first
    (Dense, ``'abc,cde->abde'``) give rows = inputs, cols = outputs; others (keras-hub Gemma's query / key / value
    ``'btd,ndh->btnh'``, kernel ``[heads, d, head_dim]``) mix them: :func:`_grouped_view` then fits their scales."""
    n_out, n_in = plan.n_out, plan.n_in
    in_k = plan.from_canonical(np.broadcast_to(np.arange(n_in), (n_out, n_in)))
    out_k = plan.from_canonical(np.broadcast_to(np.arange(n_out)[:, None], (n_out, n_in)))
    shape = list(plan.kernel_shape)
    if mode in ("gptq", "awq") and len(shape) == 3:
        k_rows = shape[0] if shape.index(max(shape)) == 0 else shape[0] * shape[1]
    elif mode in ("gptq", "awq") and len(shape) == 2:
        k_rows = shape[0]
    else:
        k_rows = n_in
    return in_k.reshape(k_rows, -1).astype(np.int64), out_k.reshape(k_rows, -1).astype(np.int64)


def _natural(in_of: np.ndarray, out_of: np.ndarray) -> bool:
    """Every row of the view is one input column and every column one output channel."""
    return bool(np.all(in_of == in_of[:, :1]) and np.all(out_of == out_of[:1, :]))


def _grouped_view(in_of: np.ndarray, out_of: np.ndarray, gs: int, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """For a view that mixes inputs and outputs: ``(keys, g_idx)`` with ``g_idx[r]`` the Keras group of view row
    ``r`` and ``keys[g, c] = out * n_groups + our group`` the (output channel, our group) whose scale and zero point
    element ``(r, c)`` of every row of group ``g`` takes. Rows that need the same parameters in every column share a
    group, so Keras's ``(q - zero[g_idx[r], c]) * scale[g_idx[r], c]`` is our ``(q - zp[o, g]) * s[o, g]`` exactly
    (Gemma's ``[heads, d, head_dim]`` query kernel, per channel: one group per head)."""
    combined = out_of * n_groups + in_of // gs
    keys, g_idx = np.unique(combined, axis=0, return_inverse=True)
    return keys, np.asarray(g_idx).reshape(-1)


def _flat(canonical: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``[rows, cols]`` Keras view of a canonical ``[out, in]`` array."""
    return np.asarray(canonical)[np.ix_(cols, rows)].T


def oneshot_codes(wrapper: Any) -> np.ndarray:
    """The ``[out, in]`` integer codes (int8 symmetric / uint8 affine, one per entry) of a layer calibrated by
    ``GptqQuantizer`` / ``RtnQuantizer`` / ``AwqQuantizer``; its ``weight_codes`` variable keeps codes of 4 bits
    or fewer two per byte (:func:`compressor.core.oneshot.store_codes`). A wrapper of another quantizer, or one
    not calibrated yet, is a ModelError."""
    states = getattr(wrapper, "state_variables", None)
    if states is None or "weight_codes" not in states():
        raise ModelError(f"oneshot_codes: {getattr(wrapper, 'name', type(wrapper).__name__)!r} holds no integer codes "
                         f"(only GptqQuantizer / RtnQuantizer / AwqQuantizer wrappers keep them, once calibrated)")
    bits = wrapper.config["quant_bits"]
    bits = int(bits["weight"] if isinstance(bits, dict) else bits)
    n_in = kernel_layout(wrapper.name, wrapper.layer).n_in
    return stored_codes_to_full(np.asarray(wrapper.weight_codes.numpy()), bits, n_in)


# ------------------------------------------------------------------------------------------- planning
def _choose(bits: int, symmetric: bool, per_channel: bool, awq: bool, fast: bool) -> str | None:
    """The Keras mode that holds these codes exactly in the fewest bytes (see the module docstring)."""
    if awq:
        return "awq" if bits <= 4 else None
    if symmetric and per_channel and (bits > 4 or fast):
        return "int8"
    if bits <= 4:
        return "int4"
    return "gptq"  # 5..8-bit grouped or affine codes: Keras's GPTQ layer with 8-bit (one byte) codes


def _plan_layer(name: str, wrapper: Any, fast: bool) -> KerasLowbitPlan:
    awq = wrapper.awq_scales.numpy() if "awq_scales" in wrapper.state_variables() else None
    bits = wrapper.config["quant_bits"]
    bits = int(bits["weight"] if isinstance(bits, dict) else bits)
    return keras_quantized_variables(name, wrapper.layer, oneshot_codes(wrapper),
                                     wrapper.weight_group_scale.numpy(), wrapper.weight_group_zero_point.numpy(),
                                     int(wrapper.weight_group_size), bits,
                                     symmetric=wrapper.weight_codes.dtype == tf.int8, awq_scales=awq, fast=fast)


def keras_quantized_variables(name: str, layer: Any, codes: Any, scale: Any, zero_point: Any, group_size: int,
                              bits: int, symmetric: bool, awq_scales: Any = None, fast: bool = False) -> KerasLowbitPlan:
    """The Keras mode, config and variable values for one layer from its one-shot codes in core's canonical
    layout (``codes`` ``[out, in]``, ``scale`` / ``zero_point`` ``[out, groups]``, groups of ``group_size`` input
    columns, AWQ's ``awq_scales`` ``[in]``): the same arrays from the torch or the Keras quantizer give the same
    values (scales are rounded to float32 first, as the torch wrapper stores them). Changes nothing."""
    from keras.quantizers import AWQConfig, GPTQConfig, Int4QuantizationConfig, Int8QuantizationConfig

    plan = kernel_layout(name, layer)
    codes = np.asarray(codes).astype(np.int32)
    scale = np.asarray(scale, dtype=np.float32).astype(np.float64)
    zp = np.rint(np.asarray(zero_point, dtype=np.float64)).astype(np.int32)
    gs = int(group_size) if group_size is not None else -1
    awq = awq_scales is not None
    symmetric = bool(symmetric)
    n_out, n_in = plan.n_out, plan.n_in
    gs = n_in if gs <= 0 or gs > n_in else gs  # -1 / None: per output channel
    if codes.shape != (n_out, n_in) or scale.shape != zp.shape or scale.shape[0] != n_out \
            or scale.shape[1] != -(-n_in // gs):
        raise ConfigError(f"layer {name!r}: codes {codes.shape} / scales {scale.shape} / zero points {zp.shape} with "
                          f"group_size {gs} do not fit its [out, in] = [{n_out}, {n_in}] weight")
    per_channel = scale.shape[1] == 1
    mode = _choose(bits, symmetric, per_channel, awq, fast)
    if mode is None:
        raise ConfigError(f"layer {name!r} ({type(layer).__name__}): {bits}-bit AWQ codes have no stock Keras "
                          f"layout (Keras's AWQ layer holds codes of at most 4 bits); use quant_bits <= 4 with "
                          f"AwqQuantizer, or GptqQuantizer / RtnQuantizer for wider codes")
    values: dict[str, np.ndarray] = {}
    if mode != "int8":  # Keras's int8 layer quantizes along the contracted axes wherever they are
        in_of, out_of = _keras_view(plan, mode)
        if not _natural(in_of, out_of):
            return _plan_mixed(name, layer, plan, mode, bits, gs, symmetric, codes, scale, zp, awq_scales,
                               in_of, out_of)
        rows, cols = in_of[:, 0], out_of[0, :]
        group_of_row = rows // gs  # our groups follow the canonical input column
    keras_gs = -1 if per_channel else gs
    if mode == "int8":
        lo, hi = int(codes.min()), int(codes.max())
        if lo < -128 or hi > 127:
            raise ConfigError(f"layer {name!r}: codes [{lo}, {hi}] do not fit int8")
        values["kernel"] = plan.from_canonical(codes).astype(np.int8)
        inv = (1.0 / scale[:, 0]).astype(np.float32)  # Keras divides by kernel_scale
        values["kernel_scale"] = inv  # canonical per output; shaped for the layer at write time
        config = Int8QuantizationConfig(activation_quantizer=None)
    elif mode == "int4":
        q, z = codes, zp
        if not symmetric:  # unsigned [0, 15] -> Keras's signed nibbles [-8, 7]; q - zp unchanged
            q, z = codes - 8, zp - 8
        flat_q = _flat(q, rows, cols).astype(np.int8)
        if per_channel and symmetric:
            values["kernel_scale"] = (1.0 / scale[cols, 0]).astype(np.float32)
            config = Int4QuantizationConfig(block_size=-1)
        else:
            values["g_idx"] = group_of_row.astype(np.float32)
            values["kernel_scale"] = scale[cols, :].T.astype(np.float32)  # [groups, cols]
            values["kernel_zero"] = z[cols, :].T.astype(np.int8)
            keras_gs = gs if not per_channel else n_in
            config = Int4QuantizationConfig(block_size=keras_gs)
        values["kernel"] = np.asarray(keras.quantizers.pack_int4(flat_q, axis=-1)[0])
    else:  # gptq / awq: unsigned codes [out(cols), in(rows)], scale / zero [cols, groups]
        q, z = codes, zp
        if symmetric:
            q, z = codes + 2 ** (bits - 1), zp + 2 ** (bits - 1)
        kq = _flat(q, rows, cols).T.astype(np.uint8)  # [cols, rows]
        if mode == "awq":  # 4-bit container, packed; GPTQ mode here always has 8-bit codes (one byte each)
            kq = np.asarray(keras.quantizers.pack_int4(kq, axis=0, dtype="uint8")[0])
        values["quantized_kernel"] = kq
        values["kernel_scale"] = scale[cols, :].astype(np.float32)
        values["kernel_zero"] = z[cols, :].astype(np.uint8)
        values["g_idx"] = group_of_row.astype(np.float32)
        if mode == "awq":
            values["awq_scales"] = np.asarray(awq_scales, dtype=np.float32)[rows]
            config = AWQConfig(None, None, weight_bits=4, group_size=keras_gs)
        else:
            config = GPTQConfig(None, None, weight_bits=8, group_size=keras_gs, symmetric=symmetric)
    return KerasLowbitPlan(name, layer, mode, bits, keras_gs, symmetric, config, values)


def _plan_mixed(name: str, layer: Any, plan: KernelLayout, mode: str, bits: int, gs: int, symmetric: bool,
                codes: np.ndarray, scale: np.ndarray, zp: np.ndarray, awq_scales: Any, in_of: np.ndarray,
                out_of: np.ndarray) -> KerasLowbitPlan:
    """The variables of a layer whose kernel Keras views with inputs and outputs mixed (see :func:`_keras_view`):
    the codes in Keras's view, and one Keras group per set of view rows that take the same (output channel, our
    group) in every column (:func:`_grouped_view`), in Keras's grouped layouts (``int4/<block>`` with
    ``g_idx``, or the GPTQ / AWQ layers). Keras's block size is chosen so that its layer has at least that many
    groups; ``g_idx`` (saved with the layer) sends each row to its own."""
    from keras.quantizers import AWQConfig, GPTQConfig, Int4QuantizationConfig

    if len(plan.kernel_shape) not in (2, 3) and mode != "int4":
        raise ConfigError(f"layer {name!r} ({type(layer).__name__}, kernel {plan.kernel_shape}): Keras's {mode} "
                          f"layer takes 2-D or 3-D kernels only; use 4-bit codes (Keras int4) for this layer")
    n_groups = scale.shape[1]
    keys, g_idx = _grouped_view(in_of, out_of, gs, n_groups)
    k_rows = in_of.shape[0]
    n_keras = len(keys)
    block = max(1, k_rows // n_keras)  # Keras builds ceil(rows / block) >= n_keras groups
    n_built = -(-k_rows // block)
    sc = np.ones((n_built, keys.shape[1]), dtype=np.float64)
    z = np.zeros((n_built, keys.shape[1]), dtype=np.int64)
    sc[:n_keras] = scale[keys // n_groups, keys % n_groups]
    z[:n_keras] = zp[keys // n_groups, keys % n_groups]
    q = codes[out_of, in_of]  # the codes in Keras's [rows, cols] view
    values: dict[str, np.ndarray] = {"g_idx": g_idx.astype(np.float32)}
    if mode == "int4":
        if not symmetric:  # unsigned [0, 15] -> Keras's signed nibbles [-8, 7]; q - zp unchanged
            q, z = q - 8, z - 8
        values["kernel"] = np.asarray(keras.quantizers.pack_int4(q.astype(np.int8), axis=-1)[0])
        values["kernel_scale"] = sc.astype(np.float32)  # [groups, cols]
        values["kernel_zero"] = z.astype(np.int8)
        return KerasLowbitPlan(name, layer, mode, bits, block, symmetric,
                               Int4QuantizationConfig(block_size=block), values)
    if symmetric:
        q, z = q + 2 ** (bits - 1), z + 2 ** (bits - 1)
    kq = q.T.astype(np.uint8)  # [cols, rows]
    if mode == "awq":
        kq = np.asarray(keras.quantizers.pack_int4(kq, axis=0, dtype="uint8")[0])
        s = np.asarray(awq_scales, dtype=np.float32)
        if not np.all(s[in_of] == s[in_of[:, :1]]):
            raise ConfigError(f"layer {name!r} ({type(layer).__name__}, kernel {plan.kernel_shape}): Keras's AWQ "
                              f"layer divides each row of its [{k_rows}, {in_of.shape[1]}] view by one scale, and "
                              f"this kernel's rows mix input columns with different AWQ scales")
        values["awq_scales"] = s[in_of[:, 0]]
    values["quantized_kernel"] = kq
    values["kernel_scale"] = sc.T.astype(np.float32)  # [cols, groups]
    values["kernel_zero"] = z.T.astype(np.uint8)
    config = (AWQConfig(None, None, weight_bits=4, group_size=block) if mode == "awq"
              else GPTQConfig(None, None, weight_bits=8, group_size=block, symmetric=symmetric))
    return KerasLowbitPlan(name, layer, mode, bits, block, symmetric, config, values)


def _is_oneshot_quantizer(obj: Any) -> bool:
    """A GptqQuantizer / RtnQuantizer / AwqQuantizer (by their marker: this module sits below compressor.tf.sequential,
    which calls it, so it cannot import their classes)."""
    return getattr(type(obj), "holds_integer_codes", False) is True


def _targets(obj: Any) -> list[tuple[str, Any]]:
    if _is_oneshot_quantizer(obj):
        if not obj.calibrated:
            raise ConfigError(f"to_keras_quantized: {type(obj).__name__} is not calibrated; call calibrate() first")
        return [(w.name, w) for w in obj.get_modules_wrapper()]
    if not isinstance(obj, keras.layers.Layer):
        raise ConfigError(f"to_keras_quantized takes a one-shot quantizer (GptqQuantizer, RtnQuantizer, "
                          f"AwqQuantizer) or its Keras model, got {type(obj).__name__}")
    found = []
    for path, layer in iter_layers(obj):
        for w in wrappers_of(layer):
            if _is_oneshot_quantizer(w.compressor) and "weight_codes" in w.state_variables():
                found.append((path, w))
    if not found:
        raise ConfigError(f"to_keras_quantized: model {obj.name!r} has no calibrated GptqQuantizer / RtnQuantizer / "
                          f"AwqQuantizer layer (their wrappers hold the integer codes)")
    return found


# ------------------------------------------------------------------------------------------- writing
@contextmanager
def _one_collection() -> Iterator[None]:
    """One ``gc.collect()`` for the whole conversion instead of one per layer: Keras's ``Layer.__delattr__`` runs a
    full collection for every variable it deletes, and ``layer.quantize`` deletes the float kernel, so each converted
    layer paid a full collection of the process's heap (0.23 s a layer in a test process holding a few tiny
    keras-hub models, measured: 3.3 s of the 4.4 s that compressing and converting a 14-layer model took; more in
    a process holding a large model). The collections are deferred to one at the end (the buffers Keras wants
    released are released then); a ``gc.collect`` another thread makes meanwhile collects nothing."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0  # noqa: ARG005 - Keras looks gc.collect up at each delete
    try:
        yield
    finally:
        gc.collect = collect
        collect()


def _write(p: KerasLowbitPlan) -> None:
    layer = p.layer
    layer.quantize(p.mode, type_check=False, config=p.config)
    v = p.values
    if p.mode == "int8":
        layer._kernel.assign(v["kernel"])
        if isinstance(layer, keras.layers.EinsumDense):
            plan = kernel_layout(p.name, layer)
            full = np.broadcast_to(v["kernel_scale"][:, None], (plan.n_out, plan.n_in))
            k = plan.from_canonical(full)
            k = k[tuple(slice(0, 1) if a in layer._kernel_reduced_axes else slice(None) for a in range(k.ndim))]
            layer.kernel_scale.assign(np.asarray(layer._adjust_scale_for_quant(k, "kernel")))
        else:
            layer.kernel_scale.assign(v["kernel_scale"])
        return
    if p.mode == "int4":
        layer._kernel.assign(v["kernel"])
        layer.kernel_scale.assign(v["kernel_scale"])
        if "kernel_zero" in v:
            layer.kernel_zero.assign(v["kernel_zero"])
            layer.g_idx.assign(v["g_idx"])
        return
    if hasattr(layer, "_kernel"):
        del layer._kernel  # as Keras's own GPTQ / AWQ calibration does: the float kernel is gone
    for name in ("quantized_kernel", "kernel_scale", "kernel_zero", "g_idx", "awq_scales"):
        if name in v:
            getattr(layer, name).assign(v[name])
    if p.mode == "gptq":
        layer.is_gptq_calibrated = True
    else:
        layer.is_awq_calibrated = True
    object.__setattr__(layer, "save_own_variables", _complete_saver(layer))


def _complete_saver(layer: Any) -> Any:
    """Keras 3.15's ``Dense`` / ``EinsumDense`` ``save_own_variables`` skips ``kernel_zero`` in GPTQ / AWQ mode
    (its ``_get_kernel_with_merged_lora`` returns no zero point there), so the file it writes has one variable
    fewer than its own ``load_own_variables`` expects and does not load (also for Keras's own
    ``quantize('gptq')``). This saver, installed on the instance, writes every variable of the layer's
    ``variable_serialization_spec`` in order: the file is what stock Keras's loader reads."""

    def save_own_variables(store: Any) -> None:
        idx = 0
        for name in layer.variable_serialization_spec[layer.quantization_mode]:
            if name == "bias" and layer.bias is None:
                continue
            store[str(idx)] = getattr(layer, name)
            idx += 1

    return save_own_variables


def _config_serialized(model: Any) -> set[int]:
    """ids of the layers a ``.keras`` file rebuilds from their own config (layers of stock Functional / Sequential
    models, recursively); the others are rebuilt by their parent's code (keras-hub's blocks and attention layers)."""
    from keras.src.models.functional import Functional

    out: set[int] = set()

    def walk(m: Any) -> None:
        if type(m) is Functional or type(m) is keras.Sequential:
            for child in m.layers:
                out.add(id(child))
                walk(child)

    out.add(id(model))
    walk(model)
    return out


def _warn_int8_rebuilt(model: Any, plans: list[KerasLowbitPlan]) -> None:
    """Keras's int8 layer is weight-only here through its quantization config; a layer its parent rebuilds from
    code when the ``.keras`` file loads gets Keras's default int8 config instead, which quantizes its inputs too:
    said at conversion, not found at the user's load."""
    serialized = _config_serialized(model)
    rebuilt = [p.name for p in plans if p.mode == "int8" and id(p.layer) not in serialized]
    if rebuilt:
        warnings.warn(f"to_keras_quantized: {len(rebuilt)} layer(s) go into Keras's int8 layer weight-only "
                      f"({', '.join(rebuilt[:4])}{' ...' if len(rebuilt) > 4 else ''}), but a .keras file rebuilds "
                      f"them from their parent layer's code with Keras's default int8 config, which also quantizes "
                      f"their inputs: the reloaded model's outputs differ from this one's (about 1e-3 relative). "
                      f"Use fast=False (Keras's int4 layers, weight-only in the file too) to save and reload",
                      UserWarning, stacklevel=3)


def to_keras_quantized(model_or_quantizer: Any, *, fast: bool = False) -> list[dict[str, Any]]:
    """Turn every calibrated one-shot-quantized layer into Keras 3's own quantized layer holding our codes (see
    the module docstring for the layouts); returns one row per layer (``layer``, ``type``, ``mode``, ``bits``,
    ``group_size``, ``symmetric``). ``model_or_quantizer``: a calibrated ``GptqQuantizer`` / ``RtnQuantizer`` /
    ``AwqQuantizer``, or its model. ``fast``: per-channel symmetric codes go into Keras's int8 layer.

    Final: every compressor wrapper of the model is removed; afterwards ``model.save('m.keras')`` writes a file
    stock Keras loads (``keras.saving.load_model``, no compressor needed) and runs in int4 / int8. A layout Keras
    cannot hold is a ``ConfigError`` before anything changes."""
    targets = _targets(model_or_quantizer)
    for name, w in targets:
        if w.layer.dtype_policy.quantization_mode is not None or not w.installed:
            raise ConfigError(f"to_keras_quantized: layer {name!r} was converted already "
                              f"({w.layer.dtype_policy.name}); the conversion is done once")
    plans = [_plan_layer(name, w, bool(fast)) for name, w in targets]
    model = model_or_quantizer.bound_model if _is_oneshot_quantizer(model_or_quantizer) else model_or_quantizer
    _warn_int8_rebuilt(model, plans)
    quantizers = {id(w.compressor): w.compressor for _, w in targets}
    strip_model(model)
    for q in quantizers.values():
        q.unhook()
    with _one_collection():
        for p in plans:
            _write(p)
    for attr in ("train_function", "test_function", "predict_function"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    from ..sequential.expert_banks import keras_quantized_note

    note = keras_quantized_note(model)  # expert banks: no Keras quantized layer holds them
    if note is not None:
        warnings.warn(note, UserWarning, stacklevel=2)
    return [p.row() for p in plans]


# ------------------------------------------------------------------------------------------- reading back
def _policy_attr(layer: Any, name: str) -> Any:
    return getattr(layer.dtype_policy, name, None)


def describe_keras_quantized(layer: Any) -> dict[str, Any] | None:
    """What a Keras-quantized ``Dense`` / ``EinsumDense`` (``int8``, ``int4``, ``gptq``, ``awq`` mode) stores, for
    ``compressor report``: ``mode``, ``bits``, ``group_size`` (-1: per channel), ``bytes`` (its weight variables:
    codes, scales, zero points, ``g_idx``, AWQ scales; not the bias) and ``offsets``: ``code - zero point`` per
    weight in Keras's ``[rows, cols]`` view (0 exactly where the weight is 0). None for other layers."""
    mode = getattr(layer.dtype_policy, "quantization_mode", None)
    if mode not in ("int8", "int4", "gptq", "awq") or not layer.built:
        return None
    from keras.quantizers import unpack_int4

    bias = getattr(layer, "bias", None)
    nbytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in layer.weights if v is not bias)
    if mode == "int8":
        q = np.asarray(layer._kernel.numpy()).astype(np.int32)
        return {"mode": mode, "bits": 8, "group_size": -1, "bytes": nbytes, "offsets": q}
    if mode == "int4":
        packed = layer._kernel
        cols = getattr(layer, "_int4_unpacked_column_size", None) or getattr(layer, "_orig_output_dim", None)
        q = np.asarray(unpack_int4(packed, int(cols), axis=-1)).astype(np.int32)
        block = getattr(layer, "_int4_block_size", None)
        if block is not None and block > 0:
            g = np.asarray(layer.g_idx.numpy()).astype(np.int64)
            q = q - np.asarray(layer.kernel_zero.numpy()).astype(np.int32)[g, :]
        return {"mode": mode, "bits": 4, "group_size": int(block) if block and block > 0 else -1, "bytes": nbytes,
                "offsets": q}
    bits = 4 if mode == "awq" else int(_policy_attr(layer, "weight_bits"))
    kq = layer.quantized_kernel
    g = np.asarray(layer.g_idx.numpy()).astype(np.int64)
    if bits == 4:
        cols = int(np.asarray(layer.kernel_scale.shape)[0])
        kq = unpack_int4(kq, cols, axis=0, dtype="uint8")
    q = np.asarray(kq).astype(np.int32) - np.asarray(layer.kernel_zero.numpy()).astype(np.int32)[:, g]
    return {"mode": mode, "bits": bits, "group_size": int(_policy_attr(layer, "group_size")), "bytes": nbytes,
            "offsets": q.T}
