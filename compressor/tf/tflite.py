"""TFLite conversion of Keras models with recurrent layers (LSTM, GRU, SimpleRNN, RNN, Bidirectional).

Keras 3 runs a recurrent layer as a ``while`` loop over tensor lists, which the TFLite converter cannot
lower to builtin ops ("Lowering tensor list ops is failed"). What the exporters do instead:

* **fixed sequence length** (the model's input has a static time axis): the recurrent layers are
  converted *unrolled*: ``unroll=True`` (and ``use_cudnn=False``, so no fused cuDNN kernel) is set on them
  for the duration of the conversion only, so the graph is a chain of builtin ops (FULLY_CONNECTED,
  LOGISTIC, TANH, ...). Float, dynamic-range and full-integer int8 models all convert and run in the
  stock ``tf.lite.Interpreter``. The model itself is left as it was.
* **variable sequence length**: unrolling is impossible; float and dynamic-range models are converted
  with the converter's documented setting for tensor-list ops (``SELECT_TF_OPS`` and
  ``_experimental_lower_tensor_list_ops = False``): the artifact needs the TFLite Flex delegate
  (``tensorflow-lite-select-tf-ops`` on Android), and a warning says so. Full-integer int8 has no
  tensor-list kernels at all, so it is refused with a :class:`ConfigError` naming the layers and the fix
  (a fixed sequence length, ``keras.Input((T, ...))``), before the converter runs.

:func:`quantize_kernels` is the other half of this module: a full-integer conversion that runs only the
weighted kernels in int8 and keeps every other op float (see there).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import tensorflow as tf

from ..core.errors import ConfigError
from .compressor import iter_layers

__all__ = ["KERNEL_OPS", "convert_recurrent", "quantize_kernels", "recurrent_layers", "unrolled"]


def recurrent_layers(model: Any) -> list[tuple[str, Any]]:
    """``(path, layer)`` of every Keras recurrent layer (``keras.layers.RNN`` subclasses) in ``model``."""
    import keras

    return [(p, layer) for p, layer in iter_layers(model) if isinstance(layer, keras.layers.RNN)]


def _time_axis(layer: Any) -> Any:
    """The static time dimension of the input the model feeds ``layer`` (or its Bidirectional), if the
    model's graph says; ``...`` when it cannot tell (a subclassed model, a layer called inside another)."""
    try:
        shape = layer.input.shape if not isinstance(layer.input, (list, tuple)) else layer.input[0].shape
    except Exception:  # no (single) inbound node: called inside another layer, or several times
        return ...
    if len(shape) < 3:
        return ...
    return shape[0] if getattr(layer, "time_major", False) else shape[1]


def _variable_length(model: Any) -> list[str]:
    """Paths of the recurrent (and Bidirectional) layers whose input has an undefined time axis."""
    import keras

    out = []
    for path, layer in iter_layers(model):
        if isinstance(layer, (keras.layers.RNN, keras.layers.Bidirectional)) and _time_axis(layer) is None:
            out.append(path)
    return out


@contextmanager
def unrolled(layers: list[Any]) -> Iterator[None]:
    """Within the block, ``layers`` (recurrent) run unrolled and without cuDNN; restored afterwards."""
    saved = [(layer, layer.unroll, getattr(layer, "use_cudnn", None)) for layer in layers]
    try:
        for layer, _, cudnn in saved:
            layer.unroll = True
            if cudnn is not None:
                layer.use_cudnn = False
        yield
    finally:
        for layer, unroll, cudnn in saved:
            layer.unroll = unroll
            if cudnn is not None:
                layer.use_cudnn = cudnn


def convert_recurrent(model: Any, make_converter: Callable[[], Any], full_integer: bool = False) -> bytes | None:
    """TFLite flatbuffer of ``model`` if it has recurrent layers (see the module doc), else None (convert it
    the usual way). ``make_converter()`` builds the configured ``tf.lite.TFLiteConverter``; it is called
    while the layers are unrolled (so a SavedModel it exports is traced unrolled). ``full_integer``: the
    converter is set up for int8 inputs/kernels (``TFLITE_BUILTINS_INT8``)."""
    rnns = recurrent_layers(model)
    if not rnns:
        return None
    dynamic = _variable_length(model)
    if not dynamic:
        with unrolled([layer for _, layer in rnns]):
            return make_converter().convert()
    names = [p for p, _ in rnns]
    if full_integer:
        raise ConfigError(
            f"export_model: a full-integer int8 TFLite model (representative_dataset) of recurrent layers {names} "
            f"needs a fixed sequence length: {dynamic} get inputs with an undefined time axis, and TFLite has no "
            f"int8 kernels for the loop a variable-length recurrent layer becomes. Give the model's input a "
            f"fixed length (keras.Input((T, ...))), or export without representative_dataset")
    converter = make_converter()
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS, tf.lite.OpsSet.SELECT_TF_OPS]
    converter._experimental_lower_tensor_list_ops = False
    warnings.warn(
        f"export_model: recurrent layers {dynamic} have a variable sequence length, so the TFLite model keeps "
        f"their loop as select TF ops: running it needs the TFLite Flex delegate (Android: "
        f"tensorflow-lite-select-tf-ops). With a fixed length (keras.Input((T, ...))) they convert to builtin ops",
        RuntimeWarning, stacklevel=3)
    return converter.convert()


