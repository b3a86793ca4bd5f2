"""The base of a one-shot method: an algorithm over one layer's weight and input statistics, and how a block's
layers are compressed with it (one after the other, unless the method searches a block as a whole: AWQ)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .memory import Undo
from .protocol import LayerResult, LayerTask, OneShotBackend
from .statistics import GramAccumulator
from .steps import compress_layers


class OneShotMethod:
    """A one-shot algorithm over one layer's weight and input statistics."""

    name = "oneshot"
    #: False: ``compress`` gets the weight as a float64 array it may keep or change; True: as the backend read it
    #: (float32 where that is exact) in a :class:`~.arrays.Handed` box, for a method that makes its own float64
    #: copy and passes the box on (GPTQ, SparseGPT: their solvers take the array out and drop it once copied)
    copies_weight = False
    kind = "pruner"  # or 'quantizer'
    #: statistics: 'gram' (H = sum x^T x), 'norms' (per-channel sums only), None (no calibration data)
    statistics: str | None = "gram"

    def compress(self, task: LayerTask, weight: np.ndarray, mask: np.ndarray | None,
                 stats: GramAccumulator | None) -> LayerResult:
        raise NotImplementedError

    def compress_block(self, backend: OneShotBackend, block: Any, inputs: list[Any], tasks: list[LayerTask],
                       accs: dict[str, GramAccumulator], rows: list[dict[str, Any]], name: str, undo: Undo) -> None:
        """Compress the layers of ``block`` once its observing pass has filled ``accs`` (one accumulator per layer;
        ``inputs``: the block's calibration inputs), each in turn (:func:`~compressor.core.oneshot.steps.compress_layers`)."""
        compress_layers(backend, self, tasks, accs, rows, name, undo)
