"""A Keras model's decoder blocks and the calls they receive: finding the blocks (:func:`find_blocks`), one
recorded block call (:class:`BlockInput`), intercepting a layer's ``call``, and the float64 pass's dtype policies."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ...core.errors import ModelError
from ...core.interrupts import deferred_interrupts
from ..compressor import iter_layers

_MISSING = object()

#: how to undo what a pass has in place now (intercepted calls, float64 dtype policies), registered before the
#: change is made: if Ctrl-C cuts a pass's own clean-up short, the run's rollback (core ``Undo``, through
#: ``KerasOneShotBackend.drop_transients``) or the caller (:func:`drop_pending`) finishes it
_PENDING: list[Callable[[], None]] = []


def _settle(undo: Callable[[], None]) -> None:
    """Run a pending ``undo`` now (all of it, even if Ctrl-C is pressed meanwhile: raised after)."""
    with deferred_interrupts():
        undo()
        if undo in _PENDING:
            _PENDING.remove(undo)


def drop_pending() -> None:
    """Undo every change a pass still has in place, newest first."""
    with deferred_interrupts():
        while _PENDING:
            _PENDING[-1]()
            _PENDING.pop()


@contextmanager
def _intercepted(layer: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Replace ``layer.call`` (and ``layer.quantized_call``) on the instance by ``make(original)``; restore on exit."""
    saved: list[tuple[str, Any]] = []

    def put_back() -> None:
        while saved:
            attr, old = saved.pop()
            if old is _MISSING:
                vars(layer).pop(attr, None)  # absent if the interrupt came before it was set
            else:
                object.__setattr__(layer, attr, old)

    _PENDING.append(put_back)  # before the first change
    try:
        for attr in ("call", "quantized_call"):
            if not hasattr(layer, attr):
                continue
            saved.append((attr, vars(layer).get(attr, _MISSING)))
            object.__setattr__(layer, attr, make(getattr(layer, attr)))
        yield
    finally:
        _settle(put_back)  # every call back, even if Ctrl-C is pressed again meanwhile


def _first_arg(layer: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """``(position or keyword, value)`` of the first argument of a call."""
    if args:
        return 0, args[0]
    params = [p for p in inspect.signature(type(layer).call).parameters if p != "self"]
    key = params[0] if params and params[0] in kwargs else next(iter(kwargs), None)
    if key is None:
        raise ModelError(f"layer {layer.name!r} ({type(layer).__name__}) was called without arguments")
    return key, kwargs[key]


class _Stop(Exception):
    """Raised inside block 0's call once its inputs are recorded (never escapes this module)."""


@dataclass
class BlockInput:
    """One calibration batch's inputs of a block: the call's arguments with the hidden state at ``key``."""

    args: tuple
    kwargs: dict
    key: Any

    @property
    def hidden(self) -> Any:
        return self.args[0] if self.key == 0 else self.kwargs[self.key]

    def with_hidden(self, h: Any) -> BlockInput:
        if self.key == 0:
            return BlockInput((h, *self.args[1:]), self.kwargs, 0)
        return BlockInput(self.args, {**self.kwargs, self.key: h}, self.key)

    def call(self, block: Any) -> Any:
        return block(*self.args, **self.kwargs)


@contextmanager
def remapper_off() -> Iterator[None]:
    """Grappler's remapper off while the calibration's ``tf.function`` graphs are built: with oneDNN on (TF's
    default on x86), it fuses a decoder block's ops into kernels that ran a Llama block 25-50x slower than eager
    on an AVX-512 CPU (1.25 s vs 0.024 s a call, TF 2.21; fine with TF_ENABLE_ONEDNN_OPTS=0, which cannot be
    changed once TensorFlow is imported). The user's setting is put back afterwards; graphs built meanwhile are
    this run's own."""
    before = tf.config.optimizer.get_experimental_options().get("remapping")
    tf.config.optimizer.set_experimental_options({"remapping": False})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"remapping": True if before is None else before})


