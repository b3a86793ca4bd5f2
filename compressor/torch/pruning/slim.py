"""SlimPruner: network slimming (Liu et al. 2017) on BatchNorm scale factors.

One global threshold over ``|gamma|`` of all selected BatchNorm layers (core ``slim_plan``: every layer
keeps a channel, ties spread evenly over the layers); a pruned channel has gamma AND beta masked, so it
outputs exactly 0. With ``dependency_aware=True`` norms whose channels meet (residual adds) are ranked
together by their summed ``|gamma|`` (still one global threshold) and pruned alike, so speedup can remove
the channels. Train with an L1 penalty on gamma first (:meth:`SlimPruner.l1_penalty`) so the scale
factors become sparse.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ...core.pruner_config import check_common_sparsity, first_active
from ...core.pruning import slim_l1_penalty
from ...core.slimming import check_max_layer_sparsity, slim_plan, tie_warning
from ..ops import ops
from .masker import WeightMasker
from .pruner import OneShotPruner

__all__ = ["SlimPruner", "SlimPrunerMasker", "BN_TYPES", "check_bn_layer"]

BN_TYPES = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")


def check_bn_layer(layer_info: LayerInfo, module: nn.Module, what: str) -> None:
    if not isinstance(module, nn.modules.batchnorm._BatchNorm) or not module.affine:
        raise ConfigError(
            f"{what}: layer {layer_info.name!r} ({layer_info.type}) is not supported; slimming needs "
            f"BatchNorm layers with affine=True (types {list(BN_TYPES)})"
        )


class SlimPrunerMasker(WeightMasker):
    """Global |gamma| threshold across all wrappers, computed once per mask update."""

    def __init__(self, model: nn.Module, pruner: Any, **kwargs: Any):
        super().__init__(model, pruner, **kwargs)
        self._cache_key: tuple | None = None
        self._cache: list[Any] = []

    @classmethod
    def check_layer(cls, layer_info: LayerInfo, module: nn.Module) -> None:
        check_bn_layer(layer_info, module, "SlimPruner")

    def calc_mask(self, sparsity: float, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any]:
        wrappers = self.pruner.get_modules_wrapper()
        idx = self.pruner._wrapper_index(wrapper) if wrapper_idx is None else wrapper_idx
        key = (self.pruner._mask_round, sparsity)
        if key != self._cache_key:
            gammas = [w.weight.detach() for w in wrappers]
            self._cache, info = slim_plan(ops, gammas, sparsity, [w.weight_mask for w in wrappers],
                                          getattr(self.pruner, "max_layer_sparsity", None))
            self._cache_key = key
            tie_warning(info, type(self.pruner).__name__)
        mask = self._cache[idx]
        return {"weight_mask": mask, "bias_mask": mask}

    def filter_importance(self, wrapper: nn.Module, wrapper_idx: int) -> Any:
        """``|gamma|`` per channel (dependency-aware slimming sums it over a group's norms)."""
        return wrapper.weight.detach().abs()


class SlimPruner(OneShotPruner):
    """Prune the BatchNorm channels with the smallest ``|gamma|`` over all selected layers at once.

    The global sparsity is that of the first non-excluded config entry; entries may not disagree. Every
    layer keeps at least ``max(1, n - floor(n * max_layer_sparsity))`` of its ``n`` channels (default: one)
    and ties at the threshold (e.g. every gamma = 1 after initialisation) are spread evenly over the
    layers, with a ``RuntimeWarning`` (:mod:`compressor.core.slimming`): slimming never disconnects a layer.
    """

    default_types = BN_TYPES
    masker_class = SlimPrunerMasker

    _group_producers_needed = False
    _rank_globally = True  # dependency-aware: one global ranking of the groups' summed |gamma|

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: Any = None,
                 dependency_aware: bool = False, dummy_input: Any = None, max_layer_sparsity: float | None = None):
        self.max_layer_sparsity = check_max_layer_sparsity(max_layer_sparsity, type(self).__name__)
        super().__init__(model, config_list, optimizer, dependency_aware=dependency_aware, dummy_input=dummy_input)
        self.sparsity = first_active(self.config_list, "sparsity")

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        check_common_sparsity(config_list)

    def sparsity_for(self, wrapper: nn.Module, wrapper_idx: int) -> float:
        return self.sparsity

    def l1_penalty(self, scale: float = 1e-4) -> torch.Tensor:
        """``scale * sum |gamma|`` over the selected BatchNorm layers, to add to the training loss."""
        return slim_l1_penalty(ops, [w.weight for w in self.modules_wrapper], scale)
