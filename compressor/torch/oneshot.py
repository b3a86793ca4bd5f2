"""PyTorch side of the one-shot compressors (issue 25): calibration data, block finding, the
:class:`~compressor.core.oneshot.OneShotBackend` adapter, and the mixin the five compressors share.

The math (Wanda, SparseGPT, GPTQ, RTN, AWQ) and the block-by-block loop live in
:mod:`compressor.core.oneshot` / :mod:`compressor.core.oneshot`; this module only moves tensors:

* **blocks**: the model's repeated decoder layers, found without naming a model family: the longest
  ``nn.ModuleList`` whose children all have one class and hold selected layers (Hugging Face Llama / Qwen2
  ``model.layers``, GPT-2 ``transformer.h``, OPT ``model.decoder.layers``), or the modules whose class name
  is in ``sequential_targets`` (``['LlamaDecoderLayer']``, as llmcompressor names them). No blocks: the
  whole model is one pass.
* **first inputs**: the model runs on each calibration batch until block 0, where a forward pre-hook
  (``with_kwargs=True``) keeps the block's ``(args, kwargs)`` and stops the forward; they stay on the
  model's device. Hugging Face models are called with ``use_cache=False`` (a key/value cache would grow at
  every re-run of a block).
* **running a block**: the block is called with the stored ``(args, kwargs)``, the hidden state (the first
  positional argument, else ``hidden_states=``) replaced by the previous block's output (a tensor, or a
  tuple whose ``[0]`` is the hidden state). Layer inputs are read with forward pre-hooks on the wrappers and
  handed to core as float32 (float64 for a float64 model) numpy rows ``[tokens, in]``. Padded tokens are
  left out of the statistics when the batch has a 2-D ``attention_mask`` (``0`` = padding) whose shape
  matches the layer input's leading axes.
* **weights**: read and written in the canonical ``[out, in]`` layout (:mod:`compressor.torch.layout`:
  HF ``Conv1D`` is transposed).

No tracing (torch.fx), and one block's calibration activations in memory at a time.
"""

from __future__ import annotations

import inspect
import numbers
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.config import KeySpec
from ..core.errors import ConfigError, ModelError
from ..core.matching import type_names
from ..core.oneshot import (
    ONESHOT_KEYS,
    ONESHOT_SKIP_HINT,
    LayerResult,
    LayerTask,
    ObserveCalls,
    ObservedAll,
    OneShotBackend,
    OneShotMethod,
    OneShotReport,
    forward_in_float64,
    run_sequential,
)
from .layout import canonical_shape, from_canonical, in_out_features, to_canonical
from .modules import innermost_module
from .pruning.wrapper import PrunerModuleWrapper

__all__ = ["ONESHOT_DEFAULT_TYPES", "calibration_batches", "forward_inputs", "find_blocks", "TorchOneShotBackend",
           "OneShotMixin", "OneShotReport"]

#: what ``op_types: ['default']`` selects for the one-shot compressors: Linear layers (HF ``Conv1D`` included)
ONESHOT_DEFAULT_TYPES = ("Linear", "Conv1D")

_FORMS = ("a tensor, a tuple of positional inputs, a dict of keyword inputs (Hugging Face BatchEncoding), or "
          "a DataLoader / list / iterable of those")


