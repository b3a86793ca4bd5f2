"""``DoReFaQuantizer``: DoReFa-Net weights (Zhou et al. 2016).

``w_q = 2 * q_k(tanh(w) / (2 max|tanh w|) + 1/2) - 1`` with ``q_k(x) = round(x (2^k - 1)) / (2^k - 1)``
(:func:`compressor.core.quant.dorefa_weight_ste`); the gradient is the paper's: straight-through on the
rounding only, exact through the tanh normalisation. Weights only. Exported weights hold the transformed
values (their grid has a half-integer zero point, so ONNX gets them as plain constants).
"""

from __future__ import annotations

from typing import Any

import torch

from ...core import quant as cq
from .fakequant import ops
from .quantizer import TorchQuantizer, builtin_ste
from .wrapper import QuantizerModuleWrapper

__all__ = ["DoReFaQuantizer"]


class DoReFaQuantizer(TorchQuantizer):
    """Quantize weights with the DoReFa transform at ``quant_bits['weight']`` bits."""

    supported_quant_types = ("weight",)

    @builtin_ste
    def quantize_weight(self, weight: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        return cq.dorefa_weight_ste(ops, weight, wrapper.quant_bits["weight"])
