"""PyTorch side of the one-shot compressors: block finding and block calls (``blocks.py``), the
:class:`~compressor.core.oneshot.OneShotBackend` adapter (``backend.py``) and the mixin the five compressors share
(``mixin.py``); calibration data is :mod:`compressor.torch.calibration_data`, the compressors themselves
:mod:`compressor.torch.pruning.oneshot` and :mod:`compressor.torch.quantization.oneshot`.

The math (Wanda, SparseGPT, GPTQ, RTN, AWQ) and the block-by-block loop live in :mod:`compressor.core.oneshot`;
this package only moves tensors:

* **blocks**: the model's repeated decoder layers, found without naming a model family: the longest
  ``nn.ModuleList`` whose children all have one class and hold selected layers (Hugging Face Llama / Qwen2
  ``model.layers``, GPT-2 ``transformer.h``, OPT ``model.decoder.layers``), or the modules whose class name
  is in ``sequential_targets`` (``['LlamaDecoderLayer']``, as llmcompressor names them). No blocks: the
  whole model is one pass.
* **first inputs**: the model runs on each calibration batch until block 0, where a forward pre-hook
  (``with_kwargs=True``) keeps the block's ``(args, kwargs)`` and stops the forward; they stay on the
  model's device. Hugging Face models are called with ``use_cache=False`` (a key/value cache would grow at
  every re-run of a block).
* **running a block**: the block is called with the stored ``(args, kwargs)``, the hidden state (the first
  positional argument, else ``hidden_states=``) replaced by the previous block's output (a tensor, or a
  tuple whose ``[0]`` is the hidden state). Layer inputs are read with forward pre-hooks on the wrappers and
  handed to core as float32 (float64 for a float64 model) numpy rows ``[tokens, in]``. Padded tokens are
  left out of the statistics when the batch has a 2-D ``attention_mask`` (``0`` = padding) whose shape
  matches the layer input's leading axes.
* **weights**: read and written in the canonical ``[out, in]`` layout (:mod:`compressor.torch.layout`:
  HF ``Conv1D`` is transposed).

No tracing (torch.fx), and one block's calibration activations in memory at a time.
"""

from ...core.oneshot import OneShotReport
from ..calibration_data import calibration_batches, forward_inputs
from .backend import TorchOneShotBackend
from .blocks import find_blocks
from .mixin import ONESHOT_DEFAULT_TYPES, OneShotMixin, oneshot_key_specs

__all__ = ["ONESHOT_DEFAULT_TYPES", "calibration_batches", "forward_inputs", "find_blocks", "TorchOneShotBackend",
           "OneShotMixin", "OneShotReport", "oneshot_key_specs"]
