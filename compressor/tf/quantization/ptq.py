"""``PtqQuantizer``: post-training quantization (calibration, no training) on Keras 3.

A :class:`~.qat.QAT_Quantizer` whose scales come from calibration instead of training; it reuses QAT's
wrappers, state variables (``<type>_scale``, ``<type>_zero_point``, ``tracked_min_<type>``,
``tracked_max_<type>``, ``<type>_observed``), fake quantization, calibration JSON and export.

* Defaults (unless ``quant_dtype`` / ``quant_scheme`` say otherwise): weights per-channel symmetric signed
  (int8: [-127, 127], one scale per output channel = the last Keras kernel axis), activations
  per-tensor affine unsigned (uint8: [0, 255]).
* :meth:`PtqQuantizer.calibrate` runs the model eagerly in inference mode (``training=False``) on
  calibration batches with quantization OFF (float activations, float weights); each quantized layer's
  input / output goes through an observer of :mod:`compressor.core.observers` (``observer='minmax'`` |
  ``'moving_average_minmax'`` | ``'percentile'`` | ``'mse'``); weights are observed once with a min/max
  observer (their qparams equal QAT's for the same kernel). Everything is computed first, then written
  into the wrapper state and frozen: from then on every call (also ``training=True``) uses the stored
  scales and zero points, weights included.
* ``bn_fold=True``: a ``BatchNormalization`` (channels-last, ``axis=-1``) whose only input is a
  weight-quantized Dense / Conv1D / Conv2D / Conv3D (channels_last) that has no other consumer is folded
  into that layer before calibration, in inference form: ``k' = k * gamma / sqrt(var + eps)`` per output
  channel, ``b' = (b - mean) * gamma / sqrt(var + eps) + beta``; the BN becomes the identity
  (``gamma=1, mean=0, var=1-eps``, ``beta=0``); a layer without bias keeps the shift in the BN's beta.
  Training the BN afterwards (moving statistics updates) undoes the folding: PTQ is for inference.
* Errors leave the model as it was: no batch -> ConfigError; a batch the model refuses -> ModelError
  naming the expected input shape; export before calibrate -> ConfigError naming ``calibrate()``.
* :meth:`PtqQuantizer.export_model` adds ``tflite_path``: a full-integer TFLite model (int8 weights and
  activations; ``inference_input_type`` / ``inference_output_type`` ``tf.int8`` or ``tf.float32``). The
  converter re-derives activation ranges on a representative dataset, by default the calibration batches
  (kept, at most ``keep_batches``), with min/max, which equals the ``'minmax'`` observer's ranges; weights
  hold their (already int8-grid) quantized values, which TFLite re-quantizes per channel losslessly.
  ``tflite_int8`` chooses which ops the .tflite runs in int8: ``'all'`` = every op the converter can
  (the converter's full-integer model); ``'kernels'`` = only the weighted kernels (Conv / Dense /
  EinsumDense, recurrent matmuls, embedding tables; :func:`compressor.tf.tflite.quantize_kernels`), every
  other op float, which is what the fake-quant model simulates; ``'auto'`` (default) = ``'kernels'`` for
  models with attention, layer / group normalization or recurrent layers (whose int8 softmax, norms and
  gates put the artifact 0.2 relative error away from the fake-quant model), ``'all'`` otherwise (CNNs:
  their int8 adds and pools cost < 0.05 and are faster). The ops kept float are reported (logger /
  stderr, see ``verbose``) and listed in :attr:`PtqQuantizer.tflite_float_ops`.
  ``strip_names=True`` (default) rewrites the converter's file smaller (:func:`compressor.tf.tflite.compact_tflite`:
  short internal tensor names, the input / output names and signatures stay; one table per distinct set of
  quantization parameters): an unrolled bidirectional GRU's int8 file had 85 KB of fused names and 60 KB of
  repeated per-channel parameters around 22 KB of int8 weights, and was larger than the float file.
  ``strip_names=False`` writes the converter's file as it is.
* ``activation='dynamic'`` (default ``'static'``; the torch backend's option of the same name, onnxruntime's
  ``quantize_dynamic``): no calibration data. :meth:`PtqQuantizer.calibrate` (no arguments; ``export_model``
  runs it if needed) folds BN and freezes the weights' per-channel int8 scales; the fake-quant model
  quantizes each quantized layer's input on every call over its own range, per row of the last axis
  (per sample for convs), as TFLite's dynamic-range (hybrid) kernels do, and leaves outputs float (an
  ``'output'`` quant type is not applied). The .tflite is the converter's dynamic-range model: int8 weights
  (per channel), float input / output and activations, every non-kernel op float. The converter keeps
  weights of fewer than 1024 elements float: those kernels are reported and listed in ``tflite_float_ops``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ...core.atomic import atomic_paths
from ...core.errors import ConfigError, ModelError
from ...core.observers import OBSERVERS, MinMaxObserver, Observer
from ..ops import ops
from .fakequant import as_channels, fake_quant
from .qat import QAT_Quantizer, input_source
from .settings import QuantSpec, resolve_spec
from .wrapper import QuantizerLayerWrapper

__all__ = ["PtqQuantizer"]

_log = logging.getLogger("compressor.tf.ptq")

_NO_DATA = "calibrate with at least one batch"
_FOLDABLE = ("Dense", "Conv1D", "Conv2D", "Conv3D")


#: values of ``PtqQuantizer(activation=...)`` (the torch backend's option of the same name)
ACTIVATION = ("static", "dynamic")
#: values of ``export_model(tflite_int8=...)``
TFLITE_INT8 = ("auto", "kernels", "all")
#: Keras layers whose TFLite lowering the converter would run in int8 without the fake-quant model simulating
#: it (softmax / score matmuls, normalization statistics, recurrent gates): 'auto' keeps those models' non-kernel
#: ops float
_FLOAT_LAYERS = ("MultiHeadAttention", "GroupedQueryAttention", "Attention", "AdditiveAttention",
                 "LayerNormalization", "GroupNormalization", "UnitNormalization", "RMSNormalization", "RNN",
                 "Bidirectional")

#: observers that clip outliers: their ranges reach a .tflite only through explicit clipping (see _to_tflite_clipped)
CLIPPING_OBSERVERS = ("percentile", "mse")


class PtqQuantizer(QAT_Quantizer):
    """Post-training quantization: ``PtqQuantizer(model, config_list).calibrate(data)``."""

    handles_start_step = False

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None,
                 observer: str = "minmax", percentile: float = 99.99, grid_size: int = 100, bn_fold: bool = True,
                 ema_decay: float = 0.99, batch_size: int = 32, keep_batches: int = 16,
                 fuse_relu: bool = True, share_ranges: bool = True, activation: str = "static") -> None:
        if activation not in ACTIVATION:
            raise ConfigError(f"PtqQuantizer: activation must be one of {list(ACTIVATION)}, got {activation!r}")
        if observer not in OBSERVERS:
            raise ConfigError(f"PtqQuantizer: unknown observer {observer!r}; allowed: {sorted(OBSERVERS)}")
        kw: dict[str, Any] = {}
        if observer == "percentile":
            kw["percentile"] = percentile
        elif observer == "mse":
            kw["grid_size"] = grid_size
        elif observer == "moving_average_minmax":
            kw["decay"] = ema_decay
        OBSERVERS[observer](ops, **kw)  # checks the arguments (ConfigError) before the model is touched
        if not isinstance(bn_fold, bool):
            raise ConfigError(f"PtqQuantizer: bn_fold must be True or False, got {bn_fold!r}")
        for name, v in (("batch_size", batch_size), ("keep_batches", keep_batches)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"PtqQuantizer: {name} must be a positive int, got {v!r}")
        self.observer = observer
        #: ``'static'`` (calibrated activation ranges, full-integer TFLite) or ``'dynamic'`` (see the module doc)
        self.activation = activation
        self._observer_kwargs = kw
        self.bn_fold = bn_fold
        self.batch_size = batch_size
        self.keep_batches = keep_batches
        self._calibrated = False
        self._clip_export = False
        self._observing: dict[tuple[str, str], Observer] | None = None
        self._samples: list[Any] = []
        self._folded: list[tuple[Any, Any]] = []
        #: ``{TFLite op: [layer names]}`` the last TFLite export kept float (``tflite_int8``); {} = none
        self.tflite_float_ops: dict[str, list[str]] = {}
        if not isinstance(share_ranges, bool):
            raise ConfigError(f"PtqQuantizer: share_ranges must be True or False, got {share_ranges!r}")
        self.share_ranges = share_ranges
        super().__init__(model, config_list, optimizer, ema_decay=ema_decay, fuse_relu=fuse_relu)

    def _substitute_layers(self, selected: list[tuple[Any, dict[str, Any]]], layers: list[Any],
                           by_name: dict[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
        """A selected ``MultiHeadAttention`` is quantized through its projections: its ``query`` / ``key`` /
        ``value`` / ``attention_output`` EinsumDense sub-layers are wrapped with its config (input, weight and
        output like a Dense; TFLite runs them as int8 FULLY_CONNECTED / BATCH_MATMUL). The attention
        scores and softmax stay the converter's. Needs a built layer (ConfigError otherwise)."""
        import keras

        chosen = {info.name for info, _ in selected}
        out: list[tuple[Any, dict[str, Any]]] = []
        for info, cfg in selected:
            layer = by_name[info.name]
            if not isinstance(layer, keras.layers.MultiHeadAttention):
                out.append((info, cfg))
                continue
            subs = [i for i in layers if i.name.startswith(info.name + "/") and i.type == "EinsumDense"]
            if not layer.built or not subs:
                raise ConfigError(f"{type(self).__name__}: layer {info.name!r} (MultiHeadAttention) is quantized "
                                  f"through its EinsumDense projections, which do not exist until it is built; "
                                  f"build the model first (call it on data or give it keras.Input)")
            out.extend((i, cfg) for i in subs if i.name not in chosen)
            chosen.update(i.name for i in subs)
        return super()._substitute_layers(out, layers, by_name)

    def shared_inputs(self) -> dict[str, str]:
        """``{layer: producer layer}`` for every layer whose quantized input reuses the producer's output
        scale and zero point (``share_ranges``; same rule as the torch backend)."""
        if not self.share_ranges or self.activation == "dynamic":
            return {}
        by_layer = {id(w.layer): w for w in self.modules_wrapper}
        out = {}
        for w in self.modules_wrapper:
            p = by_layer.get(id(input_source(w.layer)))
            if p is None or "input" not in w.qat_specs or "output" not in p.qat_specs:
                continue
            a, b = w.qat_specs["input"], p.qat_specs["output"]
            if (a.qmin, a.qmax, a.channels, b.channels) == (b.qmin, b.qmax, None, None):
                out[w.name] = p.name
        return out

    @property
    def calibrated(self) -> bool:
        return self._calibrated

    # ------------------------------------------------------------------ specs: PTQ defaults
    def _specs(self, layer: Any, layer_type: str, name: str, config: dict[str, Any]) -> dict[str, QuantSpec]:
        what = type(self).__name__
        out = {}
        for t in config["quant_types"]:
            if t == "weight":
                out[t] = resolve_spec(config, t, layer, layer_type, name, default_dtype="int",
                                      default_scheme="per_channel_symmetric", what=what)
            else:
                out[t] = resolve_spec(config, t, layer, layer_type, name, default_dtype="uint",
                                      default_scheme="per_tensor_affine", what=what)
        return out

    # ------------------------------------------------------------------ quantization (frozen)
    def quantize_weight(self, weight: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        if not self._calibrated or self._observing is not None:
            return tf.identity(weight)  # float model until calibrated, float weights while calibrating
        spec = wrapper.qat_specs["weight"]
        view = as_channels(weight, wrapper.type)
        out = fake_quant(view, wrapper.weight_scale.read_value(), wrapper.weight_zero_point.read_value(),
                         spec.qmin, spec.qmax, spec.axis, fused=self.fused)
        return tf.reshape(out, weight.shape) if view is not weight else out

    def _activation(self, t: str, x: tf.Tensor, wrapper: QuantizerLayerWrapper) -> tf.Tensor:
        if self.activation == "dynamic":  # inputs quantized per call, as the runtime does; outputs float
            if t != "input" or not self._calibrated:
                return tf.identity(x)
            return _dynamic_fake_quant(x, wrapper.qat_specs[t], _row_axes(wrapper.layer, x))
        if self._clip_export:  # TFLite export: the converter calibrates on clip(x) and finds our range
            scale = tf.reshape(getattr(wrapper, f"{t}_scale").read_value(), [])
            zp = tf.reshape(getattr(wrapper, f"{t}_zero_point").read_value(), [])
            spec = wrapper.qat_specs[t]
            return tf.clip_by_value(x, (spec.qmin - zp) * scale, (spec.qmax - zp) * scale)
        if self._observing is not None:
            if not tf.executing_eagerly():
                raise RuntimeError("PtqQuantizer: calibration observers run eagerly only")
            self._observing[(wrapper.name, t)].observe(tf.convert_to_tensor(x))
            return tf.identity(x)
        if not self._calibrated:
            return tf.identity(x)
        spec = wrapper.qat_specs[t]
        return fake_quant(x, getattr(wrapper, f"{t}_scale").read_value(),
                          getattr(wrapper, f"{t}_zero_point").read_value(), spec.qmin, spec.qmax, spec.axis,
                          fused=self.fused)

    # ------------------------------------------------------------------ calibration
    def _activation_observer(self, spec: QuantSpec) -> Observer:
        return OBSERVERS[self.observer].from_spec(ops, spec, **self._observer_kwargs)

    def _batches(self, data: Any, num_batches: int | None) -> Iterable[Any]:
        # the calibration data forms of every TF compressor (tensor, dict, (x, y), tf.data, iterables)
        from ..calibration_data import calibration_batches

        return calibration_batches(data, what="PtqQuantizer.calibrate", num_batches=num_batches,
                                   batch_size=self.batch_size, hint=_NO_DATA,
                                   n_inputs=len(getattr(self.bound_model, "inputs", None) or []) or 1)

    def _inputs_of(self, batch: Any) -> Any:
        """The model inputs of one batch: ``x`` of ``(x,)`` / ``(x, y)`` / ``(x, y, sample_weight)``; a dict
        (named inputs) or, for a model of k > 1 inputs, a list / tuple of k arrays as they are."""
        if isinstance(batch, dict) or not isinstance(batch, (tuple, list)) or _is_array(batch):
            return batch
        n_inputs = len(getattr(self.bound_model, "inputs", None) or [])
        if n_inputs > 1 and len(batch) == n_inputs and not isinstance(batch[0], (tuple, list, dict)):
            return list(batch)
        if len(batch) in (1, 2, 3):
            return batch[0]
        return batch

    def _expected_shape(self) -> Any:
        inputs = getattr(self.bound_model, "inputs", None)
        if inputs:
            return tuple(inputs[0].shape)
        return None

    def _check_batch(self, x: Any) -> Any:
        if isinstance(x, dict) or (isinstance(x, list) and len(getattr(self.bound_model, "inputs", None) or []) > 1
                                   and not _is_array(x)):
            items = x.items() if isinstance(x, dict) else enumerate(x)
            out = {k: self._check_tensor(v, f"input {k!r}") for k, v in items}
            return out if isinstance(x, dict) else [out[i] for i in range(len(x))]
        return self._check_tensor(x)

    def _check_tensor(self, x: Any, which: str | None = None) -> tf.Tensor:
        expected = self._expected_shape() if which is None else f"of every input ({which})"
        try:
            t = tf.convert_to_tensor(x)
        except (ValueError, TypeError) as e:
            raise ModelError(f"PtqQuantizer.calibrate: a batch could not be made a tensor (expected input shape "
                             f"{expected}): {e}") from None
        if not (t.dtype.is_floating or t.dtype.is_integer) or t.dtype.is_bool:
            raise ModelError(f"PtqQuantizer.calibrate: batch dtype {t.dtype.name} is not numeric (expected input "
                             f"shape {expected}, float)")
        if t.shape.rank == 0 or int(t.shape[0]) == 0:
            raise ConfigError(f"PtqQuantizer.calibrate: empty batch of shape {tuple(t.shape)}; {_NO_DATA}")
        if expected is not None and which is None:
            ok = len(expected) == t.shape.rank and all(e is None or e == int(d) for e, d in zip(expected, t.shape))
            if not ok:
                raise ModelError(f"PtqQuantizer.calibrate: batch of shape {tuple(t.shape)} does not fit the "
                                 f"model's expected input shape {expected}")
        return t

    def calibrate(self, data: Any = None, num_batches: int | None = None) -> PtqQuantizer:
        """Observe ``data`` (a ``tf.data.Dataset`` of ``x`` or ``(x, y)``, a numpy array batched by
        ``batch_size``, or an iterable of batches), at most ``num_batches`` batches; freeze scales and zero
        points into the wrappers (and fold BN first with ``bn_fold``). Returns self.
        ``activation='dynamic'``: no data is needed (nor read): BN is folded and the weights' scales frozen."""
        what = "PtqQuantizer.calibrate"
        if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(num_batches, int)
                                        or num_batches < 1):
            raise ConfigError(f"{what}: num_batches must be a positive int or None, got {num_batches!r}; {_NO_DATA}")
        wrappers = [w for w in self.modules_wrapper if w.ready]
        if len(wrappers) != len(self.modules_wrapper):
            raise ConfigError(f"{what}: build the model (call it once) before calibrating")
        dynamic = self.activation == "dynamic"
        batches = [] if dynamic else self._batches(data, num_batches)
        fold = self._fold_plan() if self.bn_fold and not self._folded else []
        backup = [(v, tf.identity(v)) for var_vals in fold for v, _ in var_vals]
        observers: dict[tuple[str, str], Observer] = {}
        for w in wrappers:
            for t in w.quant_types:
                if t != "weight" and not dynamic:
                    observers[(w.name, t)] = self._activation_observer(w.qat_specs[t])
        samples: list[Any] = []
        writes: list[tuple[Any, Any]] = []
        try:
            for var_vals in fold:
                for var, value in var_vals:
                    var.assign(value)
            self._observing = observers
            seen = 0
            for batch in batches:
                x = self._check_batch(batch)
                try:
                    self.bound_model(x, training=False)
                except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
                    desc = keras.tree.map_structure(lambda t: f"{tuple(t.shape)} {t.dtype.name}", x)
                    raise ModelError(f"{what}: the model refused a batch of shape / dtype {desc} (expected input "
                                     f"shape {self._expected_shape()}): {e}") from None
                seen += 1
                if len(samples) < self.keep_batches:  # each input keeps its dtype (token ids stay int32)
                    samples.append(keras.tree.map_structure(lambda t: t.numpy(), x))
            if seen == 0 and not dynamic:
                raise ConfigError(f"{what}: no batch in the data; {_NO_DATA}")
            self._observing = None
            values: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
            for w in wrappers:
                for t in w.quant_types:
                    if t == "weight":
                        spec = w.qat_specs["weight"]
                        obs = MinMaxObserver.from_spec(ops, spec)
                        obs.observe(as_channels(tf.convert_to_tensor(w.weight), w.type))
                        rng = None
                    elif dynamic:  # measured on every call
                        continue
                    else:
                        obs = observers[(w.name, t)]
                        rng = obs.range()
                    s, z = obs.qparams()
                    values[(w.name, t)] = (s, z, rng)
            for name, src in self.shared_inputs().items():  # one grid per tensor
                values[(name, "input")] = values[(src, "output")]
            for w in wrappers:
                for t in w.quant_types:
                    if (w.name, t) not in values:
                        continue
                    s, z, rng = values[(w.name, t)]
                    if rng is not None:
                        writes += [(getattr(w, f"tracked_min_{t}"), rng[0]), (getattr(w, f"tracked_max_{t}"), rng[1]),
                                   (getattr(w, f"{t}_observed"), True)]
                    writes += [(getattr(w, f"{t}_scale"), s), (getattr(w, f"{t}_zero_point"), z)]
                writes.append((w.frozen, True))
        except BaseException:
            self._observing = None
            for var, value in backup:
                var.assign(value)
            raise
        for var, value in writes:
            var.assign(tf.cast(tf.reshape(tf.convert_to_tensor(value), var.shape), var.dtype))
        if fold:
            self._folded = [(bn, conv) for bn, conv in self._fold_pairs()]
        self._samples = samples
        self._calibrated = True
        self._retrace()
        return self

    # ------------------------------------------------------------------ BN folding
    def _fold_pairs(self) -> list[tuple[Any, Any]]:
        """(bn, layer) pairs: a BN whose only input is a weight-quantized foldable layer with no other consumer."""
        import keras

        quantized = {id(w.layer): w for w in self.modules_wrapper if "weight" in w.quant_types and w.ready}
        layers = getattr(self.bound_model, "layers", [])
        pairs = []
        for bn in layers:
            if not isinstance(bn, keras.layers.BatchNormalization):
                continue
            nodes = getattr(bn, "_inbound_nodes", [])
            if len(nodes) != 1 or len(nodes[0].parent_nodes) != 1:
                continue
            prod = nodes[0].parent_nodes[0].operation
            if id(prod) not in quantized or type(prod).__name__ not in _FOLDABLE:
                continue
            if getattr(prod, "data_format", "channels_last") != "channels_last":
                continue
            if len(getattr(prod, "_outbound_nodes", [])) != 1 or len(getattr(prod, "_inbound_nodes", [])) != 1:
                continue
            if not bn.center or not bn.scale or not _is_last_axis(bn.axis, len(bn.moving_mean.shape), prod):
                continue
            pairs.append((bn, prod))
        return pairs

    def _fold_plan(self) -> list[list[tuple[Any, Any]]]:
        """For each pair, ``[(variable, new value), ...]`` (computed, nothing written)."""
        plan = []
        for bn, conv in self._fold_pairs():
            eps = float(bn.epsilon)
            gamma, beta = bn.gamma.numpy().astype(np.float64), bn.beta.numpy().astype(np.float64)
            mean, var = bn.moving_mean.numpy().astype(np.float64), bn.moving_variance.numpy().astype(np.float64)
            factor = gamma / np.sqrt(var + eps)
            kernel = conv.kernel.numpy().astype(np.float64) * factor  # output channels on the last axis
            bias = getattr(conv, "bias", None)
            shift = beta - mean * factor
            entries = [(conv.kernel, kernel.astype(np.float32))]
            if bias is not None:
                entries.append((bias, (bias.numpy().astype(np.float64) * factor + shift).astype(np.float32)))
                new_beta = np.zeros_like(beta)
            else:
                new_beta = shift
            c = gamma.shape
            entries += [(bn.gamma, np.ones(c, np.float32)), (bn.beta, new_beta.astype(np.float32)),
                        (bn.moving_mean, np.zeros(c, np.float32)),
                        (bn.moving_variance, np.full(c, 1.0 - eps, np.float32))]
            plan.append(entries)
        return plan

    @property
    def folded(self) -> list[tuple[str, str]]:
        """``(bn layer name, folded-into layer name)`` of each folded BatchNormalization."""
        return [(bn.name, conv.name) for bn, conv in self._folded]

    # ------------------------------------------------------------------ state loading / export
    def load_calibration_config(self, calibration_config: Any) -> None:
        """Load a calibration (see QAT); the quantizer counts as calibrated afterwards."""
        super().load_calibration_config(calibration_config)
        self._calibrated = True
        self._retrace()

    def _require_calibrated(self, what: str) -> None:
        if not self._calibrated:
            raise ConfigError(f"PtqQuantizer.{what}: the quantizer is not calibrated; call calibrate(data) (or "
                              f"load_calibration_config) first")

    def export_model(self, model_path: str | os.PathLike | None = None, calibration_path: str | os.PathLike | None = None,
                     tflite_path: str | os.PathLike | None = None, representative_dataset: Any = None,
                     input_shape: tuple[int, ...] | None = None, inference_input_type: Any = tf.float32,
                     inference_output_type: Any = tf.float32, verbose: bool = True,
                     tflite_int8: str = "auto", strip_names: bool = True) -> dict[str, dict[str, Any]]:
        """QAT's export (plain Keras model with quantized weights, calibration JSON) and, with
        ``tflite_path``, a full-integer int8 TFLite model (input/output ``tf.int8`` or ``tf.float32``;
        ``tflite_int8``: ``'auto'`` | ``'kernels'`` | ``'all'``, which ops run in int8, see the module doc;
        ``strip_names``: compact the file, see the module doc).
        The TFLite conversion takes tens of seconds on real models: a line before and after it (with the
        time) goes to the ``compressor.tf.ptq`` logger at INFO, and, with ``verbose`` and nobody listening
        to that logger, to stderr.
        ``representative_dataset`` defaults to the calibration batches kept by :meth:`calibrate`.
        ``activation='dynamic'``: no calibration needed (``calibrate()`` runs first if it has not), the .tflite is
        the converter's dynamic-range model (float input / output; ``tflite_int8`` and the representative data
        do not apply)."""
        dynamic = self.activation == "dynamic"
        if not dynamic:
            self._require_calibrated("export_model")
        for name, t in (("inference_input_type", inference_input_type), ("inference_output_type", inference_output_type)):
            if t not in (tf.int8, tf.float32, tf.uint8):
                raise ConfigError(f"PtqQuantizer.export_model: {name} must be tf.int8, tf.uint8 or tf.float32, got {t!r}")
            if dynamic and t != tf.float32:
                raise ConfigError(f"PtqQuantizer.export_model: {name} must be tf.float32 with activation='dynamic' "
                                  f"(a dynamic-range .tflite takes and returns float), got {t!r}; "
                                  f"activation='static' exports int8 input / output")
        if tflite_int8 not in TFLITE_INT8:
            raise ConfigError(f"PtqQuantizer.export_model: tflite_int8 must be one of {list(TFLITE_INT8)}, got "
                              f"{tflite_int8!r}")
        if dynamic and tflite_int8 != "auto":
            raise ConfigError(f"PtqQuantizer.export_model: tflite_int8={tflite_int8!r} chooses the int8 ops of a "
                              f"full-integer .tflite (activation='static'); with activation='dynamic' every weighted "
                              f"kernel runs int8 on activations quantized at run time: leave tflite_int8 out")
        if not isinstance(strip_names, bool):
            raise ConfigError(f"PtqQuantizer.export_model: strip_names must be True or False, got {strip_names!r}")
        rep = None
        if dynamic and not self._calibrated:
            self.calibrate()
        if tflite_path is not None and not dynamic:
            rep = representative_dataset if representative_dataset is not None else self._representative()
            if rep is None:
                raise ConfigError("PtqQuantizer.export_model: no representative data for TFLite (calibration "
                                  "batches were not kept, e.g. after load_calibration_config); pass "
                                  "representative_dataset")
        # all or nothing: temporary paths, moved into place when every artifact is written
        with atomic_paths(model_path, calibration_path, tflite_path, names=(
                "model_path", "calibration_path", "tflite_path")) as (tmp_model, tmp_calib, tmp_tflite):
            calibration = super().export_model(tmp_model, tmp_calib, None, None, input_shape)
            if tmp_tflite is not None:
                self._verbose = verbose
                self._tflite_int8 = tflite_int8
                self._strip_names = bool(strip_names)
                self._to_tflite(tmp_tflite, rep, inference_input_type, inference_output_type)
        return calibration

    def _representative(self) -> Any:
        if not self._samples:
            return None
        samples = list(self._samples)

        def gen() -> Any:
            for batch in samples:
                if isinstance(batch, dict):  # named inputs: the converter matches them by name
                    for i in range(int(next(iter(batch.values())).shape[0])):
                        yield {k: v[i:i + 1] for k, v in batch.items()}
                    continue
                parts = batch if isinstance(batch, list) else [batch]
                for i in range(parts[0].shape[0]):
                    yield [p[i:i + 1] for p in parts]

        return gen

    def _to_tflite(self, path: str, representative_dataset: Any, in_type: Any, out_type: Any) -> None:
        if self.observer in CLIPPING_OBSERVERS and self.activation == "static":
            return self._to_tflite_clipped(path, representative_dataset, in_type, out_type)
        wrappers = self.get_modules_wrapper()
        exported = [(w, self.export_weight(w)) for w in wrappers if "weight" in w.quant_types and w.ready]
        originals = [(w.weight, tf.identity(w.weight)) for w, _ in exported]
        self._unwrap_model()
        try:
            for w, value in exported:
                w.weight.assign(value)
            with tempfile.TemporaryDirectory() as d:
                if self.activation == "dynamic":
                    blob, self.tflite_float_ops = _convert_dynamic(self.bound_model, d, getattr(self, "_verbose", True),
                                                                   [w.name.split("/")[0] for w, _ in exported])
                else:
                    blob, self.tflite_float_ops = _convert(self.bound_model, d, representative_dataset, in_type,
                                                           out_type, getattr(self, "_verbose", True),
                                                           getattr(self, "_tflite_int8", "auto"))
        finally:
            for var, value in originals:
                var.assign(value)
            self._wrap_model()
        self._write_tflite(path, blob)

    def _write_tflite(self, path: str, blob: bytes) -> None:
        if getattr(self, "_strip_names", True):
            from ..tflite import compact_tflite

            blob = compact_tflite(blob)
        with open(path, "wb") as f:
            f.write(blob)

    def _to_tflite_clipped(self, path: str, representative_dataset: Any, in_type: Any, out_type: Any) -> None:
        """The converter re-derives every activation range as the min/max it sees on the representative data,
        which would undo a percentile / MSE observer's clipping. So the model is exported with each quantized
        activation clipped to the range we chose (``clip(x, (qmin - zp) * s, (qmax - zp) * s)``, our grid's
        ends) and weights on their grid: the converter then finds exactly our ranges. Costs a MINIMUM /
        MAXIMUM pair per quantized activation in the .tflite (what the clipping is)."""
        self._clip_export = True
        self._retrace()
        try:
            with tempfile.TemporaryDirectory() as d:
                blob, self.tflite_float_ops = _convert(self.bound_model, d, representative_dataset, in_type, out_type,
                                                       getattr(self, "_verbose", True),
                                                       getattr(self, "_tflite_int8", "auto"))
        finally:
            self._clip_export = False
            self._retrace()
        self._write_tflite(path, blob)


