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

__all__ = ["KERNEL_OPS", "compact_tflite", "convert_recurrent", "quantize_kernels", "recurrent_layers",
           "unrolled"]


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


#: TFLite ops whose second operand is a layer's weight: that tensor keeps (the first part of) its name in
#: :func:`compact_tflite`, so ``compressor report model.tflite`` still names the layers
_FILTER_OPS = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "BATCH_MATMUL", "TRANSPOSE_CONV", "CONV_3D")


def compact_tflite(blob: bytes) -> bytes:
    """``blob`` (a TFLite flatbuffer) rewritten smaller, for unrolled recurrent models above all, where the
    converter's bookkeeping outweighs the int8 weights (a bidirectional GRU: 22 KB of int8 weights in a 258 KB
    file):

    * short tensor names: the converter names every tensor after the ops fused into it
      (``model_1/bidirectional/forward_gru_1/...;model_1/.../MatMul;...``), 80 KB there;
    * one quantization table per distinct set of parameters: every unrolled step's tensor of a shared kernel
      carries its own copy of the per-channel scales and int64 zero points (60 KB there); tensors with equal
      parameters now point to one table, as the flatbuffer format allows (each tensor reads the same values).

    Names: every tensor becomes ``t<index>`` except: the inputs and outputs of each subgraph (``get_input_details()`` /
    ``get_output_details()`` names), the tensors a SignatureDef maps (its keys are stored apart from tensor
    names and are kept, so ``get_signature_runner()`` works), and the weight operand of each conv /
    fully-connected / batch-matmul op, which keeps the first ``;``-part of its name (the layer, for
    ``compressor report``). Ops, buffer contents, quantization values, signatures and metadata are unchanged, so
    the interpreter's outputs are bit-identical; buffer data is written 16-byte aligned (the schema's
    ``force_align: 16``).

    Uses TensorFlow's own schema module (``tensorflow.lite.python.schema_py_generated``, object API) and the
    ``flatbuffers`` package TensorFlow depends on; where those are missing, or the model keeps its buffers
    outside the flatbuffer (models over 2 GB), a RuntimeWarning says so and ``blob`` is returned as is."""
    try:
        import flatbuffers
        from tensorflow.lite.python import schema_py_generated as schema
    except ImportError as e:
        warnings.warn(f"TFLite export: the .tflite is not compacted (short tensor names, shared quantization "
                      f"tables): {e}; it is larger than it needs to be", RuntimeWarning, stacklevel=2)
        return blob
    model = schema.ModelT.InitFromPackedBuf(bytearray(blob), 0)
    if any((b.offset or 0) > 1 for b in (model.buffers or [])):
        warnings.warn("TFLite export: the .tflite is not compacted (short tensor names, shared quantization "
                      "tables): the model stores its buffers outside the flatbuffer (a model over 2 GB)", RuntimeWarning, stacklevel=2)
        return blob
    codes = [op.builtinCode if op.builtinCode else op.deprecatedBuiltinCode for op in (model.operatorCodes or [])]
    filters = {getattr(schema.BuiltinOperator, k) for k in _FILTER_OPS if hasattr(schema.BuiltinOperator, k)}
    shared: dict[Any, int] = {}  # quantization parameters -> offset of their table in the builder
    for si, sub in enumerate(model.subgraphs or []):
        keep = {int(i) for i in list(sub.inputs if sub.inputs is not None else [])
                + list(sub.outputs if sub.outputs is not None else [])}
        for sig in model.signatureDefs or []:
            if sig.subgraphIndex == si:
                keep |= {int(t.tensorIndex) for t in list(sig.inputs or []) + list(sig.outputs or [])}
        weights = {int(op.inputs[1]) for op in (sub.operators or [])
                   if codes[op.opcodeIndex] in filters and op.inputs is not None and len(op.inputs) > 1
                   and op.inputs[1] >= 0}
        for i, t in enumerate(sub.tensors or []):
            if i in keep:
                pass
            elif i in weights and t.name:
                name = t.name.decode() if isinstance(t.name, bytes) else t.name
                t.name = name.split(";")[0]
            else:
                t.name = f"t{i}"
            if t.quantization is not None:
                t.quantization = _SharedQuantization(t.quantization, shared)
    builder = flatbuffers.Builder(len(blob) + 1024)
    model.buffers = [_AlignedBuffer(builder, b, schema) for b in (model.buffers or [])]
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


class _SharedQuantization:
    """A tensor's ``QuantizationParametersT`` packed once per distinct content: ``Pack`` returns the table an
    equal one was packed into before (``shared``: content -> offset), so tensors share it. Parameters with
    ``details`` (custom quantization) are not compared and always get their own table."""

    def __init__(self, quant: Any, shared: dict[Any, int]) -> None:
        self.quant, self.shared = quant, shared
        if quant.details is not None:
            self.key: Any = id(quant)
        else:
            def arr(v: Any, dtype: str) -> Any:
                return None if v is None else np.asarray(v, dtype=dtype).tobytes()

            self.key = (arr(quant.min, "<f4"), arr(quant.max, "<f4"), arr(quant.scale, "<f4"),
                        arr(quant.zeroPoint, "<i8"), int(quant.quantizedDimension or 0), int(quant.detailsType or 0))

    def Pack(self, builder: Any) -> int:  # noqa: N802 (the object API's name)
        if self.key not in self.shared:
            self.shared[self.key] = self.quant.Pack(builder)
        return self.shared[self.key]


class _AlignedBuffer:
    """A ``BufferT`` whose bytes are written (on construction, before the model's tables) as a vector whose
    data starts 16-byte aligned, the schema's ``force_align: 16`` that the generated Python ``Pack`` does not
    apply; ``Pack`` then writes the Buffer table."""

    def __init__(self, builder: Any, buffer: Any, schema: Any) -> None:
        self.schema, self.offset, self.size, self.data = schema, buffer.offset or 0, buffer.size or 0, None
        if buffer.data is not None:
            raw = np.asarray(buffer.data, dtype=np.uint8).tobytes()
            builder.StartVector(1, len(raw), 16)
            builder.head = builder.head - len(raw)
            builder.Bytes[builder.head:builder.head + len(raw)] = raw
            self.data = builder.EndVector()

    def Pack(self, builder: Any) -> int:  # noqa: N802 (the object API's name)
        s = self.schema
        s.BufferStart(builder)
        if self.data is not None:
            s.BufferAddData(builder, self.data)
        s.BufferAddOffset(builder, self.offset)
        s.BufferAddSize(builder, self.size)
        return s.BufferEnd(builder)
