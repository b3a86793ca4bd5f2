"""``NaiveQuantizer``: 8-bit symmetric weights with scale = running max of ``max|w| / 127``.

Mirror of the torch ``NaiveQuantizer``: rounds to nearest (NNI truncated), range [-127, 127]; the running
scale is the wrapper variable ``weight_scale`` (``weight_zero_point`` is 0), updated in-graph at every
call (:func:`compressor.core.quant.naive_scale`). Weights only, 8 bits only.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...core import quant as cq
from ...core.quantizer import NAIVE_QRANGE, NaiveQuantizerRules
from ..ops import ops
from .fakequant import fake_quant
from .quantizer import TfQuantizer
from .wrapper import QuantizerLayerWrapper

__all__ = ["NaiveQuantizer"]

QMIN, QMAX = NAIVE_QRANGE


class NaiveQuantizer(NaiveQuantizerRules, TfQuantizer):
    """Quantize weights to int8 with one running scale per layer."""

    def init_wrapper(self, wrapper: QuantizerLayerWrapper) -> None:
        wrapper.add_state("weight_scale", tf.zeros([]))
        wrapper.add_state("weight_zero_point", tf.zeros([]))
        wrapper.qranges["weight"] = (QMIN, QMAX)

    def quantize_weight(self, weight: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        running = wrapper.weight_scale.read_value()
        scale = cq.naive_scale(ops, tf.stop_gradient(tf.cast(weight, tf.float32)), running)
        if self._any_frozen:
            scale = tf.where(wrapper.frozen, running, scale)
        wrapper.weight_scale.assign(scale)
        return fake_quant(weight, scale, wrapper.weight_zero_point.read_value(), QMIN, QMAX, fused=self.fused)
