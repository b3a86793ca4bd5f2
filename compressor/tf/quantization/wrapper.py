"""``QuantizerLayerWrapper`` (alias ``QuantizerModuleWrapper``): quantizes a Keras layer's input, weight
and output inside its call.

The float kernel stays the layer's trainable variable (optimizers built before or after ``compress()``
see the same variables); the call reads the fake-quantized kernel in its place through
``keras.StatelessScope`` (:meth:`LayerWrapper.call_with_weights`), so nothing is written into the kernel
and gradients reach it through the quantizer's custom gradient. Quantizer state (ranges, scales, zero
points) lives in non-trainable ``tf.Variable``s of the wrapper (checkpoint dependencies of the layer),
updated with ``assign`` inside the traced step. Learned state that must train with the model (LSQ's step
sizes) is attached to the layer as Keras variables while the wrapper is installed, so it is part of
``model.trainable_variables``.

Which quant types run is fixed at construction from ``config['quant_types']`` (inputs: the first
positional input is quantized). A layer built after wrapping gets its state on its first call.
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf

from ...core import quant as cq
from ...core.matching import LayerInfo
from .. import layout
from ..compressor import LayerWrapper, _on_device
from ..ops import ops
from ..pruning.wrapper import read_through
from .grad import QuantType

__all__ = ["QuantizerLayerWrapper", "QuantizerModuleWrapper", "training_flag"]


def training_flag() -> Any:
    """Whether the call being traced trains (may be a bool tensor).

    The Keras ``training`` value wins (True in ``fit`` for models whose ``call`` takes ``training``,
    False in ``predict`` / ``evaluate``, or what the caller passed). Without one (a subclassed model whose
    ``call`` has no ``training`` argument, which ``fit`` then calls without it, or a bare ``model(x)``),
    the call counts as training exactly when a gradient tape is recording it.
    """
    from keras.src.backend.common import global_state

    ctx = global_state.get_global_attribute("current_call_ctx")
    value = None if ctx is None else getattr(ctx, "training", None)
    if value is None:
        try:
            from tensorflow.python.eager import record

            value = bool(record.could_possibly_record())
        except (ImportError, AttributeError):  # pragma: no cover - TF internals moved
            value = False
    return value


def _in_symbolic_scope() -> bool:
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    return in_stateless_scope()


def _value(var: Any) -> tf.Tensor:
    """Current value of a (Keras) variable, honouring an enclosing Keras stateless scope."""
    return var.value if hasattr(var, "_value") else tf.convert_to_tensor(var)


class QuantizerLayerWrapper(LayerWrapper):
    """Wraps a Keras ``layer`` for ``quantizer`` with ``config``.

    Attributes the quantizers use: ``layer``, ``name``, ``type``, ``config``, ``quant_types`` (list of
    str), ``quant_bits`` ({type: bits}), ``weight`` / ``bias`` (the layer's float variables),
    ``quantizer``, ``training`` (the Keras training flag during a call), ``quant_active`` (True, or a
    bool tensor ``step >= quant_start_step``), ``qranges`` ({type: (qmin, qmax)}) and the state variables
    the quantizer created (``<type>_scale``, ``<type>_zero_point``, ...).
    """

    def __getattr__(self, name: str) -> Any:
        return read_through(self, name)  # the wrapped layer's attributes (strides, kernel_size, units, ...)

    def __init__(self, layer: Any, layer_info: LayerInfo, config: dict[str, Any], quantizer: Any) -> None:
        super().__init__(layer, layer_info, config, quantizer)
        raw = self._setattr_raw
        raw("quant_types", [str(t) for t in config.get("quant_types", ())])
        raw("quant_bits", dict(config.get("quant_bits", {})))
        raw("qranges", {})
        raw("quant_start_step", int(config.get("quant_start_step", 0)))
        raw("ready", False)
        raw("_layer_variables", [])  # Keras variables attached to the layer while installed
        raw("_q_input", QuantType.QUANT_INPUT in self.quant_types)
        raw("_q_weight", QuantType.QUANT_WEIGHT in self.quant_types)
        raw("_q_output", QuantType.QUANT_OUTPUT in self.quant_types)
        raw("fused_relu", False)  # the output feeds only a ReLU: quantize relu(output) (``fuse_relu``)

    @property
    def quantizer(self) -> Any:
        return self.compressor

    @property
    def training(self) -> Any:
        return training_flag()

    @property
    def quant_active(self) -> Any:
        """True, or (with ``quant_start_step``) the bool tensor ``optimizer steps >= quant_start_step``."""
        if self.quant_start_step <= 0:
            return True
        return self.compressor.step_count >= self.quant_start_step

    # ---------------------------------------------------------------- state
    def add_layer_variable(self, name: str, value: Any, trainable: bool = True) -> Any:
        """A Keras variable ``name`` that joins the layer's (hence the model's) variables while installed."""
        import keras

        with tf.init_scope(), _on_device(self.weight):  # mirrored like the layer's weights under tf.distribute
            prefix = self.layer.name if self.slot is None else f"{self.layer.name}_{self.slot}"  # one per matrix
            var = keras.Variable(tf.convert_to_tensor(value), trainable=trainable, name=f"{prefix}_{name}")
        self._layer_variables.append(var)
        self._setattr_raw(name, var)
        if self.installed:
            self._track(var)
        return var

    def _track(self, var: Any) -> None:
        layer = self.layer
        locked = layer._tracker.locked
        layer._tracker.unlock()
        try:
            layer._track_variable(var)
        finally:
            if locked:
                layer._lock_state()

    def _install(self, attr: str) -> None:
        super()._install(attr)
        for var in self._layer_variables:
            self._track(var)
        object.__setattr__(self.layer, "save_own_variables", self._save_own_variables)
        guard_model_saving(self.compressor)

    def _uninstall(self) -> None:
        was = self.installed
        super()._uninstall()
        if was:
            for var in self._layer_variables:
                self.layer._untrack_variable(var)
            if vars(self.layer).get("save_own_variables") == self._save_own_variables:
                object.__delattr__(self.layer, "save_own_variables")
            release_model_saving(self.compressor)

    def _save_own_variables(self, store: Any) -> None:
        """Installed as the layer's ``save_own_variables``: a Keras save that reaches this layer by another
        route than the quantizer's model's ``save`` (refused, see :func:`guard_model_saving`), e.g.
        ``keras.saving.save_model(outer_model)``, writes the layer's own FLOAT variables in Keras' layout
        (never the quantizer's, so the file loads) and warns that the quantization is not in it."""
        warnings.warn(f"layer {self.name!r} is saved by Keras with its quantizer attached: the file holds its float "
                      f"weights, not the quantized model. " + save_advice(self.compressor), RuntimeWarning,
                      stacklevel=2)
        layer = self.layer
        for var in self._layer_variables:
            layer._untrack_variable(var)
        try:
            type(layer).save_own_variables(layer, store)
        finally:
            for var in self._layer_variables:
                self._track(var)

    def qparams(self, quant_type: str, like: Any = None) -> tuple[Any, Any, int, int] | None:
        """``(scale, zero_point, qmin, qmax)`` recorded for ``quant_type``, else None.

        With ``like`` (the tensor being quantized) scale and zero point are reshaped to broadcast
        against it (per-channel: along the layer's channel axis).
        """
        t = str(quant_type)
        rng = self.qranges.get(t)
        if rng is None:
            return None
        scale = tf.convert_to_tensor(getattr(self, f"{t}_scale"))
        zp = tf.convert_to_tensor(getattr(self, f"{t}_zero_point"))
        if like is not None and scale.shape.rank == 1:
            scale, zp = (self.broadcastable(t, v, like) for v in (scale, zp))
        return scale, zp, rng[0], rng[1]

    def broadcastable(self, quant_type: str, v: Any, like: Any) -> tf.Tensor:
        """A per-channel vector ``v`` of ``quant_type`` reshaped to broadcast against ``like``."""
        nd = like.shape.rank
        if str(quant_type) == "weight":
            if self.type.startswith("Depthwise"):
                shape = [1] * nd
                shape[-2:] = [int(like.shape[-2]), int(like.shape[-1])]
                return tf.reshape(v, shape)
            return cq.channel_view(ops, v, nd, -2 if self.type.endswith("Transpose") else -1)
        return cq.channel_view(ops, v, nd, layout.channel_axis(self.layer))

    def _ensure_ready(self) -> bool:
        """Create the quantizer state of a layer built after wrapping (False inside a symbolic build)."""
        if self.ready:
            return True
        if not getattr(self.layer, "built", False) or _in_symbolic_scope():
            return False
        with tf.init_scope():
            self.compressor._init_wrapper(self)
        return True

    # ---------------------------------------------------------------- the call
    def forward(self, call_fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._ensure_ready():
            return call_fn(*args, **kwargs)
        q = self.compressor
        if self._q_input and args:
            args = (q._quantize(QuantType.QUANT_INPUT, args[0], self), *args[1:])
        if self._q_weight:
            weight = self.weight
            wq = q._quantize(QuantType.QUANT_WEIGHT, _value(weight), self)
            out = self.call_with_weights(call_fn, [(weight, wq)], *args, **kwargs)
        else:
            out = call_fn(*args, **kwargs)
        if self._q_output:
            if self.fused_relu:
                out = tf.nn.relu(out)
            out = q._quantize(QuantType.QUANT_OUTPUT, out, self)
        return out

    def __repr__(self) -> str:
        bits = ", ".join(f"{t}={b}" for t, b in self.quant_bits.items())
        return f"<{type(self).__name__} {self.name!r} ({self.type}) bits: {bits}>"


QuantizerModuleWrapper = QuantizerLayerWrapper


# ---------------------------------------------------------------- Keras saving with a quantizer attached
# A Keras file cannot hold the quantizer: ``model.save()`` would write the float weights (a DoReFa / BNN
# model reloads as the float model) or, with learned scales tracked on the layer (LSQ), a file Keras
# cannot load. So while a quantizer is installed, ``save`` and ``save_weights`` of its model (hence
# ``ModelCheckpoint``) are REFUSED before any file is opened, with an error that says what to use instead.
_GUARDS = "_compressor_save_guards"
_MODEL_SAVES = ("save", "save_weights")


def save_advice(quantizer: Any) -> str:
    what = type(quantizer).__name__
    return (f"Use {what}.export_model('model.keras') for the quantized model (plain Keras, quantized weights, "
            f"loads without compressor), tf.train.Checkpoint(model=model, optimizer=optimizer) to checkpoint "
            f"training (instead of ModelCheckpoint), or {what}.strip() first to save the float model")


def _refusing(name: str, model: Any) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        quantizer = (vars(model).get(_GUARDS) or [None])[0]
        raise RuntimeError(f"model.{name}() of {model.name!r} refused: its layers are quantized by "
                           f"{type(quantizer).__name__}, and a Keras file cannot hold the quantizer (it would "
                           f"reload as the float model, or not load at all). " + save_advice(quantizer))

    refuse._compressor_save_guard = True  # type: ignore[attr-defined]
    return refuse


def guard_model_saving(quantizer: Any) -> None:
    """Refuse ``save`` / ``save_weights`` of the quantizer's model while the quantizer is installed."""
    model = getattr(quantizer, "model", None)
    if model is None:
        return
    guards = vars(model).get(_GUARDS)
    if guards is None:
        guards = []
        object.__setattr__(model, _GUARDS, guards)
        for name in _MODEL_SAVES:
            object.__setattr__(model, name, _refusing(name, model))
    if not any(q is quantizer for q in guards):
        guards.append(quantizer)


def release_model_saving(quantizer: Any) -> None:
    """Undo :func:`guard_model_saving` once none of the quantizer's layers is installed."""
    model = getattr(quantizer, "model", None)
    guards = None if model is None else vars(model).get(_GUARDS)
    if guards is None or any(w.installed for w in quantizer.modules_wrapper):
        return
    guards[:] = [q for q in guards if q is not quantizer]
    if not guards:
        object.__delattr__(model, _GUARDS)
        for name in _MODEL_SAVES:
            if getattr(vars(model).get(name), "_compressor_save_guard", False):
                object.__delattr__(model, name)
