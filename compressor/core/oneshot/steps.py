"""One layer's turn in a one-shot run: compute the method's result from the layer's weight and statistics, check
it, write it into the model after the layer's undo copy, and add its report row."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ModelError
from .collective import owner_of
from .experts import expert_fallback, routed_expert, warn_fallbacks
from .memory import Undo, release_freed_heap
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
    there are several (:func:`_compress_layers_split`)."""
    if backend.collective.world > 1:
        _compress_layers_split(backend, method, tasks, accs, rows, block, undo)
        return
    later = [id(accs[t.name]) if accs.get(t.name) is not None else None for t in tasks]
    for i, t in enumerate(tasks):
        stats = accs.get(t.name)
        if stats is not None and id(stats) not in later[i + 1:]:
            stats.consumable = True  # no later layer reads it: the solver may take it
        result = compute_layer(backend, method, t, stats)
        commit_layer(backend, method, t, result, rows, block, undo)
        del result
        release_freed_heap()  # the solver's matrices: the next layer's start on a trimmed heap



def _compress_layers_split(backend: OneShotBackend, method: Any, tasks: list[LayerTask],
                           accs: dict[str, GramAccumulator], rows: list[dict[str, Any]], block: str,
                           undo: Undo | None) -> None:
    """Weight parallel: layer ``i`` is solved by process ``i mod N`` (from the statistics summed over all of them),
    then every result goes to every process, which writes it: all hold the same compressed block. A failure on the
    process solving a layer is raised on every process, at that layer."""
    coll = backend.collective
    mine = [i for i in range(len(tasks)) if owner_of(i, coll.world) == coll.rank]
    results: dict[int, Any] = {}
    for k, i in enumerate(mine):
        t = tasks[i]
        stats = accs.get(t.name)
        if stats is not None and all(accs.get(tasks[j].name) is not stats for j in mine[k + 1:]):
            stats.consumable = True
        try:
            results[i] = compute_layer(backend, method, t, stats)
        except Exception as e:  # noqa: BLE001 - raised on every process when layer i's turn comes
            results[i] = e
            break
        release_freed_heap()
    for i, t in enumerate(tasks):
        result = coll.broadcast_object(results.pop(i, None), owner_of(i, coll.world))
        if isinstance(result, BaseException):
            raise result
        commit_layer(backend, method, t, result, rows, block, undo)
        del result
        release_freed_heap()