# ------------------------------------------------------------------------------------------------ data
def forward_inputs(batch: Any, i: int, what: str, positional: int | None = None,
                   expected: str | None = None) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of the model's forward for one calibration batch.

    A tensor is the one positional input; a Mapping (dict, Hugging Face ``BatchEncoding``) holds keyword
    inputs. A tuple / list: with ``positional=None`` all its elements are positional inputs; with
    ``positional=1`` it is ``(inputs, *targets)`` -- its first element is the input (a tensor, a dict, or a
    tuple of positional inputs) and the rest (labels) is ignored; with ``positional=n >= 2`` its first n
    elements are the positional inputs."""
    want = expected or _FORMS
    if torch.is_tensor(batch):
        return (batch,), {}
    if isinstance(batch, Mapping):
        bad = [k for k in batch if not isinstance(k, str)]
        if bad:
            raise ModelError(f"{what}: batch {i} is a dict with non-string keys {bad!r}; a dict batch maps the "
                             f"forward's keyword-argument names to inputs")
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise ModelError(f"{what}: batch {i} is an empty {type(batch).__name__}; expected {want}")
        if positional is None:
            return tuple(batch), {}
        if positional >= 2:
            if len(batch) < positional:
                raise ModelError(f"{what}: batch {i} has {len(batch)} elements, the model takes {positional} "
                                 f"positional inputs; expected {want}")
            return tuple(batch[:positional]), {}
        first = batch[0]
        if isinstance(first, (tuple, list)):
            return tuple(first), {}
        if torch.is_tensor(first) or isinstance(first, Mapping):
            return forward_inputs(first, i, what, positional, expected)
        batch = first
    raise ModelError(f"{what}: batch {i} is a {type(batch).__name__}, expected {want}")


def _tensors(args: tuple, kwargs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for j, a in enumerate(args):
        if torch.is_tensor(a):
            yield f"input {j}", a
    for k, v in kwargs.items():
        if torch.is_tensor(v):
            yield k, v


def _batch_size(args: tuple, kwargs: dict[str, Any]) -> int:
    for _, t in _tensors(args, kwargs):
        if t.dim() >= 1:
            return int(t.shape[0])
    return 1


def _head(args: tuple, kwargs: dict[str, Any], n: int, size: int) -> tuple[tuple, dict[str, Any]]:
    def cut(v: Any) -> Any:
        return v[:n] if torch.is_tensor(v) and v.dim() >= 1 and int(v.shape[0]) == size else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def calibration_batches(data: Any, what: str, *, num_samples: int | None = None, num_batches: int | None = None,
                        positional: int | None = None, expected: str | None = None, hint: str | None = None,
                        tuple_is_batch: bool = True) -> Iterator[tuple[int, tuple, dict[str, Any]]]:
    """``(index, args, kwargs)`` per calibration batch of ``data``: a tensor, a dict / ``BatchEncoding``, a
    tuple, or a DataLoader / list / any iterable of those (see :func:`forward_inputs` for ``positional``).

    ``num_batches`` stops after that many batches; ``num_samples`` after that many sequences (the leading
    axis of the batch's tensors; the last batch is cut). A floating tensor with NaN / inf is a
    :class:`ConfigError` naming the batch; no data at all is a ConfigError once the data is exhausted.
    ``hint``: what the no-data errors tell the user to do; ``tuple_is_batch``: ``data`` given as a tuple is one
    batch of positional inputs (False: an iterable of batches)."""
    hint = hint or f"give a few hundred sequences as {_FORMS}"
    for key, v in (("num_samples", num_samples), ("num_batches", num_batches)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ConfigError(f"{what}: {key} must be a positive int or None, got {v!r}")
    if data is None:
        raise ConfigError(f"{what}: no calibration data given; {hint}")
    if torch.is_tensor(data) or isinstance(data, Mapping) or (tuple_is_batch and isinstance(data, tuple)):
        data = [data]
    elif not isinstance(data, Iterable) or isinstance(data, (str, bytes)):
        raise ConfigError(f"{what}: calibration data must be {expected or _FORMS}, got {type(data).__name__}; {hint}")
    seen = samples = 0
    for i, batch in enumerate(data):
        if (num_batches is not None and seen >= num_batches) or (num_samples is not None and samples >= num_samples):
            break
        args, kwargs = forward_inputs(batch, i, what, positional, expected)
        for name, t in _tensors(args, kwargs):
            if t.is_floating_point() or t.is_complex():
                if not bool(torch.isfinite(t).all()):
                    raise ConfigError(f"{what}: calibration batch {i} ({name}) contains NaN or inf")
        size = _batch_size(args, kwargs)
        if num_samples is not None and samples + size > num_samples:
            args, kwargs = _head(args, kwargs, num_samples - samples, size)
            size = num_samples - samples
        samples += size
        seen += 1
        yield i, args, kwargs
    if seen == 0:
        raise ConfigError(f"{what}: the calibration data yielded no batch; {hint}")


# ------------------------------------------------------------------------------------------------ blocks
def _contains(module: nn.Module, ids: set[int]) -> bool:
    return any(id(m) in ids for m in module.modules())


def find_blocks(model: nn.Module, targets: Sequence[str] | None, selected: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The model's blocks in execution (definition) order: modules whose class name is in ``targets``
    (outermost ones), or, without targets, the children of the longest ``nn.ModuleList`` whose children all
    have one class and which holds a module of ``selected`` (ties: the first one)."""
    ids = {id(m) for m in selected}
    if targets:
        names = set(targets)
        found: list[tuple[str, nn.Module]] = []
        for name, m in model.named_modules():
            if type(m).__name__ in names and not any(name.startswith(f + ".") for f, _ in found):
                found.append((name, m))
        return found
    best: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) <= len(best):
            continue
        children = list(m.named_children())
        if len({type(c) for _, c in children}) == 1 and any(_contains(c, ids) for _, c in children):
            best = [(f"{name}.{n}" if name else n, c) for n, c in children]
    return best


class _Stop(Exception):
    """Raised by the pre-hook on block 0 once its inputs are stored."""


class _Input:
    """One calibration batch at a block: ``args`` / ``kwargs`` of the call, where the hidden state is, and
    the keep-mask of real (not padded) tokens, if known."""

    __slots__ = ("args", "kwargs", "where", "keep")

    def __init__(self, args: tuple, kwargs: dict[str, Any], where: tuple[str, Any], keep: torch.Tensor | None):
        self.args, self.kwargs, self.where, self.keep = args, kwargs, where, keep

    def hidden(self) -> Any:
        kind, key = self.where
        return self.args[key] if kind == "arg" else self.kwargs[key]

    def hidden_of_call(self, key: Any) -> Any:
        return self.args[key] if key == 0 else self.kwargs[key]

    def with_hidden(self, h: torch.Tensor) -> _Input:
        kind, key = self.where
        if kind == "arg":
            return _Input((*self.args[:key], h, *self.args[key + 1:]), self.kwargs, self.where, self.keep)
        return _Input(self.args, {**self.kwargs, key: h}, self.where, self.keep)


def _hidden_of(output: Any) -> torch.Tensor:
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    try:
        h = output[0]  # a ModelOutput
    except (TypeError, KeyError, IndexError):
        h = None
    if torch.is_tensor(h):
        return h
    raise ModelError(f"one-shot calibration: a block returned {type(output).__name__}; expected the hidden state "
                     f"(a tensor) or a tuple whose first element is it")


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor (torch.inference_mode) has no version counter
        return -1


def _dedupe(v: Any, prev: Any) -> Any:
    """``prev`` where ``v`` holds the same tensors (same shape, dtype, device, values) as ``prev``, else ``v``:
    the block inputs of every batch then share one causal mask / one rotary table instead of one per batch
    (they are read only)."""
    if torch.is_tensor(v):
        same = (torch.is_tensor(prev) and v.shape == prev.shape and v.dtype == prev.dtype and v.device == prev.device
                and bool(torch.equal(v, prev)))
        return prev if same else v
    if isinstance(v, tuple) and isinstance(prev, tuple) and len(v) == len(prev) and v:
        out = tuple(_dedupe(a, b) for a, b in zip(v, prev))
        return prev if all(a is b for a, b in zip(out, prev)) else out
    return v


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (views of one tensor share it)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return id(t)


