"""One-shot pruners for Keras language models: :class:`WandaPruner` and :class:`SparseGPTPruner`
(:mod:`compressor.tf.sequential` runs them block by block; the math is :mod:`compressor.core.oneshot`)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...core.oneshot import (
    ONESHOT_KEYS,
    LayerResult,
    SparseGPTMethod,
    WandaMethod,
)
from ...core.pruning import nm_validate_config
from ..kernel_layout import KernelLayout
from ..sequential.mixin import OneShotMixin
from .pruner import TfPruner
from .wrapper import PrunerLayerWrapper

__all__ = ["WandaPruner", "SparseGPTPruner"]


class _OneShotPruner(OneShotMixin, TfPruner):
    masks_bias = False
    config_keys: tuple[Any, ...] = ("sparse_pattern",)

    def __init__(self, model: Any, config_list: list[dict[str, Any]], sequential_targets: Any = None) -> None:
        self._init_oneshot(sequential_targets)
        super().__init__(model, config_list, None)

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        nm_validate_config(config_list, self._what)

    def calc_mask(self, wrapper: PrunerLayerWrapper, wrapper_idx: int | None = None) -> None:
        return None  # the masks are set by calibrate() and never recomputed

    def _write(self, wrapper: PrunerLayerWrapper, plan: KernelLayout, result: LayerResult) -> None:
        kernel = getattr(wrapper.weight, "_value", wrapper.weight)
        kernel.assign(tf.cast(plan.from_canonical(result.weight), kernel.dtype))
        wrapper.set_masks({"weight_mask": plan.from_canonical(result.mask)})
        wrapper.apply_masks()

    def _after_calibrate(self) -> None:
        self._compressed = True


class WandaPruner(_OneShotPruner):
    """Wanda (Sun et al. 2023): prune the weights with the smallest ``|W_ij| * ||X_j||`` of each output row, from
    the layer inputs on calibration data; no weight update. Config: ``sparsity`` or ``sparse_pattern``.

    ``p = WandaPruner(model, [{'sparsity': 0.5, 'op_types': ['default']}]); p.calibrate(token_ids)``
    """

    method = WandaMethod()


class SparseGPTPruner(_OneShotPruner):
    """SparseGPT (Frantar & Alistarh 2023): OBS pruning with weight updates from each layer's Hessian ``XᵀX``.
    Config: ``sparsity`` or ``sparse_pattern``, ``damp``, ``block_size``, ``mask_scope``."""

    method = SparseGPTMethod()
    config_keys = ("sparse_pattern", ONESHOT_KEYS["damp"], ONESHOT_KEYS["block_size"], ONESHOT_KEYS["mask_scope"])