#: TFLite ops that hold a layer's weight: int8 kernels in :func:`quantize_kernels` when an operand is constant
#: (a GATHER from a constant table is an Embedding lookup: its table stays int8, which keeps the file small)
KERNEL_OPS = ("FULLY_CONNECTED", "CONV_2D", "DEPTHWISE_CONV_2D", "TRANSPOSE_CONV", "CONV_3D", "BATCH_MATMUL", "GATHER")


def quantize_kernels(converter: Any, input_type: Any, output_type: Any,
                     layer_names: Any = ()) -> tuple[bytes, dict[str, list[str]]]:
    """Full-integer conversion in which only the weighted kernels run in int8: every op of
    :data:`KERNEL_OPS` with a constant operand (a Conv / Dense / EinsumDense kernel, a recurrent layer's
    unrolled input and state matmuls, an embedding table) is int8 with int8 inputs and outputs; every other
    op (normalization, softmax, attention score matmuls between two activations, residual adds, recurrent
    gates, ...) stays float, with QUANTIZE / DEQUANTIZE at the borders. Those are exactly the tensors a
    fake-quant model quantizes (the inputs, weights and outputs of its quantized layers), so the artifact
    agrees with it; the converter's int8 versions of the other ops add errors it does not simulate (0.19
    relative on a small transformer, 0.23 on an LSTM classifier, vs 0.02 / 0.01 this way).

    TFLite's selective quantization (the mechanism of ``tf.lite.experimental.QuantizationDebugger`` with
    ``denylisted_ops`` / ``denylisted_nodes``): ``converter`` (set up for full-integer conversion, with a
    representative dataset) calibrates only; the calibrated model is quantized with every non-kernel op type
    and the kernel ops without a constant operand denylisted. Returns the flatbuffer and
    ``{TFLite op: [layer names]}`` of what stays float (``layer_names``: the model's layer names, to name
    the layer an op belongs to; the op's name scope otherwise). Where this TensorFlow lacks the pieces
    (``mlir_quantize``, ``_experimental_calibrate_only``), a RuntimeWarning says so and every op is int8."""
    try:
        from tensorflow.lite.python.convert import mlir_quantize
    except ImportError:
        mlir_quantize = None
    if mlir_quantize is None or not hasattr(converter, "_experimental_calibrate_only"):
        warnings.warn(f"TFLite export: TensorFlow {tf.__version__} has no selective quantization (mlir_quantize "
                      f"with denylisted ops), so every op of the .tflite is int8, also those the fake-quant model "
                      f"keeps float (softmax, normalization, recurrent gates)", RuntimeWarning, stacklevel=3)
        return converter.convert(), {}
    converter._experimental_calibrate_only = True
    calibrated = converter.convert()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the interpreter's deprecation notice
        interp = tf.lite.Interpreter(model_content=calibrated)
    details = {t["index"]: t for t in interp.get_tensor_details()}
    tensors = {i: t["name"] for i, t in details.items()}
    ops = interp._get_ops_details()
    variable = {i for op in ops for i in op["outputs"]} | {d["index"] for d in interp.get_input_details()}
    names = set(layer_names)
    float_types = sorted({op["op_name"] for op in ops} - set(KERNEL_OPS))
    float_nodes: list[str] = []
    kept: dict[str, list[str]] = {}
    for op in ops:
        kind = op["op_name"]
        if kind in KERNEL_OPS:
            if any(i not in variable for i in op["inputs"][:2] if i >= 0):
                continue  # a weighted kernel: int8
            float_nodes.append(tensors[op["outputs"][0]])
        if kind not in _LAYOUT and details[op["outputs"][0]]["dtype"] == np.float32:  # reported: float arithmetic
            layer = _layer_of(tensors[op["outputs"][0]], names)
            kept.setdefault(kind, [])
            if layer not in kept[kind]:
                kept[kind].append(layer)
    blob = mlir_quantize(calibrated, input_data_type=input_type, output_data_type=output_type,
                         denylisted_ops=float_types, denylisted_nodes=float_nodes)
    return blob, kept


#: data movement: float or int8 computes the same values, not reported as float arithmetic
_LAYOUT = {"RESHAPE", "TRANSPOSE", "SQUEEZE", "EXPAND_DIMS", "PACK", "UNPACK", "SPLIT", "SPLIT_V", "SLICE",
           "STRIDED_SLICE", "CONCATENATION", "GATHER", "GATHER_ND"}


def _layer_of(node: str, names: set[str]) -> str:
    """The Keras layer a TFLite node name belongs to: the first scope after the model's (``model/mha_1/...``
    -> ``mha``; Keras 3 suffixes ``_1``, ``_2`` to scopes, so they are stripped until a layer name matches)."""
    parts = node.split(";")[0].split("/")
    if len(parts) < 2:
        return parts[0]
    scope = parts[1]
    candidate = scope
    while candidate not in names:
        m = re.fullmatch(r"(.+)_\d+", candidate)
        if m is None:
            return scope
        candidate = m.group(1)
    return candidate
