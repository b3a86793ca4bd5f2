"""Routed experts held as an expert BANK in a one-shot run (keras-hub's Mixtral / Qwen-MoE / Qwen3-MoE / Qwen3.5-MoE:
one layer with 3-D weights ``[E, in, out]``, e.g. Mixtral's ``expert_feedforward_gate_dense`` /
``expert_feedforward_intermediate_dense`` ``[E, H, I]`` and ``expert_feedforward_output_dense`` ``[E, I, H]``):
each expert's slice of each weight is a layer of its own, as on PyTorch
(:mod:`compressor.torch.sequential.expert_banks`; what both share is core's, :mod:`compressor.core.oneshot.experts`).

* **which**: a bank :func:`~.blocks.find_experts` finds whose class has a known per-expert computation
  (:data:`BANKS`; :func:`supported`), beside ONE router (a Dense scoring the ``E`` experts) in a parent that says
  its ``top_k``. Each slice is matched against the config list as a ``Dense`` layer named ``<bank>/<weight>``
  (``op_names`` may also name the bank or one slice ``<bank>/<e>/<weight>``); the last matching entry wins. So
  ``op_types: ['default']`` compresses them; the routers stay float (they are not in the bank).
* **layout**: slice ``[e]`` is ``[in, out]`` (the bank's ``einsum('th,ehm->etm')``); core sees ``[out, in]``.
* **statistics**: while a block is observed, the router's ``call`` is wrapped to keep its logits and the bank's
  ``call`` to run, before the bank's own computation, the experts one at a time: expert ``e`` gets the rows the
  parent's routing (``top_k`` of the softmax of the logits, as keras-hub's MoE blocks compute it) sends to it,
  its up-side weights (gate / up, or the fused gate_up) observe those rows and its down weight the activations
  its own code makes of them. Each slice so has its own Gram matrix / channel norms; an expert that got no token
  falls back as core says (round to nearest / magnitude, one warning). The original calls are back when the pass
  ends, an exception or Ctrl-C included (:func:`~.blocks._intercepted`).
* **result**: the compressed slice is written into the 3-D weight (the model computes with it at once); its
  mask / codes / scales are kept per slice (:func:`~compressor.core.oneshot.experts.bank_results`).
  ``to_keras_quantized`` converts Dense / EinsumDense layers only: a bank stays a float layer holding the
  dequantized (pruned) values, said in one warning (:func:`keras_quantized_note`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ...core.errors import ModelError
from ...core.oneshot import LayerTask
from ...core.oneshot.experts import ExpertSlice, compressed_banks, slice_observers, slice_tasks
from ..compressor import iter_layers
from .blocks import ExpertSet, _intercepted

__all__ = ["BANKS", "BankSpec", "BankSlice", "supported", "bank_tasks", "observe_banks", "watch_banks",
           "keras_quantized_note"]


def _silu32(bank: Any, x: tf.Tensor) -> tf.Tensor:
    """keras-hub's gate activation: in float32 ("Match PyTorch SiLU precision"), back in ``x``'s dtype."""
    act = getattr(bank, "activation", None) or keras.activations.silu
    return tf.cast(act(tf.cast(x, tf.float32)), x.dtype)


def _mixtral_act(bank: Any, y: dict[str, tf.Tensor]) -> tf.Tensor:
    return _silu32(bank, y["expert_feedforward_gate_dense"]) * y["expert_feedforward_intermediate_dense"]


def _qwen_act(bank: Any, y: dict[str, tf.Tensor]) -> tf.Tensor:
    gate, up = tf.split(y["expert_feedforward_gate_dense"], 2, axis=-1)
    return up * bank.activation(gate)


def _qwen35_act(bank: Any, y: dict[str, tf.Tensor]) -> tf.Tensor:
    gate, up = tf.split(y["expert_feedforward_gate_dense"], 2, axis=-1)
    return up * _silu32(bank, gate)


@dataclass(frozen=True)
class BankSpec:
    """One bank class's per-expert computation: the weights reading the expert's input rows (``up``), the one
    reading the activations (``down``), and ``act(bank, {up weight: x @ W[e]})`` -> the down weight's input (what
    the class's ``call`` computes, one expert at a time)."""

    up: tuple[str, ...]
    down: str
    act: Callable[[Any, dict[str, tf.Tensor]], tf.Tensor]

    @property
    def params(self) -> tuple[str, ...]:
        return (*self.up, self.down)


