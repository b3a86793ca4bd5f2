"""PyTorch backend of compressor. Importing it imports torch, never tensorflow."""

from .cmpk import load_compressed, save_compressed
from .graph import build_graph
from .ops import TorchOps, ops
from .pruning import *  # noqa: F401,F403
from .pruning import __all__ as _pruning_all
from .quantization import *  # noqa: F401,F403
from .quantization import __all__ as _quant_all
from .semi_structured import to_semi_structured
from .speedup import count_flops_params, speedup_model, speedup_report
from .weight_sharing import WeightSharingQuantizer

__all__ = ["TorchOps", "ops", *_pruning_all, *_quant_all, "build_graph", "count_flops_params", "speedup_model",
           "speedup_report", "load_compressed", "save_compressed", "WeightSharingQuantizer",
           "to_semi_structured", "oneshot"]  # noqa: F405  (oneshot: module __getattr__ below)


def __getattr__(name: str):  # noqa: ANN202
    # ``compressor.torch.oneshot``: the streamed checkpoint compression needs transformers, safetensors and
    # accelerate (the hf / llm extras), imported when it is first asked for, not with the backend
    if name == "oneshot":
        from .hf_oneshot import oneshot

        return oneshot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
