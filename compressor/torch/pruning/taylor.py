"""TaylorFOWeightFilterPruner (Molchanov et al. 2019): filters ranked by first-order Taylor contribution.

After each optimizer step (the optimizer hook), ``sum((w * dL/dw)^2)`` per filter (core
``taylor_fo_contribution``) is added to a running sum on the weight's device, for
``statistics_batch_num`` steps; then the filters with the smallest totals are pruned.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core.matching import LayerInfo
from ...core.pruner_config import TaylorPrunerArgs
from ...core.pruning import importance_filter_masks, taylor_fo_contribution
from ..layout import canonical_shape, to_canonical
from ..ops import ops
from .filters import filter_result
from .masker import FILTER_DEFAULT_TYPES, WeightMasker, check_filter_layer, check_statistics_batch_num
from .pruner import OneShotPruner

__all__ = ["TaylorFOWeightFilterPruner", "TaylorFOWeightFilterPrunerMasker"]


class TaylorFOWeightFilterPrunerMasker(WeightMasker):
    """Accumulates Taylor contributions from the gradients present after each optimizer step."""

    needs_data = True

    def __init__(self, model: nn.Module, pruner: Any, statistics_batch_num: int = 1):
        super().__init__(model, pruner)
        self.statistics_batch_num = check_statistics_batch_num(statistics_batch_num, type(pruner).__name__)
        self._collecting = False
        self._reset()

    def _reset(self) -> None:
        n = len(self.pruner.get_modules_wrapper())
        self._batches = [0] * n
        self._contrib: dict[int, Any] = {}

    @classmethod
    def check_layer(cls, layer_info: LayerInfo, module: nn.Module) -> None:
        check_filter_layer(layer_info, module, cls.__name__)

    def start_statistics(self) -> None:
        self._reset()
        self._collecting = True

    def stop_statistics(self) -> None:
        self._collecting = False

    def after_step(self) -> None:
        if not self._collecting:
            return
        for idx, wrapper in enumerate(self.pruner.get_modules_wrapper()):
            grad = wrapper.weight.grad
            if grad is None or self._batches[idx] >= self.statistics_batch_num:
                continue
            c = taylor_fo_contribution(ops, to_canonical(wrapper, wrapper.weight.detach()),
                                       to_canonical(wrapper, grad.detach()))
            if idx in self._contrib:
                self._contrib[idx].add_(c)
            else:
                self._contrib[idx] = c
            self._batches[idx] += 1

    def statistics_ready(self, wrapper_idx: int) -> bool:
        return self._batches[wrapper_idx] >= self.statistics_batch_num

    def filter_importance(self, wrapper: nn.Module, wrapper_idx: int) -> Any:
        """Accumulated contributions (rank-reduced), for dependency-aware pruning."""
        self.reduce_statistics(self._contrib[wrapper_idx])
        return self._contrib[wrapper_idx]

    def calc_mask(self, sparsity: float, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        idx = self.pruner._wrapper_index(wrapper) if wrapper_idx is None else wrapper_idx
        if not self.statistics_ready(idx):
            return None
        self.reduce_statistics(self._contrib[idx])
        weight_mask, keep = importance_filter_masks(ops, self._contrib[idx], sparsity,
                                                    to_canonical(wrapper, wrapper.weight_mask),
                                                    canonical_shape(wrapper, wrapper.weight.shape))
        return filter_result(wrapper, weight_mask, keep)


class TaylorFOWeightFilterPruner(TaylorPrunerArgs, OneShotPruner):
    """Prune filters by Taylor FO contribution measured over ``statistics_batch_num`` optimizer steps."""

    default_types = FILTER_DEFAULT_TYPES
    masker_class = TaylorFOWeightFilterPrunerMasker

