"""Activation-rank filter pruners: ActivationAPoZRankFilterPruner, ActivationMeanRankFilterPruner.

Statistics of ``activation(output)`` per output channel are collected by a forward hook on the wrappers
for ``statistics_batch_num`` batches, as running sums on the output's device (core
``activation_stats``; no per-batch tensors kept, no host copies). The hook is removed as soon as every
layer has its masks, so later forwards cost nothing.

Under DDP the running sums are summed over the ranks before the masks are chosen
(:meth:`WeightMasker.reduce_statistics`). Under ``nn.DataParallel`` the hook runs on every replica: the
statistics of all replicas' chunks are added into the original wrapper's sums (under a lock, on the
original's device), counting batches per device, so a layer is ready after ``statistics_batch_num``
DataParallel forwards.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from ...core.matching import LayerInfo
from ...core.pruner_config import (
    ACTIVATIONS,
    ActivationPrunerArgs,
    check_activation,
    check_statistics_batch_num,
)
from ...core.pruning import (
    activation_stats,
    apoz_importance,
    importance_filter_masks,
    mean_activation_importance,
)
from ..layout import canonical_shape, to_canonical
from ..modules import innermost_module
from ..ops import ops
from .filters import filter_result
from .masker import FILTER_DEFAULT_TYPES, WeightMasker, check_filter_layer
from .pruner import OneShotPruner
from .wrapper import replica_origin

__all__ = [
    "ACTIVATIONS", "ActivationAPoZRankFilterPruner", "ActivationAPoZRankFilterPrunerMasker", "ActivationFilterMasker",
    "ActivationMeanRankFilterPruner", "ActivationMeanRankFilterPrunerMasker", "check_activation",
]



class ActivationFilterMasker(WeightMasker):
    """Filter criterion from per-channel activation statistics; subclasses pick the importance."""

    needs_data = True

    def __init__(self, model: nn.Module, pruner: Any, activation: str = "relu", statistics_batch_num: int = 1):
        super().__init__(model, pruner)
        self.activation = check_activation(activation, type(pruner).__name__)
        self.statistics_batch_num = check_statistics_batch_num(statistics_batch_num, type(pruner).__name__)
        self._index = {id(w): i for i, w in enumerate(pruner.get_modules_wrapper())}
        self._collector_id: int | None = None
        self._lock = threading.Lock()  # DataParallel runs the replicas' hooks in threads
        self._reset()

    def _reset(self) -> None:
        # batches seen per layer and device (one device unless DataParallel replicas feed the layer)
        self._batches: list[dict[torch.device, int]] = [{} for _ in self._index]
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
        origin = replica_origin(wrapper)
        idx = self._index.get(id(origin))
        if idx is None:
            return
        seen = self._batches[idx]
        if seen.get(output.device, 0) >= self.statistics_batch_num:
            return
        # channels: axis 1 of a conv output, the last axis of a Linear's ([..., features])
        conv = isinstance(innermost_module(origin), nn.modules.conv._ConvNd)
        batch = activation_stats(ops, output.detach(), 1 if conv or output.dim() < 2 else output.dim() - 1,
                                 self.activation)
        home = origin.weight_mask.device
        if output.device != home:
            batch = tuple(x.to(home, non_blocking=True) for x in batch)
        with self._lock:
            running = self._stats.get(idx)
            if running is None:
                self._stats[idx] = batch
            else:
                for acc, x in zip(running, batch):
                    acc.add_(x)
            seen[output.device] = seen.get(output.device, 0) + 1

    def statistics_ready(self, wrapper_idx: int) -> bool:
        home = self.pruner.get_modules_wrapper()[wrapper_idx].weight_mask.device
        return self._batches[wrapper_idx].get(home, 0) >= self.statistics_batch_num

    def importance(self, wrapper_idx: int) -> Any:
        raise NotImplementedError

    def filter_importance(self, wrapper: nn.Module, wrapper_idx: int) -> Any:
        """Per-channel importance from the (rank-reduced) statistics, for dependency-aware pruning."""
        self.reduce_statistics(*self._stats[wrapper_idx])
        return self.importance(wrapper_idx)

    def calc_mask(self, sparsity: float, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        idx = self._index[id(wrapper)] if wrapper_idx is None else wrapper_idx
        if not self.statistics_ready(idx):
            return None
        self.reduce_statistics(*self._stats[idx])
        weight_mask, keep = importance_filter_masks(ops, self.importance(idx), sparsity,
                                                    to_canonical(wrapper, wrapper.weight_mask),
                                                    canonical_shape(wrapper, wrapper.weight.shape))
        return filter_result(wrapper, weight_mask, keep)


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


class _ActivationPruner(ActivationPrunerArgs, OneShotPruner):
    default_types = FILTER_DEFAULT_TYPES


class ActivationAPoZRankFilterPruner(_ActivationPruner):
    """Filters ranked by APoZ over ``statistics_batch_num`` training batches after ``compress()``."""

    masker_class = ActivationAPoZRankFilterPrunerMasker


class ActivationMeanRankFilterPruner(_ActivationPruner):
    """Filters ranked by mean activation over ``statistics_batch_num`` batches after ``compress()``."""

    masker_class = ActivationMeanRankFilterPrunerMasker
