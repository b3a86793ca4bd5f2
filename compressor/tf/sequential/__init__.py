"""One-shot compression of Keras 3 models from a calibration set: ``WandaPruner``,
``SparseGPTPruner``, ``GptqQuantizer``, ``RtnQuantizer``, ``AwqQuantizer``.

The math and the block-by-block loop are core's (:mod:`compressor.core.oneshot`,
:mod:`compressor.core.oneshot`); this module is the Keras adapter (:class:`KerasOneShotBackend`) and
the compressor classes. No tracing of the model:

* **blocks** (decoder layers): the classes named by ``sequential_targets=['TransformerDecoder']``, else
  found without naming a family: the largest group (at least two) of same-class children of one layer
  that contain selected layers (keras-hub's ``transformer_layers``, the repeated blocks of a Functional or
  subclassed model). Before anything changes the model is run once on the first calibration batch with
  every block's ``call`` wrapped, to check that the blocks form a chain (each called once, in order, each
  one's first input the output of the one before, the same other arguments) and that every selected layer
  is called; found blocks that fail the check are dropped (whole-model pass, with a warning), named ones
  are a ``ModelError``.
* **first block inputs**: the model runs on each batch with block 0's ``call`` wrapped to record its
  ``(args, kwargs)`` and stop. A block runs on the stored arguments with the hidden state (its first
  argument) replaced; its output (or the first element of a tuple output) is the next block's hidden state.
* **layer inputs**: each selected layer's ``call`` (and ``quantized_call``, used by Keras-quantized layers)
  is wrapped on the instance while a block runs, passing rows ``[tokens, in]`` to the core accumulator (the
  layer's float32 input as it is, half precision widened to float32, as on torch). Every wrapped call is
  restored afterwards, also on errors.
* **weights** in core's canonical ``[out, in]`` layout: ``Dense`` ``[in, out]`` transposed
  (:mod:`compressor.tf.layout`); ``EinsumDense`` from its equation: the kernel axes contracted with the
  input (which must be the input's trailing axes) are ``in``, the ones in the output ``out`` (query
  ``'abc,cde->abde'``: ``[in, heads, head_dim]`` -> ``[heads * head_dim, in]``; output
  ``'abcd,cde->abe'``: ``[heads, head_dim, out]`` -> ``[out, heads * head_dim]``), as torch's Linear.

Pruners put the chosen masks in the usual :class:`PrunerLayerWrapper` and the (SparseGPT-updated) weights
in the kernel. Quantizers are weight-only: the kernel holds the method's dequantized weight (the values the
model computes with; no float copy is kept), and the wrapper keeps the integer grid for packing as
non-trainable variables: ``weight_codes`` (``[out, in]`` canonical, int8 / uint8; at 4 bits or fewer two codes
per byte, ``[out, ceil(in / 2)]``: :func:`compressor.core.oneshot.store_codes`;
:func:`compressor.tf.quantization.lowbit.oneshot_codes` gives them back one per entry), ``weight_group_scale``
and ``weight_group_zero_point`` (``[out, groups]``, float64 / int32) and, for AWQ, ``awq_scales`` (``s``,
``[in]``, float64: the kernel is ``Q(W s) / s``).
"""


from ...core.oneshot import OneShotReport
from ..kernel_layout import ONESHOT_DEFAULT_TYPES, KernelLayout, kernel_layout
from .backend import KerasOneShotBackend
from .blocks import find_blocks
from .mixin import OneShotMixin

__all__ = ["KernelLayout", "kernel_layout", "find_blocks", "KerasOneShotBackend", "OneShotReport", "ONESHOT_DEFAULT_TYPES",
           "OneShotMixin"]