def _keep_mask(kwargs: dict[str, Any]) -> torch.Tensor | None:
    m = kwargs.get("attention_mask")
    if torch.is_tensor(m) and m.dim() == 2 and not m.is_floating_point():
        return m != 0
    return None


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _to(v: Any, device: torch.device) -> Any:
    if torch.is_tensor(v):
        return v.to(device)
    if isinstance(v, (tuple, list)):
        return type(v)(_to(x, device) for x in v)
    if isinstance(v, dict):
        return {k: _to(x, device) for k, x in v.items()}
    return v


_NUMPY_DTYPES = {torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
                 torch.int64, torch.bool}


def _host(t: torch.Tensor) -> Any:
    """``t`` on the host: a numpy array (a view of a CPU tensor, no copy) or, for dtypes numpy lacks, a CPU copy."""
    t = t.detach()
    if t.dtype in _NUMPY_DTYPES:
        return t.to("cpu").numpy()
    return t.to("cpu", copy=True)


#: the most tokens (rows x sequence) one merged AWQ parent call takes (:func:`_merged_calls`). On the issue-25
#: Llama (256-token windows, one thread) 1024 and 256 (= no merging of its windows) took the same CPU time, full
#: search 101.8 vs 101.5 s, default search 31.1 vs 30.3 s, and 256 peaked 60 / 24 MiB lower (the merged batch's
#: attention scores); 8192 was no faster than 1024 and took ~400 MiB more. Shorter sequences are still merged.
MERGE_TOKENS = 256


def _hidden_key(c: _Input) -> Any:
    """Where a recorded module call's hidden state is: 0 (first positional) or the ``hidden_states`` keyword."""
    if c.args and torch.is_tensor(c.args[0]):
        return 0
    if torch.is_tensor(c.kwargs.get("hidden_states")):
        return "hidden_states"
    return None


