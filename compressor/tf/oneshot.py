"""One-shot compression of Keras 3 models from a calibration set (issue 25): ``WandaPruner``,
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
:func:`compressor.tf.lowbit.oneshot_codes` gives them back one per entry), ``weight_group_scale``
and ``weight_group_zero_point`` (``[out, groups]``, float64 / int32) and, for AWQ, ``awq_scales`` (``s``,
``[in]``, float64: the kernel is ``Q(W s) / s``).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ..core.errors import ConfigError, ModelError
from ..core.matching import LayerInfo
from ..core.oneshot import store_codes
from ..core.pruning import nm_validate_config
from ..core.oneshot import (
    ONESHOT_KEYS,
    ONESHOT_SKIP_HINT,
    QUANT_SCHEME_KEY,
    AwqMethod,
    GptqMethod,
    LayerResult,
    LayerTask,
    ObserveCalls,
    ObservedAll,
    OneShotBackend,
    OneShotMethod,
    OneShotReport,
    RtnMethod,
    SparseGPTMethod,
    WandaMethod,
    forward_in_float64,
    quant_spec_of,
    run_sequential,
    weight_only_config,
)
from ..core.sparse_pattern import parse_sparse_pattern
from .calibration_data import calibration_batches
from .compressor import iter_layers, wrappers_of
from .kernel_layout import ONESHOT_DEFAULT_TYPES, KernelLayout, kernel_layout
from .pruning.pruner import TfPruner
from .pruning.wrapper import PrunerLayerWrapper
from .quantization.quantizer import TfQuantizer
from .quantization.wrapper import QuantizerLayerWrapper

__all__ = ["WandaPruner", "SparseGPTPruner", "GptqQuantizer", "RtnQuantizer", "AwqQuantizer", "KernelLayout",
           "kernel_layout", "find_blocks", "KerasOneShotBackend", "OneShotReport", "ONESHOT_DEFAULT_TYPES"]

#: sequences per forward pass when the calibration data is one array of samples
CALIBRATION_BATCH_SIZE = 8


# ------------------------------------------------------------------------------------------- call interception
_MISSING = object()


@contextmanager
def _intercepted(layer: Any, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Replace ``layer.call`` (and ``layer.quantized_call``) on the instance by ``make(original)``; restore on exit."""
    saved = []
    try:
        for attr in ("call", "quantized_call"):
            if not hasattr(layer, attr):
                continue
            saved.append((attr, vars(layer).get(attr, _MISSING)))
            object.__setattr__(layer, attr, make(getattr(layer, attr)))
        yield
    finally:
        for attr, old in reversed(saved):
            if old is _MISSING:
                object.__delattr__(layer, attr)
            else:
                object.__setattr__(layer, attr, old)


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


# ------------------------------------------------------------------------------------------- blocks
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


# ------------------------------------------------------------------------------------------- the backend
#: tokens per float64 block call (:meth:`KerasOneShotBackend._call`): the batch is sliced by sequences to stay under it
FLOAT64_PASS_TOKENS = 512
#: tokens per call of AWQ's search passes (:meth:`KerasOneShotBackend._sliced`; the torch side merges its recorded
#: calls up to 256 tokens)
SEARCH_PASS_TOKENS = 512


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
    try:
        for lay in layers:
            lay.dtype_policy = "float64"
        yield True
    finally:
        for lay, policy in zip(layers, old):
            lay.dtype_policy = policy


