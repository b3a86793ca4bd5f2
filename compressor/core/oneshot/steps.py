"""One layer's turn in a one-shot run: compute the method's result from the layer's weight and statistics, check
it, write it into the model after the layer's undo copy, and add its report row."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ModelError
from .arrays import Handed
from .collective import assign_layers
from .experts import expert_fallback, routed_expert, warn_fallbacks
from .memory import GramSpill, Undo, release_freed_heap
from .protocol import LayerResult, LayerTask, OneShotBackend
from .statistics import GramAccumulator


def _row(task: LayerTask, method: Any, result: LayerResult, block: str) -> dict[str, Any]:
    if not np.all(np.isfinite(result.weight)):
        raise ModelError(f"{method.name}: layer {task.name!r}: the compressed weight is not finite")
    row = {"layer": task.name, "block": block, "method": method.name}
    if result.mask is not None:
        row["sparsity"] = 1.0 - float(np.count_nonzero(result.mask)) / result.mask.size
    if result.quantized is not None:
        row["bits"] = result.quantized.spec.bits
        row["group_size"] = result.quantized.group_size
    row.update(result.info)
    return row


def _check_seen(method: Any, task: LayerTask, stats: GramAccumulator | None) -> None:
    if stats is not None and stats.count == 0:
        expert = routed_expert(task)  # compute_layer gives it a fallback: only AWQ's group search gets here
        if expert is not None:
            raise ModelError(f"{type(method).__name__}: layer {task.name!r} of the routed expert {expert!r} saw no "
                             f"calibration token, and AWQ's block search scores it together with the layers reading "
                             f"its input; give awq_search: 'layer' (it then gets round to nearest) or more data")
        raise ModelError(f"{type(method).__name__}: layer {task.name!r} saw no input during calibration (is it "
                         f"used in the model's forward for these inputs?); exclude it or check the data")


def compute_layer(backend: OneShotBackend, method: Any, task: LayerTask,
                   stats: GramAccumulator | None) -> LayerResult:
    """``method``'s result for ``task`` from its current weight and ``stats`` (the model is not changed)."""
    weight, mask = backend.read_weight(task)
    fallback = expert_fallback(method, task, weight, mask, stats)  # a routed expert the data hardly reached
    if fallback is not None:
        return fallback
    _check_seen(method, task, stats)
    if getattr(method, "copies_weight", False):  # its one reference: freed once the solver has its float64 copy
        handed = Handed(weight)
        del weight
        return method.compress(task, handed, mask, stats)
    return method.compress(task, np.asarray(weight, np.float64), mask, stats)


def commit_layer(backend: OneShotBackend, method: Any, task: LayerTask, result: LayerResult,
                  rows: list[dict[str, Any]], block: str, undo: Undo | None) -> None:
    """Write ``result`` into the model (after the undo copy of the layer) and add its report row."""
    row = _row(task, method, result, block)
    if undo is not None:
        undo.before(task)
    backend.write(task, result)
    rows.append(row)
    warn_fallbacks(backend, method, rows, block)


def compress_layers(backend: OneShotBackend, method: Any, tasks: list[LayerTask],
                     accs: dict[str, GramAccumulator], rows: list[dict[str, Any]], block: str,
                     undo: Undo | None = None) -> None:
    """Compute and write each layer of ``tasks`` in turn; split over the processes of ``backend.collective`` when
    there are several (:func:`_compress_layers_split`). In a run that spills (:func:`~.memory.spilling_to`), the
    large Gram matrices of the layers after the first wait on disk until their turn."""
    if backend.collective.world > 1:
        _compress_layers_split(backend, method, tasks, accs, rows, block, undo)
        return
    later = [id(accs[t.name]) if accs.get(t.name) is not None else None for t in tasks]
    spill = _spill_later(tasks, accs)
    try:
        for i, t in enumerate(tasks):
            stats = accs.get(t.name)
            if stats is not None:
                spill.get(stats)
                if id(stats) not in later[i + 1:]:
                    stats.consumable = True  # no later layer reads it: the solver may take it
            result = compute_layer(backend, method, t, stats)
            commit_layer(backend, method, t, result, rows, block, undo)
            del result
            release_freed_heap()  # the solver's matrices: the next layer's start on a trimmed heap
    finally:
        spill.close()


def _spill_later(tasks: list[LayerTask], accs: dict[str, GramAccumulator]) -> GramSpill:
    """The Gram matrices of ``tasks`` after the first one's, spilled (see :class:`~.memory.GramSpill`)."""
    spill = GramSpill()
    first = accs.get(tasks[0].name) if tasks else None
    for t in tasks[1:]:
        acc = accs.get(t.name)
        if acc is not None and acc is not first:
            spill.put(acc)
    return spill


def solve_cost(task: LayerTask) -> float:
    """A layer's share of a block's solving time, for splitting the layers over processes: the factorization of
    its ``in x in`` Hessian (``in^3``) dominates GPTQ / SparseGPT (a TinyLlama block's down projection, 5632
    wide, is ~2/3 of its block)."""
    return float(task.in_features) ** 3


def _compress_layers_split(backend: OneShotBackend, method: Any, tasks: list[LayerTask],
                           accs: dict[str, GramAccumulator], rows: list[dict[str, Any]], block: str,
                           undo: Undo | None) -> None:
    """Weight parallel: the layers are split over the processes by their solving cost (:func:`~.collective.assign_layers`
    of :func:`solve_cost`) and solved from the statistics summed over all of them, then every result goes to every
    process, which writes it: all hold the same compressed block. A process drops the Gram matrices of the layers
    it does not solve. A failure on the process solving a layer is raised on every process, at that layer."""
    coll = backend.collective
    owner = assign_layers([solve_cost(t) for t in tasks], coll.world)
    mine = [i for i in range(len(tasks)) if owner[i] == coll.rank]
    needed = {id(accs[tasks[i].name]) for i in mine if accs.get(tasks[i].name) is not None}
    for t in tasks:  # statistics of the other processes' layers: not read here
        acc = accs.get(t.name)
        if acc is not None and id(acc) not in needed:
            acc.gram = None
    release_freed_heap()
    spill = _spill_later([tasks[i] for i in mine], accs)
    results: dict[int, Any] = {}
    try:
        for k, i in enumerate(mine):
            t = tasks[i]
            stats = accs.get(t.name)
            if stats is not None:
                spill.get(stats)
                if all(accs.get(tasks[j].name) is not stats for j in mine[k + 1:]):
                    stats.consumable = True
            try:
                results[i] = compute_layer(backend, method, t, stats)
            except Exception as e:  # noqa: BLE001 - raised on every process when layer i's turn comes
                results[i] = e
                break
            release_freed_heap()
    finally:
        spill.close()
    for i, t in enumerate(tasks):
        result = coll.broadcast_object(results.pop(i, None), owner[i])
        if isinstance(result, BaseException):
            raise result
        commit_layer(backend, method, t, result, rows, block, undo)
        del result
        release_freed_heap()