@contextmanager
def _unrolled(model: Any) -> Iterator[None]:
    """Within the block, the recurrent layers of ``model`` (also those inside ``Bidirectional``) run unrolled:
    TFLite's int8 calibrator crashes on the while loop of a Keras 3 LSTM / GRU, the unrolled steps are plain
    FULLY_CONNECTED ops (int8) and gates. The batch stays dynamic (the zero initial state is built from the
    input's batch size). Needs a fixed sequence length (a ConfigError names the layers otherwise)."""
    from ..tflite import _variable_length, recurrent_layers, unrolled

    rnns = [layer for _, layer in recurrent_layers(model) if not layer.unroll]
    dynamic = _variable_length(model) if rnns else []
    if dynamic:
        raise ConfigError(f"PtqQuantizer.export_model: recurrent layers {dynamic} run over a sequence of unknown "
                          f"length; the full-integer TFLite export unrolls them and needs a fixed length: give the "
                          f"model keras.Input((length, ...))")
    with unrolled(rnns):
        yield


def _all_layers(model: Any) -> list[Any]:
    out, stack = [], list(getattr(model, "layers", []))
    while stack:
        layer = stack.pop()
        out.append(layer)
        stack.extend(getattr(layer, "layers", []) or [])
    return out


def _say(verbose: bool, msg: str, *args: Any) -> None:
    if _log.isEnabledFor(logging.INFO):
        _log.info(msg, *args)
    elif verbose:
        print(msg % args, file=sys.stderr, flush=True)


