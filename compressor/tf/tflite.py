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
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import tensorflow as tf

from ..core.errors import ConfigError
from .compressor import iter_layers

__all__ = ["convert_recurrent", "recurrent_layers", "unrolled"]


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
