"""SensitivityPruner's backend-agnostic part: its arguments, config check and the round schedule.

Han et al. 2015 iterate prune -> retrain -> prune; :class:`SensitivityRoundsMixin` counts the rounds,
runs one at ``update_epoch(E)``, ``update_epoch(2E)``, ... (core ``sensitivity_round_due``) and checkpoints
the count. Each backend adds how a round computes its masks (core ``sensitivity_mask`` on its tensors).
"""

from __future__ import annotations

from typing import Any

from .pruner_config import check_sensitivity_args, refuse_sparsity_key
from .schedules import sensitivity_round_due

__all__ = ["SensitivityRoundsMixin"]


class SensitivityRoundsMixin:
    """Put before the backend's pruner base (it provides ``update_mask``, ``update_epoch``,
    ``current_epoch`` and ``state_dict`` / ``load_state_dict``). ``calc_mask`` computes masks only while
    ``self._due`` (inside a round)."""

    config_keys = ("sensitivity",)
    required_keys = ("sensitivity",)

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None,
                 iterations: int = 1, epochs_per_iteration: int | None = None) -> None:
        check_sensitivity_args(iterations, epochs_per_iteration)
        super().__init__(model, config_list, optimizer)  # type: ignore[call-arg]
        self.iterations = iterations
        self.epochs_per_iteration = epochs_per_iteration
        self.iteration = 0  # rounds done
        self._due = False

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        refuse_sparsity_key(config_list)

    def _run_round(self) -> None:
        """Recompute every mask (a backend may wrap this, e.g. to run it eagerly)."""
        self.update_mask()  # type: ignore[attr-defined]

    def prune_iteration(self) -> None:
        """Apply the threshold rule once more (one prune round)."""
        self._due = True
        try:
            self._run_round()
        finally:
            self._due = False
        self.iteration += 1

    def update_epoch(self, epoch: int) -> None:
        super().update_epoch(epoch)  # type: ignore[misc]
        if sensitivity_round_due(self.current_epoch, self.epochs_per_iteration, self.iteration,  # type: ignore[attr-defined]
                                 self.iterations):
            self.prune_iteration()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "iteration": self.iteration}  # type: ignore[misc]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # type: ignore[misc]
        self.iteration = int(state.get("iteration", 0))
