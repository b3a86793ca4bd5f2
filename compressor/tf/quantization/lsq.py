"""``LsqQuantizer``: learned step size quantization (Esser et al. 2020) on Keras 3.

Each quantized tensor of a layer gets a trainable step size ``<type>_scale``: a Keras variable attached
to the layer while the quantizer is installed, so it is in ``model.trainable_variables`` and whatever
trains the model (``fit``, a custom loop over ``model.trainable_variables``) updates it. Create the
optimizer's state after wrapping: a Keras optimizer that already ran ``apply`` on the model's old variable
list refuses new variables (the constructor refuses such an optimizer up front).

Forward ``round(clip(x / s, qmin, qmax)) * s`` (:func:`compressor.core.quant.lsq_quantize`) with the
paper's gradients: clipped STE for ``x``, the LSQ step-size gradient scaled by ``g = 1 / sqrt(N * qmax)``
(N: weight numel, or features per sample for activations). Range: ``quant_dtype`` 'int' (default; full
signed ``[-2^(b-1), 2^(b-1)-1]`` as in the paper) or 'uint' (``[0, 2^b-1]``, for non-negative
activations). Initial step: ``2 mean|x| / sqrt(qmax)`` from the kernel at construction and from the first
training batch for activations (in-graph). ``quant_grad`` is not used: LSQ's gradients are its own.
Under tf.distribute the activations' first-batch step size is averaged over the replicas (equal per-replica
batches: the global batch's value); that scalar all-reduce runs in every training step, since collectives
cannot sit in a ``tf.cond`` branch of a replica function.
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from ...core import quant as cq
from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ..distributed import all_reduce_mean
from ..ops import ops
from .quantizer import TfQuantizer, builtin_autograd
from .settings import QuantSpec, resolve_spec
from .wrapper import QuantizerLayerWrapper, _value

__all__ = ["LsqQuantizer"]


class LsqQuantizer(TfQuantizer):
    """Quantize with learned per-tensor step sizes."""

    config_keys = ("quant_dtype",)

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None) -> None:
        if optimizer is not None and getattr(optimizer, "built", False):
            raise ConfigError("LsqQuantizer: the optimizer has already been built for the model's variables and "
                              "cannot take the new step-size variables; pass a fresh optimizer (or None)")
        super().__init__(model, config_list, optimizer)

    def _spec(self, layer: Any, layer_type: str, name: str, config: dict[str, Any], t: str) -> QuantSpec:
        return resolve_spec(config, t, layer, layer_type, name, default_dtype="int", narrow=False, what="LsqQuantizer")

    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)
        for t in config["quant_types"]:
            self._spec(layer, layer_info.type, layer_info.name, config, t)

    def init_wrapper(self, wrapper: QuantizerLayerWrapper) -> None:
        specs = {}
        for t in wrapper.quant_types:
            spec = self._spec(wrapper.layer, wrapper.type, wrapper.name, wrapper.config, t)
            specs[t] = spec
            if t == "weight":
                init = cq.lsq_init_scale(ops, tf.convert_to_tensor(wrapper.weight), spec.qmax)
            else:
                init = tf.ones([])
                wrapper.add_state(f"{t}_observed", False, tf.bool)
            wrapper.add_layer_variable(f"{t}_scale", tf.cast(init, tf.float32))
            wrapper.add_state(f"{t}_zero_point", tf.zeros([]))
            wrapper.qranges[t] = (spec.qmin, spec.qmax)
        wrapper._setattr_raw("lsq_specs", specs)

    def scale_variables(self) -> list[Any]:
        """The learned step sizes of all layers (Keras variables)."""
        return [v for w in self.get_modules_wrapper() for v in w._layer_variables]

    def _lsq(self, t: str, x: tf.Tensor, wrapper: QuantizerLayerWrapper, numel: int) -> tf.Tensor:
        spec = wrapper.lsq_specs[t]
        scale = tf.cast(_value(getattr(wrapper, f"{t}_scale")), x.dtype)
        g = cq.lsq_grad_scale(numel, spec.qmax)
        return cq.lsq_quantize(ops, x, scale, spec.qmin, spec.qmax, g)

    @builtin_autograd
    def quantize_weight(self, weight: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        return self._lsq("weight", weight, wrapper, int(weight.shape.num_elements()))

    def _activation(self, t: str, x: tf.Tensor, wrapper: QuantizerLayerWrapper) -> tf.Tensor:
        training = wrapper.training
        if training is not None and training is not False:
            flag = getattr(wrapper, f"{t}_observed")
            raw = getattr(wrapper, f"{t}_scale")._value  # the backing tf.Variable: assign outside Keras scopes
            x32 = tf.stop_gradient(tf.cast(x, tf.float32))
            init = tf.cast(cq.lsq_init_scale(ops, x32, wrapper.lsq_specs[t].qmax), raw.dtype)
            if self.sync_ranks:  # every replica starts from the global batch's step size (a scalar all-reduce)
                (init,) = all_reduce_mean(init)
            first = tf.logical_and(tf.logical_not(flag.read_value()), tf.cast(training, tf.bool))
            with tf.control_dependencies([raw.assign(tf.where(first, init, raw.read_value())),
                                          flag.assign(tf.logical_or(flag.read_value(), first))]):
                x = tf.identity(x)
        per_sample = math.prod(int(d) if d is not None else 1 for d in x.shape[1:]) if x.shape.rank > 1 else \
            int(x.shape.num_elements() or 1)
        return self._lsq(t, x, wrapper, per_sample)

    @builtin_autograd
    def quantize_input(self, inputs: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        return self._activation("input", inputs, wrapper)

    @builtin_autograd
    def quantize_output(self, output: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        return self._activation("output", output, wrapper)
