"""LevelPruner: magnitude pruning, the ``floor(n * sparsity)`` smallest ``|w|`` of each layer."""

from __future__ import annotations

from typing import Any

from ...core.pruning import level_mask
from ..ops import ops
from .masker import WeightMasker
from .pruner import OneShotPruner

__all__ = ["LevelPruner", "LevelPrunerMasker"]


class LevelPrunerMasker(WeightMasker):
    """Magnitude criterion (core ``level_mask`` in canonical layout); monotone: pruned weights go first."""

    def calc_mask(self, sparsity: float, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any]:
        mask = level_mask(ops, wrapper.canonical_weight(), sparsity, wrapper.canonical_mask())
        return {"weight_mask": wrapper.from_canonical(mask)}


class LevelPruner(OneShotPruner):
    """One-shot magnitude pruning of every selected layer at its config's ``sparsity``.

    ``LevelPruner(model, [{'sparsity': 0.7, 'op_types': ['default']}], optimizer).compress()``
    """

    masker_class = LevelPrunerMasker
    masks_bias = False

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None) -> None:
        super().__init__(model, config_list, optimizer)
