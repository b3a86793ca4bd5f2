"""LevelPruner: magnitude pruning, the ``floor(n * sparsity)`` smallest ``|w|`` of each layer.

With ``sparse_pattern: 'N:M'`` (e.g. ``'2:4'``) in a config entry, its layers are pruned to N:M
semi-structured sparsity instead: the N largest ``|w|`` of every M consecutive weights along the input
axis of core's canonical layout (Dense ``[in, out]`` -> ``[out, in]``), so the groups and masks are the
same as on torch; ``sparsity`` may then be left out (it is ``(M - N) / M``).
"""

from __future__ import annotations

from typing import Any

from ...core.matching import LayerInfo
from ...core.pruning import level_or_nm_mask, nm_check_layer, nm_validate_config
from .. import layout
from ..ops import ops
from .masker import WeightMasker
from .pruner import OneShotPruner

__all__ = ["LevelPruner", "LevelPrunerMasker", "check_nm_layer"]


def check_nm_layer(layer_info: LayerInfo, layer: Any, config: dict[str, Any], what: str) -> None:
    """Refuse a layer a ``sparse_pattern`` cannot apply to (checked again when an unbuilt layer is masked)."""
    weight = layout.weight_of(layer)
    shape = None if weight is None else layout.canonical_shape(layer_info.type, weight.shape)
    nm_check_layer(layer_info.name, (layer_info.type, *layer_info.bases), shape, config, what)


class LevelPrunerMasker(WeightMasker):
    """Magnitude criterion (core ``level_mask``, or ``nm_mask`` with ``sparse_pattern``, in canonical
    layout); monotone: pruned weights go first."""

    def calc_mask(self, sparsity: float, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any]:
        if "sparse_pattern" in wrapper.config:  # a layer built after wrapping: its shape is known only now
            nm_check_layer(wrapper.name, (wrapper.type, *wrapper.layer_info.bases), wrapper.canonical_shape(),
                           wrapper.config, type(self.pruner).__name__)
        mask = level_or_nm_mask(ops, wrapper.canonical_weight(), sparsity, wrapper.canonical_mask(), wrapper.config)
        return {"weight_mask": wrapper.from_canonical(mask)}


class LevelPruner(OneShotPruner):
    """One-shot magnitude pruning of every selected layer at its config's ``sparsity``, or to the N:M
    pattern of its ``sparse_pattern``.

    ``LevelPruner(model, [{'sparsity': 0.7, 'op_types': ['default']}], optimizer).compress()``
    ``LevelPruner(model, [{'sparse_pattern': '2:4', 'op_types': ['Dense']}]).compress()``
    """

    masker_class = LevelPrunerMasker
    masks_bias = False
    config_keys = ("sparse_pattern",)
    required_keys = ()

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None) -> None:
        super().__init__(model, config_list, optimizer)

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        nm_validate_config(config_list, type(self).__name__)

    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)
        check_nm_layer(layer_info, layer, config, type(self).__name__)
