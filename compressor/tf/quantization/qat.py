"""``QAT_Quantizer``: quantization-aware training (Jacob et al. 2018) on Keras 3.

Mirror of the torch ``QAT_Quantizer`` (same keys, defaults, state names and math from core):

* weights: min/max of the current kernel at every call (per tensor, or per output channel = the last
  Keras kernel axis) -> scale/zero point (:func:`compressor.core.quant.qparams`), fake-quantized with
  TF's fused ``fake_quant_with_min_max_vars`` kernel where it fits (per tensor; per channel uses core's
  composed form, which is faster than TF's per-channel kernel: see :mod:`.fakequant`) and the clipped
  straight-through gradient of :class:`QuantGrad`;
* inputs/outputs: min/max tracked with an EMA (decay 0.99; the first observation seeds it) while
  training (``fit``, ``model(x, training=True)``, or a call without a ``training`` value under a
  recording gradient tape: see :func:`.wrapper.training_flag`); inference (``predict``, ``evaluate``,
  ``training=False``) uses the stored scale and zero point, and a layer never observed passes its
  activations through unchanged;
* ``quant_start_step``: until that many optimizer updates, tensors pass unchanged (ranges still tracked);
* keys ``quant_dtype`` ('int' | 'uint') and ``quant_scheme`` (per_tensor/per_channel x affine/symmetric),
  a value or a dict per quant type; defaults in :mod:`.settings` (uint, per_tensor_affine).

State per layer (``tf.Variable``s of the wrapper, saved with ``tf.train.Checkpoint(model=model)``):
``<type>_scale``, ``<type>_zero_point`` and for activations ``tracked_min_<type>``, ``tracked_max_<type>``,
``<type>_observed``. All updates are graph ops (``assign``), no host synchronisation.

Under tf.distribute (MirroredStrategy, MultiWorkerMirroredStrategy) each batch's activation min / max are
reduced over the replicas (MIN / MAX) before the EMA, so every replica tracks the global batch's ranges
(:mod:`compressor.tf.distributed`); weights are identical on all replicas, so their ranges are too.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...core import quant as cq
from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ..distributed import all_reduce_max, all_reduce_min
from ..ops import ops
from .fakequant import as_channels, fake_quant
from .quantizer import TfQuantizer
from .settings import QuantSpec, complete_spec, resolve_spec
from .wrapper import QuantizerLayerWrapper

__all__ = ["QAT_Quantizer"]


def _select(flag: Any, if_true: Any, if_false: Any) -> Any:
    """``if_true()`` or ``if_false()`` by a Python or tensor flag (``tf.cond`` for tensors)."""
    if isinstance(flag, (tf.Tensor, tf.Variable)):
        return tf.cond(tf.cast(flag, tf.bool), if_true, if_false)
    return if_true() if flag else if_false()


def _is_relu(layer: Any) -> bool:
    import keras

    if type(layer) is keras.layers.ReLU:
        cfg = layer.get_config()
        return cfg.get("max_value") is None and not cfg.get("negative_slope") and not cfg.get("threshold")
    if type(layer) is keras.layers.Activation:
        return getattr(layer.activation, "__name__", "") == "relu"
    return False


def feeds_only_relu(layer: Any) -> bool:
    """True when ``layer`` (called once, in a Functional / Sequential graph) feeds nothing but one ReLU
    (``keras.layers.ReLU()`` or ``Activation('relu')``); the torch backend's rule for ``fuse_relu``."""
    nodes = getattr(layer, "_outbound_nodes", [])
    if len(getattr(layer, "_inbound_nodes", [])) != 1 or len(nodes) != 1:
        return False
    return _is_relu(nodes[0].operation)


def _grid_preserving(layer: Any) -> bool:
    import keras

    L = keras.layers  # noqa: N806
    kinds = (L.MaxPooling1D, L.MaxPooling2D, L.MaxPooling3D, L.GlobalMaxPooling1D, L.GlobalMaxPooling2D,
             L.GlobalMaxPooling3D, L.Flatten, L.Reshape, L.Identity)
    return _is_relu(layer) or type(layer) in kinds


def input_source(layer: Any) -> Any:
    """The layer whose output reaches ``layer``'s (single) input through grid-preserving layers only (ReLU,
    max pooling, Flatten, Reshape, Identity), else None; the torch backend's rule for ``share_ranges``."""
    nodes = getattr(layer, "_inbound_nodes", [])
    while len(nodes) == 1 and len(nodes[0].parent_nodes) == 1:
        src = nodes[0].parent_nodes[0].operation
        if not _grid_preserving(src):
            return src
        nodes = getattr(src, "_inbound_nodes", [])
    return None


