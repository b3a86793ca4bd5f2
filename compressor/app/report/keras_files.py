"""Keras 3 ``.keras`` files for the report: :func:`load_keras` (the archive checked against the caps of
:mod:`compressor.core.archives` first, the variables Keras builds held to what the weights entry can fill)
and one row per layer with a main weight (Keras-quantized layers as ``code - zero point``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ...core.errors import BackendNotAvailable, ModelError


def load_keras(path: str) -> Any:
    """A ``.keras`` file as a Keras model (not compiled); BackendNotAvailable / ModelError otherwise. The
    archive is checked first against the caps of :mod:`compressor.core.archives` (entries, inflated sizes,
    config.json / metadata.json, the weights' declared shapes), so a zip bomb never reaches Keras."""
    import zipfile

    from ...core.archives import ArchiveError, check_keras_archive

    p = os.fspath(path)
    if not os.path.isfile(p):
        raise ModelError(f"Keras model file {p!r} does not exist")
    if not zipfile.is_zipfile(p):
        raise ModelError(f"{p!r} is not a .keras archive: not a zip file (save one with model.save('m.keras'))")
    try:
        _, variable_cap = check_keras_archive(p)
    except ArchiveError as e:
        raise ModelError(f"{p!r} is not a .keras archive Keras may read: {e}") from None
    except OSError as e:
        raise ModelError(f"cannot read {p!r} ({e.strerror or e})") from None
    try:
        import keras
    except ImportError:
        raise BackendNotAvailable(f"reading {p!r} needs tensorflow (pip install 'compressor[tf]')") from None
    budget = _KerasVariableBudget(variable_cap)
    token = _KERAS_BUDGET.set(budget) if _install_keras_budget_hook() else None
    try:
        return keras.saving.load_model(p, compile=False, safe_mode=True)
    except Exception as e:  # noqa: BLE001 - any Keras load failure is bad input
        if budget.refused:  # however Keras wrapped it
            raise ModelError(f"{p!r} is not a .keras archive Keras may read: {budget.refused}") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot load {p!r} as a Keras model ({first[:200]})") from None
    finally:
        if token is not None:
            _KERAS_BUDGET.reset(token)


class _KerasVariableBudget:
    """The bytes the variables Keras creates while :func:`load_keras` runs may hold together."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used, self.refused = cap, 0, ""

    def take(self, shape: Any, dtype: Any) -> None:
        try:
            itemsize = np.dtype(str(dtype)).itemsize
        except TypeError:  # bfloat16, float8_*, int4 (not numpy names): the width in the name
            digits = "".join(c for c in str(dtype) if c.isdigit())
            itemsize = max(1, int(digits) // 8) if digits else 8
        self.used += math.prod(int(d) for d in shape) * itemsize
        if self.used > self.cap:
            self.refused = (f"its config.json builds variables of more than {self.cap:,} bytes, more than its weights "
                            f"entry can fill (a shape bomb)")
            raise ModelError(self.refused)


_KERAS_BUDGET: Any = None


def _install_keras_budget_hook() -> bool:
    """Make Keras' variables check the budget of the load in progress (a context variable: other threads and
    loads outside :func:`load_keras` are not affected) when their shape is set, before their value is
    allocated. Keras has no public hook for this: its private ``Variable._validate_shape`` is wrapped once;
    on a Keras without it, nothing is installed (the zip checks still apply)."""
    global _KERAS_BUDGET
    import contextvars

    try:
        from keras.src.backend.common import variables
    except ImportError:
        return False
    orig = getattr(variables.Variable, "_validate_shape", None)
    if orig is None:
        return False
    if _KERAS_BUDGET is None:
        _KERAS_BUDGET = contextvars.ContextVar("compressor_keras_variable_budget", default=None)
    if getattr(orig, "_compressor_budget", False):
        return True

    def _validate_shape(self: Any, shape: Any) -> Any:
        shape = orig(self, shape)
        budget = _KERAS_BUDGET.get()
        if budget is not None:
            budget.take(shape, getattr(self, "_dtype", "float32"))
        return shape

    _validate_shape._compressor_budget = True  # type: ignore[attr-defined]
    variables.Variable._validate_shape = _validate_shape
    return True


def _read_keras(path: str) -> tuple[list[tuple[str, np.ndarray]], dict[str, dict[str, Any]]]:
    """Rows of a ``.keras`` file, and what its Keras-quantized layers (``int8`` / ``int4`` / ``gptq`` / ``awq``)
    store: their row holds ``code - zero point`` (0 where the weight is 0)."""
    model = load_keras(path)
    import keras

    from ...tf.compressor import iter_layers
    from ...tf.layout import weight_of
    from ...tf.quantization.lowbit import describe_keras_quantized

    rows, quantized = [], {}
    for name, layer in iter_layers(model):
        info = describe_keras_quantized(layer)
        if info is not None:
            rows.append((name, info.pop("offsets")))
            quantized[name] = info
            continue
        w = weight_of(layer)
        if w is not None:
            rows.append((name, np.asarray(keras.ops.convert_to_numpy(w))))
    return rows, quantized
