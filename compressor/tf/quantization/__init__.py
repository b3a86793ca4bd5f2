"""TensorFlow / Keras 3 quantization: the ``TfQuantizer`` framework (seeds 002/003) and the built-in quantizers.

Mirror of ``compressor.torch.quantization`` (same names, config keys, state names and calibration
format). Math lives in :mod:`compressor.core.quant`; this package adapts it to Keras layers (wrappers
that substitute the fake-quantized kernel inside the layer's call), ``tf.custom_gradient``
(:class:`QuantGrad`), TF's fused fake-quant kernels, and export (plain Keras model, calibration JSON,
TFLite).
"""

from .bnn import BNNGrad, BNNQuantizer
from .dorefa import DoReFaQuantizer
from .export import read_calibration
from .grad import QuantGrad, QuantType
from .lsq import LsqQuantizer
from .naive import NaiveQuantizer
from .oneshot import AwqQuantizer, GptqQuantizer, RtnQuantizer
from .ptq import PtqQuantizer
from .qat import QAT_Quantizer
from .quantizer import Quantizer, TfQuantizer, builtin_autograd, builtin_ste
from .wrapper import QuantizerLayerWrapper, QuantizerModuleWrapper

__all__ = [
    "BNNGrad", "BNNQuantizer", "DoReFaQuantizer", "LsqQuantizer", "NaiveQuantizer", "PtqQuantizer", "QAT_Quantizer",
    "QuantGrad", "QuantType", "Quantizer", "QuantizerLayerWrapper", "QuantizerModuleWrapper", "TfQuantizer", "builtin_autograd",
    "builtin_ste", "read_calibration", "GptqQuantizer", "RtnQuantizer", "AwqQuantizer",
]