def _convert(model: Any, workdir: str, representative_dataset: Any, in_type: Any, out_type: Any,
             verbose: bool = True, int8: str = "all") -> tuple[bytes, dict[str, list[str]]]:
    """Saved model in ``workdir`` -> full-integer TFLite flatbuffer and ``{op: [layers]}`` kept float
    (``int8``: see ``PtqQuantizer.export_model``). Says when the conversion starts, how long it took (tens
    of seconds on real models) and which ops stay float, and why."""
    import time

    from ..tflite import quantize_kernels

    t0 = time.perf_counter()
    _say(verbose, "PtqQuantizer: converting %r to full-integer TFLite ...", getattr(model, "name", "model"))
    with _unrolled(model):
        model.export(workdir, format="tf_saved_model", verbose=False)
    converter = _converter(workdir, representative_dataset, in_type, out_type)
    why = _float_reason(model) if int8 == "auto" else "tflite_int8='kernels'" if int8 == "kernels" else None
    kept: dict[str, list[str]] = {}
    if why is None:
        blob = converter.convert()
    else:
        blob, kept = quantize_kernels(converter, in_type, out_type, [la.name for la in _all_layers(model)])
        if kept:
            ops = "; ".join(f"{op} ({', '.join(layers)})" for op, layers in sorted(kept.items()))
            _say(verbose, "PtqQuantizer: the TFLite model runs the Conv / Dense / EinsumDense / recurrent kernels "
                 "in int8 and keeps float: %s. Why: %s; the fake-quant model quantizes only the inputs, weights and "
                 "outputs of its quantized layers, and int8 versions of these ops would add errors it does not "
                 "simulate. export_model(tflite_int8='all') converts them to int8 too", ops, why)
    _say(verbose, "PtqQuantizer: TFLite conversion done in %.1f s (%d bytes)", time.perf_counter() - t0, len(blob))
    return blob, kept


