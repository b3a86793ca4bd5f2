"""Per-layer sparsity / bit-width report of an EXPORTED model file (what ``compressor report`` prints).

Reads, without needing the model's Python class:

* PyTorch ``state_dict`` files (``.pt`` / ``.pth``, loaded with ``weights_only=True``): one row per
  ``<layer>.weight`` tensor; a wrapped model's ``<layer>.module.weight`` and ``<layer>.weight_mask``
  entries are understood too;
* Keras 3 ``.keras`` files: one row per layer with a main weight (kernel, depthwise kernel, embeddings,
  BatchNormalization gamma), layer paths as the TF backend names them (``block1/conv``);
* ``.npz`` archives of weights (``{layer: array}``);
* deployable artifacts, read as the runtime gets them: ONNX (``.onnx``; an integer QDQ export's int8 weight
  codes appear as int8 rows (also when stored as uint8 + 128), its float weights as float rows) and TFLite flatbuffers (``.tflite``; the
  weight operand of every CONV_2D / DEPTHWISE_CONV_2D / FULLY_CONNECTED / BATCH_MATMUL op, int8 in a
  full-integer model; read by a bounds-checked flatbuffer reader, without TensorFlow). Zero codes (code == zero point) count as pruned weights.

File sizes (``--artifact``): the model file and any exported artifacts side by side, in bytes and as a
ratio to the model file, so one report shows sparsity, bits, params, MACs and size together.

Masks (``--masks``): the torch export format ``{layer: {'weight': mask, 'bias': mask}}`` (``.pt``) or
the TF one, ``.npz`` with ``{layer: weight mask, 'layer:bias': bias mask}``. Calibration
(``--calibration``): the torch quantizer's export (``{layer: {'weight_bits': b, ...}}``, ``.pt`` or
``.json``). Without calibration, the bit width is estimated from the number of distinct non-zero
values (``b`` bits hold at most ``2**b`` levels); with too few weights to tell, the dtype's width is
shown. Everything here runs on the host: it is a reporting tool, not part of training.

MACs and parameters, dense vs. after structured speedup (``compressor report --flops``): :func:`file_flops`
loads a ``.keras`` file as is; a torch state_dict needs the model's class (``model_fn``, a
``module:callable`` that builds the model) and an input shape. :func:`pruner_report` is the same for a
live pruner (its sparsity report with the MACs underneath). The speedup always runs on a copy.

The readers live one per file format (:mod:`.torch_files`, :mod:`.keras_files`, :mod:`.onnx_files`,
:mod:`.tflite_files`, chosen in :mod:`.files`), the rows and their table in :mod:`.table`, the MACs in
:mod:`.flops`; this package exports their public names.
"""

from .files import read_calibration, read_masks, read_weights, read_weights_info
from .flops import file_flops, parse_input_shape, pruner_report
from .keras_files import load_keras
from .onnx_files import ONNX_MAX_BYTES
from .table import LayerStats, as_dicts, file_sizes, format_sizes, format_table, layer_stats, plot
from .tflite_files import TFLITE_MAX_BYTES
from .torch_files import TORCH_SUFFIXES

__all__ = ["LayerStats", "read_weights", "read_weights_info", "read_masks", "read_calibration", "layer_stats", "format_table",
           "plot", "file_flops", "pruner_report", "parse_input_shape", "file_sizes", "format_sizes", "as_dicts",
           "load_keras", "ONNX_MAX_BYTES", "TFLITE_MAX_BYTES", "TORCH_SUFFIXES"]