class KerasOneShotBackend(OneShotBackend):
    """The Keras side of :func:`compressor.core.oneshot.run_sequential` for one compressor."""

    def __init__(self, compressor: Any, blocks: list[tuple[str, Any]], float64: bool = False) -> None:
        self.c = compressor
        self.float64 = float64  # run_block in float64 (core.oneshot.forward_in_float64)
        self.model = compressor.bound_model
        self._blocks = list(blocks)
        self.tasks = {w.name: LayerTask(w.name, w.config, compressor._layouts[w.name].n_in, w)
                      for w in compressor.modules_wrapper}
        self._compiled: dict[int, Any] = {}

    # -- structure
    def blocks(self) -> list[tuple[str, Any]]:
        return list(self._blocks)

    def _block_of(self, name: str) -> Any:
        return next((b for p, b in self._blocks if name.startswith(p + "/")), None)

    def block_layers(self, block: Any) -> list[LayerTask]:
        return [t for n, t in self.tasks.items() if self._block_of(n) is block]

    # -- running
    def _run_model(self, batch: Any, index: int) -> Any:
        try:
            return self.model(batch, training=False)
        except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
            desc = keras.tree.map_structure(lambda t: f"{tuple(t.shape)} {t.dtype.name}" if hasattr(t, "shape") else t,
                                            batch)
            raise ModelError(f"{self.c._what}: the model refused calibration batch {index} {desc}: {e}") from None

    @contextmanager
    def _observing(self, observe: dict[str, Callable[[Any], None]] | None, calls: ObserveCalls | None = None
                   ) -> Iterator[None]:
        """Each observed layer's ``call`` hands its input rows to ``observe[name]`` first; with ``calls`` it then
        raises :class:`~compressor.core.oneshot.ObservedAll` once the block call has nothing left to observe
        (the caller catches it)."""
        with ExitStack() as stack:
            for name, fn in (observe or {}).items():
                task = self.tasks[name]
                plan = self.c._layouts[name]
                layer = task.handle.layer

                def make(orig: Callable[..., Any], fn: Callable[[Any], None] = fn, plan: KernelLayout = plan,
                         layer: Any = layer, name: str = name) -> Callable[..., Any]:
                    def observed(*args: Any, **kwargs: Any) -> Any:
                        fn(plan.rows(_first_arg(layer, args, kwargs)[1]))
                        if calls is not None and calls.fired(name):
                            raise ObservedAll
                        return orig(*args, **kwargs)
                    return observed

                stack.enter_context(_intercepted(layer, make))
            yield

    def check(self, batch: Any) -> str | None:
        """Run the model once on ``batch`` with every block and selected layer watched (nothing changes).
        Returns None when the blocks form a chain, else why not; a selected layer that is never called is a
        ModelError."""
        calls: list[tuple[int, BlockInput, Any]] = []
        seen: set[str] = set()
        with ExitStack() as stack:
            for i, (_, block) in enumerate(self._blocks):
                def make(orig: Callable[..., Any], i: int = i, block: Any = block) -> Callable[..., Any]:
                    def watched(*args: Any, **kwargs: Any) -> Any:
                        key, _ = _first_arg(block, args, kwargs)
                        out = orig(*args, **kwargs)
                        calls.append((i, BlockInput(args, kwargs, key), out))
                        return out
                    return watched
                stack.enter_context(_intercepted(block, make))
            stack.enter_context(self._observing({n: (lambda x, n=n: seen.add(n)) for n in self.tasks}))
            self._run_model(batch, 0)
        missing = [n for n in self.tasks if n not in seen]
        if missing:
            raise ModelError(f"{self.c._what}: selected layer(s) {missing} are not called when the model runs on the "
                             f"calibration data; exclude them (op_names + exclude: True) or check the data")
        if not self._blocks:
            return None
        order = [i for i, _, _ in calls]
        if order != list(range(len(self._blocks))):
            return (f"the blocks are called in the order {order} (block indices), not once each in model order "
                    f"{list(range(len(self._blocks)))}")
        for (i, inp, _), (_, prev_in, prev_out) in zip(calls[1:], calls[:-1]):
            name = self._blocks[i][0]
            try:
                prev_hidden = _hidden_of(prev_out, self._blocks[i - 1][1])
            except ModelError as e:
                return str(e)
            if not _same(inp.hidden, prev_hidden):
                return f"block {name!r} does not get the previous block's output as its first input"
            if not _same(inp.with_hidden(None).args, prev_in.with_hidden(None).args) or \
                    not _same(inp.with_hidden(None).kwargs, prev_in.with_hidden(None).kwargs):
                return f"block {name!r} gets other arguments than the block before it"
        return None

    def first_inputs(self, batches: Sequence[Any]) -> list[BlockInput]:
        block = self._blocks[0][1]
        out: list[BlockInput] = []
        for i, batch in enumerate(batches):
            got: list[BlockInput] = []

            def make(orig: Callable[..., Any], got: list[BlockInput] = got) -> Callable[..., Any]:
                def record(*args: Any, **kwargs: Any) -> Any:
                    got.append(BlockInput(args, dict(kwargs), _first_arg(block, args, kwargs)[0]))
                    raise _Stop()
                return record

            with _intercepted(block, make):
                try:
                    self._run_model(batch, i)
                except _Stop:
                    pass
            if not got:
                raise ModelError(f"{self.c._what}: block {self._blocks[0][0]!r} was not called on calibration batch {i}")
            inp = got[0]
            if out:  # the causal mask / rotary tables repeat on every batch: keep one copy (as torch)
                prev = out[-1]
                pos = tuple(a if j == inp.key or j >= len(prev.args) else _shared_with(a, prev.args[j])
                            for j, a in enumerate(inp.args))
                named = {k: _shared_with(v, prev.kwargs[k]) if k != inp.key and k in prev.kwargs else v
                         for k, v in inp.kwargs.items()}
                inp = BlockInput(pos, named, inp.key)
            out.append(inp)
            del got, inp
        return out

    def run_block(self, block: Any, inputs: list[BlockInput], observe: dict[str, Callable[[Any], None]] | None) -> list[BlockInput]:
        """``block`` on each input; the outputs are returned only when nothing is observed (the driver drops them
        after an observing run, as on torch: keeping them held a second copy of the activations at that peak)."""
        out = []
        calls = ObserveCalls(observe) if observe else None
        with self._observing(observe, calls), _float64_policies(block, self.float64) as wide:
            for inp in inputs:
                if calls is not None:
                    self._observe_call(block, inp, wide, calls)
                    continue
                h = self._call(block, inp, wide)
                out.append(inp.with_hidden(h))
                del h
        return out

    def _observe_call(self, block: Any, inp: BlockInput, wide: bool, calls: ObserveCalls) -> None:
        """:meth:`_call` for an observing run: the output is not needed, and each call of the block (each slice of a
        wide call) ends after the block's last observed input (core :class:`ObserveCalls`)."""
        def once(part: BlockInput) -> None:
            calls.begin()
            try:
                self._invoke(block, part, wide)
            except ObservedAll:
                pass
        if wide:
            self._by_slices(inp, FLOAT64_PASS_TOKENS, once)
        else:
            once(inp)

    def advance(self, block: Any, inputs: list[BlockInput]) -> list[BlockInput]:
        """:meth:`run_block` without observing, each entry of ``inputs`` replaced by the block's output for it as
        soon as it is computed (the list is updated in place and returned). TensorFlow's CPU allocator with oneDNN
        (TF's default on x86, allocator ``mklcpu``) keeps the memory of freed tensors for reuse and never gives it
        back to the OS, so its footprint is the most tensor memory ever alive at once: replacing the inputs one by
        one lets each output reuse the buffer its input just freed, one copy of the activations instead of the
        inputs and outputs side by side (+32 MiB on the issue-25 Llama)."""
        with _float64_policies(block, self.float64) as wide:
            for i in range(len(inputs)):
                inp = inputs[i]
                inputs[i] = None  # type: ignore[call-overload]
                try:
                    h = self._call(block, inp, wide)
                except BaseException:
                    inputs[i] = inp
                    raise
                inputs[i] = inp.with_hidden(h)
                del inp, h
        return inputs

    def _call(self, block: Any, inp: BlockInput, wide: bool) -> Any:
        """The block's hidden-state output on ``inp``; ``wide``: the block's layers compute in float64 (see
        :func:`_float64_policies`), the call's floating inputs are widened and the output is handed back in the
        hidden state's own dtype (the activations stay in the model's dtype between blocks). A wide call runs
        on slices of at most :data:`FLOAT64_PASS_TOKENS` tokens of the batch: TensorFlow's CPU allocator keeps
        the most tensor memory ever alive at once, and a float64 pass over a whole batch of 8 x 256 tokens
        left +63 MiB there on the issue-25 Llama (slices of 2 sequences: see examples/RESULTS.md)."""
        if not wide:
            return _hidden_of(self._invoke(block, inp, False), block)
        dtype = inp.hidden.dtype
        outs = self._by_slices(inp, FLOAT64_PASS_TOKENS, lambda part: tf.cast(
            _hidden_of(self._invoke(block, part, True), block), dtype))
        return outs[0] if len(outs) == 1 else tf.concat(outs, axis=0)

    @staticmethod
    def _invoke(block: Any, part: BlockInput, wide: bool) -> Any:
        """``block`` called on ``part``'s arguments, widened to float64 when ``wide``."""
        return block(*_float64_of(part.args), **_float64_of(part.kwargs)) if wide else part.call(block)

    def _by_slices(self, inp: BlockInput, tokens: int, fn: Callable[[BlockInput], Any]) -> list[Any]:
        """``fn`` on ``inp`` cut by sequences into slices of at most ``tokens`` tokens (``inp`` itself when it fits;
        at least one sequence a slice), the outputs in order."""
        h = inp.hidden
        rows = self.batch_rows(inp)
        per_row = int(np.prod(h.shape[1:-1])) if len(h.shape) > 2 else 1
        step = max(1, tokens // max(per_row, 1))
        if step >= rows:
            return [fn(inp)]
        return [fn(self.take_rows(inp, list(range(i, min(i + step, rows))))) for i in range(0, rows, step)]

    def shared_inputs(self, block: Any, inputs: list[BlockInput], tasks: list[LayerTask]) -> dict[str, str]:
        """``{layer: earlier layer}`` for the block's layers called with the very same input tensor as an earlier
        one (q / k / v, gate / up), seen in one run of the block on the first calibration batch."""
        if not inputs:
            return {}
        calls: dict[str, list[int]] = {}
        first: dict[str, int] = {}
        alive: list[Any] = []  # keeps the inputs alive, so ids stay unique during the probe
        with ExitStack() as stack:
            for t in tasks:
                layer = t.handle.layer

                def make(orig: Callable[..., Any], name: str = t.name, layer: Any = layer) -> Callable[..., Any]:
                    def probe(*args: Any, **kwargs: Any) -> Any:
                        x = _first_arg(layer, args, kwargs)[1]
                        alive.append(x)
                        first.setdefault(name, len(alive))
                        calls.setdefault(name, []).append(id(x))
                        return orig(*args, **kwargs)
                    return probe

                stack.enter_context(_intercepted(layer, make))
            inputs[0].call(block)
        order = sorted(calls, key=lambda n: first[n])  # the leader is the layer called first
        out: dict[str, str] = {}
        for i, n in enumerate(order):
            lead = next((m for m in order[:i] if m not in out and calls[m] == calls[n]), None)
            if lead is not None:
                out[n] = lead
        return out

    def block_output(self, block: Any, inputs: list[BlockInput]) -> list[np.ndarray]:
        """The block's hidden-state output on each cached input (float64). AWQ runs this once per candidate
        ``alpha`` with only kernel values changed, so the block runs as one ``tf.function`` (traced once per
        input signature; eager Keras calls cost ~20x more)."""
        fn = self._compiled.get(id(block))
        if fn is None:
            def run(args: tuple, kwargs: dict) -> Any:
                return _hidden_of(block(*args, **kwargs), block)
            fn = self._compiled[id(block)] = tf.function(run, reduce_retracing=True)
        return (np.asarray(self._sliced(fn, inp), dtype=np.float64) for inp in inputs)  # lazily, as module_output

    def _sliced(self, fn: Any, inp: BlockInput) -> Any:
        """``fn(inp.args, inp.kwargs)`` over slices of the batch of at most :data:`SEARCH_PASS_TOKENS` tokens, the
        outputs concatenated: AWQ's search runs a module 20 times per group and TensorFlow's CPU pool keeps the
        largest call's transients (attention scores of 8 sequences of 256 tokens: +33-41 MiB a block)."""
        outs = self._by_slices(inp, SEARCH_PASS_TOKENS, lambda part: np.asarray(fn(part.args, part.kwargs)))
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)

    # -- AWQ: the parent layer of a group of layers
    def awq_parent(self, block: Any, tasks: list[LayerTask]) -> Any:
        """The smallest layer of ``block`` that holds every layer of ``tasks`` (their longest common path: the
        attention layer for q / k / v); None when that is the block itself."""
        parts = [t.name.split("/") for t in tasks]
        common: list[str] = []
        for level in zip(*parts):
            if len(set(level)) != 1:
                break
            common.append(level[0])
        path = "/".join(common)
        bpath = next((p for p, b in self._blocks if b is block), None)
        if bpath is None or not path.startswith(bpath + "/"):
            return None
        return next((layer for p, layer in iter_layers(self.model) if p == path), None)

    def batch_rows(self, inp: BlockInput) -> int:
        return int(inp.hidden.shape[0])

    def take_rows(self, inp: BlockInput, rows: list[int]) -> BlockInput:
        """``inp`` restricted to the sequences ``rows`` of its batch (see the torch adapter's ``take_rows``): tensors
        with the batch as their first axis and at least 2 axes are gathered there, the rest kept."""
        b = self.batch_rows(inp)
        idx = tf.constant(rows, dtype=tf.int32)

        def cut(v: Any) -> Any:
            if hasattr(v, "shape") and hasattr(v, "dtype") and len(v.shape) >= 2 and v.shape[0] == b:
                return tf.gather(v, idx, axis=0)
            if isinstance(v, tuple):
                return tuple(cut(x) for x in v)
            if isinstance(v, list):
                return [cut(x) for x in v]
            return v
        return BlockInput(tuple(cut(a) for a in inp.args), {k: cut(v) for k, v in inp.kwargs.items()}, inp.key)

    def record_calls(self, block: Any, inputs: list[BlockInput], modules: list[Any]) -> list[list[BlockInput]]:
        """Run ``block`` once on ``inputs`` and keep each layer's call arguments (the tensors the block made)."""
        got: list[list[BlockInput]] = [[] for _ in modules]
        with ExitStack() as stack:
            for store, layer in zip(got, modules):
                def make(orig: Callable[..., Any], store: list[BlockInput] = store, layer: Any = layer) -> Callable[..., Any]:
                    def record(*args: Any, **kwargs: Any) -> Any:
                        store.append(BlockInput(args, dict(kwargs), _first_arg(layer, args, kwargs)[0]))
                        return orig(*args, **kwargs)
                    return record
                stack.enter_context(_intercepted(layer, make))
            for inp in inputs:
                inp.call(block)
        return got

    def module_output(self, layer: Any, calls: list[BlockInput]) -> list[np.ndarray]:
        """``layer``'s (hidden-state) output on each recorded call (float32 as computed), through one
        ``tf.function`` per layer (AWQ runs it once per candidate ``alpha`` with only kernel values changed)."""
        fn = self._compiled.get(id(layer))
        if fn is None:
            def run(args: tuple, kwargs: dict) -> Any:
                return _hidden_of(layer(*args, **kwargs), layer)
            fn = self._compiled[id(layer)] = tf.function(run, reduce_retracing=True)
        return (np.asarray(self._sliced(fn, c)) for c in calls)  # lazily: AWQ scores each output as it comes

    def run_model(self, batches: Sequence[Any], observe: dict[str, Callable[[Any], None]]) -> None:
        with self._observing(observe):
            for i, b in enumerate(batches):
                self._run_model(b, i)

    # -- weights
    def read_weight(self, task: LayerTask) -> tuple[np.ndarray, np.ndarray | None]:
        w = task.handle
        plan = self.c._layouts[task.name]
        weight = plan.to_canonical(np.asarray(w.weight.numpy())).astype(np.float64)
        pruner = next((p for p in wrappers_of(w.layer) if isinstance(p, PrunerLayerWrapper) and p.ready), None)
        mask = None
        if pruner is not None and pruner.slot is None:
            mask = plan.to_canonical(np.asarray(pruner.weight_mask.numpy())).astype(bool)
        return weight, mask

    def write(self, task: LayerTask, result: LayerResult) -> None:
        self.c._write(task.handle, self.c._layouts[task.name], result)

    def set_weight(self, task: LayerTask, weight: np.ndarray) -> None:
        kernel = _kernel(task.handle)
        kernel.assign(tf.cast(self.c._layouts[task.name].from_canonical(weight), kernel.dtype))

    def snapshot(self, task: LayerTask) -> dict[str, Any]:
        """Host copies of what :meth:`write` / :meth:`set_weight` change: the kernel, the wrapper's state
        variables (masks, codes, ...), and which of them and of its plain attributes existed."""
        w = task.handle
        return {"kernel": np.array(_kernel(w).numpy()),
                "states": {n: np.array(v.numpy()) for n, v in w.state_variables().items()},
                "attrs": {a: vars(w)[a] for a in _WRITTEN_ATTRS if a in vars(w)}}

    def restore(self, task: LayerTask, saved: dict[str, Any]) -> None:
        w = task.handle
        _kernel(w).assign(saved["kernel"])
        states = w.__dict__["_state_vars"]
        for n in list(states):
            if n in saved["states"]:
                states[n].assign(saved["states"][n])
            else:  # created by this run
                del states[n]
                object.__delattr__(w, n)
        for a in _WRITTEN_ATTRS:
            if a in saved["attrs"]:
                object.__setattr__(w, a, saved["attrs"][a])
            elif a in vars(w):
                object.__delattr__(w, a)


