"""Filter pruners on weights: L1FilterPruner, L2FilterPruner, FPGMPruner.

A filter is one output channel: the LAST axis of a Keras kernel, the first axis in core's canonical
layout. ``floor(F * sparsity)`` filters with the lowest score are pruned, and the bias entry of a pruned
filter with it. Scores are in core (``filter_prune_masks``).
"""

from __future__ import annotations

from typing import Any

from ...core.matching import LayerInfo
from ...core.pruner_config import FilterPrunerArgs
from ...core.pruning import filter_prune_masks, filter_scores
from ..ops import ops
from .masker import WeightMasker, check_filter_layer, filter_result
from .pruner import FILTER_DEFAULT_TYPES, OneShotPruner

__all__ = [
    "FPGMPruner", "FPGMPrunerMasker", "FilterMasker", "L1FilterPruner", "L1FilterPrunerMasker", "L2FilterPruner",
    "L2FilterPrunerMasker",
]


class FilterMasker(WeightMasker):
    """Weight-based filter criterion ``criterion`` ('l1', 'l2', 'fpgm') of core ``filter_prune_masks``."""

    criterion = "l1"

    @classmethod
    def check_layer(cls, layer_info: LayerInfo, layer: Any) -> None:
        check_filter_layer(layer_info, layer, cls.__name__)

    def calc_mask(self, sparsity: float, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any]:
        weight_mask, keep = filter_prune_masks(ops, wrapper.canonical_weight(), sparsity, self.criterion,
                                               wrapper.canonical_mask())
        return filter_result(wrapper, weight_mask, keep)

    def filter_importance(self, wrapper: Any) -> Any:
        """Per-filter score in canonical order (dependency-aware pruning sums it over coupled layers)."""
        return filter_scores(ops, wrapper.canonical_weight(), self.criterion)


class L1FilterPrunerMasker(FilterMasker):
    criterion = "l1"


class L2FilterPrunerMasker(FilterMasker):
    criterion = "l2"


class FPGMPrunerMasker(FilterMasker):
    criterion = "fpgm"


class _FilterPruner(FilterPrunerArgs, OneShotPruner):
    #: ``'default'``: convolutions and Dense layers, the model's classifier (a layer whose filters are model
    #: outputs) left out
    default_types = FILTER_DEFAULT_TYPES
    default_skips_classifier = True


class L1FilterPruner(_FilterPruner):
    """Prune the filters with the smallest L1 norm ``sum |W_f|`` (Li et al. 2017)."""

    masker_class = L1FilterPrunerMasker


class L2FilterPruner(_FilterPruner):
    """Prune the filters with the smallest L2 norm."""

    masker_class = L2FilterPrunerMasker


class FPGMPruner(_FilterPruner):
    """Prune the filters nearest the geometric median of the layer's filters (He et al. 2019)."""

    masker_class = FPGMPrunerMasker
