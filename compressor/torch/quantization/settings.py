"""Per-layer, per-quant-type settings resolved from a config entry (bits, dtype, scheme -> range, axis).

Bits, dtype, scheme and their defaults are resolved in core (:mod:`compressor.core.quant_config`, which
also says the defaults). Channel axes on torch: weights use their output-channel axis (0; 1 for
transposed convolutions and HF Conv1D, stored ``[in, out]``); per-channel activations use axis 1 for
convolutions (NCHW) and the last axis for Linear and HF Conv1D.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...core.errors import ConfigError
from ...core.quant_config import DEFAULT_DTYPE, DEFAULT_SCHEME, QuantSpec, base_spec
from ..layout import in_out_features
from .wrapper import activation_channel_axis, weight_channel_axis

__all__ = ["DEFAULT_DTYPE", "DEFAULT_SCHEME", "QuantSpec", "layer_device", "resolve_spec"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def resolve_spec(config: dict[str, Any], quant_type: str, layer: nn.Module, name: str,
                 default_dtype: str = DEFAULT_DTYPE, default_scheme: str = DEFAULT_SCHEME,
                 narrow: bool = True, what: str = "quantizer") -> QuantSpec:
    """The :class:`QuantSpec` of ``quant_type`` for ``layer`` under ``config`` (ConfigError if impossible)."""
    spec, per_channel = base_spec(config, quant_type, name, default_dtype, default_scheme, narrow, what)
    if not per_channel:
        return spec
    if quant_type == "weight":
        axis = weight_channel_axis(layer)
        channels = int(layer.weight.shape[axis])
    elif isinstance(layer, _CONVS):
        axis = activation_channel_axis(layer)
        channels = int(layer.in_channels if quant_type == "input" else layer.out_channels)
    elif in_out_features(layer) is not None:  # nn.Linear, HF Conv1D (features on the last axis)
        axis = activation_channel_axis(layer)
        channels = in_out_features(layer)[0 if quant_type == "input" else 1]
    else:
        raise ConfigError(f"{what}: layer {name!r} ({type(layer).__name__}): per-channel {quant_type} "
                          f"quantization needs a Conv or Linear layer (channel count unknown); use a per_tensor scheme")
    return replace(spec, axis=axis, channels=channels)


def layer_device(layer: nn.Module) -> torch.device:
    """Where the layer's tensors live (new buffers go there)."""
    for t in layer.parameters():
        return t.device
    for t in layer.buffers():
        return t.device
    return torch.device("cpu")
