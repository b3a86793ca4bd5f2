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

from ...core.interrupts import deferred_interrupts, undone_on_error
from ...core.pruning import sensitivity_mask
from ...core.sensitivity import SensitivityRoundsMixin
from ..ops import ops
from .pruner import TorchPruner

__all__ = ["SensitivityPruner"]


class SensitivityPruner(SensitivityRoundsMixin, TorchPruner):
    """Threshold pruning at ``sensitivity * std`` per layer, optionally iterated with retraining.

    ``SensitivityPruner(model, config_list, optimizer=None, iterations=1, epochs_per_iteration=None)``;
    arguments, rounds and checkpoints: :class:`compressor.core.sensitivity.SensitivityRoundsMixin`."""

    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        if not self._due:
            return None
        mask = sensitivity_mask(ops, wrapper.weight.detach(), wrapper.config["sensitivity"], wrapper.weight_mask)
        return {"weight_mask": mask}

    def compress(self) -> nn.Module:
        if self.iteration == 0:
            with deferred_interrupts(), undone_on_error():  # see TorchPruner.compress
                self._undoable_round()
                self.prune_iteration()
        return self.bound_model

    def step(self) -> None:
        self.apply_masks()
