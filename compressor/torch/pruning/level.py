"""LevelPruner: magnitude pruning, the ``floor(n * sparsity)`` smallest ``|w|`` of each layer.

With ``sparse_pattern: 'N:M'`` (e.g. ``'2:4'``) in a config entry, its layers are pruned to N:M
semi-structured sparsity instead: the N largest ``|w|`` of every M consecutive weights along the input
axis are kept (core :func:`~compressor.core.pruning.nm_mask`); ``sparsity`` may then be left out (it is
``(M - N) / M``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...core.matching import LayerInfo
from ...core.pruning import level_or_nm_mask, nm_check_layer, nm_validate_config
from ..layout import canonical_shape, from_canonical, to_canonical
from ..ops import ops
from .masker import WeightMasker
from .pruner import OneShotPruner

__all__ = ["LevelPruner", "LevelPrunerMasker", "check_nm_module"]


def check_nm_module(layer_info: LayerInfo, module: nn.Module, config: dict[str, Any], what: str) -> None:
    """Refuse a layer a ``sparse_pattern`` cannot apply to (transposed convs: their axis 1 is the output)."""
    kinds: tuple[str, ...] = (layer_info.type, *layer_info.bases)  # a subclass computing as Linear counts as one
    if isinstance(module, nn.modules.conv._ConvNd) and module.transposed:
        kinds = (type(module).__name__,)
    shape = canonical_shape(module, module.weight.shape) if hasattr(module, "weight") else None
    nm_check_layer(layer_info.name, kinds, shape, config, what)


class LevelPrunerMasker(WeightMasker):
    """Magnitude criterion (core ``level_mask``, or ``nm_mask`` with ``sparse_pattern``); monotone:
    already-pruned weights go first."""

    def calc_mask(self, sparsity: float, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any]:
        weight = to_canonical(wrapper, wrapper.weight.detach())  # HF Conv1D: out-first, as nn.Linear
        mask = level_or_nm_mask(ops, weight, sparsity, to_canonical(wrapper, wrapper.weight_mask), wrapper.config)
        return {"weight_mask": from_canonical(wrapper, mask)}


class LevelPruner(OneShotPruner):
    """One-shot magnitude pruning of every selected layer at its config's ``sparsity``, or to the N:M
    pattern of its ``sparse_pattern``.

    ``LevelPruner(model, [{'sparsity': 0.7, 'op_types': ['default']}], optimizer).compress()``
    ``LevelPruner(model, [{'sparse_pattern': '2:4', 'op_types': ['Linear']}]).compress()``
    """

    masker_class = LevelPrunerMasker
    config_keys = ("sparse_pattern",)
    required_keys = ()

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: Any = None):
        super().__init__(model, config_list, optimizer)

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        nm_validate_config(config_list, type(self).__name__)

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        check_nm_module(layer_info, module, config, type(self).__name__)
