"""SensitivityPruner: Han et al. 2015, "Learning both weights and connections".

Each layer prunes ``|w| < sensitivity * std(w)`` (core ``sensitivity_mask``; ``sensitivity`` is the
paper's quality parameter, per config entry). The paper iterates prune -> retrain (at about 1/10 of
the original learning rate) -> prune: with ``iterations=N`` and ``epochs_per_iteration=E`` the rule is
re-applied at ``update_epoch(E)``, ``update_epoch(2E)``, ... until N rounds are done (or call
:meth:`SensitivityPruner.prune_iteration` yourself). Each round uses the std of the weights still kept,
so it prunes further; masks are monotone. Rounds run eagerly (between steps), never in the train step.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...core.pruning import sensitivity_mask
from ...core.sensitivity import SensitivityRoundsMixin
from ..ops import ops
from .pruner import TfPruner

__all__ = ["SensitivityPruner"]


class SensitivityPruner(SensitivityRoundsMixin, TfPruner):
    """Threshold pruning at ``sensitivity * std`` per layer, optionally iterated with retraining.

    ``SensitivityPruner(model, config_list, optimizer=None, iterations=1, epochs_per_iteration=None)``;
    arguments, rounds and checkpoints: :class:`compressor.core.sensitivity.SensitivityRoundsMixin`."""

    masks_bias = False

    def calc_mask(self, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        if not self._due:
            return None
        mask = sensitivity_mask(ops, wrapper.canonical_weight(), wrapper.config["sensitivity"],
                                wrapper.canonical_mask())
        return {"weight_mask": wrapper.from_canonical(mask)}

    def _run_round(self) -> None:
        with tf.init_scope():  # eagerly, between steps
            self.update_mask()

    def compress(self) -> Any:
        if self.iteration == 0:
            self._masks_in_one_commit(self.prune_iteration)
        else:
            self._compressed = True
        return self.model

    def _initial_masks(self, wrapper: Any) -> Any:
        self._due = True
        try:
            return super()._initial_masks(wrapper)
        finally:
            self._due = False

    def _update_in_step(self) -> None:
        """Masks change only in prune rounds; the step only re-masks (done by the hook)."""
