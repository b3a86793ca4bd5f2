"""The sequential one-shot driver: calibrate a model block by block, compress each block's layers from their
recorded input statistics, feed the compressed block's outputs to the next block.

Written once for both backends. A backend supplies an adapter (:class:`~compressor.core.oneshot.protocol.OneShotBackend`:
find the blocks, capture the first block's inputs, run one block on cached inputs while reporting each selected
layer's input, read and write a layer's weight); a method (:class:`~compressor.core.oneshot.method.OneShotMethod`:
Wanda, SparseGPT, GPTQ, RTN, AWQ) turns a layer's weight and statistics into its compressed form.
:func:`run_sequential` is the loop, as SparseGPT / GPTQ describe it:

1. run the calibration batches through the model up to the first block and keep the block's inputs;
2. for each block: run it on the cached inputs with each selected layer's input recorded into a
   :class:`~compressor.core.oneshot.statistics.GramAccumulator` (float64); compress the block's layers
   (:meth:`OneShotMethod.compress_block`); run the COMPRESSED block again on the same inputs: its outputs are the
   next block's inputs (so later blocks calibrate on what the compressed model really computes);
3. selected layers outside every block (or all layers, for a model without repeated blocks) are
   compressed after that, from one pass of the whole (already compressed) model.

Memory: the inputs of one block at a time (plus one accumulator per layer of that block), never the
whole model's activations. No tracing: adapters use forward hooks (torch) / wrapped ``call`` (Keras).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError
from .collective import reduce_statistics
from .memory import Undo, release_freed_heap
from .method import OneShotMethod
from .observe import observers
from .protocol import LayerTask, OneShotBackend
from .steps import compress_layers


def _progress(stream: Any) -> Callable[[str], None]:
    if stream is None or stream is False:
        return lambda msg: None
    out = sys.stderr if stream is True else stream

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)
    return say


def _shared_inputs(backend: OneShotBackend, block: Any, inputs: list[Any], tasks: list[LayerTask]) -> dict[str, str]:
    """The backend's ``shared_inputs(block, inputs, tasks)`` (layers that read the very same input tensor share one
    accumulator, computed once), probed on ONE sequence of the first batch (``take_rows``, where the backend can
    split a batch): which layers share an input is a property of the block's code, and a whole batch of 128
    windows made the probe a full extra block run (6.3 of 36 s of an AWQ run)."""
    probe = inputs[:1]
    if probe:
        rows = backend.batch_rows(probe[0])
        if rows is not None and rows > 1:
            probe = [backend.take_rows(probe[0], [0])]
    return backend.shared_inputs(block, probe, tasks)


def run_sequential(backend: OneShotBackend, method: OneShotMethod, batches: Sequence[Any],
                   progress: Any = True) -> list[dict[str, Any]]:
    """Compress every selected layer of the backend's model with ``method``, block by block (see the module
    docstring). ``batches``: the calibration batches (backend-specific objects; a method without
    statistics, RTN, needs none). ``progress``: True (stderr), False / None, or a file. Returns one report
    row per layer (``layer``, ``block``, ``method``, ``sparsity`` / ``bits``, the method's numbers)."""
    say = _progress(progress)
    undo = Undo(backend)
    try:
        rows = _run(backend, method, batches, say, undo)
    except BaseException as e:  # KeyboardInterrupt too: the model goes back to what it was
        try:
            undo.rollback()
        except Exception as r:  # noqa: BLE001
            e.add_note(f"(restoring the layers changed before the failure failed too: {type(r).__name__}: {r})")
        finally:
            undo.close()
            release_freed_heap()
        raise
    undo.close()
    # the last block's activations, statistics and solver copies are free now; glibc would keep most of their
    # pages (measured: 91 MiB resident after the call -> 27 on a 3-block slice of the 34 M-parameter Llama)
    release_freed_heap()
    return rows


def _run(backend: OneShotBackend, method: OneShotMethod, batches: Sequence[Any], say: Callable[[str], None],
         undo: Undo) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    blocks = list(backend.blocks())
    needs_data = method.statistics is not None
    if needs_data and not batches:
        raise ConfigError(f"{type(method).__name__}: the calibration set is empty; give a few hundred sequences")
    inputs: list[Any] | None = None
    total = len(blocks)
    for i, (name, block) in enumerate(blocks):
        tasks = backend.block_layers(block)
        t0 = time.perf_counter()
        if not needs_data:
            compress_layers(backend, method, tasks, {}, rows, name, undo)
        else:
            if inputs is None:
                inputs = backend.first_inputs(batches)
                release_freed_heap()
            if tasks:
                accs, observe = observers(method, tasks, _shared_inputs(backend, block, inputs, tasks))
                backend.run_block(block, inputs, observe)
                observe = None  # its bound methods hold the accumulators: only ``accs`` may, from here on
                reduce_statistics(backend.collective, accs)  # over several processes: all their sequences
                release_freed_heap()
                method.compress_block(backend, block, inputs, tasks, accs, rows, name, undo)
                accs = None  # type: ignore[assignment]
            if i + 1 < total:  # the compressed block's outputs feed the next block
                inputs = backend.advance(block, inputs)
                release_freed_heap()
        say(f"[{method.name}] block {i + 1}/{total} {name}: {len(tasks)} layer(s), {time.perf_counter() - t0:.1f} s")
    inputs = None  # free the last block's activations
    rest = backend.block_layers(None)
    if rest:
        t0 = time.perf_counter()
        if needs_data:
            accs, observe = observers(method, rest)
            backend.run_model(batches, observe)
            reduce_statistics(backend.collective, accs)
        else:
            accs = {}
        compress_layers(backend, method, rest, accs, rows, "", undo)
        where = "outside the blocks" if blocks else "whole model"
        say(f"[{method.name}] {where}: {len(rest)} layer(s), {time.perf_counter() - t0:.1f} s")
    if not rows:
        raise ConfigError(f"{type(method).__name__}: no layer was selected for one-shot compression")
    return rows


def mean_error(rows: list[dict[str, Any]]) -> float:
    """Mean of the rows' ``error`` entries (nan when none has one)."""
    vals = [r["error"] for r in rows if "error" in r]
    return float(np.mean(vals)) if vals else math.nan

