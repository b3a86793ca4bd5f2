"""The seed-004 prototype API on PyTorch, as thin shims over :mod:`compressor.torch`.

::

    from compressor import torchCompressor
    pruner = torchCompressor.LevelPruner([{'sparsity': 0.8, 'support_type': 'default'}])
    pruner(model)            # instruments the model in place and returns it; train as usual

Built-in names: ``LevelPruner``, ``AGPruner`` (-> ``AGPPruner``), ``SensitivityPruner``, ``QATquantizer``
(-> ``QAT_Quantizer``), ``DoReFaQuantizer``. Designers subclass :class:`TorchPruner` and implement
``calc_mask(self, layer_info, weight) -> mask`` (``weight``: the layer's weight tensor, detached, in
PyTorch's layout; the mask: same shape, bool or 0/1, True/1 = keep), or :class:`TorchQuantizer` and
implement ``quantize_weight(self, layer_info, weight) -> new weight`` (gradients pass straight through).
``layer_info.name`` is the module path, ``layer_info.type`` the class name and
``layer_info.extra['layer']`` the module itself. Call ``step()`` / ``update_epoch(epoch)`` from the
training loop; masks are re-evaluated after each. Configure keys of the prototype (``support_type``,
``support_op``, ``prune: False``) and of the modern API are both accepted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import torch as _modern
from ..core.matching import LayerInfo
from ..torch.modules import innermost_module
from .prototype import (
    Configure,
    PrototypeCompressor,
    PrototypePruner,
    PrototypeQuantizer,
    PrunerAdapterMixin,
    QuantizerAdapterMixin,
    define_builtins,
)

__all__ = ["TorchPruner", "TorchQuantizer", "LevelPruner", "AGPruner", "SensitivityPruner", "QATquantizer",
           "DoReFaQuantizer"]


def _layer_infos(compressor: Any) -> list[LayerInfo]:
    """Prototype ``layer_info`` of every wrapper, in wrapper order (the module under ``extra['layer']``)."""
    return [LayerInfo(info.name, info.type, {"layer": innermost_module(w.module)})
            for (info, _), w in zip(compressor.get_modules_to_compress(), compressor.get_modules_wrapper())]


class _PrunerAdapter(PrunerAdapterMixin, _modern.TorchPruner):
    """Runs a prototype ``calc_mask(layer_info, weight)`` as a modern pruner's masks."""

    def __init__(self, model: nn.Module, config_list: Configure, prototype: TorchPruner):
        self._adopt(prototype)
        super().__init__(model, config_list)
        self._infos = _layer_infos(self)

    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        if not self._due:  # the modern clock (optimizer hook) does not drive a prototype pruner
            return None
        idx = self._wrapper_index(wrapper) if wrapper_idx is None else wrapper_idx
        mask = self.prototype.calc_mask(self._infos[idx], wrapper.weight.detach())
        return None if mask is None else {"weight_mask": mask}

    def refresh(self) -> None:
        """Evaluate the prototype's ``calc_mask`` for every layer now and apply the masks."""
        with self._designer_due():
            self.update_mask()

    def compress(self) -> nn.Module:
        self.refresh()
        return self.bound_model


class _QuantizerAdapter(QuantizerAdapterMixin, _modern.TorchQuantizer):
    """Runs a prototype ``quantize_weight(layer_info, weight)`` as a modern weight quantizer."""

    def __init__(self, model: nn.Module, config_list: Configure, prototype: TorchQuantizer):
        self._adopt(prototype)
        self._info_by_name: dict[str, LayerInfo] = {}
        super().__init__(model, config_list)
        self._info_by_name = {info.name: info for info in _layer_infos(self)}

    def quantize_weight(self, weight: torch.Tensor, wrapper: nn.Module, **kwargs: Any) -> torch.Tensor:
        return self.prototype.quantize_weight(self._info_by_name[wrapper.name], weight)


class _TorchPrototype(PrototypeCompressor):
    _backend = "torch"
    _namespace = _modern


class TorchPruner(_TorchPrototype, PrototypePruner):
    """Prototype pruner base: implement ``calc_mask(self, layer_info, weight)`` returning the mask
    (``weight``: detached, in PyTorch's layout)."""

    _adapter = _PrunerAdapter


class TorchQuantizer(_TorchPrototype, PrototypeQuantizer):
    """Prototype quantizer base: implement ``quantize_weight(self, layer_info, weight)`` returning the new
    weight. Configure entries quantize weights by default (``quant_types: ['weight']``)."""

    _adapter = _QuantizerAdapter


#: the seed-004 built-in names (:data:`compressor.compat.prototype.BUILTIN_PROTOTYPES`)
LevelPruner, AGPruner, SensitivityPruner, QATquantizer, DoReFaQuantizer = define_builtins(__name__, TorchPruner, TorchQuantizer)