#: keras-hub bank classes (by class name) whose per-expert computation is known
BANKS: dict[str, BankSpec] = {
    "MixtralMoeExperts": BankSpec(("expert_feedforward_gate_dense", "expert_feedforward_intermediate_dense"),
                                  "expert_feedforward_output_dense", _mixtral_act),
    "QwenMoeExperts": BankSpec(("expert_feedforward_gate_dense",), "expert_feedforward_output_dense", _qwen_act),
    "Qwen3MoeExperts": BankSpec(("expert_feedforward_gate_dense",), "expert_feedforward_output_dense", _qwen_act),
    "Qwen3_5MoeExperts": BankSpec(("expert_feedforward_gate_dense",), "expert_feedforward_output_dense",
                                  _qwen35_act),
}


def _variable(bank: Any, param: str) -> Any:
    """The bank's weight named ``param`` (the last component of its path)."""
    for w in bank.weights:
        if (w.path.rsplit("/", 1)[-1] if hasattr(w, "path") else w.name) == param:
            return w
    raise ModelError(f"expert bank {bank.name!r} ({type(bank).__name__}) has no weight {param!r}")


def _top_k(parent: Any) -> int | None:
    k = getattr(parent, "top_k", None)
    return k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else None


def supported(s: ExpertSet, by_path: dict[str, Any]) -> bool:
    """An expert set whose bank is compressed slice by slice: fused, of a class in :data:`BANKS` holding its
    weights ``[E, in, out]``, beside exactly one router, in a parent with an integer ``top_k``."""
    if not s.fused or len(s.routers) != 1:
        return False
    bank, parent = by_path.get(s.members[0]), by_path.get(s.parent)
    spec = BANKS.get(type(bank).__name__)
    if spec is None or parent is None or _top_k(parent) is None:
        return False
    shapes = dict(s.params)
    return all(p in shapes and len(shapes[p]) == 3 for p in spec.params)


class BankSlice(ExpertSlice):
    """Expert ``expert``'s slice ``[in, out]`` of the bank weight ``param``; core sees ``[out, in]``."""

    sep = "/"

    def __init__(self, bank: Any, path: str, param: str, expert: int, router: Any = None, parent: Any = None):
        super().__init__(bank, path, param, expert)
        self.variable = _variable(bank, param)
        self.router, self.parent = router, parent

    def _tf(self) -> Any:
        return getattr(self.variable, "_value", self.variable)

    def stored(self) -> np.ndarray:
        return np.array(self._tf()[self.expert].numpy())

    def read(self) -> np.ndarray:
        return self.stored().T.astype(np.float64)

    def in_features(self) -> int:
        return int(self.variable.shape[1])

    def assign(self, weight: Any) -> None:
        v = self._tf()
        v[self.expert].assign(tf.cast(np.ascontiguousarray(np.asarray(weight).T), v.dtype))

    def put_back(self, stored: np.ndarray) -> None:
        self._tf()[self.expert].assign(stored)


def bank_tasks(compressor: Any, model: Any, experts: list[ExpertSet]) -> list[LayerTask]:
    """One task per expert and weight of the supported banks of ``experts`` (:func:`supported`) that the
    compressor's config list selects; each handle marked as its routed expert's for core's fallback."""
    by_path = dict(iter_layers(model))
    banks = []
    links: dict[int, tuple[Any, Any]] = {}
    for s in experts:
        if not supported(s, by_path):
            continue
        bank = by_path[s.members[0]]
        links[id(bank)] = (by_path[s.routers[0]], by_path[s.parent])
        banks.append((bank, s.members[0], BANKS[type(bank).__name__].params, s.count))

    def make(bank: Any, path: str, param: str, e: int) -> BankSlice:
        return BankSlice(bank, path, param, e, *links[id(bank)])

    return slice_tasks(compressor.config_list, compressor.default_types, "Dense", banks, make)


def _rows(x: tf.Tensor) -> np.ndarray:
    """``x`` as host rows for core: float32 as it is, float64 kept, half precision widened to float32."""
    return np.asarray(x.numpy(), np.float64 if x.dtype == tf.float64 else np.float32)