class QAT_Quantizer(TfQuantizer):  # noqa: N801  (NNI's public name)
    """Quantization-aware training with fake quantization of weights, inputs and outputs."""

    config_keys = ("quant_dtype", "quant_scheme")
    handles_start_step = True

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None,
                 ema_decay: float = 0.99, fuse_relu: bool = False) -> None:
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay!r}")
        if not isinstance(fuse_relu, bool):
            raise ConfigError(f"{type(self).__name__}: fuse_relu must be True or False, got {fuse_relu!r}")
        self.ema_decay = float(ema_decay)
        super().__init__(model, config_list, optimizer)
        if fuse_relu:
            for w in self.modules_wrapper:
                w._setattr_raw("fused_relu", "output" in w.quant_types and feeds_only_relu(w.layer))

    # ------------------------------------------------------------------ construction
    def _specs(self, layer: Any, layer_type: str, name: str, config: dict[str, Any]) -> dict[str, QuantSpec]:
        return {t: resolve_spec(config, t, layer, layer_type, name, what=type(self).__name__)
                for t in config["quant_types"]}

    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)
        self._specs(layer, layer_info.type, layer_info.name, config)

    def init_wrapper(self, wrapper: QuantizerLayerWrapper) -> None:
        specs = {t: complete_spec(s, wrapper.layer, wrapper.type)
                 for t, s in self._specs(wrapper.layer, wrapper.type, wrapper.name, wrapper.config).items()}
        wrapper._setattr_raw("qat_specs", specs)
        for t, spec in specs.items():
            shape = [] if spec.channels is None else [spec.channels]
            wrapper.add_state(f"{t}_scale", tf.ones(shape))
            wrapper.add_state(f"{t}_zero_point", tf.zeros(shape))
            if t != "weight":
                wrapper.add_state(f"tracked_min_{t}", tf.zeros(shape))
                wrapper.add_state(f"tracked_max_{t}", tf.zeros(shape))
                wrapper.add_state(f"{t}_observed", False, tf.bool)
            wrapper.qranges[t] = (spec.qmin, spec.qmax)

    # ------------------------------------------------------------------ quantization
    def quantize_weight(self, weight: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        spec = wrapper.qat_specs["weight"]
        view = as_channels(weight, wrapper.type)
        rmin, rmax = cq.minmax(ops, tf.stop_gradient(tf.cast(view, tf.float32)), spec.axis)
        scale, zp = cq.qparams(ops, rmin, rmax, spec.qmin, spec.qmax, spec.symmetric)
        if self._any_frozen:  # loaded calibration holds until the next optimizer update
            scale = tf.where(wrapper.frozen, wrapper.weight_scale, scale)
            zp = tf.where(wrapper.frozen, wrapper.weight_zero_point, zp)
        wrapper.weight_scale.assign(scale)
        wrapper.weight_zero_point.assign(zp)
        out = fake_quant(view, scale, zp, spec.qmin, spec.qmax, spec.axis, fused=self.fused)
        return tf.reshape(out, weight.shape) if view is not weight else out

    def quantize_input(self, inputs: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        return self._activation("input", inputs, wrapper)

    def quantize_output(self, output: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        return self._activation("output", output, wrapper)

    def _activation(self, t: str, x: tf.Tensor, wrapper: QuantizerLayerWrapper) -> tf.Tensor:
        spec = wrapper.qat_specs[t]
        axis = spec.axis
        scale_v, zp_v = getattr(wrapper, f"{t}_scale"), getattr(wrapper, f"{t}_zero_point")
        tmin, tmax = getattr(wrapper, f"tracked_min_{t}"), getattr(wrapper, f"tracked_max_{t}")
        observed = getattr(wrapper, f"{t}_observed")
        training = wrapper.training
        if training is not None and training is not False:
            # observed outside the cond: collectives cannot run in a cond branch of a replica function
            rmin, rmax = cq.minmax(ops, tf.stop_gradient(tf.cast(x, tf.float32)), axis)
            if self.sync_ranks:  # the global batch's range on every replica (no-op on one device)
                rmin, rmax = all_reduce_min(rmin), all_reduce_max(rmax)

        def train() -> tf.Tensor:
            seen = observed.read_value()
            new_min = tf.where(seen, cq.ema(ops, tmin.read_value(), rmin, self.ema_decay), rmin)
            new_max = tf.where(seen, cq.ema(ops, tmax.read_value(), rmax, self.ema_decay), rmax)
            s, z = cq.qparams(ops, new_min, new_max, spec.qmin, spec.qmax, spec.symmetric)
            with tf.control_dependencies([tmin.assign(new_min), tmax.assign(new_max), observed.assign(True),
                                          scale_v.assign(s), zp_v.assign(z)]):
                return fake_quant(x, s, z, spec.qmin, spec.qmax, axis, fused=self.fused)

        def infer() -> tf.Tensor:
            return tf.cond(observed.read_value(),
                           lambda: fake_quant(x, scale_v.read_value(), zp_v.read_value(), spec.qmin, spec.qmax, axis,
                                              fused=self.fused),
                           lambda: tf.identity(x))

        return _select(training, train, infer)
