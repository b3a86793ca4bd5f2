"""The seed-004 prototype API on TensorFlow / Keras 3, as thin shims over :mod:`compressor.tf`.

::

    from compressor import tfCompressor
    pruner = tfCompressor.LevelPruner([{'sparsity': 0.8, 'support_type': 'default'}])
    pruner(model)            # instruments the Keras model in place and returns it; fit as usual

As in the prototype, the masks are part of the layer's computation (the call reads ``where(mask, w, 0)``,
the modern pruners' ``mask_mode='forward'``), so ``model.fit`` or any custom loop trains with the masks
applied without an optimizer hook or callback. Built-in names: ``LevelPruner``, ``AGPruner`` (->
``AGPPruner``), ``SensitivityPruner``, ``QATquantizer`` (-> ``QAT_Quantizer``), ``DoReFaQuantizer``.
Designers subclass :class:`TfPruner` and implement ``calc_mask(self, layer_info, weight) -> mask``
(``weight``: the layer's main weight in Keras layout, e.g. Dense ``[in, out]``; the mask: same shape,
bool or 0/1, True/1 = keep), or :class:`TfQuantizer` and implement
``quantize_weight(self, layer_info, weight) -> new weight`` (TF ops, runs inside the traced step;
gradients pass straight through). ``layer_info.name`` is the Keras layer path, ``layer_info.type`` the
class name, ``layer_info.extra['layer']`` the layer. Call ``step()`` / ``update_epoch(epoch)`` from Python
in the training loop; masks are re-evaluated after each.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from .. import tf as _modern
from .prototype import (
    Configure,
    PrototypeCompressor,
    PrototypePruner,
    PrototypeQuantizer,
    PrunerAdapterMixin,
    QuantizerAdapterMixin,
    define_builtins,
)

__all__ = ["TfPruner", "TfQuantizer", "LevelPruner", "AGPruner", "SensitivityPruner", "QATquantizer",
           "DoReFaQuantizer"]

#: how the prototype applied masks: inside the layer's computation
PROTOTYPE_MASK_MODE = "forward"


class _PrunerAdapter(PrunerAdapterMixin, _modern.TfPruner):
    """Runs a prototype ``calc_mask(layer_info, weight)`` as a modern pruner's masks."""

    mask_mode = PROTOTYPE_MASK_MODE

    def __init__(self, model: Any, config_list: Configure, prototype: TfPruner):
        self._adopt(prototype)
        super().__init__(model, config_list)

    def calc_mask(self, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        if not self._due:  # the modern clock (optimizer hook) does not drive a prototype pruner
            return None
        mask = self.prototype.calc_mask(wrapper.layer_info, tf.convert_to_tensor(wrapper.weight))
        return None if mask is None else {"weight_mask": mask}

    def refresh(self) -> None:
        """Evaluate the prototype's ``calc_mask`` for every built layer now (eagerly) and apply the masks."""
        with self._designer_due(), tf.init_scope():
            self.update_mask()

    def _on_wrapper_ready(self, wrapper: Any) -> None:
        with self._designer_due():  # a layer built after instrumentation gets the designer's mask at once
            super()._on_wrapper_ready(wrapper)

    def compress(self) -> Any:
        self._compressed = True
        self.refresh()
        return self.model


class _QuantizerAdapter(QuantizerAdapterMixin, _modern.TfQuantizer):
    """Runs a prototype ``quantize_weight(layer_info, weight)`` as a modern weight quantizer."""

    def __init__(self, model: Any, config_list: Configure, prototype: TfQuantizer):
        self._adopt(prototype)
        super().__init__(model, config_list)

    def quantize_weight(self, weight: tf.Tensor, wrapper: Any, **kwargs: Any) -> tf.Tensor:
        return self.prototype.quantize_weight(wrapper.layer_info, weight)


class _TfPrototype(PrototypeCompressor):
    _backend = "tf"
    _namespace = _modern

    def _configure_modern(self, compressor: Any) -> None:
        if self._kind == "pruner":
            compressor.mask_mode = PROTOTYPE_MASK_MODE  # read at trace time by the wrappers
            compressor._retrace()


class TfPruner(_TfPrototype, PrototypePruner):
    """Prototype pruner base: implement ``calc_mask(self, layer_info, weight)`` returning the mask
    (``weight``: Keras layout; called eagerly)."""

    _adapter = _PrunerAdapter


class TfQuantizer(_TfPrototype, PrototypeQuantizer):
    """Prototype quantizer base: implement ``quantize_weight(self, layer_info, weight)`` returning the new
    weight (TF ops, Keras layout). Configure entries quantize weights by default (``quant_types: ['weight']``)."""

    _adapter = _QuantizerAdapter


#: the seed-004 built-in names (:data:`compressor.compat.prototype.BUILTIN_PROTOTYPES`)
LevelPruner, AGPruner, SensitivityPruner, QATquantizer, DoReFaQuantizer = define_builtins(__name__, TfPruner, TfQuantizer)