@contextmanager
def observe_banks(tasks: list[LayerTask], observe: dict[str, Callable[[Any], None]],
                  fired: Callable[[str], None], keep: Callable[[], Any] = lambda: None) -> Iterator[None]:
    """While the body runs, each bank holding an observed slice of ``tasks`` hands expert ``e``'s routed rows to
    its up-side slices' observers and its activations to its down slice's (see the module docstring), then calls
    ``fired(name)`` after each (which may raise to end the call), before computing its output as always.
    ``keep()``: the call's real tokens (``[tokens]`` booleans, None: all); padded ones count for no expert."""
    with ExitStack() as stack:
        for bank, names in slice_observers(tasks, observe):
            h0 = next(t.handle for t in tasks if isinstance(t.handle, BankSlice) and t.handle.bank is bank)
            spec = BANKS[type(bank).__name__]
            logits: list[Any] = []

            def keep_logits(orig: Callable[..., Any], logits: list[Any] = logits) -> Callable[..., Any]:
                def router(*args: Any, **kwargs: Any) -> Any:
                    out = orig(*args, **kwargs)
                    logits[:] = [out]
                    return out
                return router

            def per_expert(orig: Callable[..., Any], bank: Any = bank, names: dict = names, spec: BankSpec = spec,
                           logits: list[Any] = logits, k: int = _top_k(h0.parent),
                           count: int = int(h0.variable.shape[0])) -> Callable[..., Any]:
                def call(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
                    x = tf.convert_to_tensor(hidden_states)
                    if not logits or int(logits[0].shape[0]) != int(x.shape[0]):
                        raise ModelError(f"expert bank {bank.name!r}: its router was not called on the bank's rows "
                                         f"just before it; its routed tokens are unknown")
                    _, top = tf.math.top_k(tf.nn.softmax(tf.convert_to_tensor(logits[0]), axis=-1), k)
                    logits.clear()
                    top = top.numpy()
                    real = keep()
                    if real is not None and real.size != top.shape[0]:
                        real = None
                    for e in range(count):
                        routed = (top == e).any(axis=-1)
                        tok = np.flatnonzero(routed if real is None else routed & real)
                        if not tok.size:
                            continue
                        xe = tf.gather(x, tok)
                        ys = {}
                        for p in spec.up:
                            name = names.get((e, p))
                            if name is not None:
                                observe[name](_rows(xe))
                                fired(name)
                            ys[p] = xe @ tf.cast(_variable(bank, p)._value[e], xe.dtype)
                        name = names.get((e, spec.down))
                        if name is not None:
                            observe[name](_rows(spec.act(bank, ys)))
                            fired(name)
                    return orig(hidden_states, *args, **kwargs)
                return call

            stack.enter_context(_intercepted(h0.router, keep_logits))
            stack.enter_context(_intercepted(bank, per_expert))
        yield


@contextmanager
def watch_banks(tasks: list[LayerTask], seen: Callable[[str], None]) -> Iterator[None]:
    """While the body runs, a call of a bank marks each of its slices of ``tasks`` as ``seen`` (the check that
    every selected layer is called)."""
    with ExitStack() as stack:
        banks: dict[int, tuple[Any, list[str]]] = {}
        for t in tasks:
            if isinstance(t.handle, BankSlice):
                banks.setdefault(id(t.handle.bank), (t.handle.bank, []))[1].append(t.name)
        for bank, names in banks.values():
            def make(orig: Callable[..., Any], names: list[str] = names) -> Callable[..., Any]:
                def call(*args: Any, **kwargs: Any) -> Any:
                    for n in names:
                        seen(n)
                    return orig(*args, **kwargs)
                return call
            stack.enter_context(_intercepted(bank, make))
        yield


def keras_quantized_note(model: Any) -> str | None:
    """For ``to_keras_quantized``: one line naming the expert banks of ``model`` a one-shot run quantized (Keras has
    no quantized layer for a bank: they stay float layers holding the dequantized values), or None."""
    got = [(p, r) for p, _, r in compressed_banks(iter_layers(model))
           if any(x.quantized is not None for x in r.values())]
    if not got:
        return None
    slices = sum(len(r) for _, r in got)
    return (f"to_keras_quantized: {len(got)} expert bank(s) ({got[0][0]}{' ...' if len(got) > 1 else ''}; {slices} "
            f"expert slices) stay float layers holding their dequantized values: Keras quantizes Dense / "
            f"EinsumDense layers only")
