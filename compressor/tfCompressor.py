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

from . import tf as _modern
from ._prototype import Configure, PrototypeCompressor
from .core.matching import LayerInfo

__all__ = ["TfPruner", "TfQuantizer", "LevelPruner", "AGPruner", "SensitivityPruner", "QATquantizer",
           "DoReFaQuantizer"]

#: how the prototype applied masks: inside the layer's computation
PROTOTYPE_MASK_MODE = "forward"


class _PrunerAdapter(_modern.TfPruner):
    """Runs a prototype ``calc_mask(layer_info, weight)`` as a modern pruner's masks."""

    mask_mode = PROTOTYPE_MASK_MODE

    def __init__(self, model: Any, config_list: Configure, prototype: TfPruner):
        self.prototype = prototype
        self.config_keys = tuple(prototype.config_keys)
        self._due = False
        super().__init__(model, config_list)

    def calc_mask(self, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        if not self._due:  # the modern clock (optimizer hook) does not drive a prototype pruner
            return None
        mask = self.prototype.calc_mask(wrapper.layer_info, tf.convert_to_tensor(wrapper.weight))
        return None if mask is None else {"weight_mask": mask}

    def refresh(self) -> None:
        """Evaluate the prototype's ``calc_mask`` for every built layer now (eagerly) and apply the masks."""
        self._due = True
        try:
            with tf.init_scope():
                self.update_mask()
        finally:
            self._due = False

    def _on_wrapper_ready(self, wrapper: Any) -> None:
        self._due = True  # a layer built after instrumentation gets the designer's mask at once
        try:
            super()._on_wrapper_ready(wrapper)
        finally:
            self._due = False

    def compress(self) -> Any:
        self._compressed = True
        self.refresh()
        return self.model


class _QuantizerAdapter(_modern.TfQuantizer):
    """Runs a prototype ``quantize_weight(layer_info, weight)`` as a modern weight quantizer."""

    required_keys = ("quant_types",)
    supported_quant_types = ("weight",)

    def __init__(self, model: Any, config_list: Configure, prototype: TfQuantizer):
        self.prototype = prototype
        self.config_keys = tuple(prototype.config_keys)
        super().__init__(model, config_list)

    def quantize_weight(self, weight: tf.Tensor, wrapper: Any, **kwargs: Any) -> tf.Tensor:
        return self.prototype.quantize_weight(wrapper.layer_info, weight)


class _TfPrototype(PrototypeCompressor):
    _backend = "tf"
    _method = ""
    _base: type = PrototypeCompressor
    _adapter: type = object

    def _modern_class(self) -> type | None:
        if getattr(type(self), self._method) is not getattr(self._base, self._method):
            return None  # the designer's method runs through the adapter
        if self._modern is None:
            raise NotImplementedError(f"{type(self).__name__} must implement {self._method}(self, layer_info, weight)")
        return getattr(_modern, self._modern)

    def _adapter_class(self) -> type:
        return self._adapter

    def _modern_step(self, compressor: Any) -> None:
        # what the optimizer hook runs after an update: step counter (quant_start_step), re-mask
        compressor.step()

    def _configure_modern(self, compressor: Any) -> None:
        if self._kind == "pruner":
            compressor.mask_mode = PROTOTYPE_MASK_MODE  # read at trace time by the wrappers
            compressor._retrace()


class TfPruner(_TfPrototype):
    """Prototype pruner base: implement ``calc_mask(self, layer_info, weight)`` returning the mask."""

    _kind = "pruner"
    _method = "calc_mask"
    _adapter = _PrunerAdapter

    def calc_mask(self, layer_info: LayerInfo, weight: tf.Tensor) -> Any:
        """The mask of ``weight`` (Keras layout, same shape; True/1 keeps a weight). Called eagerly when
        the model is instrumented and after every ``step()`` / ``update_epoch()``."""
        raise NotImplementedError(f"{type(self).__name__} must implement calc_mask(self, layer_info, weight)")


class TfQuantizer(_TfPrototype):
    """Prototype quantizer base: implement ``quantize_weight(self, layer_info, weight)`` returning the new
    weight. Configure entries quantize weights by default (``quant_types: ['weight']``)."""

    _kind = "quantizer"
    _method = "quantize_weight"
    _adapter = _QuantizerAdapter
    _legacy_renames = {"q_bits": "quant_bits"}
    _legacy_defaults = {"quant_types": ["weight"]}

    def quantize_weight(self, layer_info: LayerInfo, weight: tf.Tensor) -> tf.Tensor:
        """The quantized ``weight`` (Keras layout); called in every forward of the layer."""
        raise NotImplementedError(f"{type(self).__name__} must implement quantize_weight(self, layer_info, weight)")


TfPruner._base = TfPruner
TfQuantizer._base = TfQuantizer


class LevelPruner(TfPruner):
    """Magnitude pruning to ``sparsity`` per layer (modern :class:`compressor.tf.LevelPruner`)."""

    _modern = "LevelPruner"


class AGPruner(TfPruner):
    """Automated gradual pruning; call ``update_epoch(epoch)`` each epoch (modern ``AGPPruner``)."""

    _modern = "AGPPruner"


class SensitivityPruner(TfPruner):
    """Han et al. 2015: prune ``|w| < s * std(w)``. The prototype named ``s`` 'sparsity'; it is passed on as
    ``sensitivity`` (modern :class:`compressor.tf.SensitivityPruner`)."""

    _modern = "SensitivityPruner"
    _legacy_renames = {"sparsity": "sensitivity"}


class QATquantizer(TfQuantizer):
    """Quantization-aware training (modern ``QAT_Quantizer``)."""

    _modern = "QAT_Quantizer"


class DoReFaQuantizer(TfQuantizer):
    """DoReFa weight quantization (modern :class:`compressor.tf.DoReFaQuantizer`)."""

    _modern = "DoReFaQuantizer"
