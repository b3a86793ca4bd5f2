"""Export of a quantized Keras model: plain Keras model with quantized float weights, calibration config
(JSON), TFLite.

* ``export_model`` saves the model with the wrappers taken out and every quantized kernel holding its
  quantized values (dequantized floats): a ``.keras`` file (``model.save``), a ``.weights.h5`` file
  (``save_weights``, for subclassed models) or a TF SavedModel directory (``model.export``). They load
  without compressor. The live model is restored afterwards (float kernels, still quantizing).
  ``quantizer.strip()`` does the same in place, for good.
* The calibration config maps layer name -> ``{'quant_types', 'module_type', '<type>_bits',
  '<type>_scale', '<type>_zero_point', '<type>_qmin', '<type>_qmax', 'tracked_min_<type>',
  'tracked_max_<type>'}`` exactly as the torch backend writes it (lists for per-channel schemes, in
  output-channel order, so a torch and a TF model of the same weights give the same file).
* TFLite: the exported (stripped) model goes through ``tf.lite.TFLiteConverter``; with a
  ``representative_dataset`` the result is full-integer int8 (TFLite calibrates the activation ranges on
  that data itself and re-quantizes the already-quantized weights per channel, which is lossless for
  int8 ``per_channel_symmetric`` weights); without one, a dynamic-range model with int8 weights.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import numpy as np
import tensorflow as tf

from ...core.atomic import atomic_paths
from ...core.calibration import (
    calibration_record,
    check_calibration_layers,
    check_calibration_type,
    loadable_keys,
)
from ...core.errors import ConfigError
from .wrapper import QuantizerLayerWrapper


def _host(v: Any) -> Any:
    return np.asarray(tf.convert_to_tensor(v).numpy(), dtype=np.float64).tolist()


def calibration_entry(wrapper: QuantizerLayerWrapper) -> dict[str, Any]:
    """Bits, scale, zero point, integer range and tracked ranges of every quant type of one layer."""

    def qparams(t: str) -> tuple[Any, Any, int, int] | None:
        qp = wrapper.qparams(t) if wrapper.ready else None
        if qp is None:
            return None
        s, z, qmin, qmax = qp
        return np.asarray(s.numpy(), np.float64), np.asarray(z.numpy(), np.float64), qmin, qmax

    def tracked(key: str) -> Any:
        v = wrapper.state_variables().get(key)
        return None if v is None else _host(v)

    return calibration_record(wrapper.quant_types, wrapper.type, wrapper.quant_bits, qparams, tracked)


def _save(model: Any, path: str) -> None:
    if path.endswith(".keras"):
        model.save(path)
    elif path.endswith(".weights.h5"):
        model.save_weights(path)
    else:
        model.export(path, format="tf_saved_model", verbose=False)


def _to_tflite(model: Any, path: str, representative_dataset: Any) -> None:
    from ..tflite import convert_recurrent  # recurrent layers convert unrolled (see compressor.tf.tflite)

    with tempfile.TemporaryDirectory() as d:
        def converter() -> Any:
            model.export(d, format="tf_saved_model", verbose=False)
            conv = tf.lite.TFLiteConverter.from_saved_model(d)
            conv.optimizations = [tf.lite.Optimize.DEFAULT]
            if representative_dataset is not None:
                conv.representative_dataset = representative_dataset
                conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
            return conv

        blob = convert_recurrent(model, converter, full_integer=representative_dataset is not None)
        if blob is None:
            blob = converter().convert()
    with open(path, "wb") as f:  # path: a temporary file of export_model's atomic_paths
        f.write(blob)


def export_model(quantizer: Any, model_path: str | os.PathLike | None = None,
                 calibration_path: str | os.PathLike | None = None, tflite_path: str | os.PathLike | None = None,
                 representative_dataset: Any = None, input_shape: tuple[int, ...] | None = None) -> dict[str, dict[str, Any]]:
    """See :meth:`TfQuantizer.export_model`."""
    model = quantizer.bound_model
    if input_shape is not None and not model.built:
        model.build(input_shape)
    wrappers: list[QuantizerLayerWrapper] = quantizer.get_modules_wrapper()
    exported = [(w, quantizer.export_weight(w)) for w in wrappers if "weight" in w.quant_types and w.ready]
    calibration = {w.name: quantizer.calibration(w) for w in wrappers}
    originals = [(w.weight, tf.identity(w.weight)) for w, _ in exported]
    # all or nothing: every artifact goes to a temporary path, moved into place when all are written
    with atomic_paths(model_path, calibration_path, tflite_path, names=("model_path", "calibration_path", "tflite_path")
                      ) as (tmp_model, tmp_calib, tmp_tflite):
        quantizer._unwrap_model()
        try:
            for w, value in exported:
                w.weight.assign(value)
            if tmp_model is not None:
                _save(model, tmp_model)
            if tmp_tflite is not None:
                _to_tflite(model, tmp_tflite, representative_dataset)
        finally:
            for var, value in originals:
                var.assign(value)
            quantizer._wrap_model()
        if tmp_calib is not None:
            with open(tmp_calib, "w", encoding="utf-8") as f:
                json.dump(calibration, f, indent=1)
    return calibration


def read_calibration(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Read a calibration config written by ``export_model`` (JSON)."""
    from ...core.atomic import recover_for_reading

    recover_for_reading(path)  # a killed export of this file: finished or undone before it is read
    with open(os.fspath(path), encoding="utf-8") as f:
        return json.load(f)


def load_calibration_config(quantizer: Any, calibration_config: Any) -> None:
    """Copy a calibration config into the wrappers; everything is checked before anything is written."""
    what = type(quantizer).__name__
    if isinstance(calibration_config, (str, os.PathLike)):
        calibration_config = read_calibration(calibration_config)
    wrappers = {w.name: w for w in quantizer.get_modules_wrapper()}
    check_calibration_layers(what, calibration_config, wrappers, "a dict {layer name: record} or a JSON path")
    plan: list[tuple[Any, Any]] = []
    flags: list[Any] = []
    frozen: list[QuantizerLayerWrapper] = []
    for name, entry in calibration_config.items():
        w = wrappers[name]
        if not isinstance(entry, dict):
            raise ConfigError(f"{what}: calibration record of {name!r} must be a dict, got {type(entry).__name__}")
        if not w.ready:
            raise ConfigError(f"{what}: layer {name!r} is not built yet; call the model once before loading calibration")
        state = w.state_variables()
        for t in w.quant_types:
            check_calibration_type(what, name, t, entry, w.quant_bits[t], w.qranges.get(t))
            for key in loadable_keys(t):
                if key not in entry:
                    continue
                target = state.get(key)
                if target is None:
                    target = getattr(w, key, None)  # a learned scale (Keras variable)
                if target is None or not hasattr(target, "assign"):
                    continue
                value = np.asarray(entry[key], dtype=np.float32)
                if tuple(value.shape) != tuple(target.shape):
                    raise ConfigError(f"{what}: layer {name!r}: calibration {key} has shape {tuple(value.shape)}, "
                                      f"expected {tuple(target.shape)}")
                plan.append((target, value))
            observed = state.get(f"{t}_observed")
            if observed is not None and f"{t}_scale" in entry:
                flags.append(observed)
        if "weight" in w.quant_types and "weight_scale" in entry:
            frozen.append(w)
    for target, value in plan:
        target.assign(value)
    for flag in flags:
        flag.assign(True)
    for w in frozen:
        w.frozen.assign(True)
    if frozen and not quantizer._any_frozen:
        quantizer._any_frozen = True
        quantizer._retrace()
