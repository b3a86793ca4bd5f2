"""SlimPruner: network slimming (Liu et al. 2017) on BatchNormalization scale factors.

One global threshold over ``|gamma|`` of all selected BatchNormalization layers (core ``slim_plan``: every
layer keeps a channel, ties spread evenly over the layers); a pruned channel has gamma AND beta masked, so
it outputs exactly 0. With ``dependency_aware=True`` norms whose channels meet (residual adds) are ranked
together by their summed ``|gamma|`` and pruned alike. Train with an L1 penalty on gamma first
(:meth:`SlimPruner.l1_penalty`, e.g. ``model.add_loss``) so the scale factors become sparse.
"""

from __future__ import annotations

from typing import Any

from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ...core.pruner_config import check_common_sparsity, first_active
from ...core.pruning import slim_l1_penalty
from ...core.slimming import check_max_layer_sparsity, slim_plan, tie_warning
from ..ops import ops
from .masker import WeightMasker
from .pruner import OneShotPruner

__all__ = ["SlimPruner", "SlimPrunerMasker", "BN_TYPES", "check_bn_layer"]

BN_TYPES = ("BatchNormalization",)


def check_bn_layer(layer_info: LayerInfo, layer: Any, what: str) -> None:
    if layer_info.type not in BN_TYPES or not getattr(layer, "scale", True):
        raise ConfigError(
            f"{what}: layer {layer_info.name!r} ({layer_info.type}) is not supported; slimming needs "
            f"BatchNormalization layers with scale=True"
        )


class SlimPrunerMasker(WeightMasker):
    """Global |gamma| threshold across all wrappers, computed once per mask update (trace) and shared."""

    def __init__(self, model: Any, pruner: Any, **kwargs: Any) -> None:
        super().__init__(model, pruner, **kwargs)
        self._cache_key: tuple | None = None
        self._cache: list[Any] = []

    @classmethod
    def check_layer(cls, layer_info: LayerInfo, layer: Any) -> None:
        check_bn_layer(layer_info, layer, "SlimPruner")

    def calc_mask(self, sparsity: float, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any]:
        import tensorflow as tf

        wrappers = self.pruner.get_modules_wrapper()
        if not all(w.ready for w in wrappers):
            return None  # a global threshold needs every layer built: computed at the first step after that
        idx = self.pruner._wrapper_index(wrapper) if wrapper_idx is None else wrapper_idx
        graph = tf.compat.v1.get_default_graph() if tf.inside_function() else None
        key = (id(graph), getattr(self.pruner, "_mask_round", 0), sparsity)
        if key != self._cache_key or idx == 0:
            gammas = [w.canonical_weight() for w in wrappers]
            self._cache, info = slim_plan(ops, gammas, sparsity, [w.canonical_mask() for w in wrappers],
                                          getattr(self.pruner, "max_layer_sparsity", None))
            self._cache_key = key
            if tf.executing_eagerly():  # in a traced step the counts are not known: no host read there
                tie_warning(info, type(self.pruner).__name__)
        mask = self._cache[idx]
        return {"weight_mask": mask, "bias_mask": mask}

    def filter_importance(self, wrapper: Any) -> Any:
        """``|gamma|`` per channel (dependency-aware slimming sums it over a group's norms)."""
        return ops.abs(wrapper.canonical_weight())


class SlimPruner(OneShotPruner):
    """Prune the BN channels with the smallest ``|gamma|`` over all selected layers at once.

    The global sparsity is that of the first non-excluded config entry; entries may not disagree. Every
    layer keeps at least ``max(1, n - floor(n * max_layer_sparsity))`` of its ``n`` channels (default: one)
    and ties at the threshold (e.g. every gamma = 1 after initialisation) are spread evenly over the
    layers, with a ``RuntimeWarning`` (:mod:`compressor.core.slimming`; the same masks as on torch).
    """

    default_types = BN_TYPES
    masker_class = SlimPrunerMasker

    _group_producers_needed = False

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None,
                 dependency_aware: bool = False, dummy_input: Any = None, max_layer_sparsity: float | None = None) -> None:
        self.max_layer_sparsity = check_max_layer_sparsity(max_layer_sparsity, type(self).__name__)
        super().__init__(model, config_list, optimizer, dependency_aware=dependency_aware, dummy_input=dummy_input)
        self.sparsity = first_active(self.config_list, "sparsity")

    _rank_globally = True

    def _group_masks(self, wrapper: Any, idx: int) -> dict[str, Any] | None:
        """Dependency-aware slimming: one global ranking of every group's summed ``|gamma|`` (eager)."""
        if idx not in self._pending:
            self._pending.update(self._group_decision(self._dependency.groups))
        return self._pending.pop(idx)

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        check_common_sparsity(config_list)

    def sparsity_for(self, wrapper: Any, wrapper_idx: int) -> float:
        return self.sparsity

    def l1_penalty(self, scale: float = 1e-4) -> Any:
        """``scale * sum |gamma|`` over the selected BN layers, to add to the training loss."""
        return slim_l1_penalty(ops, [w.weight for w in self.modules_wrapper], scale)
