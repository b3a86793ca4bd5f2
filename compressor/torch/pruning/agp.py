"""AGPPruner: automated gradual pruning (Zhu & Gupta 2017) over any built-in criterion.

The target sparsity of each layer follows core ``agp_sparsity`` on the epoch clock (``update_epoch``);
masks are recomputed only on the epochs core ``agp_should_update`` names (start, every ``frequency``
epochs, up to the last ramp epoch). Weight criteria (level, l1, l2, fpgm, slim) recompute at
``update_epoch``; data criteria (apoz, mean_activation, taylorfo) collect ``statistics_batch_num``
batches after that epoch starts and recompute in the optimizer hook. Masks are monotone.

``dependency_aware=True`` (filter criteria; needs ``dummy_input=``, as the one-shot filter pruners):
coupled layers (:mod:`compressor.core.dependency`) get one decision per group on every schedule update,
at the epoch's target sparsity (summed member scores; slim: one global ranking over the groups), channels
pruned at earlier updates first; norms and depthwise convs carrying the channels are masked with them.

``sparse_pattern: 'N:M'`` (``pruning_algorithm='level'``): the final sparsity is the pattern's
``(M - N) / M`` and the last schedule update gives exactly N:M. Every intermediate update prunes exactly
``floor(n * s_t)`` weights, the smallest ``|w|`` among those that the layer's N:M groups may still drop
(at most ``M - N`` per group, core :func:`~compressor.core.pruning.nm_mask`): the ramp is monotone and
never prunes a weight the final N:M pattern would keep, so no group ever has more than ``M - N`` zeros.

Config keys, their validation and the schedule are core's (:mod:`compressor.core.agp`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ... import torch_plugin
from ...core.agp import (
    agp_due_layers,
    agp_masker_kwargs,
    agp_schedule,
    agp_target,
    check_agp_args,
    check_agp_dependency,
    validate_agp_config,
)
from ...core.matching import LayerInfo
from ...core.pruning import nm_validate_config
from .activation import ActivationAPoZRankFilterPrunerMasker, ActivationMeanRankFilterPrunerMasker
from .filters import FPGMPrunerMasker, L1FilterPrunerMasker, L2FilterPrunerMasker
from .level import LevelPrunerMasker, check_nm_module
from .masker import FILTER_DEFAULT_TYPES, WeightMasker
from .pruner import DependencyAwareMixin, TorchPruner
from .slim import BN_TYPES, SlimPrunerMasker
from .taylor import TaylorFOWeightFilterPrunerMasker

__all__ = ["AGPPruner", "AGP_CRITERIA", "agp_schedule"]

#: pruning_algorithm -> (masker class, what op_types 'default' means)
AGP_CRITERIA: dict[str, tuple[type[WeightMasker], tuple[str, ...]]] = {
    "level": (LevelPrunerMasker, torch_plugin.DEFAULT_TYPES),
    "l1": (L1FilterPrunerMasker, FILTER_DEFAULT_TYPES),
    "l2": (L2FilterPrunerMasker, FILTER_DEFAULT_TYPES),
    "fpgm": (FPGMPrunerMasker, FILTER_DEFAULT_TYPES),
    "slim": (SlimPrunerMasker, BN_TYPES),
    "apoz": (ActivationAPoZRankFilterPrunerMasker, FILTER_DEFAULT_TYPES),
    "mean_activation": (ActivationMeanRankFilterPrunerMasker, FILTER_DEFAULT_TYPES),
    "taylorfo": (TaylorFOWeightFilterPrunerMasker, FILTER_DEFAULT_TYPES),
}


class AGPPruner(DependencyAwareMixin, TorchPruner):
    """Gradual pruning from ``initial_sparsity`` to ``final_sparsity`` with ``pruning_algorithm`` as criterion."""

    config_keys = ("sparse_pattern",)

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: Any = None,
                 pruning_algorithm: str = "level", statistics_batch_num: int = 1, activation: str = "relu",
                 dependency_aware: bool = False, dummy_input: Any = None):
        check_agp_args(pruning_algorithm, AGP_CRITERIA, statistics_batch_num, activation)
        check_agp_dependency(pruning_algorithm, dependency_aware)
        self.pruning_algorithm = pruning_algorithm
        self._masker_class, self.default_types = AGP_CRITERIA[pruning_algorithm]
        self._group_producers_needed = pruning_algorithm != "slim"
        self._rank_globally = pruning_algorithm == "slim"
        self._init_dependency(dependency_aware, dummy_input, self._masker_class)
        super().__init__(model, config_list, optimizer)
        self._dummy_input = None  # traced already: do not keep the user's tensors alive
        kwargs = agp_masker_kwargs(pruning_algorithm, activation, statistics_batch_num)
        self.masker = self._masker_class(model, self, **kwargs)
        self._scheduled_epoch: int | None = None
        self._pending: set[int] = set()

    # ------------------------------------------------------------ validation
    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        nm_validate_config(config_list, type(self).__name__, "final_sparsity", self.pruning_algorithm)
        validate_agp_config(config_list, self.pruning_algorithm)

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        self._masker_class.check_layer(layer_info, module)
        check_nm_module(layer_info, module, config, type(self).__name__)

    # ------------------------------------------------------------ schedule
    def _config_of(self, wrapper_idx: int) -> dict[str, Any]:
        return self._wrappers[0 if self.pruning_algorithm == "slim" else wrapper_idx].config

    def target_sparsity(self, wrapper_idx: int, epoch: int | None = None) -> float:
        """The AGP target of wrapper ``wrapper_idx`` at ``epoch`` (default: the current epoch)."""
        return agp_target(self._config_of(wrapper_idx), self.current_epoch if epoch is None else epoch)

    def _schedule_epoch(self, epoch: int) -> None:
        if self._scheduled_epoch == epoch:
            return
        self._scheduled_epoch = epoch
        due = agp_due_layers([self._config_of(idx) for idx in range(len(self._wrappers))], epoch)
        if due:
            self._pending |= due
            self.masker.start_statistics()

    def compress(self) -> nn.Module:
        self._schedule_epoch(self.current_epoch)
        return super().compress()

    def update_epoch(self, epoch: int) -> None:
        """Advance the clock; on a schedule epoch, recompute masks (data criteria: once statistics are in)."""
        super().update_epoch(epoch)
        self._schedule_epoch(self.current_epoch)
        if self._pending and not self.masker.needs_data:
            self.update_mask()

    def update_mask(self) -> None:
        """Dependency-aware: one decision per due group (monotone), then the layers outside groups."""
        if self._dependency is None:
            return super().update_mask()
        self._mask_round += 1
        self._pending.difference_update(self._group_round(lambda i: i in self._pending, self.target_sparsity,
                                                          monotone=True))
        # selected layers in no group (the plan's warning says why) stay unpruned: speedup could not remove them
        self._pending.difference_update(self._ungrouped_indices())
        if not self._pending:
            self.masker.stop_statistics()
        self.apply_masks()

    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        idx = self._wrapper_index(wrapper) if wrapper_idx is None else wrapper_idx
        if idx not in self._pending or not self.masker.statistics_ready(idx):
            return None
        masks = self.masker.calc_mask(self.target_sparsity(idx), wrapper, idx)
        self._pending.discard(idx)
        if not self._pending:
            self.masker.stop_statistics()
        return masks

    def step(self) -> None:
        self.apply_masks()
        if self._pending:
            self.masker.after_step()
            self.update_mask()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "scheduled_epoch": self._scheduled_epoch, "pending": sorted(self._pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._scheduled_epoch = state.get("scheduled_epoch")
        self._pending = set(state.get("pending", ()))
        if self._pending:
            self.masker.start_statistics()
        else:
            self.masker.stop_statistics()
