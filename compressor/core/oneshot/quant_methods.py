"""The one-shot weight-only quantization methods: GPTQ and round to nearest over
:mod:`compressor.core.oneshot.quantize`. A layer's grid is its task's :class:`~compressor.core.oneshot.codes.QuantSpec`,
resolved once."""

from __future__ import annotations

import numpy as np

from .arrays import DEFAULT_BLOCK_SIZE, DEFAULT_DAMP
from .method import OneShotMethod
from .protocol import LayerResult
from .quantize import gptq_quantize, rtn_quantize


class GptqMethod(OneShotMethod):
    """GPTQ (Frantar et al. 2022): weight-only quantization with OBS error feedback. A layer already pruned
    (a keep-mask from a pruner on the same layer) keeps its zeros."""

    name = "gptq"
    kind = "quantizer"
    #: the solver makes its own float64 copy of the weight (transposed): it takes the float32 read as it is
    copies_weight = True

    def compress(self, task, weight, mask, stats):
        c = task.config
        q = gptq_quantize(weight, stats.gram_for_solver(), task.quant_spec("GptqQuantizer"),
                              damp=c.get("damp", DEFAULT_DAMP), block_size=c.get("block_size", DEFAULT_BLOCK_SIZE),
                              act_order=c.get("act_order", False), mask=mask)
        return LayerResult(weight=q.dequantized, mask=mask, quantized=q, info={"error": q.error})


class RtnMethod(OneShotMethod):
    """Round to nearest, weight-only, per group (the baseline; needs no calibration data)."""

    name = "rtn"
    kind = "quantizer"
    statistics = None

    def compress(self, task, weight, mask, stats):
        w = weight if mask is None else np.where(mask, weight, 0.0)
        q = rtn_quantize(w, task.quant_spec("RtnQuantizer"))
        return LayerResult(weight=q.dequantized, mask=mask, quantized=q)