def _convert_dynamic(model: Any, workdir: str, verbose: bool, quantized: list[str]) -> tuple[bytes, dict[str, list[str]]]:
    """Saved model in ``workdir`` -> the converter's dynamic-range TFLite flatbuffer (int8 weights, activations
    quantized at run time by the hybrid kernels, float everywhere else) and ``{op: [layers]}`` of the weighted
    kernels of ``quantized`` layers it kept float: the converter leaves weights of fewer than 1024 elements float."""
    import time

    from ..tflite import convert_recurrent

    t0 = time.perf_counter()
    _say(verbose, "PtqQuantizer: converting %r to dynamic-range int8 TFLite ...", getattr(model, "name", "model"))

    def converter() -> Any:
        model.export(workdir, format="tf_saved_model", verbose=False)
        conv = tf.lite.TFLiteConverter.from_saved_model(workdir)
        conv.optimizations = [tf.lite.Optimize.DEFAULT]
        return conv

    blob = convert_recurrent(model, converter, full_integer=False)
    if blob is None:
        blob = converter().convert()
    kept = _float_kernels(blob, quantized, [la.name for la in _all_layers(model)])
    extra = _float_kernels(blob, quantized, [la.name for la in _all_layers(model)], outside=True)
    if extra:
        import warnings

        warnings.warn(
            "PtqQuantizer(activation='dynamic'): the TFLite converter's dynamic-range mode also stored int8 weights "
            "for layers the config does not quantize (it quantizes every weight of at least 1024 elements and has "
            "no per-layer switch): " + "; ".join(f"{op} ({', '.join(layers)})" for op, layers in sorted(extra.items()))
            + ". Use activation='static' (full integer, per-layer) to keep them float", UserWarning, stacklevel=4)
    if kept:
        _say(verbose, "PtqQuantizer: the dynamic-range TFLite model keeps the weights of %s float (the converter "
             "quantizes weights of at least 1024 elements)",
             "; ".join(f"{op} ({', '.join(layers)})" for op, layers in sorted(kept.items())))
    _say(verbose, "PtqQuantizer: TFLite conversion done in %.1f s (%d bytes)", time.perf_counter() - t0, len(blob))
    return blob, kept