def _kernel(wrapper: Any) -> Any:
    return getattr(wrapper.weight, "_value", wrapper.weight)


#: plain attributes a one-shot ``_write`` sets on a wrapper (restored by :meth:`KerasOneShotBackend.restore`)
_WRITTEN_ATTRS = ("weight_group_size",)


# ------------------------------------------------------------------------------------------- report
# ------------------------------------------------------------------------------------------- compressors
def _targets(sequential_targets: Any, what: str) -> list[str] | None:
    if sequential_targets is None:
        return None
    if isinstance(sequential_targets, str):
        sequential_targets = [sequential_targets]
    if not isinstance(sequential_targets, (list, tuple)) or not sequential_targets or \
            not all(isinstance(t, str) and t for t in sequential_targets):
        raise ConfigError(f"{what}: sequential_targets must be None or a non-empty list of layer class names (e.g. "
                          f"['TransformerDecoder']), got {sequential_targets!r}")
    return list(sequential_targets)


class _OneShot:
    """What the one-shot pruners and quantizers share (mixed in before TfPruner / TfQuantizer)."""

    method: OneShotMethod
    default_types = ONESHOT_DEFAULT_TYPES
    default_skip_hint = ONESHOT_SKIP_HINT

    def _oneshot_setup(self, sequential_targets: Any) -> None:
        self._what = type(self).__name__
        self.sequential_targets = _targets(sequential_targets, self._what)
        self._layouts: dict[str, KernelLayout] = {}
        self._blocks: list[tuple[str, Any]] = []
        self.excluded: list[str] = []
        self.calibrated = False
        self.rows: OneShotReport = OneShotReport()

    # -- selection (before the model changes)
    def _substitute_layers(self, selected: list[tuple[LayerInfo, dict[str, Any]]], layers: list[LayerInfo],
                           by_name: dict[str, Any]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """A selected MultiHeadAttention is compressed through its EinsumDense projections; the LM head (a layer
        outside every block producing the vocabulary of an Embedding of the model) is left out unless it is
        named in ``op_names``; the blocks are found here."""
        what = self._what
        chosen = {i.name for i, _ in selected}
        out: list[tuple[LayerInfo, dict[str, Any]]] = []
        for info, cfg in selected:
            layer = by_name[info.name]
            if isinstance(layer, keras.layers.MultiHeadAttention):
                subs = [i for i in layers if i.name.startswith(info.name + "/") and i.type == "EinsumDense"]
                if not layer.built or not subs:
                    raise ConfigError(f"{what}: layer {info.name!r} (MultiHeadAttention) is compressed through its "
                                      f"EinsumDense projections; build the model first (call it on data)")
                out.extend((i, cfg) for i in subs if i.name not in chosen)
                chosen.update(i.name for i in subs)
            else:
                out.append((info, cfg))
        for info, _ in out:
            self._layouts[info.name] = kernel_layout(info.name, by_name[info.name])
        self._blocks = find_blocks(self.bound_model, [i.name for i, _ in out], self.sequential_targets)
        vocab = {int(layer.input_dim) for layer in by_name.values() if isinstance(layer, keras.layers.Embedding)}
        kept = []
        for info, cfg in out:
            inside = any(info.name.startswith(p + "/") for p, _ in self._blocks)
            if not inside and self._layouts[info.name].n_out in vocab and info.name not in cfg.get("op_names", ()):
                self.excluded.append(info.name)
                continue
            kept.append((info, cfg))
        if not kept:
            raise ConfigError(f"{what}: the config selects only the LM head {self.excluded} (left out by default: it "
                              f"produces the vocabulary); name it in op_names to compress it. Layers in the model: "
                              f"{sorted({i.type for i in layers})}")
        return kept

    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)  # type: ignore[misc]
        plan = self._layouts.get(layer_info.name) or kernel_layout(layer_info.name, layer)
        pattern = config.get("sparse_pattern")
        if pattern is not None:
            _, m = parse_sparse_pattern(pattern)
            if plan.n_in % m:
                raise ConfigError(f"{self._what}: layer {layer_info.name!r} ({layer_info.type}) has {plan.n_in} input "
                                  f"features, not a multiple of M={m} of sparse_pattern {pattern!r}; exclude it")
        if self.method.kind == "quantizer":
            quant_spec_of(config, self._what)

    # -- calibration
    def calibrate(self, data: Any = None, num_samples: int | None = None, progress: Any = True,
                  forward_dtype: str = "auto") -> Any:
        """Run the one-shot algorithm on ``data`` (see :mod:`compressor.tf.calibration_data` for the forms; at most
        ``num_samples`` sequences) block by block and leave the model compressed. ``progress``: a line per
        block on stderr (True), nothing (False) or a file. ``forward_dtype``: the dtype of the block passes that
        record the statistics and hand the compressed outputs on ('auto': float64 on CPU, the model's dtype on
        an accelerator; 'float64'; 'model'; see :func:`compressor.core.oneshot.forward_in_float64`). Bad data
        is an error before the model changes. Returns self."""
        what = f"{self._what}.calibrate"
        float64 = forward_in_float64(forward_dtype, what, not tf.config.list_logical_devices("GPU"))
        batches: list[Any] = []
        if self.method.statistics is not None or data is not None:
            if data is None:
                raise ConfigError(f"{what}: {self.method.name} needs calibration data (a few hundred sequences)")
            n_inputs = len(getattr(self.bound_model, "inputs", None) or []) or 1
            batches = list(calibration_batches(data, what=what, num_samples=num_samples,
                                               batch_size=CALIBRATION_BATCH_SIZE, n_inputs=n_inputs,
                                               hint="give a few hundred calibration sequences"))
            if not batches:
                raise ConfigError(f"{what}: the calibration data is empty; give a few hundred calibration sequences")
        blocks = self._blocks
        if self.method.statistics is not None:
            backend = KerasOneShotBackend(self, blocks)
            why = backend.check(batches[0])
            if why is not None:
                if self.sequential_targets:
                    raise ModelError(f"{what}: the blocks {self.sequential_targets} cannot be calibrated one after "
                                     f"the other: {why}")
                warnings.warn(f"{what}: the repeated layers {[p for p, _ in blocks]} are not a chain of blocks ({why}); "
                              f"calibrating the whole model in one pass instead", RuntimeWarning, stacklevel=2)
                blocks = []
        backend = KerasOneShotBackend(self, blocks, float64)
        with remapper_off():
            rows = run_sequential(backend, self.method, batches, progress=progress)
        self.rows = OneShotReport(rows)
        self.calibrated = True
        self._after_calibrate()
        self._retrace()  # type: ignore[attr-defined]
        return self

    def _after_calibrate(self) -> None:
        pass

    @property
    def blocks(self) -> list[str]:
        """Paths of the blocks calibrated one after the other."""
        return [p for p, _ in self._blocks]


