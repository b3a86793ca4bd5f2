"""SensitivityPruner: Han et al. 2015, "Learning both weights and connections".

Each layer prunes ``|w| < sensitivity * std(w)`` (core ``sensitivity_mask``; ``sensitivity`` is the
paper's quality parameter, per config entry). The paper iterates prune -> retrain (at about 1/10 of
the original learning rate) -> prune: with ``iterations=N`` and ``epochs_per_iteration=E`` the rule is
re-applied at ``update_epoch(E)``, ``update_epoch(2E)``, ... until N rounds are done (or call
:meth:`SensitivityPruner.prune_iteration` yourself). Each round uses the std of the weights still kept,
so it prunes further; masks are monotone.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core.pruner_config import check_sensitivity_args, refuse_sparsity_key
from ...core.pruning import sensitivity_mask
from ...core.schedules import sensitivity_round_due
from ..ops import ops
from .pruner import TorchPruner

__all__ = ["SensitivityPruner"]


class SensitivityPruner(TorchPruner):
    """Threshold pruning at ``sensitivity * std`` per layer, optionally iterated with retraining."""

    config_keys = ("sensitivity",)
    required_keys = ("sensitivity",)

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: Any = None,
                 iterations: int = 1, epochs_per_iteration: int | None = None):
        check_sensitivity_args(iterations, epochs_per_iteration)
        super().__init__(model, config_list, optimizer)
        self.iterations = iterations
        self.epochs_per_iteration = epochs_per_iteration
        self.iteration = 0  # rounds done
        self._due = False

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        refuse_sparsity_key(config_list)

    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        if not self._due:
            return None
        mask = sensitivity_mask(ops, wrapper.weight.detach(), wrapper.config["sensitivity"], wrapper.weight_mask)
        return {"weight_mask": mask}

    def prune_iteration(self) -> None:
        """Apply the threshold rule once more (one prune round)."""
        self._due = True
        try:
            self.update_mask()
        finally:
            self._due = False
        self.iteration += 1

    def compress(self) -> nn.Module:
        if self.iteration == 0:
            self.prune_iteration()
        return self.bound_model

    def step(self) -> None:
        self.apply_masks()

    def update_epoch(self, epoch: int) -> None:
        super().update_epoch(epoch)
        if sensitivity_round_due(self.current_epoch, self.epochs_per_iteration, self.iteration, self.iterations):
            self.prune_iteration()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "iteration": self.iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.iteration = int(state.get("iteration", 0))
