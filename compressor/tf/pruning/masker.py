"""``WeightMasker``: the pruning criterion of a pruner (seed 003), separate from scheduling (mirror of torch).

A masker computes the masks of one wrapped layer at a given sparsity; the pruner decides when. The math is
in :mod:`compressor.core.pruning`, on tensors in core's canonical layout (``wrapper.canonical_weight()``);
masks come back in the layer's Keras layout (``wrapper.from_canonical``). Data-driven maskers
(activation statistics, Taylor) also implement the statistics protocol, which the built-in pruners drive:
``start_statistics`` -> batches flow -> ``statistics_ready`` (a bool tensor inside ``tf.function``) ->
``calc_mask`` -> ``stop_statistics``. Their statistics are running sums in variables on the device.
"""

from __future__ import annotations

from typing import Any

from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ...core.pruner_config import check_statistics_batch_num
from ...core.pruning import filter_masks, importance_filter_masks
from ..ops import ops

__all__ = [
    "CONV_TYPES", "WeightMasker", "batches_ready", "check_filter_layer", "check_statistics_batch_num", "filter_result",
    "importance_filter_result",
]

#: Keras layers whose LAST kernel axis is the filters (output channels)
CONV_TYPES = ("Conv1D", "Conv2D", "Conv3D", "DepthwiseConv1D", "DepthwiseConv2D", "Dense")


class WeightMasker:
    """Base class of maskers: ``calc_mask(sparsity, wrapper, wrapper_idx=None) -> dict | None``."""

    #: True when masks need statistics collected from training batches
    needs_data: bool = False

    def __init__(self, model: Any, pruner: Any, **kwargs: Any) -> None:
        self.model = model
        self.pruner = pruner

    def calc_mask(self, sparsity: float, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        """Masks ``{'weight_mask': ..., 'bias_mask': ...}`` of ``wrapper`` at ``sparsity`` (Keras layout)."""
        raise NotImplementedError(f"{type(self).__name__} must implement calc_mask()")

    @classmethod
    def check_layer(cls, layer_info: LayerInfo, layer: Any) -> None:
        """Raise ConfigError if this criterion cannot handle ``layer`` (checked before wrapping)."""

    # ---- statistics protocol (no-ops for weight-only criteria)
    def start_statistics(self) -> None:
        """Forget collected statistics and start collecting."""

    def stop_statistics(self) -> None:
        """Stop collecting (removes collectors so they cost nothing after the next retrace)."""

    def statistics_ready(self, wrapper_idx: int) -> Any:
        """Python bool, or a bool tensor (graph-safe)."""
        return True

    def after_step(self, pairs: list[tuple[Any, Any]]) -> None:
        """Called after every optimizer update with its ``(gradient, variable)`` pairs (in-graph)."""

    def wrapper_ready(self, wrapper: Any, wrapper_idx: int) -> None:
        """A wrapper got its masks (layer built after wrapping): create its statistics state."""


def check_filter_layer(layer_info: LayerInfo, layer: Any, what: str) -> None:
    """Filter criteria need the filters on the last kernel axis (Conv1D/2D/3D, depthwise, Dense)."""
    if layer_info.type not in CONV_TYPES:
        raise ConfigError(
            f"{what}: layer {layer_info.name!r} ({layer_info.type}) is not supported; filter pruning needs "
            f"one of {list(CONV_TYPES)} (filters on the last kernel axis), not transposed convolutions"
        )


def filter_result(wrapper: Any, weight_mask_canonical: Any, filter_keep: Any) -> dict[str, Any]:
    """Masks dict (Keras layout) for a filter decision: the bias follows its filter."""
    masks = filter_masks(wrapper.from_canonical(weight_mask_canonical), filter_keep, wrapper.bias_mask is not None)
    if "bias_mask" in masks and "heads_of" in wrapper.config:  # value bias [heads, head_dim]
        masks["bias_mask"] = wrapper.from_canonical(masks["bias_mask"], like=wrapper.bias)
    return masks


def importance_filter_result(wrapper: Any, scores: Any, sparsity: float) -> dict[str, Any]:
    """Masks dict (Keras layout) pruning ``wrapper``'s filters with the lowest ``scores`` (data criteria)."""
    weight_mask, keep = importance_filter_masks(ops, scores, sparsity, wrapper.canonical_mask(),
                                                wrapper.canonical_shape())
    return filter_result(wrapper, weight_mask, keep)


def batches_ready(wrapper: Any, counter: str, needed: int) -> Any:
    """Whether the statistics counter ``counter`` of ``wrapper`` reached ``needed`` batches: a bool tensor,
    or False before the layer has its statistics state (not built yet)."""
    if counter not in wrapper.state_variables():
        return False
    return getattr(wrapper, counter) >= needed
