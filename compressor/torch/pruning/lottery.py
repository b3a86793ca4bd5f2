"""LotteryTicketPruner (Frankle & Carbin 2019): iterative magnitude pruning with rewinding.

``for i in pruner.get_prune_iterations(): pruner.prune_iteration_start(); train()``. Round 0 trains
dense; each later round prunes the smallest trained weights up to core ``lottery_sparsity(i)`` (the
final ``sparsity`` is reached in round ``prune_iterations``), then resets the weights, the optimizer
state and the LR scheduler (if given) to their initial copies, so the ticket is trained from the same
start. Masks are monotone.

Under torch.distributed the initial copies are taken from rank 0 when round 0 starts (DDP broadcasts rank
0's weights when it wraps the model, after this pruner copied each rank's own), so every rank rewinds to
the same weights.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ...core.errors import ConfigError
from ...core.pruner_config import PRUNE_ITERATIONS, check_common_prune_iterations, first_active
from ...core.pruning import level_mask
from ...core.schedules import lottery_next_round, lottery_sparsity
from ..distributed import broadcast
from ..ops import ops
from .pruner import TorchPruner
from .wrapper import PrunerModuleWrapper

__all__ = ["LotteryTicketPruner"]


class LotteryTicketPruner(TorchPruner):
    """Iterative magnitude pruning with weight/optimizer/LR-scheduler rewinding to their initial state."""

    config_keys = (PRUNE_ITERATIONS,)
    required_keys = ("sparsity", "prune_iterations")

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: Any = None,
                 lr_scheduler: Any = None, reset_weights: bool = True):
        if lr_scheduler is not None and not (hasattr(lr_scheduler, "state_dict") and hasattr(lr_scheduler, "load_state_dict")):
            raise ConfigError(f"LotteryTicketPruner: lr_scheduler must have state_dict()/load_state_dict(), "
                              f"got {type(lr_scheduler).__name__}")
        super().__init__(model, config_list, optimizer)
        self.prune_iterations = first_active(self.config_list, "prune_iterations")
        self.lr_scheduler = lr_scheduler
        self.reset_weights = reset_weights
        self.curr_prune_iteration: int | None = None
        self._initial_model = {k: v.detach().clone() for k, v in self._resettable_state().items()}
        self._initial_optimizer = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        self._initial_scheduler = copy.deepcopy(lr_scheduler.state_dict()) if lr_scheduler is not None else None

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        check_common_prune_iterations(config_list)

    def _mask_keys(self) -> set[str]:
        keys = set()
        for name, module in self.bound_model.named_modules():
            if isinstance(module, PrunerModuleWrapper):
                keys.update(f"{name}.{b}" for b in module._buffers)
        return keys

    def _resettable_state(self) -> dict[str, torch.Tensor]:
        skip = self._mask_keys()
        return {k: v for k, v in self.bound_model.state_dict(keep_vars=True).items() if k not in skip}

    def get_prune_iterations(self) -> range:
        """Rounds 0..prune_iterations (round 0 trains the dense model)."""
        return range(self.prune_iterations + 1)

    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        return None  # masks change only in prune_iteration_start

    def compress(self) -> nn.Module:
        self.apply_masks()
        return self.bound_model

    def step(self) -> None:
        self.apply_masks()

    def prune_iteration_start(self) -> None:
        """Start the next round: prune to this round's sparsity, then rewind weights and optimizer."""
        nxt = lottery_next_round(self.curr_prune_iteration, self.prune_iterations)
        self.curr_prune_iteration = nxt
        if nxt == 0 and self.sync_ranks:
            with torch.no_grad():
                broadcast(*self._initial_model.values())  # no-op unless torch.distributed is initialised
        if nxt > 0:
            for wrapper in self.modules_wrapper:
                s = lottery_sparsity(nxt, wrapper.config["sparsity"], self.prune_iterations)
                wrapper.set_mask("weight_mask", level_mask(ops, wrapper.weight.detach(), s, wrapper.weight_mask))
            if self.reset_weights:
                self._rewind()
        self.apply_masks()

    def _rewind(self) -> None:
        current = self._resettable_state()
        with torch.no_grad():
            for k, v in self._initial_model.items():
                current[k].copy_(v)
        if self.optimizer is not None and self._initial_optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(self._initial_optimizer))
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(copy.deepcopy(self._initial_scheduler))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "curr_prune_iteration": self.curr_prune_iteration,
                "initial_model": self._initial_model, "initial_optimizer": self._initial_optimizer,
                "initial_scheduler": self._initial_scheduler}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.curr_prune_iteration = state.get("curr_prune_iteration")
        if state.get("initial_model") is not None:
            self._initial_model = {k: v.detach().clone() for k, v in state["initial_model"].items()}
        self._initial_optimizer = state.get("initial_optimizer", self._initial_optimizer)
        self._initial_scheduler = state.get("initial_scheduler", self._initial_scheduler)
