"""A Keras model's decoder blocks and the calls they receive: finding the blocks (:func:`find_blocks`), the experts
and routers of its mixture-of-experts layers (:func:`find_experts`, :func:`find_routers`), one recorded block call
(:class:`BlockInput`), intercepting a layer's ``call``, and the float64 pass's dtype policies."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ...core.errors import ModelError
from ...core.interrupts import deferred_interrupts
from ...core.oneshot.experts import mark_routed
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


@dataclass
class ExpertSet:
    """The routed experts of one mixture-of-experts layer ``parent``: ``members`` (paths), ``count`` expert layers of
    one class (``fused`` False), or one layer holding each expert's weights as slice ``[e]`` of its 3-D weights
    (``fused`` True, ``members`` its path, ``params``: the weights' names and shapes, e.g. keras-hub Mixtral's
    expert bank); ``routers``: the layers beside them that score ``count`` experts; ``gates``: the Dense layers
    beside them with ONE output (a scalar gate per token)."""

    parent: str
    members: list[str]
    count: int
    fused: bool
    routers: list[str] = field(default_factory=list)
    gates: list[str] = field(default_factory=list)
    params: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)


def _width(layer: Any) -> int | None:
    """The output width of a layer that could score experts: a Dense layer's ``units``, or the last axis of a leaf
    layer's 2-D ``kernel``."""
    units = getattr(layer, "units", None)
    if isinstance(units, int) and not isinstance(units, bool):
        return units
    kernel = getattr(layer, "kernel", None) if not _children(layer) else None
    shape = getattr(kernel, "shape", None)
    return int(shape[-1]) if shape is not None and len(shape) == 2 else None


def _fused_weights(layer: Any) -> list[tuple[str, tuple[int, ...]]]:
    """A leaf layer's 3-D weights ``[experts, ...]`` sharing their first axis (at least 2), else []. A Dense /
    EinsumDense is one projection however many axes its kernel has (an attention's ``[hidden, heads, head_dim]``
    query kernel is no bank of ``hidden`` experts)."""
    if _children(layer) or isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        return []
    shapes = [(w.path.rsplit("/", 1)[-1] if hasattr(w, "path") else w.name, tuple(int(d) for d in w.shape))
              for w in layer.weights if len(w.shape) == 3]
    if not shapes or len({s[0] for _, s in shapes}) != 1 or shapes[0][1][0] < 2:
        return []
    return shapes


def find_experts(model: Any) -> list[ExpertSet]:
    """The routed experts of ``model``'s mixture-of-experts layers, without naming a model family: ``E >= 2`` child
    layers of one class that hold sub-layers (or a leaf child holding 3-D weights ``[E, ...]``), next to a child that
    scores ``E`` experts (a Dense layer with ``E`` units): the router must be a direct child of the layer holding
    the experts."""
    layers = iter_layers(model)
    path_of = {id(layer): p for p, layer in layers}
    out: list[ExpertSet] = []
    for node in [model] + [layer for _, layer in layers]:
        kids = [(path_of[id(c)], c) for c in _children(node) if id(c) in path_of]
        if not kids:
            continue
        parent = path_of.get(id(node), "")
        sets: list[tuple[list[tuple[str, Any]], bool, list[tuple[str, tuple[int, ...]]]]] = []
        groups: dict[type, list[tuple[str, Any]]] = {}
        for p, c in kids:
            if _children(c):
                groups.setdefault(type(c), []).append((p, c))
            elif (fused := _fused_weights(c)):
                sets.append(([(p, c)], True, fused))
        sets += [(g, False, []) for g in groups.values() if len(g) >= 2]
        for members, fused, params in sets:
            count = params[0][1][0] if fused else len(members)
            inside = {id(c) for _, c in members}
            routers = [p for p, c in kids if id(c) not in inside and _width(c) == count]
            if not routers:
                continue
            gates = [p for p, c in kids if id(c) not in inside and _width(c) == 1]
            out.append(ExpertSet(parent, [p for p, _ in members], count, fused, routers, gates, params))
    return out


def find_routers(model: Any) -> list[str]:
    """The paths of the routers and scalar gates of ``model``'s mixture-of-experts layers (:func:`find_experts`):
    the layers a one-shot run leaves float unless they are named (as llmcompressor and vLLM expect)."""
    return [p for e in find_experts(model) for p in e.routers + e.gates]


