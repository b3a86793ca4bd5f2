"""The one-shot pruning methods: Wanda and SparseGPT over :mod:`compressor.core.oneshot.sparse`."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..sparse_pattern import parse_sparse_pattern
from .arrays import DEFAULT_BLOCK_SIZE, DEFAULT_DAMP
from .method import OneShotMethod
from .protocol import LayerResult
from .sparse import sparsegpt_prune, wanda_mask


def _sparsity(config: dict[str, Any]) -> tuple[float | None, str | None]:
    pattern = config.get("sparse_pattern")
    if pattern is not None:
        parse_sparse_pattern(pattern)
        return None, pattern
    return float(config["sparsity"]), None


class WandaMethod(OneShotMethod):
    """Wanda (Sun et al. 2023): prune by ``|W_ij| * ||X_j||`` per output row (no weight update)."""

    name = "wanda"
    statistics = "norms"

    def compress(self, task, weight, mask, stats):
        sparsity, pattern = _sparsity(task.config)
        keep = wanda_mask(weight, stats.channel_norms(), sparsity, pattern)
        if mask is not None:
            keep &= mask
        return LayerResult(weight=np.where(keep, weight, 0.0), mask=keep)


class SparseGPTMethod(OneShotMethod):
    """SparseGPT (Frantar & Alistarh 2023): OBS pruning with weight updates from the layer's Hessian."""

    name = "sparsegpt"
    #: the solver makes its own float64 copy of the weight (transposed): it takes the float32 read as it is
    copies_weight = True

    def compress(self, task, weight, mask, stats):
        c = task.config
        sparsity, pattern = _sparsity(c)
        r = sparsegpt_prune(weight, stats.gram_for_solver(), sparsity, pattern, damp=c.get("damp", DEFAULT_DAMP),
                                block_size=c.get("block_size", DEFAULT_BLOCK_SIZE),
                                mask_scope=c.get("mask_scope", "block"))
        # r.weight is +0.0 wherever r.mask is False: only a mask from before needs a copy
        keep, weight = (r.mask, r.weight) if mask is None else (r.mask & mask, np.where(r.mask & mask, r.weight, 0.0))
        return LayerResult(weight=weight, mask=keep,
                           info={"error": r.error, "dead_inputs": int(np.count_nonzero(r.dead))})