def _same_rest(a: Any, b: Any, rows: int) -> bool:
    """``a`` and ``b`` (an argument of two calls, not the hidden state) are the same object (recorded calls share
    their repeated masks / rotary tables) or equal plain values, and hold no tensor with a batch axis of
    ``rows`` > 1 (a per-sequence tensor would not broadcast over a merged batch)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return a is b and not (rows > 1 and a.dim() >= 2 and a.shape[0] == rows)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_rest(x, y, rows) for x, y in zip(a, b))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a usable ==: not mergeable
        return False


def _mergeable(head: _Input, c: _Input, key: Any) -> bool:
    h0, h1 = (head.args[0], c.args[0]) if key == 0 else (head.kwargs[key], c.kwargs[key])
    if (_hidden_key(c) != key or h0.shape[1:] != h1.shape[1:] or h0.dtype != h1.dtype or h0.device != h1.device
            or len(head.args) != len(c.args) or head.kwargs.keys() != c.kwargs.keys()
            or (head.keep is None) != (c.keep is None)):
        return False
    rows = max(int(h0.shape[0]), int(h1.shape[0]))
    first = 1 if key == 0 else 0
    return (all(_same_rest(a, b, rows) for a, b in zip(head.args[first:], c.args[first:]))
            and all(_same_rest(head.kwargs[k], c.kwargs[k], rows) for k in head.kwargs if k != key))


def _concat(group: list[_Input], key: Any) -> _Input:
    head = group[0]
    hs = [c.args[0] if key == 0 else c.kwargs[key] for c in group]
    h = torch.cat(hs, dim=0)
    keep = None if head.keep is None else torch.cat([c.keep for c in group], dim=0)
    if key == 0:
        return _Input((h, *head.args[1:]), head.kwargs, ("arg", 0), keep)
    return _Input(head.args, {**head.kwargs, key: h}, ("kw", key), keep)


def _merged_calls(module: nn.Module, calls: list[_Input]) -> list[_Input]:
    """AWQ runs each parent module once per grid point on every recorded call: consecutive calls that differ only
    in their hidden state (the usual case: one calibration batch per call, shared masks / rotary tables) are
    concatenated on the batch axis into calls of up to :data:`MERGE_TOKENS` tokens, so the module runs a few large
    batches instead of many short ones. Checked once on the first
    merged call against the separate calls (same outputs to float32 rounding); any difference or error keeps
    the calls as recorded."""
    key = _hidden_key(calls[0]) if calls else None
    if key is None or len(calls) < 2:
        return calls
    groups: list[list[_Input]] = []
    tokens = 0
    for c in calls:
        h = c.hidden_of_call(key) if _hidden_key(c) == key else None
        n = 0 if h is None else int(h.numel() // max(int(h.shape[-1]), 1))
        if groups and h is not None and tokens + n <= MERGE_TOKENS and _mergeable(groups[-1][0], c, key):
            groups[-1].append(c)
            tokens += n
        else:
            groups.append([c])
            tokens = n
    if all(len(g) == 1 for g in groups):
        return calls
    try:
        with torch.no_grad():
            first = next(g for g in groups if len(g) > 1)
            cat = _concat(first, key)
            merged = _hidden_of(module(*cat.args, **cat.kwargs))
            alone = torch.cat([_hidden_of(module(*c.args, **c.kwargs)) for c in first], dim=0)
        ok = merged.shape == alone.shape and bool(torch.allclose(merged, alone, rtol=1e-4, atol=1e-5))
    except Exception:  # noqa: BLE001 - a module that cannot take the merged batch: keep the calls as recorded
        ok = False
    if not ok:
        return calls
    calls.clear()  # drop the separate calls group by group as they are merged (no second copy of all of them)
    out = []
    for i, g in enumerate(groups):
        groups[i] = []
        out.append(_concat(g, key) if len(g) > 1 else g[0])
        del g
    return out


def _widened(v: Any, hidden: Any, shared: dict[int, tuple[torch.Tensor, int, torch.Tensor]]) -> Any:
    """``v`` (tensors in tuples / lists / dicts) with its floating tensors widened to float64: ``hidden`` anew,
    the others once, kept in ``shared`` by identity and version (a block's calls share the attention mask and
    the rotary tables)."""
    if torch.is_tensor(v):
        if not v.is_floating_point() or v.dtype == torch.float64:
            return v
        if v is hidden:
            return v.to(torch.float64)
        got = shared.get(id(v))
        if got is None or got[0] is not v or got[1] != _version(v):
            got = shared[id(v)] = (v, _version(v), v.to(torch.float64))
        return got[2]
    if isinstance(v, tuple):
        return tuple(_widened(x, hidden, shared) for x in v)
    if isinstance(v, list):
        return [_widened(x, hidden, shared) for x in v]
    if isinstance(v, dict):
        return {k: _widened(x, hidden, shared) for k, x in v.items()}
    return v


class TorchOneShotBackend(OneShotBackend):
    """The torch adapter of :class:`compressor.core.oneshot.OneShotBackend` for one compressor."""

    def __init__(self, compressor: Any, targets: Sequence[str] | None, float64: bool = False):
        self.compressor = compressor
        self.float64 = float64  # run_block / advance in float64 (core.oneshot.forward_in_float64)
        self.model: nn.Module = compressor.bound_model
        self.what = type(compressor).__name__
        self.wrappers: list[nn.Module] = list(compressor.get_modules_wrapper())
        self._blocks = find_blocks(self.model, targets, self.wrappers)
        self._block_ids = [{id(m) for m in b.modules()} for _, b in self._blocks]
        self._tasks = {id(w): LayerTask(w.name, w.config, canonical_shape(w, w.weight.shape)[1], w)
                       for w in self.wrappers}
        fwd = getattr(self.model, "forward", None)
        try:
            params = inspect.signature(fwd).parameters if fwd is not None else {}
        except (TypeError, ValueError):
            params = {}
        self._no_cache = "use_cache" in params
        self._shared: dict[str, str] = {}

    # ---- structure
    def blocks(self) -> list[tuple[str, nn.Module]]:
        return list(self._blocks)

    def block_layers(self, block: nn.Module | None) -> list[LayerTask]:
        if block is None:
            inside = set().union(*self._block_ids) if self._block_ids else set()
            return [self._tasks[id(w)] for w in self.wrappers if id(w) not in inside]
        ids = {id(m) for m in block.modules()}
        return [self._tasks[id(w)] for w in self.wrappers if id(w) in ids]

    # ---- running
    def _call_model(self, i: int, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._no_cache and "use_cache" not in kwargs:
            kwargs = {**kwargs, "use_cache": False}
        try:
            self.model(*args, **kwargs)
        except _Stop:
            raise
        except Exception as e:  # noqa: BLE001  (any failure of the user's model on this batch)
            shapes = "; ".join(f"{n}: shape {tuple(t.shape)}, dtype {t.dtype}" for n, t in _tensors(args, kwargs))
            raise ModelError(f"{self.what}.calibrate: calibration batch {i} ({shapes}) failed in the model: "
                             f"{type(e).__name__}: {e}") from e

    def first_inputs(self, batches: Sequence[tuple[tuple, dict[str, Any]]]) -> list[_Input]:
        _, block0 = self._blocks[0]
        store: list[_Input] = []
        current: dict[str, Any] = {}

        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            if args:
                where: tuple[str, Any] = ("arg", 0)
            elif "hidden_states" in kwargs:
                where = ("kw", "hidden_states")
            else:
                key = next((k for k, v in kwargs.items() if torch.is_tensor(v) and v.is_floating_point()), None)
                if key is None:
                    raise ModelError(f"{self.what}.calibrate: block {self._blocks[0][0]!r} was called without a "
                                     f"hidden-state tensor")
                where = ("kw", key)
            kwargs = dict(kwargs)
            # advance() overwrites the hidden state in place: where it is the caller's own tensor (e.g. an
            # inputs_embeds batch the model passes straight to its first block), keep a copy instead
            h = args[0] if where[0] == "arg" else kwargs[where[1]]
            if _storage(h) in current["given"]:
                h = h.detach().clone()
                if where[0] == "arg":
                    args = (h, *args[1:])
                else:
                    kwargs[where[1]] = h
            if store:  # the causal mask / rotary tables repeat on every batch: keep one copy
                prev = store[-1].kwargs
                kwargs = {k: _dedupe(v, prev[k]) if k in prev and where != ("kw", k) else v
                          for k, v in kwargs.items()}
            store.append(_Input(tuple(args), kwargs, where, current.get("keep")))
            raise _Stop

        handle = block0.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            for i, (args, kwargs) in enumerate(batches):
                current["keep"] = _keep_mask(kwargs)
                current["given"] = {_storage(t) for _, t in _tensors(args, kwargs)}
                try:
                    self._call_model(i, args, kwargs)
                except _Stop:
                    continue
                raise ModelError(f"{self.what}.calibrate: the model's forward never reached block "
                                 f"{self._blocks[0][0]!r} on calibration batch {i}")
        finally:
            handle.remove()
        return store

    def _observing(self, observe: dict[str, Callable[[Any], None]] | None, keep: Callable[[], Any], stop: bool = False
                   ) -> tuple[list[Any], Callable[[], None]]:
        """Pre-hooks that hand each observed layer's input rows to ``observe[name]``, and a ``reset()`` to call after
        each call of the block: it drops the references to that call's tensors (each call then starts on the same
        heap: kept into the next call, they made the allocator place that call's buffers elsewhere). ``stop``: a
        hook raises :class:`~compressor.core.oneshot.ObservedAll` once the call has nothing left to observe
        (core :class:`~compressor.core.oneshot.ObserveCalls`); the caller catches it."""
        handles: list[Any] = []
        if not observe:
            return handles, lambda: None
        last: list[Any] = [None, -1, None]  # (tensor, version, its rows): q / k / v read one hidden state
        fed: dict[str, Any] = {}  # layer -> a weak reference to the input it got last (not kept alive by this)
        shared = self._shared

        def rows(t: torch.Tensor) -> np.ndarray:
            if last[0] is t and last[1] == _version(t):
                return last[2]
            x = t.detach()
            k = keep()
            if k is not None and tuple(x.shape[:-1]) == tuple(k.shape):
                x = x[k.to(x.device)]
            # float32 as it is (core's Gram takes float32 products of float32 values, whatever the dtype handed
            # over: no float64 copy here); half precision widened to float32, float64 kept
            dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
            last[:] = [t, _version(t), x.to("cpu", dtype).numpy().reshape(-1, x.shape[-1])]
            return last[2]

        hooked = [w.name for w in self.wrappers
                  if w.name in observe or (shared.get(w.name) is not None and shared[w.name] in observe)]
        calls = ObserveCalls(hooked)
        for w in self.wrappers:
            fn = observe.get(w.name)
            lead = shared.get(w.name)
            if fn is not None:
                def pre(module: nn.Module, args: tuple, fn: Callable[[Any], None] = fn, name: str = w.name) -> None:
                    fed[name] = weakref.ref(args[0])
                    fn(rows(args[0]))
                    if stop and calls.fired(name):
                        raise ObservedAll
            elif lead is not None and lead in observe:
                def pre(module: nn.Module, args: tuple, lead: str = lead, name: str = w.name) -> None:
                    got = fed.get(lead)
                    if got is None or got() is not args[0]:
                        raise ModelError(f"{self.what}.calibrate: layer {name!r} read the same input as {lead!r} on "
                                         f"the first calibration batch but not on a later one (data-dependent "
                                         f"control flow?); their statistics cannot be shared")
                    if stop and calls.fired(name):
                        raise ObservedAll
            else:
                continue
            handles.append(w.register_forward_pre_hook(pre))

        def reset() -> None:
            last[:] = [None, -1, None]
            fed.clear()
            calls.begin()
        return handles, reset

    def shared_inputs(self, block: nn.Module, inputs: list[_Input], tasks: list[LayerTask]) -> dict[str, str]:
        """``{layer: earlier layer}`` for the block's layers that read the very same tensor as an earlier one on
        every call (q / k / v, gate / up), seen on the first calibration batch (one extra run of the block);
        they share one accumulator (the later calls are checked)."""
        self._shared = {}
        if not inputs:
            return {}
        names = [t.name for t in tasks]
        calls: dict[str, list[tuple[int, int]]] = {}
        first: dict[str, int] = {}
        alive: list[Any] = []  # keeps the inputs alive, so ids stay unique during the probe
        handles = []
        for w in self.wrappers:
            if w.name in names:
                def pre(module: nn.Module, args: tuple, name: str = w.name) -> None:
                    alive.append(args[0])
                    first.setdefault(name, len(alive))
                    calls.setdefault(name, []).append((id(args[0]), _version(args[0])))
                handles.append(w.register_forward_pre_hook(pre))
        try:
            block(*inputs[0].args, **inputs[0].kwargs)
        finally:
            for h in handles:
                h.remove()
        out: dict[str, str] = {}
        order = sorted(calls, key=lambda n: first[n])  # the leader is the layer called first (OPT: q before k)
        for i, n in enumerate(order):
            lead = next((m for m in order[:i] if m not in out and calls[m] == calls[n]), None)
            if lead is not None:
                out[n] = lead
        self._shared = out
        return out

    def _float64_units(self, block: nn.Module) -> list[nn.Module]:
        """The modules of ``block`` whose tensors :meth:`_calling` widens to float64 only while they run: each of
        this compressor's wrappers in the block, or the outermost wrapper around it (a layer wrapped twice, e.g.
        pruned then quantized: the outer wrapper's forward reads the inner layer's weight itself), i.e. the
        chain of modules that each hold the next as ``.module``."""
        parent: dict[int, nn.Module] = {}
        for m in block.modules():
            for c in m.children():
                parent.setdefault(id(c), m)
        units: dict[int, nn.Module] = {}
        inside = {id(m) for m in block.modules()}
        for w in self.wrappers:
            if id(w) not in inside or w is block:
                continue
            u = w
            while (p := parent.get(id(u))) is not None and p is not block and getattr(p, "module", None) is u:
                u = p
            units.setdefault(id(u), u)
        return list(units.values())

    @contextmanager
    def _calling(self, block: nn.Module) -> Iterator[Callable[[_Input], Any]]:
        """A pass over ``block``: yields ``inp ->`` the block's hidden-state output on ``inp``. With :attr:`float64`
        the block runs in float64 on float64 copies of its floating parameters and buffers and of the call's
        floating tensors, and the output comes back in the hidden state's dtype (the activations stay in the
        model's dtype between blocks); the module's own tensors are back when the pass ends (an exception
        included), its hooks still fire. Set up once per pass, not per call (per-call hook registration and
        ``functional_call`` were a fifth of a float64 pass's CPU time on the issue-25 Llama):

        * the tensors outside the wrapped layers (norms, layers not selected) are swapped for float64 copies for
          the whole pass;
        * each wrapped layer's tensors are copied to float64 when it is called and swapped back when it returns:
          one layer's float64 weight alive at a time, not the block's (half the float64 pass's extra memory on the
          issue-25 Llama: examples/RESULTS.md; a float64 workspace kept for the whole pass measured no lower);
        * a call's floating tensors other than the hidden state (the attention mask, the rotary tables: the same
          tensors on every call) are widened once per pass."""
        if not self.float64:
            yield lambda inp: _hidden_of(block(*inp.args, **inp.kwargs))
            return
        units = self._float64_units(block)
        unit_ids = {id(m) for u in units for m in u.modules()}

        def own_slots(module: nn.Module) -> list[tuple[dict[str, Any], str]]:
            return [(d, n) for m in module.modules() for d in (m._parameters, m._buffers) for n, t in d.items()
                    if t is not None and t.is_floating_point() and t.dtype != torch.float64]

        slots = {id(u): own_slots(u) for u in units}
        pruners = {id(u): [m for m in u.modules() if isinstance(m, PrunerModuleWrapper)] for u in units}
        swapped: list[tuple[list[tuple[dict[str, Any], str, torch.Tensor]], list[tuple[nn.Module, Any]]]] = []

        def widen(module: nn.Module, args: Any) -> None:
            own = [(d, n, d[n]) for d, n in slots[id(module)]]
            # a pruner wrapper whose layer is masked gets float64 copies of masked tensors: it is marked masked on
            # them (else it would mask the copies again on every call) and gets its own mark back after
            marks = [(m, mark) for m in pruners[id(module)] if (mark := m.masked_mark()) is not None]
            for d, n, t in own:
                d[n] = t.to(torch.float64)
            for m, _ in marks:
                m.set_mark()
            swapped.append((own, marks))

        def narrow(module: nn.Module, args: Any, out: Any) -> None:
            own, marks = swapped.pop()
            for d, n, t in own:
                d[n] = t
            for m, mark in marks:
                m.set_mark(mark)

        shared: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

        def call(inp: _Input) -> Any:
            h = inp.hidden()
            try:
                out = _hidden_of(block(*_widened(inp.args, h, shared), **_widened(inp.kwargs, h, shared)))
            finally:
                while swapped:  # a layer that raised: its own tensors back
                    narrow(block, None, None)
            return out.to(h.dtype) if torch.is_tensor(h) else out

        outside: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        handles: list[Any] = []
        try:
            copies: dict[int, torch.Tensor] = {}  # a tensor held under two names (tied) gets one float64 copy
            for m in block.modules():
                if id(m) in unit_ids:
                    continue
                for d in (m._parameters, m._buffers):
                    for n, t in list(d.items()):
                        if t is not None and t.is_floating_point() and t.dtype != torch.float64:
                            outside.append((d, n, t))
                            d[n] = copies.setdefault(id(t), t.to(torch.float64))
            handles = [h for u in units for h in (u.register_forward_pre_hook(widen), u.register_forward_hook(narrow))]
            yield call
        finally:
            for hd in handles:
                hd.remove()
            while swapped:
                narrow(block, None, None)
            for d, n, t in reversed(outside):
                d[n] = t
            shared.clear()  # the pass's float64 arguments go now, not when the closures are collected

    def run_block(self, block: nn.Module, inputs: list[_Input], observe: dict[str, Callable[[Any], None]] | None
                  ) -> list[_Input]:
        state: dict[str, Any] = {}
        handles, reset = self._observing(observe, lambda: state.get("keep"), stop=True)
        outs: list[_Input] = []
        try:
            with self._calling(block) as call:
                for inp in inputs:
                    state["keep"] = inp.keep
                    try:
                        out = call(inp)
                    except ObservedAll:  # an observing call ends after the block's last observed input
                        out = None
                    reset()
                    if observe is None:
                        outs.append(inp.with_hidden(out))
                    del out
        finally:
            for h in handles:
                h.remove()
            if observe is not None:
                self._shared = {}
        return outs

    def advance(self, block: nn.Module, inputs: list[_Input]) -> list[_Input]:
        """:meth:`run_block` without observing, each entry of ``inputs`` replaced by the block's output for it as
        soon as it is computed (the list is updated in place and returned): one copy of the calibration
        activations in memory, not the block's inputs and outputs side by side. The output is copied into the
        input's own storage (:meth:`first_inputs` copies a hidden state that is the caller's tensor) where
        shape / dtype / device agree:
        the activations then never move, and the allocator is left with only the block's transient buffers to
        reuse (allocating each output anew while its input is freed grew the heap by ~3/4 of the activations
        on the issue-25 Llama)."""
        with self._calling(block) as call:
            for i in range(len(inputs)):
                inp = inputs[i]
                h = inp.hidden()
                out = call(inp)
                if (out is not h and out.shape == h.shape and out.dtype == h.dtype and out.device == h.device
                        and not h.requires_grad):
                    try:
                        h.copy_(out)
                        continue
                    except RuntimeError:  # e.g. an inference tensor outside inference mode: keep the new tensor
                        pass
                inputs[i] = inp.with_hidden(out)
        return inputs

    def run_model(self, batches: Sequence[tuple[tuple, dict[str, Any]]], observe: dict[str, Callable[[Any], None]]) -> None:
        state: dict[str, Any] = {}
        handles, reset = self._observing(observe, lambda: state.get("keep"))
        try:
            for i, (args, kwargs) in enumerate(batches):
                state["keep"] = _keep_mask(kwargs)
                self._call_model(i, args, kwargs)
                reset()
        finally:
            for h in handles:
                h.remove()

    def block_output(self, block: nn.Module, inputs: list[_Input]) -> Iterator[np.ndarray]:
        """The block's hidden-state output on each cached input (float64 rows of the real, not padded, tokens)."""
        for inp in inputs:  # a generator, as module_output
            h = _hidden_of(block(*inp.args, **inp.kwargs)).detach()
            k = inp.keep
            if k is not None and tuple(h.shape[:-1]) == tuple(k.shape):
                h = h[k.to(h.device)]
            yield h.to("cpu", torch.float64).numpy()

    # ---- AWQ: the sequences the grid is scored on (core.oneshot.search_inputs)
    def batch_rows(self, inp: _Input) -> int:
        return int(inp.hidden().shape[0])

    def take_rows(self, inp: _Input, rows: list[int]) -> _Input:
        """``inp`` restricted to the sequences ``rows`` of its batch: every tensor argument with the batch as its
        first axis (hidden state, 4-D masks, position ids and rotary tables, the keep-mask) indexed there;
        1-D tensors (cache positions), batch-1 broadcasts and other objects as they are."""
        b = self.batch_rows(inp)
        idx = torch.tensor(rows, dtype=torch.long)

        def cut(v: Any) -> Any:
            if torch.is_tensor(v):
                return v.index_select(0, idx.to(v.device)) if v.dim() >= 2 and v.shape[0] == b else v
            if isinstance(v, tuple):
                return tuple(cut(x) for x in v)
            if isinstance(v, list):
                return [cut(x) for x in v]
            return v
        return _Input(tuple(cut(a) for a in inp.args), {k: cut(v) for k, v in inp.kwargs.items()}, inp.where,
                      None if inp.keep is None else cut(inp.keep))

    # ---- AWQ: the parent module of a group of layers
    def awq_parent(self, block: nn.Module, tasks: list[LayerTask]) -> nn.Module | None:
        """The smallest module of ``block`` that holds every layer of ``tasks`` (their longest common module path:
        ``model.layers.0.self_attn`` for q / k / v); None when that is the block itself."""
        parts = [t.name.split(".") for t in tasks]
        common: list[str] = []
        for level in zip(*parts):
            if len(set(level)) != 1:
                break
            common.append(level[0])
        if not common:
            return None
        try:
            parent = self.model.get_submodule(".".join(common))
        except AttributeError:
            return None
        if parent is block or not any(m is parent for m in block.modules()):
            return None
        return parent

    def record_calls(self, block: nn.Module, inputs: list[_Input], modules: list[nn.Module]) -> list[list[_Input]]:
        """Run ``block`` once on ``inputs`` and keep each module's call arguments (``(args, kwargs)``, with the
        keep-mask of the block input it came from; the tensors the block made, no copies; repeated masks /
        rotary tables kept once)."""
        got: list[list[_Input]] = [[] for _ in modules]
        state: dict[str, Any] = {}
        handles = []
        for store, module in zip(got, modules):
            def pre(mod: nn.Module, args: tuple, kwargs: dict[str, Any], store: list[_Input] = store) -> None:
                kwargs = dict(kwargs)
                if store:
                    prev = store[-1]
                    args = tuple(_dedupe(a, prev.args[j]) if 0 < j < len(prev.args) else a for j, a in enumerate(args))
                    kwargs = {k: _dedupe(v, prev.kwargs[k]) if k in prev.kwargs and k != "hidden_states" else v
                              for k, v in kwargs.items()}
                store.append(_Input(args, kwargs, ("arg", 0), state.get("keep")))
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        try:
            for inp in inputs:
                state["keep"] = inp.keep
                block(*inp.args, **inp.kwargs)
        finally:
            for h in handles:
                h.remove()
        return [_merged_calls(module, calls) for module, calls in zip(modules, got)]

    def module_output(self, module: nn.Module, calls: list[_Input]) -> Iterator[np.ndarray]:
        """``module``'s (hidden-state) output on each recorded call, rows of the real (not padded) tokens, float32
        (float64 for a float64 model) numpy."""
        for c in calls:  # a generator: AWQ scores each output as it comes (no list of a whole run's outputs)
            h = _hidden_of(module(*c.args, **c.kwargs)).detach()
            k = c.keep
            if k is not None and tuple(h.shape[:-1]) == tuple(k.shape):
                h = h[k.to(h.device)]
            yield h.to("cpu", torch.float64 if h.dtype == torch.float64 else torch.float32).numpy()

    # ---- weights
    def snapshot(self, task: LayerTask) -> dict[str, Any]:
        """What :meth:`write` / :meth:`set_weight` change: the weight and the wrapper's buffers, as host numpy
        arrays (views of CPU tensors: core writes them out at once, before anything changes) or, for dtypes
        numpy lacks (bfloat16), CPU tensor copies."""
        w = task.handle
        saved = {f"buffer:{n}": _host(b) for n, b in w.named_buffers()}
        saved["weight"] = _host(w.weight)
        return saved

    def restore(self, task: LayerTask, saved: dict[str, Any]) -> None:
        w = task.handle
        buffers = dict(w.named_buffers())

        def tensor(v: Any) -> torch.Tensor:
            return torch.from_numpy(v) if isinstance(v, np.ndarray) else v
        with torch.no_grad():
            w.weight.copy_(tensor(saved["weight"]))
            for key, value in saved.items():
                if key.startswith("buffer:"):
                    buffers[key[7:]].copy_(tensor(value))

    def set_weight(self, task: LayerTask, weight: np.ndarray) -> None:
        w = task.handle
        new = from_canonical(w, torch.from_numpy(np.ascontiguousarray(weight)))
        with torch.no_grad():
            w.weight.copy_(new.to(dtype=w.weight.dtype, device=w.weight.device))

    def read_weight(self, task: LayerTask) -> tuple[np.ndarray, np.ndarray | None]:
        w = task.handle
        weight = to_canonical(w, w.weight.detach()).to("cpu", torch.float64).numpy()
        mask = self.compressor._oneshot_mask(w)
        if mask is not None:
            mask = to_canonical(w, mask).cpu().numpy().astype(bool)
            if mask.all():
                mask = None
        return weight, mask

    def write(self, task: LayerTask, result: LayerResult) -> None:
        self.set_weight(task, result.weight)
        self.compressor._oneshot_write(task.handle, result)


