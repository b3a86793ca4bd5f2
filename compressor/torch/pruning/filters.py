"""Filter pruners on weights: L1FilterPruner, L2FilterPruner, FPGMPruner.

A filter is one output channel (the first axis of a Conv/Linear weight in canonical layout, see
:mod:`compressor.torch.layout`); ``floor(F * sparsity)`` filters
with the lowest score are pruned, and the bias entry of a pruned filter with it. Scores are in core.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core.matching import LayerInfo
from ...core.pruner_config import FilterPrunerArgs
from ...core.pruning import filter_masks, filter_prune_masks, filter_scores
from ..layout import from_canonical, to_canonical
from ..ops import ops
from .masker import FILTER_DEFAULT_TYPES, WeightMasker, check_filter_layer
from .pruner import OneShotPruner

__all__ = [
    "FPGMPruner", "FPGMPrunerMasker", "L1FilterPruner", "L1FilterPrunerMasker", "L2FilterPruner",
    "L2FilterPrunerMasker", "FilterMasker", "filter_result",
]


def filter_result(wrapper: nn.Module, weight_mask: Any, filter_keep: Any) -> dict[str, Any]:
    """Masks dict for a filter decision (``weight_mask`` in canonical layout): the bias follows its filter."""
    return filter_masks(from_canonical(wrapper, weight_mask), filter_keep, wrapper.bias_mask is not None)


class FilterMasker(WeightMasker):
    """Weight-based filter criterion ``criterion`` ('l1', 'l2', 'fpgm') of core ``filter_prune_masks``."""

    criterion = "l1"

    @classmethod
    def check_layer(cls, layer_info: LayerInfo, module: nn.Module) -> None:
        check_filter_layer(layer_info, module, cls.__name__)

    def calc_mask(self, sparsity: float, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any]:
        weight_mask, keep = filter_prune_masks(ops, to_canonical(wrapper, wrapper.weight.detach()), sparsity,
                                               self.criterion, to_canonical(wrapper, wrapper.weight_mask))
        return filter_result(wrapper, weight_mask, keep)

    def filter_importance(self, wrapper: nn.Module, wrapper_idx: int) -> Any:
        """Per-filter score (dependency-aware pruning sums it over coupled layers)."""
        return filter_scores(ops, to_canonical(wrapper, wrapper.weight.detach()), self.criterion)


class L1FilterPrunerMasker(FilterMasker):
    criterion = "l1"


class L2FilterPrunerMasker(FilterMasker):
    criterion = "l2"


class FPGMPrunerMasker(FilterMasker):
    criterion = "fpgm"


class _FilterPruner(FilterPrunerArgs, OneShotPruner):
    default_types = FILTER_DEFAULT_TYPES


class L1FilterPruner(_FilterPruner):
    """Prune the filters with the smallest L1 norm ``sum |W_f|`` (Li et al. 2017)."""

    masker_class = L1FilterPrunerMasker


class L2FilterPruner(_FilterPruner):
    """Prune the filters with the smallest L2 norm."""

    masker_class = L2FilterPrunerMasker


class FPGMPruner(_FilterPruner):
    """Prune the filters nearest the geometric median of the layer's filters (He et al. 2019)."""

    masker_class = FPGMPrunerMasker
