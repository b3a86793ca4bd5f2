"""``TfQuantizer`` (exported as ``Quantizer``): the base of every TensorFlow / Keras 3 quantizer.

Writing a quantizer is the same as on torch (seeds 002 and 003): subclass and override
``quantize_weight``, ``quantize_input`` and/or ``quantize_output``; each returns the quantized tensor.
Two calling styles are accepted:

* **canonical (seed 002)**: ``quantize_weight(self, weight, wrapper, **kwargs)``,
  ``quantize_input(self, *inputs, wrapper, **kwargs)``, ``quantize_output(self, output, wrapper, **kwargs)``;
  ``wrapper`` is the layer's :class:`QuantizerLayerWrapper` (``wrapper.config`` is its config entry,
  variables set with ``set_wrappers_attribute`` live there);
* **seed 003**: the same methods with a parameter named ``config`` instead of ``wrapper``; they get the
  layer's config dict (and ``op``, ``op_type``, ``op_name`` if they take ``**kwargs``).

The style is read from each method's signature. Methods receive Keras-layout tensors (Dense kernel
``[in, out]``, Conv2D ``[kh, kw, in, out]``) and run inside the traced step: use TF ops (or core math on
``compressor.tf.ops``) and ``assign`` to keep state, never ``.numpy()``.

Gradients: each quantization runs under ``tf.custom_gradient`` through ``self.quant_grad`` (default
:class:`QuantGrad`: straight-through estimator clipped to the quantization range the quantizer recorded
on the wrapper, plain STE when it recorded none); ``self.quant_grad = MyGrad`` changes it. Methods marked
:func:`builtin_autograd` (LSQ) carry their own gradients; :func:`builtin_ste` ones (DoReFa) are called
directly while ``quant_grad`` is the default.

Clocks: ``step()`` runs after every optimizer update (the optimizer hook or the ``CompressionCallback``,
in-graph) and the base's step counter drives ``quant_start_step``: a layer's tensors pass unchanged
until that many updates have run (``tf.cond`` on the counter). With ``handles_start_step`` the
quantizer's methods run from the first step (they track ranges) and the base uses their result only
from the start step on. Subclasses overriding ``step`` should call ``super().step()``.
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf

from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ...core.quantizer import QuantizerBaseMixin, builtin_autograd, builtin_ste, calls_directly
from .. import layout
from ..compressor import Compressor
from .grad import QuantGrad, QuantType
from .wrapper import QuantizerLayerWrapper

__all__ = ["TfQuantizer", "Quantizer", "builtin_ste", "builtin_autograd"]


class TfQuantizer(QuantizerBaseMixin, Compressor):
    """Base quantizer: wraps the selected Keras layers in :class:`QuantizerLayerWrapper`.

    Config keys: ``quant_types`` (list of 'input' / 'weight' / 'output'), ``quant_bits`` (int or
    ``{type: bits}``, 1..32), optional ``quant_start_step``; subclasses add their own.
    """

    #: gradient rule of every quantization; swap it per instance (``self.quant_grad = MyGrad``)
    quant_grad: type[QuantGrad] = QuantGrad
    #: use TF's fused fake-quant kernels where they fit (see :mod:`.fakequant`)
    fused: bool = True

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None) -> None:
        self._read_method_styles()
        self._any_frozen = False
        super().__init__(model, config_list, optimizer)

    # ------------------------------------------------------------------ construction
    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        what = type(self).__name__
        types = config.get("quant_types", [])
        self._check_quant_types(layer_info.name, types)
        if "weight" in types and getattr(layer, "built", False) and \
                layout.weight_of(layer, layer_info.extra.get("slot")) is None:
            raise ConfigError(f"{what}: layer {layer_info.name!r} ({layer_info.type}) has no weight to quantize; "
                              f"quantizable: {layout.KNOWN_WEIGHTS}")

    def _create_wrapper(self, layer: Any, layer_info: LayerInfo, config: dict[str, Any]) -> QuantizerLayerWrapper:
        wrapper = QuantizerLayerWrapper(layer, layer_info, config, self)
        wrapper.add_state("frozen", False, tf.bool)
        if getattr(layer, "built", False):
            self._init_wrapper(wrapper)
        return wrapper

    def _init_wrapper(self, wrapper: QuantizerLayerWrapper) -> None:
        if "weight" in wrapper.quant_types and wrapper.weight is None:  # a layer built after wrapping
            raise ConfigError(f"{type(self).__name__}: layer {wrapper.name!r} ({wrapper.type}) has no weight to "
                              f"quantize; quantizable: {layout.KNOWN_WEIGHTS}")
        self.init_wrapper(wrapper)
        wrapper._setattr_raw("ready", True)

    def init_wrapper(self, wrapper: QuantizerLayerWrapper) -> None:
        """Hook: create the state a layer's quantization needs (``wrapper.add_state`` for non-trainable
        variables, ``wrapper.add_layer_variable`` for trainable ones). Runs once the layer is built:
        at construction, or on the first call of a layer built later."""

    # ------------------------------------------------------------------ dispatch (called by the wrapper)
    def _call(self, quant_type: str, tensor: tf.Tensor, wrapper: QuantizerLayerWrapper) -> tf.Tensor:
        out = self._call_method(quant_type, tensor, wrapper)
        return tf.convert_to_tensor(out, dtype=tensor.dtype)

    def _quantize(self, quant_type: str, tensor: tf.Tensor, wrapper: QuantizerLayerWrapper) -> tf.Tensor:
        t = str(quant_type)
        mode = self._autograd[t]
        grad = self.quant_grad

        def quantized() -> tf.Tensor:
            if calls_directly(mode, grad is QuantGrad):
                return self._call(t, tensor, wrapper)

            def run(x: tf.Tensor) -> tuple[tf.Tensor, Any]:
                return self._call(t, x, wrapper), wrapper.qparams(t, like=x)

            return grad.apply(tensor, QuantType(t), run)

        active = wrapper.quant_active
        if active is True:
            return quantized()
        if self.handles_start_step:
            q = quantized()  # tracks ranges from the first step
            return tf.cond(active, lambda: q, lambda: tf.identity(tensor))
        return tf.cond(active, quantized, lambda: tf.identity(tensor))

    # ------------------------------------------------------------------ clocks
    def step(self) -> None:
        """After each optimizer update (in-graph): count it (``quant_start_step``); weights moved, so loaded
        calibration no longer applies."""
        super().step()
        if self._any_frozen:
            for w in self.modules_wrapper:
                w.frozen.assign(False)

    @property
    def steps(self) -> int:
        """Optimizer updates seen so far (host value; the in-graph counter is ``step_count``)."""
        return int(self.step_count.numpy())

    # ------------------------------------------------------------------ export
    def export_weight(self, wrapper: QuantizerLayerWrapper) -> tf.Tensor:
        """The weight the exported float model holds for ``wrapper``'s layer (its quantized values)."""
        weight = tf.convert_to_tensor(wrapper.weight)
        if QuantType.QUANT_WEIGHT in wrapper.quant_types and wrapper.ready:
            weight = self._quantize("weight", weight, wrapper)
        return tf.identity(weight)

    def calibration(self, wrapper: QuantizerLayerWrapper) -> dict[str, Any]:
        """The calibration record of one layer (see :func:`compressor.tf.quantization.export.calibration_entry`)."""
        from .export import calibration_entry

        return calibration_entry(wrapper)

    def strip(self) -> Any:
        """Remove the instrumentation for good, leaving each quantized layer's kernel holding its
        quantized values: a plain Keras model (nothing of compressor left in it). Returns the model."""
        exported = [(w, self.export_weight(w)) for w in self.modules_wrapper if "weight" in w.quant_types and w.ready]
        model = super().strip()
        for w, value in exported:
            w.weight.assign(value)
        return model

    def export_model(self, model_path: str | os.PathLike | None = None, calibration_path: str | os.PathLike | None = None,
                     tflite_path: str | os.PathLike | None = None, representative_dataset: Any = None,
                     input_shape: tuple[int, ...] | None = None) -> dict[str, dict[str, Any]]:
        """Save the plain Keras model with quantized float weights and return (and save as JSON to
        ``calibration_path``) the per-layer calibration config; optionally convert it to TFLite.

        ``model_path``: ``*.keras`` (``model.save``), ``*.weights.h5`` (``save_weights``) or a directory
        (TF SavedModel via ``model.export``). The model itself is left as it was (still quantizing).
        ``tflite_path`` with ``representative_dataset`` (a callable yielding ``[input]`` batches) gives a
        full-integer int8 model; without it, a float model with int8 weights. See :mod:`.export`.
        """
        from .export import export_model

        return export_model(self, model_path, calibration_path, tflite_path, representative_dataset, input_shape)

    def load_calibration_config(self, calibration_config: dict[str, dict[str, Any]] | str | os.PathLike) -> None:
        """Load ranges, scales and zero points saved by :meth:`export_model` (a dict or a JSON path) into
        the wrappers, checked completely before anything is written. Loaded weight scales are used until
        the next optimizer update. The model's Keras functions are retraced; retrace your own
        ``tf.function``s that call the model (they read the new state only after a retrace)."""
        from .export import load_calibration_config

        load_calibration_config(self, calibration_config)


Quantizer = TfQuantizer
