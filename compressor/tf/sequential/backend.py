"""The Keras adapter of :class:`~compressor.core.oneshot.OneShotBackend`: runs a compressor's model block by block
on cached inputs with each selected layer's ``call`` (and ``quantized_call``) wrapped to hand its input to core,
reads and writes kernels in the canonical ``[out, in]`` layout, and keeps the undo copies core asks for."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ...core.errors import ModelError
from ...core.oneshot import (
    LayerResult,
    LayerTask,
    ObserveCalls,
    ObservedAll,
    OneShotBackend,
)
from ...core.oneshot.experts import record_slice, restore_slice, slice_mask, snapshot_slice
from ..compressor import iter_layers, wrappers_of
from ..kernel_layout import KernelLayout
from ..pruning.wrapper import PrunerLayerWrapper
from . import expert_banks as banks
from .blocks import (
    BlockInput,
    _first_arg,
    _float64_of,
    _float64_policies,
    _hidden_of,
    _intercepted,
    _same,
    _shared_with,
    _Stop,
    drop_pending,
    find_experts,
)

#: tokens per float64 block call (:meth:`KerasOneShotBackend._call`): the batch is sliced by sequences to stay under it
FLOAT64_PASS_TOKENS = 512


#: tokens per call of AWQ's search passes (:meth:`KerasOneShotBackend._sliced`; the torch side merges its recorded
#: calls up to 256 tokens)
SEARCH_PASS_TOKENS = 512



class KerasOneShotBackend(OneShotBackend):
    """The Keras side of :func:`compressor.core.oneshot.run_sequential` for one compressor."""

    def __init__(self, compressor: Any, blocks: list[tuple[str, Any]], float64: bool = False) -> None:
        self.c = compressor
        self.float64 = float64  # run_block in float64 (core.oneshot.forward_in_float64)
        self.model = compressor.bound_model
        self._blocks = list(blocks)
        self.tasks = {w.name: LayerTask(w.name, w.config, compressor._layouts[w.name].n_in, w,
                                        compressor._specs.get(w.name))
                      for w in compressor.modules_wrapper}
        # the routed experts of expert banks (3-D weights): one task per expert slice (expert_banks)
        self._banks = banks.bank_tasks(compressor, self.model, find_experts(self.model))
        self._compiled: dict[int, Any] = {}
        #: the real (not padded) tokens of the call being observed, flattened ``[batch * seq]``; None: all of them
        self._keep: list[np.ndarray | None] = [None]

    # -- structure
    def blocks(self) -> list[tuple[str, Any]]:
        return list(self._blocks)

    def _block_of(self, name: str) -> Any:
        return next((b for p, b in self._blocks if name.startswith(p + "/")), None)

    def block_layers(self, block: Any) -> list[LayerTask]:
        return [t for n, t in self.tasks.items() if self._block_of(n) is block] + \
            [t for t in self._banks if self._block_of(t.name) is block]

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
                task = self.tasks.get(name)
                if task is None:  # an expert bank's slice: observed below
                    continue
                plan = self.c._layouts[name]
                layer = task.handle.layer

                def make(orig: Callable[..., Any], fn: Callable[[Any], None] = fn, plan: KernelLayout = plan,
                         layer: Any = layer, name: str = name) -> Callable[..., Any]:
                    def observed(*args: Any, **kwargs: Any) -> Any:
                        fn(kept_rows(plan.rows(_first_arg(layer, args, kwargs)[1]), self._keep[0]))
                        if calls is not None and calls.fired(name):
                            raise ObservedAll
                        return orig(*args, **kwargs)
                    return observed

                stack.enter_context(_intercepted(layer, make))

            def fired(name: str) -> None:
                if calls is not None and calls.fired(name):
                    raise ObservedAll
            stack.enter_context(banks.observe_banks(self._banks, observe or {}, fired, lambda: self._keep[0]))
            yield

    def drop_transients(self) -> None:
        """Undo whatever a pass still has in place (intercepted calls, float64 dtype policies): called by the
        rollback of a failed or interrupted run (core ``Undo``) before the layers' weights are put back."""
        drop_pending()

    def check(self, batch: Any) -> str | None:
        """Run the model once on ``batch`` with every block and selected layer watched (nothing changes).
        Returns None when the blocks form a chain, else why not; a selected layer that is never called is a
        ModelError."""
        try:
            return self._check(batch)
        except BaseException:  # a Ctrl-C that cut the watching's clean-up short: finish it
            drop_pending()
            raise

    def _check(self, batch: Any) -> str | None:
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
            stack.enter_context(banks.watch_banks(self._banks, seen.add))
            self._run_model(batch, 0)
        missing = [n for n in [*self.tasks, *(t.name for t in self._banks)] if n not in seen]
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
            self._keep[0] = real_tokens(part.kwargs, part.hidden)
            try:
                self._invoke(block, part, wide)
            except ObservedAll:
                pass
            finally:
                self._keep[0] = None
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
        inputs and outputs side by side (+32 MiB on the trained byte-level Llama of examples/RESULTS.md)."""
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
        left +63 MiB there on the trained byte-level Llama (slices of 2 sequences: see examples/RESULTS.md)."""
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
                if isinstance(t.handle, banks.BankSlice):  # each slice its own statistics (a layer of its own)
                    continue
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
                self._keep[0] = real_tokens(b) if isinstance(b, dict) else None
                try:
                    self._run_model(b, i)
                finally:
                    self._keep[0] = None

    # -- weights
    def read_weight(self, task: LayerTask) -> tuple[np.ndarray, np.ndarray | None]:
        w = task.handle
        if isinstance(w, banks.BankSlice):
            return w.read(), slice_mask(w)
        plan = self.c._layouts[task.name]
        raw = np.asarray(w.weight.numpy())
        # float32 holds a float32 / bf16 / fp16 weight exactly, at half the bytes of float64: the solvers make
        # their own float64 copy (core.oneshot.steps.compute_layer), the other methods get float64 there
        weight = plan.to_canonical(raw).astype(np.float64 if raw.dtype == np.float64 else np.float32)
        pruner = next((p for p in wrappers_of(w.layer) if isinstance(p, PrunerLayerWrapper) and p.ready), None)
        mask = None
        if pruner is not None and pruner.slot is None:
            mask = plan.to_canonical(np.asarray(pruner.weight_mask.numpy())).astype(bool)
        return weight, mask

    def write(self, task: LayerTask, result: LayerResult) -> None:
        if isinstance(task.handle, banks.BankSlice):
            task.handle.assign(result.weight)
            record_slice(task.handle, result)
            return
        self.c._write(task.handle, self.c._layouts[task.name], result)

    def set_weight(self, task: LayerTask, weight: np.ndarray) -> None:
        if isinstance(task.handle, banks.BankSlice):
            task.handle.assign(weight)
            return
        kernel = _kernel(task.handle)
        kernel.assign(tf.cast(self.c._layouts[task.name].from_canonical(weight), kernel.dtype))

    def snapshot(self, task: LayerTask) -> dict[str, Any]:
        """Host copies of what :meth:`write` / :meth:`set_weight` change: the kernel, the wrapper's state
        variables (masks, codes, ...), and which of them and of its plain attributes existed."""
        w = task.handle
        if isinstance(w, banks.BankSlice):
            return snapshot_slice(w)
        return {"kernel": np.array(_kernel(w).numpy()),
                "states": {n: np.array(v.numpy()) for n, v in w.state_variables().items()},
                "attrs": {a: vars(w)[a] for a in _WRITTEN_ATTRS if a in vars(w)}}

    def restore(self, task: LayerTask, saved: dict[str, Any]) -> None:
        w = task.handle
        if isinstance(w, banks.BankSlice):
            restore_slice(w, saved)
            return
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