class _OneShotPruner(_OneShot, TfPruner):
    masks_bias = False
    config_keys: tuple[Any, ...] = ("sparse_pattern",)

    def __init__(self, model: Any, config_list: list[dict[str, Any]], sequential_targets: Any = None) -> None:
        self._oneshot_setup(sequential_targets)
        super().__init__(model, config_list, None)

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        nm_validate_config(config_list, self._what)

    def calc_mask(self, wrapper: PrunerLayerWrapper, wrapper_idx: int | None = None) -> None:
        return None  # the masks are set by calibrate() and never recomputed

    def _write(self, wrapper: PrunerLayerWrapper, plan: KernelLayout, result: LayerResult) -> None:
        kernel = getattr(wrapper.weight, "_value", wrapper.weight)
        kernel.assign(tf.cast(plan.from_canonical(result.weight), kernel.dtype))
        wrapper.set_masks({"weight_mask": plan.from_canonical(result.mask)})
        wrapper.apply_masks()

    def _after_calibrate(self) -> None:
        self._compressed = True


class WandaPruner(_OneShotPruner):
    """Wanda (Sun et al. 2023): prune the weights with the smallest ``|W_ij| * ||X_j||`` of each output row, from
    the layer inputs on calibration data; no weight update. Config: ``sparsity`` or ``sparse_pattern``.

    ``p = WandaPruner(model, [{'sparsity': 0.5, 'op_types': ['default']}]); p.calibrate(token_ids)``
    """

    method = WandaMethod()


