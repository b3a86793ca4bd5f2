"""TensorFlow / Keras 3 backend of compressor. Importing it imports tensorflow, never torch."""

from .cmpk import load_compressed, save_compressed
from .graph import build_graph
from .ops import TfOps, ops
from .pruning import *  # noqa: F401,F403
from .pruning import __all__ as _pruning_all
from .quantization import *  # noqa: F401,F403
from .quantization import __all__ as _quant_all
from .quantization.lowbit import oneshot_codes, to_keras_quantized
from .speedup import count_flops_params, speedup_model
from .weight_sharing import WeightSharingQuantizer

__all__ = ["TfOps", "ops", *_pruning_all, *_quant_all, "build_graph", "count_flops_params", "speedup_model",
           "load_compressed", "save_compressed", "WeightSharingQuantizer",
           "to_keras_quantized", "oneshot_codes", "oneshot"]  # noqa: F405  (oneshot: module __getattr__ below)


def __getattr__(name: str):  # noqa: ANN202
    # ``compressor.tf.oneshot``: the streamed compression of a keras-hub preset (h5py, keras-hub's tokenizer),
    # imported when it is first asked for, not with the backend
    if name == "oneshot":
        from .hub_oneshot import oneshot

        return oneshot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
