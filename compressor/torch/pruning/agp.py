"""AGPPruner: automated gradual pruning (Zhu & Gupta 2017) over any built-in criterion.

The target sparsity of each layer follows core ``agp_sparsity`` on the epoch clock (``update_epoch``);
masks are recomputed only on the epochs core ``agp_should_update`` names (start, every ``frequency``
epochs, up to the last ramp epoch). Weight criteria (level, l1, l2, fpgm, slim) recompute at
``update_epoch``; data criteria (apoz, mean_activation, taylorfo) collect ``statistics_batch_num``
batches after that epoch starts and recompute in the optimizer hook. Masks are monotone.

Config keys per entry: ``final_sparsity`` (or ``sparsity``), ``initial_sparsity`` (0), ``start_epoch``
(0), ``end_epoch`` (10), ``frequency`` (1).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ... import torch_plugin
from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ...core.schedules import agp_should_update, agp_sparsity
from .activation import (
    ActivationAPoZRankFilterPrunerMasker,
    ActivationMeanRankFilterPrunerMasker,
    check_activation,
)
from .filters import FPGMPrunerMasker, L1FilterPrunerMasker, L2FilterPrunerMasker
from .level import LevelPrunerMasker
from .masker import WeightMasker, check_statistics_batch_num
from .pruner import TorchPruner
from .slim import BN_TYPES, SlimPrunerMasker
from .taylor import TaylorFOWeightFilterPrunerMasker

__all__ = ["AGPPruner", "AGP_CRITERIA"]

#: pruning_algorithm -> (masker class, what op_types 'default' means)
AGP_CRITERIA: dict[str, tuple[type[WeightMasker], tuple[str, ...]]] = {
    "level": (LevelPrunerMasker, torch_plugin.DEFAULT_TYPES),
    "l1": (L1FilterPrunerMasker, ("Conv2d",)),
    "l2": (L2FilterPrunerMasker, ("Conv2d",)),
    "fpgm": (FPGMPrunerMasker, ("Conv2d",)),
    "slim": (SlimPrunerMasker, BN_TYPES),
    "apoz": (ActivationAPoZRankFilterPrunerMasker, ("Conv2d",)),
    "mean_activation": (ActivationMeanRankFilterPrunerMasker, ("Conv2d",)),
    "taylorfo": (TaylorFOWeightFilterPrunerMasker, ("Conv2d",)),
}
_DEFAULTS = {"initial_sparsity": 0.0, "start_epoch": 0, "end_epoch": 10, "frequency": 1}


def agp_schedule(config: dict[str, Any]) -> tuple[float, float, int, int, int]:
    """``(initial, final, start_epoch, end_epoch, frequency)`` of a normalised config entry."""
    final = config.get("final_sparsity", config.get("sparsity"))
    return (config.get("initial_sparsity", _DEFAULTS["initial_sparsity"]), final,
            config.get("start_epoch", _DEFAULTS["start_epoch"]), config.get("end_epoch", _DEFAULTS["end_epoch"]),
            config.get("frequency", _DEFAULTS["frequency"]))


class AGPPruner(TorchPruner):
    """Gradual pruning from ``initial_sparsity`` to ``final_sparsity`` with ``pruning_algorithm`` as criterion."""

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: Any = None,
                 pruning_algorithm: str = "level", statistics_batch_num: int = 1, activation: str = "relu"):
        if pruning_algorithm not in AGP_CRITERIA:
            raise ConfigError(f"AGPPruner: pruning_algorithm = {pruning_algorithm!r} is invalid; "
                              f"allowed: {list(AGP_CRITERIA)}")
        check_statistics_batch_num(statistics_batch_num, "AGPPruner")
        check_activation(activation, "AGPPruner")
        self.pruning_algorithm = pruning_algorithm
        self._masker_class, self.default_types = AGP_CRITERIA[pruning_algorithm]
        super().__init__(model, config_list, optimizer)
        kwargs: dict[str, Any] = {}
        if pruning_algorithm in ("apoz", "mean_activation"):
            kwargs = {"activation": activation, "statistics_batch_num": statistics_batch_num}
        elif pruning_algorithm == "taylorfo":
            kwargs = {"statistics_batch_num": statistics_batch_num}
        self.masker = self._masker_class(model, self, **kwargs)
        self._scheduled_epoch: int | None = None
        self._pending: set[int] = set()

    # ------------------------------------------------------------ validation
    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        schedules = []
        for i, c in enumerate(config_list):
            if c["exclude"]:
                continue
            if "final_sparsity" not in c and "sparsity" not in c:
                raise ConfigError(f"config_list[{i}]: AGPPruner needs 'final_sparsity' (or 'sparsity') in every "
                                  f"non-excluded entry")
            if "final_sparsity" in c and "sparsity" in c and c["final_sparsity"] != c["sparsity"]:
                raise ConfigError(f"config_list[{i}]: 'sparsity' = {c['sparsity']} and 'final_sparsity' = "
                                  f"{c['final_sparsity']} disagree; give one of them")
            s = agp_schedule(c)
            if s[0] > s[1]:
                raise ConfigError(f"config_list[{i}]: 'initial_sparsity' = {s[0]} is invalid; allowed: a value "
                                  f"<= final sparsity ({s[1]})")
            schedules.append(s)
        if self.pruning_algorithm == "slim" and len(set(schedules)) > 1:
            raise ConfigError("AGPPruner(pruning_algorithm='slim'): one global threshold needs one schedule, "
                              f"but config entries give {sorted(set(schedules))}")

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        self._masker_class.check_layer(layer_info, module)

    # ------------------------------------------------------------ schedule
    def _config_of(self, wrapper_idx: int) -> dict[str, Any]:
        return self._wrappers[0 if self.pruning_algorithm == "slim" else wrapper_idx].config

    def target_sparsity(self, wrapper_idx: int, epoch: int | None = None) -> float:
        """The AGP target of wrapper ``wrapper_idx`` at ``epoch`` (default: the current epoch)."""
        si, sf, start, end, freq = agp_schedule(self._config_of(wrapper_idx))
        return agp_sparsity(self.current_epoch if epoch is None else epoch, si, sf, start, end, freq)

    def _schedule_epoch(self, epoch: int) -> None:
        if self._scheduled_epoch == epoch:
            return
        self._scheduled_epoch = epoch
        due = set()
        for idx in range(len(self._wrappers)):
            _, _, start, end, freq = agp_schedule(self._config_of(idx))
            if agp_should_update(epoch, start, end, freq):
                due.add(idx)
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
