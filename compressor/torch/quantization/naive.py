"""``NaiveQuantizer``: 8-bit symmetric weights with scale = running max of ``max|w| / 127``.

Rounds to nearest (NNI truncated with ``.to(int8)``); range [-127, 127]; the running scale is the
buffer ``weight_scale`` (``weight_zero_point`` is 0). Weights only, 8 bits only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core import quant as cq
from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from .fakequant import fake_quant, ops
from .quantizer import TorchQuantizer, builtin_ste
from .settings import layer_device
from .wrapper import QuantizerModuleWrapper

__all__ = ["NaiveQuantizer"]

QMIN, QMAX = cq.quant_range(8, "int")


class NaiveQuantizer(TorchQuantizer):
    """Quantize weights to int8 with one running scale per layer."""

    supported_quant_types = ("weight",)

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        bits = config["quant_bits"].get("weight")
        if bits != 8:
            raise ConfigError(f"NaiveQuantizer: layer {layer_info.name!r}: quant_bits = {bits}; "
                              f"NaiveQuantizer is 8-bit only (use QAT_Quantizer for other widths)")

    def init_wrapper(self, wrapper: QuantizerModuleWrapper) -> None:
        dev = layer_device(wrapper.layer)
        wrapper.register_buffer("weight_scale", torch.zeros((), device=dev))
        wrapper.register_buffer("weight_zero_point", torch.zeros((), device=dev))
        wrapper.qranges["weight"] = (QMIN, QMAX)

    @builtin_ste
    def quantize_weight(self, weight: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        scale = wrapper.weight_scale
        if not wrapper.frozen:
            with torch.no_grad():
                scale.copy_(cq.naive_scale(ops, weight.detach(), scale))
        return fake_quant(weight, scale, wrapper.weight_zero_point, QMIN, QMAX)
