"""Per-layer, per-quant-type settings resolved from a config entry (bits, dtype, scheme -> range, axis).

Defaults when ``quant_dtype`` / ``quant_scheme`` are absent follow NNI's QAT_Quantizer, which the seeds
describe: ``'uint'`` and ``'per_tensor_affine'`` for every quant type (8 bits: [0, 255], zero point
chosen so 0 is exact). The torch.ao-style setup is ``quant_dtype: {'weight': 'int', 'output': 'uint'}``
with ``quant_scheme: {'weight': 'per_channel_symmetric', 'output': 'per_tensor_affine'}``.
Signed ints use the narrow range (int8: [-127, 127]).

Channel axes: weights use their output-channel axis (0; 1 for transposed convolutions); per-channel
activations use axis 1 for convolutions (NCHW) and the last axis for Linear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...core import quant as cq
from ...core.errors import ConfigError
from .wrapper import activation_channel_axis, weight_channel_axis

DEFAULT_DTYPE = "uint"
DEFAULT_SCHEME = "per_tensor_affine"
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor of one layer is quantized."""

    quant_type: str
    bits: int
    dtype: str
    scheme: str
    qmin: int
    qmax: int
    symmetric: bool
    axis: int | None  # channel axis (negative: counted from the end at run time), None = per tensor
    channels: int | None  # number of channels for per-channel scales


def _per_type(config: dict[str, Any], key: str, quant_type: str, default: str) -> str:
    v = config.get(key, default)
    if isinstance(v, dict):
        return v.get(quant_type, default)
    return v


def resolve_spec(config: dict[str, Any], quant_type: str, layer: nn.Module, name: str,
                 default_dtype: str = DEFAULT_DTYPE, default_scheme: str = DEFAULT_SCHEME,
                 narrow: bool = True, what: str = "quantizer") -> QuantSpec:
    """The :class:`QuantSpec` of ``quant_type`` for ``layer`` under ``config`` (ConfigError if impossible)."""
    bits = config["quant_bits"][quant_type]
    dtype = _per_type(config, "quant_dtype", quant_type, default_dtype)
    scheme = _per_type(config, "quant_scheme", quant_type, default_scheme)
    try:
        qmin, qmax = cq.quant_range(bits, dtype, narrow=narrow)
        per_channel, symmetric = cq.parse_scheme(scheme)
    except ValueError as e:
        raise ConfigError(f"{what}: layer {name!r}, {quant_type}: {e}") from None
    axis = channels = None
    if per_channel:
        if quant_type == "weight":
            axis = weight_channel_axis(layer)
            channels = int(layer.weight.shape[axis])
        elif isinstance(layer, _CONVS):
            axis = activation_channel_axis(layer)
            channels = int(layer.in_channels if quant_type == "input" else layer.out_channels)
        elif isinstance(layer, nn.Linear):
            axis = activation_channel_axis(layer)
            channels = int(layer.in_features if quant_type == "input" else layer.out_features)
        else:
            raise ConfigError(f"{what}: layer {name!r} ({type(layer).__name__}): per-channel {quant_type} "
                              f"quantization needs a Conv or Linear layer (channel count unknown); use a per_tensor scheme")
    return QuantSpec(quant_type, bits, dtype, scheme, qmin, qmax, symmetric, axis, channels)


def layer_device(layer: nn.Module) -> torch.device:
    """Where the layer's tensors live (new buffers go there)."""
    for t in layer.parameters():
        return t.device
    for t in layer.buffers():
        return t.device
    return torch.device("cpu")
