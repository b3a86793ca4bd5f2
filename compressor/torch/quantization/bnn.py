"""``BNNQuantizer``: binarized weights and outputs (Courbariaux, Hubara et al. 2016).

Forward: ``sign`` with ``sign(0) = +1`` (:func:`compressor.core.quant.binarize`) for weights and outputs.
Backward (:class:`BNNGrad`): outputs use the hard-tanh straight-through estimator, gradient 0 where
``|x| > 1`` (:func:`compressor.core.quant.hardtanh_pass`); weights pass the gradient straight through
to the latent float weights, which the optimizer keeps training. ``quant_bits`` must be 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core import quant as cq
from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from .fakequant import ops
from .grad import QuantGrad, QuantType
from .quantizer import TorchQuantizer
from .wrapper import QuantizerModuleWrapper

__all__ = ["BNNQuantizer", "BNNGrad"]


class BNNGrad(QuantGrad):
    """Hard-tanh STE for outputs, plain STE for weights."""

    @staticmethod
    def quant_backward(tensor: torch.Tensor, grad_output: torch.Tensor, quant_type: QuantType,
                       **kwargs: Any) -> torch.Tensor:
        if quant_type == QuantType.QUANT_OUTPUT:
            return grad_output * cq.hardtanh_pass(ops, tensor).to(grad_output.dtype)
        return grad_output


class BNNQuantizer(TorchQuantizer):
    """Binarize weights and/or outputs of the selected layers."""

    supported_quant_types = ("weight", "output")
    quant_grad = BNNGrad

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        bad = {t: b for t, b in config["quant_bits"].items() if b != 1}
        if bad:
            raise ConfigError(f"BNNQuantizer: layer {layer_info.name!r}: quant_bits {bad}; BNN binarizes, use 1")

    def quantize_weight(self, weight: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        return cq.binarize(ops, weight)

    def quantize_output(self, output: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        return cq.binarize(ops, output)
