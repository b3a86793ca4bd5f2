"""LevelPruner: magnitude pruning, the ``floor(n * sparsity)`` smallest ``|w|`` of each layer."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core.pruning import level_mask
from ..ops import ops
from .masker import WeightMasker
from .pruner import OneShotPruner

__all__ = ["LevelPruner", "LevelPrunerMasker"]


class LevelPrunerMasker(WeightMasker):
    """Magnitude criterion (core ``level_mask``); monotone: already-pruned weights go first."""

    def calc_mask(self, sparsity: float, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any]:
        weight = wrapper.weight.detach()
        return {"weight_mask": level_mask(ops, weight, sparsity, wrapper.weight_mask)}


class LevelPruner(OneShotPruner):
    """One-shot magnitude pruning of every selected layer at its config's ``sparsity``.

    ``LevelPruner(model, [{'sparsity': 0.7, 'op_types': ['default']}], optimizer).compress()``
    """

    masker_class = LevelPrunerMasker

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: Any = None):
        super().__init__(model, config_list, optimizer)
