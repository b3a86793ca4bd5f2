"""LotteryTicketPruner (Frankle & Carbin 2019): iterative magnitude pruning with rewinding.

``for i in pruner.get_prune_iterations(): pruner.prune_iteration_start(); model.fit(...)``. Round 0
trains dense; each later round prunes the smallest trained weights up to core ``lottery_sparsity(i)``
(the final ``sparsity`` is reached in round ``prune_iterations``), then resets every model variable
(weights and BN statistics) and every optimizer variable (slots, iteration count) to their initial
copies, taken on the device when the pruner was built, so the ticket is trained from the same start.
Masks are monotone. Rounds run eagerly between ``fit`` calls, never inside the train step.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...core.errors import ConfigError
from ...core.pruner_config import PRUNE_ITERATIONS, check_common_prune_iterations, first_active
from ...core.pruning import level_mask
from ...core.schedules import lottery_next_round, lottery_sparsity
from ..ops import ops
from .pruner import TfPruner

__all__ = ["LotteryTicketPruner"]


def _copies(variables: list[Any]) -> list[tuple[Any, Any]]:
    with tf.init_scope():
        return [(v, tf.identity(tf.convert_to_tensor(v))) for v in variables]


class LotteryTicketPruner(TfPruner):
    """Iterative magnitude pruning with weight and optimizer rewinding to their initial state."""

    config_keys = (PRUNE_ITERATIONS,)
    required_keys = ("sparsity", "prune_iterations")
    masks_bias = False

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None,
                 reset_weights: bool = True) -> None:
        if not isinstance(reset_weights, bool):
            raise ConfigError(f"LotteryTicketPruner: reset_weights = {reset_weights!r} is invalid; allowed: True or False")
        super().__init__(model, config_list, optimizer)
        self.prune_iterations = first_active(self.config_list, "prune_iterations")
        self.reset_weights = reset_weights
        self.curr_prune_iteration: int | None = None
        self._initial_model = _copies(list(model.variables))
        self._initial_optimizer: list[tuple[Any, Any]] = []
        if optimizer is not None:
            self._snapshot_optimizer(optimizer)

    def _snapshot_optimizer(self, optimizer: Any) -> None:
        if not optimizer.built and self.model.built:
            optimizer.build(self.model.trainable_variables)  # slots exist from now on: copy them as they start
        self._initial_optimizer = _copies(list(optimizer.variables))

    def hook_optimizer(self, optimizer: Any) -> None:
        super().hook_optimizer(optimizer)
        if not self._initial_optimizer or self._initial_optimizer[0][0] not in optimizer.variables:
            self._snapshot_optimizer(optimizer)

    def validate_layer(self, layer_info: Any, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)
        if not getattr(layer, "built", False):
            raise ConfigError(f"LotteryTicketPruner: layer {layer_info.name!r} is not built; build the model first "
                              f"(model.build(input_shape) or call it once): the initial weights are copied now")

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        check_common_prune_iterations(config_list)

    def get_prune_iterations(self) -> range:
        """Rounds 0..prune_iterations (round 0 trains the dense model)."""
        return range(self.prune_iterations + 1)

    def calc_mask(self, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        return None  # masks change only in prune_iteration_start

    def _update_in_step(self) -> None:
        """Masks change only between rounds; the hook only re-masks."""

    def prune_iteration_start(self) -> None:
        """Start the next round: prune to this round's sparsity, then rewind weights and optimizer."""
        nxt = lottery_next_round(self.curr_prune_iteration, self.prune_iterations)
        self.curr_prune_iteration = nxt
        with tf.init_scope():
            if nxt > 0:
                for wrapper in self.modules_wrapper:
                    if not wrapper.ready:
                        continue
                    s = lottery_sparsity(nxt, wrapper.config["sparsity"], self.prune_iterations)
                    mask = level_mask(ops, wrapper.canonical_weight(), s, wrapper.canonical_mask())
                    wrapper.set_mask("weight_mask", wrapper.from_canonical(mask))
                if self.reset_weights:
                    self._rewind()
            self.apply_masks()

    def _rewind(self) -> None:
        for var, value in self._initial_model + self._initial_optimizer:
            var.assign(value)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "curr_prune_iteration": self.curr_prune_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.curr_prune_iteration = state.get("curr_prune_iteration")