# ------------------------------------------------------------------------------------------------ compressors
def _check_targets(model: nn.Module, targets: Any, what: str) -> list[str] | None:
    if targets is None:
        return None
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(f"{what}: sequential_targets must be None or a non-empty list of block class names, e.g. "
                          f"['LlamaDecoderLayer'], got {targets!r}")
    present = {type(m).__name__ for m in model.modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        lists = sorted({type(c).__name__ for m in model.modules() if isinstance(m, nn.ModuleList) for c in m})
        raise ModelError(f"{what}: sequential_targets {missing} name no module class of the model; the classes in "
                         f"its ModuleLists are {lists}")
    return list(targets)


def _is_output_embedding(model: nn.Module, module: nn.Module, name: str, embeddings: set[int]) -> bool:
    layer = innermost_module(module)
    if isinstance(layer, nn.Embedding):
        return False
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            out = get()
        except Exception:  # noqa: BLE001  (a model whose method needs more than it has)
            out = None
        if out is not None and innermost_module(out) is layer:
            return True
    w = getattr(layer, "weight", None)
    return name.rpartition(".")[2] == "lm_head" or (w is not None and id(w) in embeddings)


class OneShotMixin:
    """What the one-shot pruners and quantizers share: ``sequential_targets``, the default layer types
    (Linear + HF Conv1D, the output head and embedding-tied layers left out unless named in op_names), and
    :meth:`calibrate`. Mixed in before :class:`TorchPruner` / :class:`TorchQuantizer`."""

    method_class: type[OneShotMethod] = OneShotMethod
    default_types = ONESHOT_DEFAULT_TYPES
    default_skip_hint = ONESHOT_SKIP_HINT
    #: the rows of the last :meth:`calibrate` (``layer``, ``block``, ``method``, ``sparsity`` / ``bits``, ...)
    oneshot_rows: list[dict[str, Any]]

    def _init_oneshot(self, model: nn.Module, sequential_targets: Any) -> None:
        what = type(self).__name__
        if not isinstance(model, nn.Module):
            raise ModelError(f"{what}: model must be a torch.nn.Module, got {type(model).__module__}."
                             f"{type(model).__qualname__}")
        self.sequential_targets = _check_targets(model, sequential_targets, what)
        self.oneshot_rows = []
        self.calibrated = False

    def _substitute_layers(self, selected: list, layers: list, modules: dict[str, nn.Module]) -> list:
        """'default' selects Linear-like layers only (a torch nn.Conv1d shares the alias Conv1D); the output head
        (``get_output_embeddings()``, a layer called ``lm_head``, a weight tied to an ``nn.Embedding``) is left
        out unless op_names names it."""
        selected = super()._substitute_layers(selected, layers, modules)  # type: ignore[misc]
        model = self.bound_model  # type: ignore[attr-defined]
        embeddings = {id(e.weight) for e in map(innermost_module, modules.values()) if isinstance(e, nn.Embedding)}
        out = []
        skipped = []
        for info, cfg in selected:
            module = modules[info.name]
            if info.name in cfg.get("op_names", ()):
                out.append((info, cfg))
                continue
            typed = any(t != "default" and info.type in type_names(t) for t in cfg.get("op_types", ()))
            if not typed and in_out_features(module) is None:
                continue  # 'default' = Linear-like layers (a torch nn.Conv1d shares the alias Conv1D)
            if _is_output_embedding(model, module, info.name, embeddings):
                skipped.append(info.name)
                continue
            out.append((info, cfg))
        if not out:
            present = sorted({info.type for info in layers if info.extra.get("weighted")})
            extra = f" (left out by default: the output head {skipped}; name it in op_names to include it)" if skipped else ""
            raise ConfigError(f"{type(self).__name__}: config_list selects no Linear layer of the model{extra}. Weighted "
                              f"layer types in the model: {present}; 'default' means {list(ONESHOT_DEFAULT_TYPES)}")
        return out

    def validate_layer(self, layer_info: Any, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)  # type: ignore[misc]
        if in_out_features(module) is None or getattr(module, "weight", None) is None or module.weight.dim() != 2:
            raise ConfigError(f"{type(self).__name__}: layer {layer_info.name!r} ({layer_info.type}) is not a Linear "
                              f"layer; the one-shot methods take nn.Linear and Hugging Face Conv1D")

    def _oneshot_mask(self, wrapper: nn.Module) -> torch.Tensor | None:
        """The keep-mask the method must respect (a pruner's own mask / the pruner wrapper under a quantizer)."""
        return None

    def _oneshot_write(self, wrapper: nn.Module, result: LayerResult) -> None:
        """Install the method's result in ``wrapper`` (the weight is written already)."""

    def calibrate(self, data: Any = None, num_samples: int | None = None, progress: Any = True,
                  forward_dtype: str = "auto") -> Any:
        """Run the one-shot method on the calibration ``data`` (a tensor of token ids, a tuple of positional
        inputs, a dict / ``BatchEncoding`` of keyword inputs, or a DataLoader / list / iterable of those;
        ``num_samples``: at most that many sequences), block by block, and leave the model compressed.
        ``progress``: one line per block on stderr (True), a file, or False. ``forward_dtype``: the dtype of the
        block passes that record the statistics and hand the compressed outputs on ('auto': float64 on CPU, the
        model's dtype on an accelerator; 'float64'; 'model'; see
        :func:`compressor.core.oneshot.forward_in_float64`). Bad data raises before any weight
        changes. Returns self."""
        what = type(self).__name__
        method = self.method_class()
        model: nn.Module = self.bound_model  # type: ignore[attr-defined]
        device = _model_device(model)
        float64 = forward_in_float64(forward_dtype, f"{what}.calibrate", device.type == "cpu")
        if method.statistics is None and data is None:
            batches: list[tuple[tuple, dict[str, Any]]] = []
        else:
            batches = [(_to(a, device), _to(k, device))
                       for _, a, k in calibration_batches(data, f"{what}.calibrate", num_samples=num_samples)]
        backend = TorchOneShotBackend(self, self.sequential_targets, float64)
        modes = {m: m.training for m in model.modules()}
        try:
            model.eval()
            with torch.no_grad():
                self.oneshot_rows = run_sequential(backend, method, batches, progress=progress)
        finally:
            for m, mode in modes.items():
                m.training = mode
        self.calibrated = True
        return self


def oneshot_key_specs(*names: str) -> tuple[KeySpec, ...]:
    """The :data:`~compressor.core.oneshot.ONESHOT_KEYS` specs of ``names``."""
    return tuple(ONESHOT_KEYS[n] for n in names)