def _mark_routed_layers(experts: list[ExpertSet], layers: list[tuple[str, Any]], selected: Sequence[str]) -> None:
    """Mark each selected layer inside a routed expert (not fused) with the expert's path for core's fallback
    (:func:`~compressor.core.oneshot.experts.mark_routed`); every other selected layer unmarked."""
    members = [m for e in experts if not e.fused for m in e.members]
    by_path = dict(layers)
    for s in selected:
        layer = by_path.get(s)
        if layer is not None:
            mark_routed(layer, next((m for m in members if s.startswith(m + "/")), None))


def _warn_fused(experts: list[ExpertSet], model: Any, blocks: list[tuple[str, Any]], selected: Sequence[str],
                supported: Callable[[ExpertSet, dict[str, Any]], bool]) -> None:
    """One warning naming the fused expert weights of the mixture-of-experts layers in the blocks that hold
    selected layers whose per-expert computation is not known (``supported``, :func:`.expert_banks.supported`:
    keras-hub's Mixtral / Qwen-MoE banks are, and are compressed slice by slice), so these stay as they are."""
    by_path = dict(iter_layers(model))
    scopes = [p for p, _ in blocks if any(s.startswith(p + "/") for s in selected)] or ([""] if selected else [])
    fused = [e for e in experts if e.fused and not supported(e, by_path)
             and any(not p or e.members[0].startswith(p + "/") for p in scopes)]
    if not fused:
        return
    shapes = ", ".join(f"{n} {list(s)}" for n, s in fused[0].params)
    more = f" and {len(fused) - 1} more like it" if len(fused) > 1 else ""
    warnings.warn(f"one-shot calibration: the routed experts of {len(fused)} mixture-of-experts layer(s) are fused 3-D "
                  f"weights ({fused[0].members[0]}: {shapes}{more}) and are NOT compressed: the one-shot methods "
                  f"compress Dense / EinsumDense layers and the expert banks of compressor.tf.sequential.expert_banks."
                  f"BANKS", stacklevel=4)


def find_blocks(model: Any, selected: Sequence[str], targets: Sequence[str] | None = None,
                supported: Callable[[ExpertSet, dict[str, Any]], bool] = lambda s, by_path: False,
                ) -> list[tuple[str, Any]]:
    """The model's repeated blocks ``[(path, layer)]``; ``[]``: none found. ``targets``: class names of the blocks
    (outermost ones; a ModelError when the model has none). Without targets: the largest group of two or more
    child layers of one class of one parent that hold sub-layers and a selected layer, that is neither

    * the routed experts of a mixture-of-experts layer (:func:`find_experts`: they are called on the tokens the
      router picks, not one after the other on the previous one's output), nor
    * inside a member of another such group (the outermost repeated layers are the decoder, not a group nested in
      its layers).

    Also marks the selected layers of routed experts for core's fallback and warns once about fused expert
    weights that stay uncompressed (those ``supported`` does not accept: the caller passes
    :func:`.expert_banks.supported`)."""
    layers = iter_layers(model)
    path_of = {id(layer): p for p, layer in layers}
    experts = find_experts(model)
    _mark_routed_layers(experts, layers, selected)

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
        _warn_fused(experts, model, found, selected, supported)
        return found
    routed = {tuple(e.members) for e in experts if not e.fused}
    groups: list[list[tuple[str, Any]]] = []
    for node in [model] + [layer for _, layer in layers]:
        by_type: dict[type, list[tuple[str, Any]]] = {}
        for child in _children(node):
            p = path_of.get(id(child))
            if p is not None and _children(child):
                by_type.setdefault(type(child), []).append((p, child))
        groups += [m for m in by_type.values() if len(m) >= 2 and any(holds_selected(p) for p, _ in m)]

    def nested(members: list[tuple[str, Any]]) -> bool:  # inside a member of another group
        return any(g is not members and any(members[0][0].startswith(p + "/") for p, _ in g) for g in groups)

    best: list[tuple[str, Any]] = []
    for members in groups:
        if len(members) > len(best) and tuple(p for p, _ in members) not in routed and not nested(members):
            best = members
    _warn_fused(experts, model, best, selected, supported)
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

