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

Config keys, their validation, the schedule and its driver (which layers are due at an epoch, the pending
set, statistics on/off, checkpoints) are core's (:class:`compressor.core.agp.AGPScheduleMixin`); this module
keeps what touches the framework.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ... import torch_plugin
from ...core.agp import AGPScheduleMixin, agp_schedule, resolve_agp_criteria
from ...core.matching import LayerInfo
from .activation import ActivationAPoZRankFilterPrunerMasker, ActivationMeanRankFilterPrunerMasker
from .dependency import DependencyAwareMixin
from .filters import FPGMPrunerMasker, L1FilterPrunerMasker, L2FilterPrunerMasker
from .level import LevelPrunerMasker, check_nm_module
from .masker import FILTER_DEFAULT_TYPES, WeightMasker
from .pruner import TorchPruner
from .slim import BN_TYPES, SlimPrunerMasker
from .taylor import TaylorFOWeightFilterPrunerMasker

__all__ = ["AGPPruner", "AGP_CRITERIA", "agp_schedule"]

#: pruning_algorithm -> (masker class, what op_types 'default' means); the table is core's
AGP_CRITERIA: dict[str, tuple[type[WeightMasker], tuple[str, ...]]] = resolve_agp_criteria(
    (LevelPrunerMasker, L1FilterPrunerMasker, L2FilterPrunerMasker, FPGMPrunerMasker, SlimPrunerMasker,
     ActivationAPoZRankFilterPrunerMasker, ActivationMeanRankFilterPrunerMasker, TaylorFOWeightFilterPrunerMasker),
    {"weighted": torch_plugin.DEFAULT_TYPES, "filter": FILTER_DEFAULT_TYPES, "bn": BN_TYPES})


class AGPPruner(AGPScheduleMixin, DependencyAwareMixin, TorchPruner):
    """Gradual pruning from ``initial_sparsity`` to ``final_sparsity`` with ``pruning_algorithm`` as criterion."""

    config_keys = ("sparse_pattern",)
    AGP_CRITERIA = AGP_CRITERIA

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: Any = None,
                 pruning_algorithm: str = "level", statistics_batch_num: int = 1, activation: str = "relu",
                 dependency_aware: bool = False, dummy_input: Any = None):
        self._agp_setup(pruning_algorithm, statistics_batch_num, activation, dependency_aware)
        self._init_dependency(dependency_aware, dummy_input, self._masker_class)
        super().__init__(model, config_list, optimizer)
        self._dummy_input = None  # traced already: do not keep the user's tensors alive
        self._agp_start(model, activation, statistics_batch_num)

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        self._masker_class.check_layer(layer_info, module)
        check_nm_module(layer_info, module, config, type(self).__name__)

    def update_mask(self) -> None:
        """Dependency-aware: one decision per due group (monotone), then the layers outside groups."""
        if self._dependency is None:
            return super().update_mask()
        self._mask_round += 1
        grouped = self._group_round(lambda i: i in self._pending, self.target_sparsity, monotone=True)
        # selected layers in no group (the plan's warning says why) stay unpruned: speedup could not remove them
        self._done(*grouped, *self._ungrouped_indices())
        self.apply_masks()

    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        idx = self._wrapper_index(wrapper) if wrapper_idx is None else wrapper_idx
        if idx not in self._pending or not self.masker.statistics_ready(idx):
            return None
        masks = self.masker.calc_mask(self.target_sparsity(idx), wrapper, idx)
        self._done(idx)
        return masks

    def step(self) -> None:
        self.apply_masks()
        if self._pending:
            self.masker.after_step()
            self.update_mask()
