"""One-shot weight-only quantizers for Keras language models: :class:`GptqQuantizer`, :class:`RtnQuantizer` and
:class:`AwqQuantizer` (:mod:`compressor.tf.sequential` runs them block by block; the math is
:mod:`compressor.core.oneshot`). The wrapper keeps the integer grid for :mod:`compressor.tf.lowbit`."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from ...core.oneshot import (
    ONESHOT_KEYS,
    QUANT_SCHEME_KEY,
    AwqMethod,
    GptqMethod,
    LayerResult,
    OneShotReport,
    RtnMethod,
    store_codes,
    weight_only_config,
)
from ..kernel_layout import KernelLayout
from ..sequential.mixin import OneShotMixin
from .quantizer import TfQuantizer
from .wrapper import QuantizerLayerWrapper

__all__ = ["GptqQuantizer", "RtnQuantizer", "AwqQuantizer"]


class _OneShotQuantizer(OneShotMixin, TfQuantizer):
    #: its wrappers hold integer codes / group scales / zero points (what compressor.tf.lowbit exports)
    holds_integer_codes = True
    required_keys = ("quant_bits",)
    supported_quant_types = ("weight",)
    config_keys: tuple[Any, ...] = (QUANT_SCHEME_KEY, ONESHOT_KEYS["group_size"], ONESHOT_KEYS["quant_range"])

    def __init__(self, model: Any, config_list: list[dict[str, Any]], sequential_targets: Any = None) -> None:
        self._init_oneshot(sequential_targets)
        super().__init__(model, weight_only_config(config_list), None)

    def quantize_weight(self, weight: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        return tf.identity(weight)  # the kernel holds the dequantized weight once calibrated

    def _write(self, wrapper: QuantizerLayerWrapper, plan: KernelLayout, result: LayerResult) -> None:
        q = result.quantized
        kernel = getattr(wrapper.weight, "_value", wrapper.weight)
        kernel.assign(tf.cast(plan.from_canonical(result.weight), kernel.dtype))
        code_dtype = tf.int8 if q.spec.symmetric else tf.uint8
        wrapper.add_state("weight_codes", tf.constant(store_codes(q.codes, q.spec.bits)), code_dtype)
        wrapper.add_state("weight_group_scale", tf.constant(q.scale, tf.float64))
        wrapper.add_state("weight_group_zero_point", tf.constant(np.rint(q.zero_point).astype(np.int32)))
        wrapper._setattr_raw("weight_group_size", int(q.group_size))
        if result.scales is not None:
            wrapper.add_state("awq_scales", tf.constant(result.scales, tf.float64))

    def report(self) -> OneShotReport:
        """One row per compressed layer (bits, group size, the method's error / alpha)."""
        return OneShotReport(self.rows)

    def to_keras_quantized(self, fast: bool = False) -> list[dict[str, Any]]:
        """The calibrated layers as Keras 3's own int8 / int4 / GPTQ / AWQ layers holding these codes (final:
        the wrappers go); ``model.save('m.keras')`` then loads in stock Keras. See
        :func:`compressor.tf.lowbit.to_keras_quantized`."""
        from .lowbit import to_keras_quantized

        return to_keras_quantized(self, fast=fast)


class GptqQuantizer(_OneShotQuantizer):
    """GPTQ (Frantar et al. 2022): weight-only quantization (2..8 bits) with OBS error feedback from each layer's
    Hessian. Config: ``quant_bits``, ``group_size``, ``quant_scheme`` (symmetric / affine), ``damp``,
    ``block_size``, ``act_order``. A layer pruned before (a pruner's mask on it) keeps its zeros."""

    method = GptqMethod()
    config_keys = (*_OneShotQuantizer.config_keys, ONESHOT_KEYS["damp"], ONESHOT_KEYS["block_size"],
                   ONESHOT_KEYS["act_order"])


class RtnQuantizer(_OneShotQuantizer):
    """Round to nearest, weight-only, per group: the baseline; needs no calibration data (``calibrate()``)."""

    method = RtnMethod()


class AwqQuantizer(_OneShotQuantizer):
    """AWQ (Lin et al. 2023): per-input-channel scales ``s`` searched on each layer's output error, then round to
    nearest; the kernel holds ``Q(W s) / s``. Config: ``quant_bits``, ``group_size``, ``quant_scheme``,
    ``n_grid``, ``duo_scaling``, ``apply_clip``."""

    method = AwqMethod()
    config_keys = (*_OneShotQuantizer.config_keys, ONESHOT_KEYS["n_grid"], ONESHOT_KEYS["duo_scaling"],
                   ONESHOT_KEYS["awq_search"], ONESHOT_KEYS["search_samples"], ONESHOT_KEYS["apply_clip"])