#: the keyword arguments that carry a batch's padding mask (``[batch, seq]``, 0 = padding) into a keras-hub
#: decoder block (``decoder_padding_mask``: Llama, Mistral, Qwen, Phi-3, GPT-2, OPT, Falcon, GPT-NeoX, Bloom, the
#: MoE families; ``padding_mask``: Gemma, Gemma-3, and the model's own input dict)
PADDING_KEYS = ("decoder_padding_mask", "padding_mask")


def real_tokens(kwargs: dict, hidden: Any = None) -> np.ndarray | None:
    """The real tokens of a call, flattened ``[batch * seq]`` booleans, from its 2-D padding mask (whose shape is
    the hidden state's leading two axes when ``hidden`` is given); None when there is no such mask or nothing
    is padded."""
    lead = tuple(int(d) for d in hidden.shape[:2]) if hidden is not None and len(hidden.shape) >= 3 else None
    for key in PADDING_KEYS:
        m = kwargs.get(key)
        if m is None or not hasattr(m, "shape") or len(m.shape) != 2:
            continue
        if lead is not None and tuple(int(d) for d in m.shape) != lead:
            continue
        keep = np.asarray(m).reshape(-1) != 0
        return None if keep.all() else keep
    return None


def kept_rows(rows: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """``rows`` (``[tokens * r, in]``, each token's ``r`` rows together, as a layer input ``[batch, seq, ...]``
    flattens) without the padded tokens' rows; unchanged when ``keep`` is None or does not divide them."""
    if keep is None or rows.shape[0] % keep.size:
        return rows
    per = rows.shape[0] // keep.size
    return rows[np.repeat(keep, per) if per > 1 else keep]
