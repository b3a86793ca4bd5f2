"""Calibration data in the forms Keras users hold, as a stream of model-input batches.

One helper for every TF compressor that calibrates (``PtqQuantizer.calibrate`` and the one-shot
compressors of :mod:`compressor.tf.sequential`). :func:`calibration_batches` accepts

* a tensor / numpy array of samples (split into batches of ``batch_size`` along axis 0);
* a dict (or any mapping, e.g. a tokenizer's output) of such arrays, one per named input, keras-hub style
  ``{'token_ids': ..., 'padding_mask': ...}`` (split the same way);
* a Keras-style ``(x, y)`` or ``(x, y, sample_weight)`` tuple: ``x`` is used (a tuple of exactly as many
  arrays as a multi-input model has inputs is the inputs);
* a ``tf.data.Dataset`` or any other iterable (a list, a generator) of batches, each ``x``, ``(x,)``,
  ``(x, y)``, ``(x, y, w)`` or a dict.

and yields each batch's model input (a tensor, a dict of tensors, or a list for a multi-input model), at
most ``num_samples`` samples in all (the last batch is cut) and at most ``num_batches`` batches. An empty
batch, or NaN / inf in a float input, is a :class:`~compressor.core.errors.ConfigError` naming the batch,
raised when that batch is reached (callers that must not change the model on bad data consume the stream
first, or undo on error). Dtypes and shapes are the model's to judge.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from ..core.errors import ConfigError

__all__ = ["calibration_batches", "num_rows"]


def _is_tensor(x: Any) -> bool:
    return isinstance(x, (np.ndarray, tf.Tensor, tf.Variable)) or (
        hasattr(x, "__array__") and hasattr(x, "shape") and not isinstance(x, (Mapping, list, tuple)))


def _is_number_list(x: Any) -> bool:
    """A list / tuple that is itself one array of numbers (nested lists), not a structure of arrays."""
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    return isinstance(x, (int, float, np.number)) and not isinstance(x, bool)


def _rows(x: Any) -> int | None:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) == 0 or shape[0] is None:
        return None
    return int(shape[0])


def num_rows(batch: Any) -> int | None:
    """The number of samples (axis 0) of a model-input batch (the first input's, for several)."""
    if isinstance(batch, Mapping):
        batch = next(iter(batch.values()), None)
    elif isinstance(batch, (list, tuple)) and batch and not _is_number_list(batch):
        batch = batch[0]
    return _rows(batch)


def _take(batch: Any, n: int) -> Any:
    if isinstance(batch, Mapping):
        return {k: v[:n] for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and not _is_number_list(batch):
        return [v[:n] for v in batch]
    return batch[:n]


def _inputs_of(batch: Any, n_inputs: int) -> Any:
    """``x`` of one dataset element / list item: ``x``, ``(x,)``, ``(x, y)``, ``(x, y, w)``; a dict as is; for a
    model of ``n_inputs > 1`` inputs a list / tuple of that many arrays is the inputs."""
    if isinstance(batch, Mapping):
        return dict(batch)
    if not isinstance(batch, (tuple, list)) or _is_number_list(batch):
        return batch
    if n_inputs > 1 and len(batch) == n_inputs and all(_is_tensor(v) for v in batch):
        return list(batch)
    if len(batch) in (1, 2, 3):
        return _inputs_of(batch[0], n_inputs) if isinstance(batch[0], (tuple, list)) and n_inputs > 1 else batch[0]
    return batch


def _split(data: Any, batch_size: int) -> Iterator[Any]:
    n = num_rows(data)
    if n is None:
        yield data
        return
    for i in range(0, n, batch_size):
        yield _take_range(data, i, i + batch_size)


def _take_range(data: Any, a: int, b: int) -> Any:
    if isinstance(data, Mapping):
        return {k: v[a:b] for k, v in data.items()}
    if isinstance(data, list):
        return [v[a:b] for v in data]
    return data[a:b]


def _source(data: Any, batch_size: int, n_inputs: int, what: str, hint: str) -> Iterator[Any]:
    """The raw batches of ``data`` (model inputs, not yet checked)."""
    if isinstance(data, tf.data.Dataset):
        return (_inputs_of(b, n_inputs) for b in data)
    if _is_tensor(data):
        return _split(data, batch_size)
    if isinstance(data, Mapping):
        if data and all(_is_tensor(v) for v in data.values()):
            return _split(dict(data), batch_size)
        raise ConfigError(f"{what}: a dict of calibration data must map input names to arrays / tensors of samples, "
                          f"got {{{', '.join(f'{k!r}: {type(v).__name__}' for k, v in data.items())}}}; {hint}")
    if isinstance(data, tuple) and data and not _is_number_list(data) and (
            _is_tensor(data[0]) or isinstance(data[0], Mapping)):  # Keras-style (x, y[, w]) or a model's inputs
        x = _inputs_of(data, n_inputs)
        if isinstance(x, list) or (isinstance(x, Mapping) and all(_is_tensor(v) for v in x.values())) or _is_tensor(x):
            return _split(x, batch_size)
    if data is None or isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
        raise ConfigError(f"{what}: calibration data must be a tensor / numpy array of samples, a dict of them, an "
                          f"(x, y) tuple, a tf.data.Dataset or an iterable of batches; got {type(data).__name__}; "
                          f"{hint}")
    if isinstance(data, list) and _is_number_list(data):
        return iter([data])
    return (_inputs_of(b, n_inputs) for b in data)


def _check(batch: Any, index: int, what: str, hint: str) -> None:
    parts = batch.items() if isinstance(batch, Mapping) else (
        enumerate(batch) if isinstance(batch, list) and not _is_number_list(batch) else [(None, batch)])
    for key, x in parts:
        name = f"calibration batch {index}" + ("" if key is None else f" (input {key!r})")
        try:
            t = tf.convert_to_tensor(x)
        except (ValueError, TypeError):
            continue  # not a tensor: the model judges it
        if t.shape.rank is not None and (t.shape.rank == 0 or 0 in t.shape):
            raise ConfigError(f"{what}: {name} is empty (shape {tuple(t.shape)}); {hint}")
        if t.dtype.is_floating and not bool(tf.reduce_all(tf.math.is_finite(t))):
            raise ConfigError(f"{what}: {name} contains NaN or inf; clean the calibration data")


def calibration_batches(data: Any, *, what: str, num_samples: int | None = None, num_batches: int | None = None,
                        batch_size: int = 32, n_inputs: int = 1, hint: str = "give at least one batch") -> Iterator[Any]:
    """Yield the model-input batches of ``data`` (see the module docstring), each checked (not empty, finite);
    at most ``num_samples`` samples and ``num_batches`` batches. ``what`` prefixes error messages, ``hint``
    ends those about missing data; ``n_inputs``: the model's number of inputs (a Functional model's
    ``len(model.inputs)``). Argument errors are raised at once, data errors when the batch is reached."""
    for name, v in (("num_samples", num_samples), ("num_batches", num_batches), ("batch_size", batch_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ConfigError(f"{what}: {name} must be a positive int" + (" or None" if name != "batch_size" else "")
                              + f", got {v!r}")
    source = _source(data, int(batch_size), int(n_inputs), what, hint)

    def stream() -> Iterator[Any]:
        seen = 0
        for i, batch in enumerate(source):
            if (num_batches is not None and i >= num_batches) or (num_samples is not None and seen >= num_samples):
                return
            rows = num_rows(batch)
            if num_samples is not None and rows is not None and seen + rows > num_samples:
                batch = _take(batch, num_samples - seen)
                rows = num_samples - seen
            _check(batch, i, what, hint)
            seen += rows or 0
            yield batch

    return stream()
