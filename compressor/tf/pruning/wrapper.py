"""``PrunerLayerWrapper`` (alias ``PrunerModuleWrapper``): one Keras layer's bool masks and config.

Masks are non-trainable ``tf.bool`` variables in the layer's own (Keras) layout, created on the
weight's device: ``weight_mask`` for the main weight (kernel, depthwise kernel, BN gamma) and
``bias_mask`` for the bias (BN: beta), or None. They are checkpoint dependencies of the layer, so
``tf.train.Checkpoint(model=model)`` saves and restores them.

How masks are applied (``mask_mode`` of the pruner). ``benchmarks/tf_prune.py`` (small CNN, 70 %, one TF
thread, shared 2-core machine) measured the in-place upkeep alone at 1.8 ms CPU per step = 1.3 % of a dense
``fit`` step (fastest rounds: 1.01x dense), ``predict`` unchanged; ``'forward'`` 1.08x for ``fit`` and
``predict``. Hence the default:

* ``'inplace'`` (default): the pruned weights are zeroed IN PLACE (``assign``) when masks change and
  right after every optimizer update (the optimizer hook, in-graph), because momentum and weight decay
  move pruned weights. The forward pass reads the layer's own variables: zero cost in ``predict`` and
  in the forward/backward of ``fit``; one ``where`` + ``assign`` per masked variable per step. If you
  write weights yourself (``set_weights``, ``load_weights``), call ``pruner.apply_masks()`` (the
  ``CompressionCallback`` does so at train/epoch begin).
* ``'forward'``: the call reads ``where(mask, w, 0)`` through ``keras.StatelessScope`` (masks hold
  even if something writes the weights), at the cost of a masking op in every forward and backward.

Layers built after wrapping get their masks on their first call (outside any Keras symbolic scope).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...core.interrupts import record_undo, undo_active
from ...core.matching import LayerInfo
from ...core.pruner_config import MASK_NAMES, mask_to_set
from .. import layout
from ..compressor import LayerWrapper

__all__ = ["PrunerLayerWrapper", "PrunerModuleWrapper", "MASK_NAMES"]

def _raw(var: Any) -> Any:
    """The backing ``tf.Variable`` of a Keras variable (assigns bypass any Keras stateless scope)."""
    return getattr(var, "_value", var)


def _in_keras_symbolic_scope() -> bool:
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    return in_stateless_scope()


def read_through(wrapper: Any, name: str) -> Any:
    """``wrapper.<name>`` for a name the wrapper lacks: the wrapped layer's attribute (``strides``,
    ``kernel_size``, ``filters``, ``units``, ``kernel``, ...), as on torch. The model itself keeps calling
    and reading the original layer (the wrapper only intercepts its ``call``), so model code is unaffected
    either way; this makes ``wrapper.strides`` work too. Private names are never read through."""
    layer = wrapper.__dict__.get("layer")
    if name.startswith("_") or layer is None:
        raise AttributeError(f"{type(wrapper).__name__!r} object has no attribute {name!r}")
    return getattr(layer, name)


class PrunerLayerWrapper(LayerWrapper):
    """Wraps a Keras ``layer`` for a pruner: masks, in-place masking, canonical-layout views. Attributes it
    does not have are read from the wrapped layer (:func:`read_through`)."""

    def __getattr__(self, name: str) -> Any:
        return read_through(self, name)

    def __init__(self, layer: Any, layer_info: LayerInfo, config: dict[str, Any], pruner: Any) -> None:
        super().__init__(layer, layer_info, config, pruner)
        self._setattr_raw("_has_bias_mask", False)
        if self.weight is not None:  # (a slot's matrix for a recurrent / attention layer)
            self._create_masks()

    # -- masks -----------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """True once the layer is built and its masks exist."""
        return "weight_mask" in self.__dict__["_state_vars"]

    def _create_masks(self) -> None:
        w = self.weight
        self.add_state("weight_mask", tf.ones(w.shape, tf.bool))
        b = self.bias
        if b is not None:
            self.add_state("bias_mask", tf.ones(b.shape, tf.bool))
            self._setattr_raw("_has_bias_mask", True)
        else:
            self._setattr_raw("bias_mask", None)

    def _ensure_ready(self) -> None:
        """Create masks for a layer built after wrapping, and let the pruner compute its first masks.

        Inside a trace (a model first built by ``fit``) the layer's variables are not initialized yet:
        the masks are created (all True) and the pruner computes them in-graph at the first step.
        """
        if self.ready or self.weight is None or _in_keras_symbolic_scope():
            return
        deferred = tf.inside_function()
        with tf.init_scope():
            self._create_masks()
            self.compressor._on_wrapper_ready(self, deferred=deferred)

    def set_mask(self, name: str, value: Any) -> None:
        """Copy ``value`` (bool or 0/1, Keras layout) into mask ``name`` (graph-safe)."""
        if name not in MASK_NAMES:
            raise ValueError(f"{self.name}: unknown mask {name!r}; allowed: {list(MASK_NAMES)}")
        if not self.ready:
            raise ValueError(f"{self.name}: layer is not built yet, it has no masks")
        current = self.__dict__["_state_vars"].get(name)
        if not mask_to_set(self.name, name, current is not None, value):
            return
        t = tf.convert_to_tensor(value)
        if t.dtype != tf.bool:
            t = tf.not_equal(t, tf.zeros([], t.dtype))
        if tuple(t.shape) != tuple(current.shape):
            raise ValueError(f"{self.name}: {name} has shape {tuple(t.shape)}, expected {tuple(current.shape)} "
                             f"(masks are in the layer's Keras layout)")
        if undo_active():  # inside compress(): the mask from before it, put back if compress() does not finish
            old = current.numpy().copy()
            record_undo(("mask", id(current)), lambda: current.assign(old))
        current.assign(t)

    def set_masks(self, masks: dict[str, Any]) -> None:
        """Set the masks given (``{'weight_mask': ..., 'bias_mask': ...}``); the others are kept."""
        for key, value in masks.items():
            self.set_mask(key, value)

    def apply_masks(self) -> None:
        """Zero the pruned weights (and bias) in place now; graph-safe, idempotent. Inside ``compress()`` the
        weights are masked once, all together, when every mask is set (its commit): skipped until then."""
        if not self.ready or undo_active():
            return
        pairs = [(self.weight, self.weight_mask)]
        if self._has_bias_mask and getattr(self.compressor, "masks_bias", True):
            pairs.append((self.bias, self.bias_mask))
        for var, mask in pairs:
            raw = _raw(var)
            raw.assign(tf.where(mask, raw, tf.zeros_like(raw)))

    # -- canonical views for core math -----------------------------------------------------------------
    @property
    def layout_type(self) -> str:
        """The layer type core's layout is chosen by: the layer's, or :data:`~compressor.tf.layout.HEADS_VALUE`
        for a MultiHeadAttention value projection pruned by heads (config key ``heads_of``)."""
        return layout.HEADS_VALUE if "heads_of" in self.config else self.type

    def canonical(self, x: Any) -> Any:
        """A Keras-layout tensor of this layer's weight shape in core's layout (output channels first)."""
        return layout.to_canonical(self.layout_type, tf.convert_to_tensor(x))

    def from_canonical(self, x: Any, like: Any = None) -> Any:
        """Back from core's layout to the Keras layout of ``like`` (default: the main weight)."""
        return layout.from_canonical(self.layout_type, x, (self.weight if like is None else like).shape)

    def canonical_shape(self) -> tuple[int, ...]:
        """Shape of the main weight in core's layout (static; no read of the weight)."""
        return layout.canonical_shape(self.layout_type, self.weight.shape)

    def canonical_weight(self) -> Any:
        """The current main weight, in core's layout, without gradient."""
        return tf.stop_gradient(self.canonical(self.weight))

    def canonical_mask(self) -> Any:
        return self.canonical(self.weight_mask)

    # -- the call --------------------------------------------------------------------------------------
    def forward(self, call_fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.ready:
            self._ensure_ready()
        if self.ready and getattr(self.compressor, "mask_mode", "inplace") == "forward":
            mapping = [(self.weight, tf.where(self.weight_mask, self.weight, tf.zeros_like(self.weight)))]
            if self._has_bias_mask:
                mapping.append((self.bias, tf.where(self.bias_mask, self.bias, tf.zeros_like(self.bias))))
            return self.call_with_weights(call_fn, mapping, *args, **kwargs)
        return call_fn(*args, **kwargs)


PrunerModuleWrapper = PrunerLayerWrapper
