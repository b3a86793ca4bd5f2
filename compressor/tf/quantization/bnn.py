"""``BNNQuantizer``: binarized weights and outputs (Courbariaux, Hubara et al. 2016) on Keras 3.

Forward: ``sign`` with ``sign(0) = +1`` (:func:`compressor.core.quant.binarize`) for weights and outputs.
Backward (:class:`BNNGrad`, through ``tf.custom_gradient``): outputs use the hard-tanh straight-through
estimator, gradient 0 where ``|x| > 1`` (:func:`compressor.core.quant.hardtanh_pass`); weights pass the
gradient straight through to the latent float kernels, which the optimizer keeps training.
``quant_bits`` must be 1.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...core import quant as cq
from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ..ops import ops
from .grad import QuantGrad, QuantType
from .quantizer import TfQuantizer
from .wrapper import QuantizerLayerWrapper

__all__ = ["BNNQuantizer", "BNNGrad"]


class BNNGrad(QuantGrad):
    """Hard-tanh STE for outputs, plain STE for weights."""

    @staticmethod
    def quant_backward(tensor: tf.Tensor, grad_output: tf.Tensor, quant_type: QuantType, **kwargs: Any) -> tf.Tensor:
        if quant_type == QuantType.QUANT_OUTPUT:
            return tf.where(cq.hardtanh_pass(ops, tensor), grad_output, tf.zeros_like(grad_output))
        return grad_output


class BNNQuantizer(TfQuantizer):
    """Binarize weights and/or outputs of the selected layers."""

    supported_quant_types = ("weight", "output")
    quant_grad = BNNGrad

    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)
        bad = {t: b for t, b in config["quant_bits"].items() if b != 1}
        if bad:
            raise ConfigError(f"BNNQuantizer: layer {layer_info.name!r}: quant_bits {bad}; BNN binarizes, use 1")

    def quantize_weight(self, weight: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        return cq.binarize(ops, weight)

    def quantize_output(self, output: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        return cq.binarize(ops, output)
