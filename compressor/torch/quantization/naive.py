"""``NaiveQuantizer``: 8-bit symmetric weights with scale = running max of ``max|w| / 127``.

Rounds to nearest (NNI truncated with ``.to(int8)``); range [-127, 127]; the running scale is the
buffer ``weight_scale`` (``weight_zero_point`` is 0). Weights only, 8 bits only.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core import quant as cq
from ...core.quantizer import NAIVE_QRANGE, NaiveQuantizerRules
from .fakequant import fake_quant, ops
from .quantizer import TorchQuantizer, builtin_ste
from .settings import layer_device
from .wrapper import QuantizerModuleWrapper

__all__ = ["NaiveQuantizer"]

QMIN, QMAX = NAIVE_QRANGE


class NaiveQuantizer(NaiveQuantizerRules, TorchQuantizer):
    """Quantize weights to int8 with one running scale per layer."""

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
