"""Per-layer, per-quant-type settings resolved from a config entry (bits, dtype, scheme -> range, axis).

Bits, dtype, scheme and their defaults (NNI's QAT_Quantizer: ``'uint'``, ``'per_tensor_affine'``; signed
ints narrow, int8: [-127, 127]) are resolved in core (:mod:`compressor.core.quant_config`).

Channel axes in Keras layouts: a weight's output channels are the last kernel axis (second to last for
transposed convolutions; depthwise kernels are viewed as ``[..., in * mult]``, see
:mod:`.fakequant`); per-channel activations use the layer's channel axis (last for ``channels_last``,
1 for ``channels_first``). Channel counts come from the built kernel, so per-channel specs of a layer
built after wrapping are completed on its first call.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...core.errors import ConfigError
from ...core.quant_config import DEFAULT_DTYPE, DEFAULT_SCHEME, QuantSpec, base_spec
from .. import layout
from .fakequant import as_channels, channel_axis

__all__ = ["DEFAULT_DTYPE", "DEFAULT_SCHEME", "QuantSpec", "complete_spec", "io_channels", "resolve_spec"]


def io_channels(layer: Any, layer_type: str) -> tuple[int, int] | None:
    """``(input channels, output channels)`` of a built Dense/Conv-like layer, from its kernel; else None."""
    k = layout.weight_of(layer)
    if k is None or len(k.shape) < 2 or type(layer).__name__ == "Embedding":
        return None
    shape = [int(d) for d in k.shape]
    if layer_type.startswith("Depthwise"):
        return shape[-2], shape[-2] * shape[-1]
    if layer_type.endswith("Transpose"):
        return shape[-1], shape[-2]
    groups = int(getattr(layer, "groups", 1) or 1)
    return shape[-2] * groups, shape[-1]


def resolve_spec(config: dict[str, Any], quant_type: str, layer: Any, layer_type: str, name: str,
                 default_dtype: str = DEFAULT_DTYPE, default_scheme: str = DEFAULT_SCHEME, narrow: bool = True,
                 what: str = "quantizer") -> QuantSpec:
    """The :class:`QuantSpec` of ``quant_type`` for ``layer`` under ``config`` (ConfigError if impossible)."""
    spec, per_channel = base_spec(config, quant_type, name, default_dtype, default_scheme, narrow, what)
    if not per_channel:
        return spec
    channels = None
    if quant_type == "weight":
        axis = channel_axis(layer_type)
        k = layout.weight_of(layer)
        if k is not None:
            channels = int(as_channels(k, layer_type).shape[axis])
    else:
        io = io_channels(layer, layer_type)
        if io is None and getattr(layer, "built", False) or not _has_channels(layer_type):
            raise ConfigError(f"{what}: layer {name!r} ({layer_type}): per-channel {quant_type} quantization "
                              f"needs a Conv or Dense layer (channel count unknown); use a per_tensor scheme")
        axis = layout.channel_axis(layer)
        if io is not None:
            channels = io[0] if quant_type == "input" else io[1]
    return replace(spec, axis=axis, channels=channels)


def _has_channels(layer_type: str) -> bool:
    return layer_type == "Dense" or "Conv" in layer_type


def complete_spec(spec: QuantSpec, layer: Any, layer_type: str) -> QuantSpec:
    """Fill in the channel count of a per-channel spec once ``layer`` is built."""
    if spec.axis is None or spec.channels is not None:
        return spec
    if spec.quant_type == "weight":
        channels = int(as_channels(layout.weight_of(layer), layer_type).shape[spec.axis])
    else:
        io = io_channels(layer, layer_type)
        channels = io[0] if spec.quant_type == "input" else io[1]
    return replace(spec, channels=channels)