def _float_kernels(blob: bytes, quantized: list[str], layer_names: list[str],
                   outside: bool = False) -> dict[str, list[str]]:
    """``{op: [layers]}``: weighted kernels (an operand constant) of the ``quantized`` layers whose weight is float;
    with ``outside=True`` instead the kernels of the other layers whose weight is int8 (quantized anyway)."""
    import warnings

    from ..tflite import KERNEL_OPS, _layer_of

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the interpreter's deprecation notice
        interp = tf.lite.Interpreter(model_content=blob)
    details = {t["index"]: t for t in interp.get_tensor_details()}
    ops_ = interp._get_ops_details()
    variable = {i for op in ops_ for i in op["outputs"]} | {d["index"] for d in interp.get_input_details()}
    names, wanted = set(layer_names), set(quantized)
    kept: dict[str, list[str]] = {}
    for op in ops_:
        if op["op_name"] not in KERNEL_OPS or op["op_name"] == "GATHER":
            continue
        weights = [i for i in op["inputs"][:2] if i >= 0 and i not in variable]
        if not weights or details[weights[0]]["dtype"] != (np.int8 if outside else np.float32):
            continue
        layer = _layer_of(details[weights[0]]["name"], names)  # the weight keeps its layer's scope, an output
        if layer not in (names if outside else wanted):            # of the model its signature name
            layer = _layer_of(details[op["outputs"][0]]["name"], names)
        if outside:
            if layer in names and layer not in wanted and layer not in kept.setdefault(op["op_name"], []):
                kept[op["op_name"]].append(layer)
        elif layer in wanted and layer not in kept.setdefault(op["op_name"], []):
            kept[op["op_name"]].append(layer)
    return {k: v for k, v in kept.items() if v}


