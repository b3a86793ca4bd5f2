"""The PyTorch adapter of :class:`~compressor.core.oneshot.OneShotBackend`: runs a compressor's model block by
block on cached inputs, with forward hooks that hand each selected layer's input to core, reads and writes
weights in the canonical ``[out, in]`` layout, and keeps the undo copies core asks for."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from ...core.errors import ModelError
from ...core.interrupts import deferred_interrupts
from ...core.oneshot import (
    LayerResult,
    LayerTask,
    ObserveCalls,
    ObservedAll,
    OneShotBackend,
    RowSource,
)
from ..calibration_data import _tensors
from ..layout import canonical_shape, from_canonical, to_canonical
from ..modules import is_wrapper
from ..pruning.wrapper import PrunerModuleWrapper
from . import expert_banks as fused
from .blocks import (
    _dedupe,
    _hidden_of,
    _host,
    _Input,
    _keep_mask,
    _merged_calls,
    _Stop,
    _storage,
    _version,
    _widened,
    find_blocks,
    find_experts,
    float64_exempt,
    model_dtype_hooks,
)


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
        self._tasks = {id(w): LayerTask(w.name, w.config, canonical_shape(w, w.weight.shape)[1], w,
                                        getattr(w, "quant_spec", None))
                       for w in self.wrappers}
        # the routed experts of fused 3-D parameters: one task per expert slice (expert_banks)
        self._fused = fused.fused_tasks(compressor, self.model, find_experts(self.model))
        fwd = getattr(self.model, "forward", None)
        try:
            params = inspect.signature(fwd).parameters if fwd is not None else {}
        except (TypeError, ValueError):
            params = {}
        self._no_cache = "use_cache" in params
        self._shared: dict[str, str] = {}
        #: how to undo what a pass has in place now (hooks, float64 tensors swapped in), registered before the
        #: change is made: the rollback of an interrupted run calls :meth:`drop_transients`, in case the pass's own
        #: clean-up was cut short by the Ctrl-C
        self._pending: list[Callable[[], None]] = []

    def _called(self, wrapper: nn.Module) -> nn.Module:
        """The module the model calls for ``wrapper``'s layer: the wrapper itself, or the outer wrapper of a
        compressor applied later (a quantizer over a pruner's wrapper, as a streamed recipe's stages stand at
        once), which hands its input on unchanged (weight-only) and may reach the inner layer without calling
        the inner wrapper."""
        outer = self.model.get_submodule(wrapper.name) if wrapper.name else wrapper
        return outer if is_wrapper(outer) else wrapper

    # ---- structure
    def blocks(self) -> list[tuple[str, nn.Module]]:
        return list(self._blocks)

    def block_layers(self, block: nn.Module | None) -> list[LayerTask]:
        if block is None:
            inside = set().union(*self._block_ids) if self._block_ids else set()
            return ([self._tasks[id(w)] for w in self.wrappers if id(w) not in inside]
                    + [t for t in self._fused if id(t.handle.bank) not in inside])
        ids = {id(m) for m in block.modules()}
        return ([self._tasks[id(w)] for w in self.wrappers if id(w) in ids]
                + [t for t in self._fused if id(t.handle.bank) in ids])

    def _undo_later(self, undo: Callable[[], None]) -> Callable[[], None]:
        self._pending.append(undo)
        return undo

    def _settle(self, undo: Callable[[], None]) -> None:
        """Run a pending ``undo`` now (all of it, even if Ctrl-C is pressed meanwhile: raised after)."""
        with deferred_interrupts():
            undo()
            if undo in self._pending:
                self._pending.remove(undo)

    def drop_transients(self) -> None:
        """Undo whatever a pass still has in place (its hooks, the float64 copies swapped into layers): called
        by the rollback of a failed or interrupted run (core ``Undo``) before the layers' weights are put back."""
        with deferred_interrupts():
            while self._pending:
                self._pending[-1]()
                self._pending.pop()

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

        handles: list[Any] = []
        undo = self._undo_later(partial(_remove_hooks, handles))
        try:
            handles.append(block0.register_forward_pre_hook(hook, with_kwargs=True))
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
            self._settle(undo)
        return store

    def _observing(self, observe: dict[str, Callable[[Any], None]] | None, keep: Callable[[], Any], stop: bool = False,
                   handles: list[Any] | None = None) -> tuple[list[Any], Callable[[], None]]:
        """Pre-hooks that hand each observed layer's input rows to ``observe[name]``, and a ``reset()`` to call after
        each call of the block: it drops the references to that call's tensors (each call then starts on the same
        heap: kept into the next call, they made the allocator place that call's buffers elsewhere). ``stop``: a
        hook raises :class:`~compressor.core.oneshot.ObservedAll` once the call has nothing left to observe
        (core :class:`~compressor.core.oneshot.ObserveCalls`); the caller catches it. ``handles``: the caller's
        list the hooks go to as they are registered (removed by the caller, also after an interrupt part way)."""
        handles = [] if handles is None else handles
        if not observe:
            return handles, lambda: None
        last: list[Any] = [None, -1, None]  # (tensor, version, its rows): q / k / v read one hidden state
        fed: dict[str, Any] = {}  # layer -> a weak reference to the input it got last (not kept alive by this)
        shared = self._shared

        def rows(t: torch.Tensor) -> np.ndarray | RowSource:
            if last[0] is t and last[1] == _version(t):
                return last[2]
            x = t.detach()
            k = keep()
            if k is not None and tuple(x.shape[:-1]) == tuple(k.shape):
                x = x[k.to(x.device)]
            # float32 as it is (core's Gram takes float32 products of float32 values, whatever the dtype handed
            # over: no float64 copy here), float64 kept; half precision widened to float32 a slice of rows at a
            # time as the statistics read it (RowSource: no float32 copy of the whole batch)
            if x.dtype in (torch.float32, torch.float64):
                got: np.ndarray | RowSource = x.to("cpu").numpy().reshape(-1, x.shape[-1])
            else:
                x2 = x.reshape(-1, x.shape[-1])

                def get(i: int, j: int, x2: torch.Tensor = x2) -> np.ndarray:
                    return x2[i:j].to("cpu", torch.float32).contiguous().numpy()
                got = RowSource(x2.shape[0], x2.shape[1], get)
            last[:] = [t, _version(t), got]
            return got

        hooked = [w.name for w in self.wrappers
                  if w.name in observe or (shared.get(w.name) is not None and shared[w.name] in observe)]
        hooked += [t.name for t in self._fused if t.name in observe]
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
            handles.append(self._called(w).register_forward_pre_hook(pre))

        def fired(name: str) -> None:
            if stop and calls.fired(name):
                raise ObservedAll
        fused.observe_fused(self._fused, observe, keep, fired, handles)

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
        handles: list[Any] = []
        undo = self._undo_later(partial(_remove_hooks, handles))
        try:
            for w in self.wrappers:
                if w.name in names:
                    def pre(module: nn.Module, args: tuple, name: str = w.name) -> None:
                        alive.append(args[0])
                        first.setdefault(name, len(alive))
                        calls.setdefault(name, []).append((id(args[0]), _version(args[0])))
                    handles.append(self._called(w).register_forward_pre_hook(pre))
            block(*inputs[0].args, **inputs[0].kwargs)
        finally:
            self._settle(undo)
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
        ``functional_call`` were a fifth of a float64 pass's CPU time on the trained byte-level Llama of examples/RESULTS.md):

        * the tensors outside the wrapped layers (norms, layers not selected) are swapped for float64 copies for
          the whole pass;
        * each wrapped layer's tensors are copied to float64 when it is called and swapped back when it returns:
          one layer's float64 weight alive at a time, not the block's (half the float64 pass's extra memory on the
          trained byte-level Llama: examples/RESULTS.md; a float64 workspace kept for the whole pass measured no lower);
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
            swapped.append((own, marks))  # recorded before the first tensor is swapped: an interrupt is undone
            for d, n, t in own:
                d[n] = t.to(torch.float64)
            for m, _ in marks:
                m.set_mark()

        def narrow(module: nn.Module, args: Any, out: Any) -> None:
            own, marks = swapped[-1]
            for d, n, t in own:
                d[n] = t
            for m, mark in marks:
                m.set_mark(mark)
            swapped.pop()  # forgotten only once all is back: an interrupt part way is finished by the next narrow

        shared: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

        def call(inp: _Input) -> Any:
            h = inp.hidden()
            try:
                out = _hidden_of(block(*_widened(inp.args, h, shared), **_widened(inp.kwargs, h, shared)))
            finally:
                if swapped:  # a layer that raised: its own tensors back (a second Ctrl-C waits for it)
                    with deferred_interrupts():
                        while swapped:
                            narrow(block, None, None)
            return out.to(h.dtype) if torch.is_tensor(h) else out

        outside: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        handles: list[Any] = []

        def put_back() -> None:
            _remove_hooks(handles)
            while swapped:
                narrow(block, None, None)
            while outside:
                d, n, t = outside.pop()
                d[n] = t

        undo = self._undo_later(put_back)  # registered before the first swap
        try:
            # fused experts (grouped matrix products that take no float64) keep the model's dtype, cast at their
            # boundary (blocks.float64_exempt): they are not compressed, only their outputs feed the pass
            exempt = float64_exempt(block)
            exempt_ids = {id(m) for e in exempt for m in e.modules()}
            for e in exempt:
                handles.extend(model_dtype_hooks(e))
            copies: dict[int, torch.Tensor] = {}  # a tensor held under two names (tied) gets one float64 copy
            for m in block.modules():
                if id(m) in unit_ids or id(m) in exempt_ids:
                    continue
                for d in (m._parameters, m._buffers):
                    for n, t in list(d.items()):
                        if t is not None and t.is_floating_point() and t.dtype != torch.float64:
                            outside.append((d, n, t))
                            d[n] = copies.setdefault(id(t), t.to(torch.float64))
            for u in units:
                handles.append(u.register_forward_pre_hook(widen))
                handles.append(u.register_forward_hook(narrow))
            yield call
        finally:
            self._settle(undo)  # everything back, even if Ctrl-C is pressed again meanwhile
            shared.clear()  # the pass's float64 arguments go now, not when the closures are collected

    def run_block(self, block: nn.Module, inputs: list[_Input], observe: dict[str, Callable[[Any], None]] | None
                  ) -> list[_Input]:
        state: dict[str, Any] = {}
        handles: list[Any] = []
        undo = self._undo_later(partial(_remove_hooks, handles))
        outs: list[_Input] = []
        try:
            _, reset = self._observing(observe, lambda: state.get("keep"), stop=True, handles=handles)
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
            self._settle(undo)
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
        on the trained byte-level Llama of examples/RESULTS.md)."""
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
        handles: list[Any] = []
        undo = self._undo_later(partial(_remove_hooks, handles))
        try:
            _, reset = self._observing(observe, lambda: state.get("keep"), handles=handles)
            for i, (args, kwargs) in enumerate(batches):
                state["keep"] = _keep_mask(kwargs)
                self._call_model(i, args, kwargs)
                reset()
        finally:
            self._settle(undo)

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
        1-D tensors (cache positions), batch-1 broadcasts and other objects as they are. A tensor of 3 or more axes
        whose first axis is the batch folded with another one, ``b * m`` entries (Bloom's ALiBi bias
        ``[batch * heads, 1, keys]``), is cut as ``b`` runs of ``m``: the batch-major order ``x.view(b * m, ...)``
        gives a ``[b, m, ...]`` tensor, the order a block unfolds it in (``view(b, m, ...)``). 2-D tensors are cut
        only when their first axis is the batch (a ``[positions, dim]`` rotary table is no batch)."""
        b = self.batch_rows(inp)
        idx = torch.tensor(rows, dtype=torch.long)

        def cut(v: Any) -> Any:
            if torch.is_tensor(v):
                if v.dim() < 2 or b < 2 or v.shape[0] % b or (v.dim() == 2 and v.shape[0] != b):
                    return v
                m = v.shape[0] // b
                sel = idx if m == 1 else (idx[:, None] * m + torch.arange(m)).reshape(-1)
                return v.index_select(0, sel.to(v.device))
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
        handles: list[Any] = []
        undo = self._undo_later(partial(_remove_hooks, handles))
        try:
            for store, module in zip(got, modules):
                def pre(mod: nn.Module, args: tuple, kwargs: dict[str, Any], store: list[_Input] = store) -> None:
                    kwargs = dict(kwargs)
                    if store:
                        prev = store[-1]
                        args = tuple(_dedupe(a, prev.args[j]) if 0 < j < len(prev.args) else a
                                     for j, a in enumerate(args))
                        kwargs = {k: _dedupe(v, prev.kwargs[k]) if k in prev.kwargs and k != "hidden_states" else v
                                  for k, v in kwargs.items()}
                    store.append(_Input(args, kwargs, ("arg", 0), state.get("keep")))
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            for inp in inputs:
                state["keep"] = inp.keep
                block(*inp.args, **inp.kwargs)
        finally:
            self._settle(undo)
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
        if isinstance(w, fused.FusedSlice):
            return fused.snapshot(w)
        saved = {f"buffer:{n}": _host(b) for n, b in w.named_buffers()}
        saved["weight"] = _host(w.weight)
        return saved

    def restore(self, task: LayerTask, saved: dict[str, Any]) -> None:
        w = task.handle
        if isinstance(w, fused.FusedSlice):
            fused.restore(w, saved)
            return
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
        if isinstance(w, fused.FusedSlice):
            w.assign(weight)
            return
        # the solvers' results are transposed views of their sweep arrays: cast first (one copy in the weight's
        # dtype, strides kept), not a float64 C-contiguous copy of the layer's weight
        new = from_canonical(w, torch.from_numpy(weight).to(dtype=w.weight.dtype))
        with torch.no_grad():
            w.weight.copy_(new.to(device=w.weight.device))

    def read_weight(self, task: LayerTask) -> tuple[np.ndarray, np.ndarray | None]:
        w = task.handle
        if isinstance(w, fused.FusedSlice):
            return w.read(), fused.slice_mask(w)
        # float32 holds a float32 / bf16 / fp16 weight exactly, at half the bytes of float64: the solvers make
        # their own float64 copy (core.oneshot.steps.compute_layer), the other methods get float64 there
        wide = torch.float64 if w.weight.dtype == torch.float64 else torch.float32
        weight = to_canonical(w, w.weight.detach()).to("cpu", wide).numpy()
        mask = self.compressor._oneshot_mask(w)
        if mask is not None:
            mask = to_canonical(w, mask).cpu().numpy().astype(bool)
            if mask.all():
                mask = None
        return weight, mask

    def write(self, task: LayerTask, result: LayerResult) -> None:
        self.set_weight(task, result.weight)
        if isinstance(task.handle, fused.FusedSlice):
            fused.record(task.handle, result)
            return
        self.compressor._oneshot_write(task.handle, result)


def _remove_hooks(handles: list[Any]) -> None:
    """Remove the hooks of ``handles`` (registered as each was appended), all of them even if Ctrl-C is pressed
    meanwhile (it is raised after)."""
    with deferred_interrupts():
        while handles:
            handles.pop().remove()
