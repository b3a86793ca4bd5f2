"""Activation-rank filter pruners: ActivationAPoZRankFilterPruner, ActivationMeanRankFilterPruner.

Statistics of ``activation(output)`` per output channel are collected by a forward hook on the wrappers
for ``statistics_batch_num`` batches, as running sums on the output's device (core
``activation_stats``; no per-batch tensors kept, no host copies). The hook is removed as soon as every
layer has its masks, so later forwards cost nothing.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ...core.pruning import (
    activation_stats,
    apoz_importance,
    expand_filter_mask,
    filter_keep_from_mask,
    filter_mask,
    mean_activation_importance,
)
from ..ops import ops
from .filters import filter_result
from .masker import WeightMasker, all_reduce_sum, check_filter_layer, check_statistics_batch_num
from .pruner import OneShotPruner

__all__ = [
    "ActivationAPoZRankFilterPruner", "ActivationAPoZRankFilterPrunerMasker", "ActivationFilterMasker",
    "ActivationMeanRankFilterPruner", "ActivationMeanRankFilterPrunerMasker", "check_activation",
]

ACTIVATIONS = ("relu", "relu6")


def check_activation(value: Any, what: str) -> str:
    if value not in ACTIVATIONS:
        raise ConfigError(f"{what}: activation = {value!r} is invalid; allowed: {list(ACTIVATIONS)}")
    return value


class ActivationFilterMasker(WeightMasker):
    """Filter criterion from per-channel activation statistics; subclasses pick the importance."""

    needs_data = True

    def __init__(self, model: nn.Module, pruner: Any, activation: str = "relu", statistics_batch_num: int = 1):
        super().__init__(model, pruner)
        self.activation = check_activation(activation, type(pruner).__name__)
        self.statistics_batch_num = check_statistics_batch_num(statistics_batch_num, type(pruner).__name__)
        self._index = {id(w): i for i, w in enumerate(pruner.get_modules_wrapper())}
        self._collector_id: int | None = None
        self._reset()

    def _reset(self) -> None:
        self._batches = [0] * len(self._index)
        self._stats: dict[int, tuple[Any, Any, Any]] = {}  # idx -> running (zeros, total, count)

    @classmethod
    def check_layer(cls, layer_info: LayerInfo, module: nn.Module) -> None:
        check_filter_layer(layer_info, module, cls.__name__)

    def start_statistics(self) -> None:
        self._reset()
        if self._collector_id is None:
            def collect(wrapper: nn.Module, inputs: Any, output: Any) -> None:  # a plain function: a deepcopy
                self._collect(wrapper, inputs, output)                        # of the model does not copy us

            self._collector_id = self.pruner.add_activation_collector(collect)

    def stop_statistics(self) -> None:
        if self._collector_id is not None:
            self.pruner.remove_activation_collector(self._collector_id)
            self._collector_id = None

    def _collect(self, wrapper: nn.Module, inputs: Any, output: Any) -> None:
        idx = self._index.get(id(wrapper))
        if idx is None or self._batches[idx] >= self.statistics_batch_num:
            return
        batch = activation_stats(ops, output.detach(), 1, self.activation)
        running = self._stats.get(idx)
        if running is None:
            self._stats[idx] = batch
        else:
            for acc, x in zip(running, batch):
                acc.add_(x)
        self._batches[idx] += 1

    def statistics_ready(self, wrapper_idx: int) -> bool:
        return self._batches[wrapper_idx] >= self.statistics_batch_num

    def importance(self, wrapper_idx: int) -> Any:
        raise NotImplementedError

    def calc_mask(self, sparsity: float, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        idx = self._index[id(wrapper)] if wrapper_idx is None else wrapper_idx
        if not self.statistics_ready(idx):
            return None
        all_reduce_sum(*self._stats[idx])
        kept = filter_keep_from_mask(ops, wrapper.weight_mask)
        keep = filter_mask(ops, self.importance(idx), sparsity, kept)
        return filter_result(wrapper, expand_filter_mask(ops, keep, tuple(wrapper.weight.shape)), keep)


class ActivationAPoZRankFilterPrunerMasker(ActivationFilterMasker):
    """APoZ (Hu et al. 2016): prune the channels whose activations are most often zero."""

    def importance(self, wrapper_idx: int) -> Any:
        zeros, _, count = self._stats[wrapper_idx]
        return apoz_importance(ops, zeros, count)


class ActivationMeanRankFilterPrunerMasker(ActivationFilterMasker):
    """Mean activation (Molchanov et al. 2017): prune the channels with the smallest mean activation."""

    def importance(self, wrapper_idx: int) -> Any:
        _, total, count = self._stats[wrapper_idx]
        return mean_activation_importance(ops, total, count)


class _ActivationPruner(OneShotPruner):
    default_types = ("Conv2d",)

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: Any = None,
                 activation: str = "relu", statistics_batch_num: int = 1):
        check_activation(activation, type(self).__name__)
        check_statistics_batch_num(statistics_batch_num, type(self).__name__)
        super().__init__(model, config_list, optimizer, activation=activation,
                         statistics_batch_num=statistics_batch_num)


class ActivationAPoZRankFilterPruner(_ActivationPruner):
    """Filters ranked by APoZ over ``statistics_batch_num`` training batches after ``compress()``."""

    masker_class = ActivationAPoZRankFilterPrunerMasker


class ActivationMeanRankFilterPruner(_ActivationPruner):
    """Filters ranked by mean activation over ``statistics_batch_num`` batches after ``compress()``."""

    masker_class = ActivationMeanRankFilterPrunerMasker