def _row_axes(layer: Any, x: Any) -> list[int]:
    """The axes of ``layer``'s input that one row of its TFLite kernel spans: the contracted axes of an
    EinsumDense (``'abcd,cde->abe'``: c, d), the last axis of a Dense, every axis but the batch of a conv."""
    rank = len(x.shape)
    equation = getattr(layer, "equation", None)
    if isinstance(equation, str) and "->" in equation and "," in equation:
        inp, rest = equation.replace(" ", "").split(",", 1)
        out = rest.split("->")[1]
        if "." not in inp and len(inp) == rank:
            axes = [i for i, c in enumerate(inp) if c not in out]
            if axes:
                return axes
    if "Conv" in type(layer).__name__:
        return list(range(1, rank))
    return [rank - 1]


def _dynamic_fake_quant(x: tf.Tensor, spec: QuantSpec, axes: list[int]) -> tf.Tensor:
    """``x`` on the grid TFLite's dynamic-range (hybrid) kernels quantize it to at run time: affine over its own
    min / max (0 included) per row (``axes``: the axes a row spans, see :func:`_row_axes`)."""
    from ...core import quant as cq

    x = tf.convert_to_tensor(x)
    lo, hi = tf.reduce_min(x, axis=axes, keepdims=True), tf.reduce_max(x, axis=axes, keepdims=True)
    scale, zp = cq.qparams(ops, lo, hi, spec.qmin, spec.qmax)
    return cq.fake_quantize(ops, x, scale, zp, spec.qmin, spec.qmax)


