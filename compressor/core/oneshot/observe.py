"""The observing pass of a block: one accumulator per selected layer (layers that read one input share it), and
when a block call may stop early (:class:`ObserveCalls`: after its last observed input)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .protocol import LayerTask
from .statistics import GramAccumulator


def observers(method: Any, tasks: list[LayerTask], shared: dict[str, str] | None = None
               ) -> tuple[dict[str, GramAccumulator], dict[str, Callable]]:
    """One accumulator per layer; a layer in ``shared`` (``{layer: earlier layer that reads the same input}``,
    e.g. k / v -> q) gets the earlier layer's accumulator and is not observed (its statistics are equal)."""
    accs: dict[str, GramAccumulator] = {}
    observe: dict[str, Callable] = {}
    shared = shared or {}
    # leaders first: a leader may come after its followers in the layer list (keras-hub Llama: the up
    # projection is defined before the gate, which is called first)
    for t in sorted(tasks, key=lambda t: t.name in shared):
        lead = shared.get(t.name)
        if lead in accs and accs[lead].in_features == t.in_features:
            accs[t.name] = accs[lead]
        else:
            accs[t.name] = GramAccumulator(t.in_features, gram=method.statistics == "gram")
            observe[t.name] = accs[t.name].add
    return accs, observe


class ObservedAll(Exception):
    """Raised by a backend's observing hook once a block call has handed over every observed layer's input (see
    :class:`ObserveCalls`); the backend catches it around that call, whose output an observing run drops."""


class ObserveCalls:
    """When may an observing run of a block stop? After the last observed input of the call: the layers that
    run after it (Llama's down projection and the residual add; fc2 in OPT / GPT-2) compute an output nobody
    reads. Skipping them saves one of seven matrix products of an observing call (a float64 one, by default,
    on a CPU).

    A backend calls :meth:`begin` before each block call and :meth:`fired(name) <fired>` from each observing
    hook (leaders and the layers that share their input alike), after the hook has done its work; when it
    returns True the hook raises :class:`ObservedAll`. The first call always runs to the end and fixes the
    order: only when each hooked layer fired exactly once there does a later call stop, on the first call's
    last layer, once every hooked layer has fired (a layer called twice per block, or an order that changes
    from call to call, then runs the whole block as before)."""

    def __init__(self, names: Iterable[str]):
        self.names = frozenset(names)
        self._calls: list[str] = []
        self._last: str | None = None
        self._learnt = False

    def begin(self) -> None:
        if self._calls and not self._learnt:  # the first call ran to the end: learn its order
            self._learnt = True
            if len(self._calls) == len(self.names) and set(self._calls) == self.names:
                self._last = self._calls[-1]
        self._calls = []

    def fired(self, name: str) -> bool:
        self._calls.append(name)
        return (self._last is not None and name == self._last and len(self._calls) == len(self.names)
                and set(self._calls) == self.names)

