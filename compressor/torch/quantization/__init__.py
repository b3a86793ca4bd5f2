"""PyTorch quantization: the ``TorchQuantizer`` framework (seeds 002/003) and the built-in quantizers.

Math lives in :mod:`compressor.core.quant`; this package adapts it to modules (wrappers), autograd
(:class:`QuantGrad`, fused fake-quant kernels) and export (state_dict, calibration config, QDQ ONNX).
"""

from .bnn import BNNGrad, BNNQuantizer
from .dorefa import DoReFaQuantizer
from .grad import QuantGrad, QuantType
from .lowbit import PackedExperts, PackedLinear, oneshot_codes, pack_weights
from .lsq import LsqQuantizer
from .naive import NaiveQuantizer
from .oneshot import AwqQuantizer, GptqQuantizer, RtnQuantizer
from .ptq import PtqQuantizer
from .qat import QAT_Quantizer
from .quantizer import Quantizer, TorchQuantizer
from .wrapper import QuantizerModuleWrapper

__all__ = [
    "BNNGrad", "BNNQuantizer", "DoReFaQuantizer", "LsqQuantizer", "NaiveQuantizer", "PtqQuantizer", "QAT_Quantizer",
    "QuantGrad", "QuantType", "Quantizer", "QuantizerModuleWrapper", "TorchQuantizer", "GptqQuantizer",
    "RtnQuantizer", "AwqQuantizer", "oneshot_codes", "PackedLinear", "PackedExperts", "pack_weights",
]