class SparseGPTPruner(_OneShotPruner):
    """SparseGPT (Frantar & Alistarh 2023): OBS pruning with weight updates from each layer's Hessian ``XᵀX``.
    Config: ``sparsity`` or ``sparse_pattern``, ``damp``, ``block_size``, ``mask_scope``."""

    method = SparseGPTMethod()
    config_keys = ("sparse_pattern", ONESHOT_KEYS["damp"], ONESHOT_KEYS["block_size"], ONESHOT_KEYS["mask_scope"])


class _OneShotQuantizer(_OneShot, TfQuantizer):
    #: its wrappers hold integer codes / group scales / zero points (what compressor.tf.lowbit exports)
    holds_integer_codes = True
    required_keys = ("quant_bits",)
    supported_quant_types = ("weight",)
    config_keys: tuple[Any, ...] = (QUANT_SCHEME_KEY, ONESHOT_KEYS["group_size"], ONESHOT_KEYS["quant_range"])

    def __init__(self, model: Any, config_list: list[dict[str, Any]], sequential_targets: Any = None) -> None:
        self._oneshot_setup(sequential_targets)
        super().__init__(model, weight_only_config(config_list), None)

    def quantize_weight(self, weight: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        return tf.identity(weight)  # the kernel holds the dequantized weight once calibrated

    def _write(self, wrapper: QuantizerLayerWrapper, plan: KernelLayout, result: LayerResult) -> None:
        q = result.quantized
        kernel = getattr(wrapper.weight, "_value", wrapper.weight)
        kernel.assign(tf.cast(plan.from_canonical(result.weight), kernel.dtype))
        code_dtype = tf.int8 if q.spec.symmetric else tf.uint8
        wrapper.add_state("weight_codes", tf.constant(store_codes(q.codes, q.spec.bits)), code_dtype)
        wrapper.add_state("weight_group_scale", tf.constant(q.scale, tf.float64))
        wrapper.add_state("weight_group_zero_point", tf.constant(np.rint(q.zero_point).astype(np.int32)))
        wrapper._setattr_raw("weight_group_size", int(q.group_size))
        if result.scales is not None:
            wrapper.add_state("awq_scales", tf.constant(result.scales, tf.float64))

    def report(self) -> OneShotReport:
        """One row per compressed layer (bits, group size, the method's error / alpha)."""
        return OneShotReport(self.rows)

    def to_keras_quantized(self, fast: bool = False) -> list[dict[str, Any]]:
        """The calibrated layers as Keras 3's own int8 / int4 / GPTQ / AWQ layers holding these codes (final:
        the wrappers go); ``model.save('m.keras')`` then loads in stock Keras. See
        :func:`compressor.tf.lowbit.to_keras_quantized`."""
        from .lowbit import to_keras_quantized

        return to_keras_quantized(self, fast=fast)


class GptqQuantizer(_OneShotQuantizer):
    """GPTQ (Frantar et al. 2022): weight-only quantization (2..8 bits) with OBS error feedback from each layer's
    Hessian. Config: ``quant_bits``, ``group_size``, ``quant_scheme`` (symmetric / affine), ``damp``,
    ``block_size``, ``act_order``. A layer pruned before (a pruner's mask on it) keeps its zeros."""

    method = GptqMethod()
    config_keys = (*_OneShotQuantizer.config_keys, ONESHOT_KEYS["damp"], ONESHOT_KEYS["block_size"],
                   ONESHOT_KEYS["act_order"])


class RtnQuantizer(_OneShotQuantizer):
    """Round to nearest, weight-only, per group: the baseline; needs no calibration data (``calibrate()``)."""

    method = RtnMethod()


class AwqQuantizer(_OneShotQuantizer):
    """AWQ (Lin et al. 2023): per-input-channel scales ``s`` searched on each layer's output error, then round to
    nearest; the kernel holds ``Q(W s) / s``. Config: ``quant_bits``, ``group_size``, ``quant_scheme``,
    ``n_grid``, ``duo_scaling``, ``apply_clip``."""

    method = AwqMethod()
    config_keys = (*_OneShotQuantizer.config_keys, ONESHOT_KEYS["n_grid"], ONESHOT_KEYS["duo_scaling"],
                   ONESHOT_KEYS["awq_search"], ONESHOT_KEYS["search_samples"], ONESHOT_KEYS["apply_clip"])