def _hidden_of(out: Any, block: Any) -> Any:
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    if isinstance(out, Mapping) or not hasattr(out, "shape"):
        raise ModelError(f"block {block.name!r} ({type(block).__name__}) returned {type(out).__name__}; a block must "
                         f"return its hidden state (a tensor, or a tuple whose first element is it)")
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal structures of equal values (tensors compared by value)."""
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    ta, tb = hasattr(a, "shape") and hasattr(a, "dtype"), hasattr(b, "shape") and hasattr(b, "dtype")
    if ta or tb:
        if not (ta and tb) or tuple(a.shape) != tuple(b.shape):
            return False
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values differ
        return False


def _shared_with(v: Any, prev: Any) -> Any:
    """``prev`` where ``v`` holds the same tensors as ``prev`` (shape, dtype and bytes), else ``v``: read-only
    block arguments repeated on every calibration batch are then kept once (a Llama's causal mask and rotary
    tables: 384 KiB a batch for 256 tokens, 48 MiB for 128 one-window batches)."""
    if v is prev:
        return v
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        if not (hasattr(prev, "shape") and hasattr(prev, "dtype")) or tuple(v.shape) != tuple(prev.shape) or \
                v.dtype != prev.dtype:
            return v
        try:
            a, b = np.asarray(v), np.asarray(prev)
        except Exception:  # noqa: BLE001 - a symbolic tensor: kept as it is
            return v
        return prev if a.dtype == b.dtype and a.tobytes() == b.tobytes() else v
    if isinstance(v, tuple) and isinstance(prev, tuple) and len(v) == len(prev) and v:
        out = tuple(_shared_with(a, b) for a, b in zip(v, prev))
        return prev if all(a is b for a, b in zip(out, prev)) else out
    return v


def _children(layer: Any) -> list[Any]:
    return [c for c in layer._flatten_layers(include_self=False, recursive=False)
            if not isinstance(c, keras.layers.InputLayer)]


def find_blocks(model: Any, selected: Sequence[str], targets: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """The model's repeated blocks ``[(path, layer)]`` (see the module docstring); ``[]``: none found.
    ``targets``: class names of the blocks (a ModelError when the model has none)."""
    layers = iter_layers(model)
    path_of = {id(layer): p for p, layer in layers}

    def holds_selected(path: str) -> bool:
        return any(s.startswith(path + "/") for s in selected)

    if targets:
        found: list[tuple[str, Any]] = []
        for p, layer in layers:
            if type(layer).__name__ in targets and not any(p.startswith(b + "/") for b, _ in found):
                found.append((p, layer))
        if not found:
            containers = sorted({type(layer).__name__ for p, layer in layers if _children(layer)})
            raise ModelError(f"sequential_targets {list(targets)}: the model has no layer of these classes; its layers "
                             f"with sub-layers are {containers}")
        return found
    best: list[tuple[str, Any]] = []
    for node in [model] + [layer for _, layer in layers]:
        groups: dict[type, list[tuple[str, Any]]] = {}
        for child in _children(node):
            p = path_of.get(id(child))
            if p is not None and _children(child):
                groups.setdefault(type(child), []).append((p, child))
        for members in groups.values():
            if len(members) >= 2 and any(holds_selected(p) for p, _ in members) and len(members) > len(best):
                best = members
    return best






def _float64_of(v: Any) -> Any:
    """``v`` (tensors / arrays in tuples / lists / dicts) with its floating values widened to float64."""
    if isinstance(v, (tuple, list)):
        return type(v)(_float64_of(x) for x in v)
    if isinstance(v, dict):
        return {k: _float64_of(x) for k, x in v.items()}
    dtype = getattr(v, "dtype", None)
    if dtype is not None and tf.as_dtype(dtype).is_floating and tf.as_dtype(dtype) != tf.float64:
        return tf.cast(v, tf.float64)
    return v


@contextmanager
def _float64_policies(block: Any, on: bool) -> Iterator[bool]:
    """Every layer of ``block`` computing in float64 while the body runs (``dtype_policy`` 'float64': the float32
    variables are read widened, inputs are not cast down), the policies put back after. Yields whether it did:
    not for a block holding a quantized layer (its policy carries the quantization mode)."""
    layers = list(block._flatten_layers(include_self=True, recursive=True)) if on else []
    if not layers or any(getattr(lay.dtype_policy, "quantization_mode", None) for lay in layers):
        yield False
        return
    old = [lay.dtype_policy for lay in layers]

    def put_back() -> None:
        for lay, policy in zip(layers, old):
            lay.dtype_policy = policy

    _PENDING.append(put_back)  # before the first change
    try:
        for lay in layers:
            lay.dtype_policy = "float64"
        yield True
    finally:
        _settle(put_back)  # every policy back, even if Ctrl-C is pressed again meanwhile

