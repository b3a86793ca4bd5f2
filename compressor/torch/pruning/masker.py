"""``WeightMasker``: the pruning criterion of a pruner (seed 003), separate from scheduling.

A masker computes the masks of one wrapped layer at a given sparsity; the pruner decides when. The math
is in :mod:`compressor.core.pruning`; maskers only fetch tensors from wrappers. Data-driven maskers
(activation statistics, Taylor) also implement the statistics protocol below, which the built-in
pruners drive: ``start_statistics`` -> batches flow -> ``statistics_ready`` -> ``calc_mask`` ->
``stop_statistics``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ...core.pruner_config import check_statistics_batch_num
from ..distributed import all_reduce_sum

__all__ = ["WeightMasker", "all_reduce_sum", "check_filter_layer", "check_statistics_batch_num", "FILTER_DEFAULT_TYPES"]

#: what ``op_types: ['default']`` means for filter pruners: the convolutions and Linear layers (Hugging
#: Face ``Conv1D`` is an alias of ``Conv1d``). A Linear whose outputs are a model output (the classifier)
#: is left whole by dependency-aware pruning (core: its channels are fixed)
FILTER_DEFAULT_TYPES = ("Conv1d", "Conv2d", "Conv3d", "Linear")


class WeightMasker:
    """Base class of maskers: ``calc_mask(sparsity, wrapper, wrapper_idx=None) -> dict | None``."""

    #: True when masks need statistics collected from training batches
    needs_data: bool = False

    def __init__(self, model: nn.Module, pruner: Any, **kwargs: Any):
        self.model = model
        self.pruner = pruner

    def calc_mask(self, sparsity: float, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        """Masks ``{'weight_mask': ..., 'bias_mask': ...}`` of ``wrapper`` at ``sparsity``."""
        raise NotImplementedError(f"{type(self).__name__} must implement calc_mask()")

    @classmethod
    def check_layer(cls, layer_info: LayerInfo, module: nn.Module) -> None:
        """Raise ConfigError if this criterion cannot handle ``module`` (checked before wrapping)."""

    # ---- statistics protocol (no-ops for weight-only criteria)
    def start_statistics(self) -> None:
        """Forget collected statistics and start collecting."""

    def stop_statistics(self) -> None:
        """Stop collecting (removes forward hooks so they cost nothing)."""

    def statistics_ready(self, wrapper_idx: int) -> bool:
        return True

    def after_step(self) -> None:
        """Called by the pruner after every optimizer step, before masks are updated."""

    def reduce_statistics(self, *tensors: torch.Tensor) -> None:
        """Sum data statistics over the ranks of torch.distributed (if initialised and the pruner's
        ``sync_ranks`` is on) so every rank, each of which saw different batches, picks the same filters.
        Called in the same order on every rank, right before a mask is derived from the statistics."""
        if getattr(self.pruner, "sync_ranks", True):
            all_reduce_sum(*tensors)


def check_filter_layer(layer_info: LayerInfo, module: nn.Module, what: str) -> None:
    """Filter criteria need output channels (Conv, Linear, HF Conv1D seen out-first: :mod:`..layout`)."""
    from ..layout import is_hf_conv1d

    conv = isinstance(module, nn.modules.conv._ConvNd)
    if (conv and module.transposed) or not (conv or isinstance(module, nn.Linear) or is_hf_conv1d(module)):
        raise ConfigError(
            f"{what}: layer {layer_info.name!r} ({layer_info.type}) is not supported; filter pruning needs "
            f"Conv1d/Conv2d/Conv3d, Linear or Hugging Face Conv1D (output channels known), not transposed "
            f"convolutions"
        )
