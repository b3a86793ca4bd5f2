"""One-shot pruners for language models: :class:`WandaPruner` and :class:`SparseGPTPruner`.

``p = SparseGPTPruner(model, [{'sparsity': 0.5, 'op_types': ['default']}]); p.calibrate(batches)`` runs the
model block by block on the calibration batches (:mod:`compressor.torch.sequential`), computes each layer's
mask (and, for SparseGPT, its updated weights) with the core math (:mod:`compressor.core.oneshot`), and
leaves the model pruned: each selected layer sits in the usual :class:`PrunerModuleWrapper` holding the mask
the method chose, so ``report()``, ``export_model(...)`` and speedup work as for the other pruners. Masks are
computed once, in :meth:`calibrate`; optimizer steps afterwards keep the pruned weights at zero.

Config keys: ``sparsity`` (unstructured, per layer; Wanda compares per output row) or ``sparse_pattern``
(``'2:4'``); SparseGPT also ``damp``, ``block_size``, ``mask_scope``. ``op_types: ['default']`` = Linear
and Hugging Face Conv1D; the output head (``lm_head``, a weight tied to the embedding) is left out unless
named in ``op_names``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core.matching import LayerInfo
from ...core.oneshot import LayerResult, SparseGPTMethod, WandaMethod
from ...core.pruning import nm_validate_config
from ..layout import from_canonical
from ..sequential import OneShotMixin, oneshot_key_specs
from .level import check_nm_module
from .pruner import TorchPruner

__all__ = ["WandaPruner", "SparseGPTPruner"]


class _OneShotPruner(OneShotMixin, TorchPruner):
    config_keys: tuple[Any, ...] = ("sparse_pattern",)

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], sequential_targets: Any = None):
        self._init_oneshot(model, sequential_targets)
        super().__init__(model, config_list)
        # masks are written once, by calibrate(): no float copy of each mask for the per-step re-mask (4 bytes per
        # weight on CPU, more than a language model's calibration activations); a later fine-tune re-masks from
        # the bool mask itself
        for w in self.get_modules_wrapper():
            w.multiplier_cache = False
            w.drop_multiplier_cache()

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        nm_validate_config(config_list, type(self).__name__)

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        check_nm_module(layer_info, module, config, type(self).__name__)

    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        return None  # masks are set once, by calibrate()

    def _oneshot_mask(self, wrapper: nn.Module) -> torch.Tensor | None:
        return wrapper.weight_mask

    def _oneshot_write(self, wrapper: nn.Module, result: LayerResult) -> None:
        wrapper.set_masks({"weight_mask": from_canonical(wrapper, torch.from_numpy(result.mask))})
        wrapper.apply_masks()


class WandaPruner(_OneShotPruner):
    """Wanda (Sun et al. 2023): in each output row, prune the weights of smallest ``|W_ij| * ||X_j||``
    (``X_j``: input channel ``j`` over the calibration tokens); no weight update.

    ``WandaPruner(model, [{'sparsity': 0.5, 'op_types': ['default']}]).calibrate(batches)``"""

    method_class = WandaMethod


class SparseGPTPruner(_OneShotPruner):
    """SparseGPT (Frantar & Alistarh 2023): OBS pruning with weight updates from each layer's Hessian
    ``X^T X`` (damped inverse, lazy blocks of ``block_size`` columns), unstructured or N:M.

    ``SparseGPTPruner(model, [{'sparse_pattern': '2:4', 'op_types': ['default']}]).calibrate(batches)``"""

    method_class = SparseGPTMethod
    config_keys = ("sparse_pattern", *oneshot_key_specs("damp", "block_size", "mask_scope"))