def _float_reason(model: Any) -> str | None:
    """Why 'auto' keeps a model's non-kernel ops float (the layers that need it), or None: all int8."""
    import keras

    kinds = tuple(getattr(keras.layers, k) for k in _FLOAT_LAYERS if hasattr(keras.layers, k))
    found = [la.name for la in _all_layers(model) if isinstance(la, kinds)]
    if not found:
        return None
    return (f"tflite_int8='auto' and the model has attention / normalization / recurrent layers "
            f"({', '.join(sorted(found)[:6])}{' ...' if len(found) > 6 else ''})")


def _converter(saved_model: str, representative_dataset: Any, in_type: Any, out_type: Any) -> Any:
    conv = tf.lite.TFLiteConverter.from_saved_model(saved_model)
    conv.optimizations = [tf.lite.Optimize.DEFAULT]
    conv.representative_dataset = representative_dataset
    conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    conv.inference_input_type = in_type
    conv.inference_output_type = out_type
    return conv


def _is_array(batch: Any) -> bool:
    """A list/tuple that is itself one batch of numbers (nested lists), not ``(x, y)``."""
    try:
        first = batch[0]
    except (IndexError, TypeError):
        return False
    return isinstance(first, (int, float, np.number))


def _is_last_axis(axis: Any, _: int, prod: Any) -> bool:
    """Whether a BN's axis is the channels-last axis of its producer's output."""
    if isinstance(axis, (list, tuple)):
        if len(axis) != 1:
            return False
        axis = axis[0]
    try:
        ndim = len(prod.output.shape)
    except (AttributeError, ValueError):
        return axis == -1
    return int(axis) in (-1, ndim - 1)
