"""Export and reload of pruned Keras models.

* :func:`export_pruned_model` -- with the instrumentation removed for the duration, saves the plain
  model (masked weights, the user's own layers and config, no compressor objects) as a ``.keras`` file
  and/or a SavedModel (``model.export``), the masks as ``.npz`` and/or a TFLite flatbuffer; all load
  without compressor installed. The pruner is reinstalled afterwards and keeps working.
* :func:`save_masks` / :func:`load_masks` -- ``.npz``: ``'<layer path>'`` -> weight mask and
  ``'<layer path>:bias'`` -> bias mask (bool, Keras layout).
* :func:`apply_compression_results` -- zero a (plain or wrapped) model's weights by a saved mask file.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any

import numpy as np
import tensorflow as tf

from ...core.atomic import atomic_path, atomic_paths
from ...core.errors import ConfigError
from ...core.npz import save_npz
from .. import layout
from ..compressor import iter_layers

__all__ = ["apply_compression_results", "export_pruned_model", "load_masks", "save_masks", "unwrapped"]

BIAS_SUFFIX = ":bias"


@contextmanager
def unwrapped(pruner: Any):
    """The pruner's model as a plain Keras model (masked weights) inside the block; reinstalled after."""
    with tf.init_scope():
        pruner.apply_masks()
    installed = [w for w in pruner.get_modules_wrapper() if w.installed]
    pruner._unwrap_model()
    try:
        yield pruner.model
    finally:
        for w in installed:
            w._install(pruner.wrapper_attr)
        pruner._retrace()


def save_masks(pruner: Any, mask_path: str) -> None:
    """Write the masks of ``pruner`` to ``mask_path`` (``.npz``)."""
    arrays: dict[str, np.ndarray] = {}
    for w in pruner.get_modules_wrapper():
        if not w.ready:
            continue
        arrays[w.name] = w.weight_mask.numpy()
        if w.bias_mask is not None:
            arrays[w.name + BIAS_SUFFIX] = w.bias_mask.numpy()
    with atomic_path(mask_path) as tmp:
        save_npz(tmp, arrays)  # not np.savez(**arrays): a layer named 'file' or 'allow_pickle' would break it


def load_masks(mask_path: str) -> dict[str, dict[str, np.ndarray]]:
    """``{layer path: {'weight': mask, 'bias': mask}}`` from a mask file (no pickle)."""
    from ...core.npz import load_npz

    out: dict[str, dict[str, np.ndarray]] = {}
    for key, value in load_npz(mask_path, "mask file", ConfigError).items():  # checked, never unpickled
        if key.endswith(BIAS_SUFFIX):
            out.setdefault(key[: -len(BIAS_SUFFIX)], {})["bias"] = value.astype(bool)
        else:
            out.setdefault(key, {})["weight"] = value.astype(bool)
    return out


def zero_masked(model: Any, masks: dict[str, dict[str, Any]], source: str = "masks") -> dict[str, Any]:
    """Zero the weights of ``model`` where ``masks`` (``{layer: {'weight': bool, 'bias': bool}}``, Keras
    layout) are False; every name and shape is checked before any weight changes. Returns the model's
    layers by name."""
    layers = dict(iter_layers(model))
    missing = sorted(n for n in masks if layout.resolve(layers, n) is None)
    if missing:
        raise ConfigError(f"{source} names layers the model does not have: {missing}")
    todo = []
    for name, m in masks.items():
        layer, slot = layout.resolve(layers, name)  # '<layer>/<slot>': a recurrent / attention matrix
        bias = layout.bias_of(layer) if slot is None else None
        for key, var in (("weight", layout.weight_of(layer, slot)), ("bias", bias)):
            if key not in m:
                continue
            if var is None or tuple(var.shape) != tuple(m[key].shape):
                raise ConfigError(f"{source}: {key} mask of {name!r} has shape {tuple(m[key].shape)}, the layer's "
                                  f"{key} is {None if var is None else tuple(var.shape)}")
            todo.append((var, m[key]))
    for var, m in todo:
        var.assign(tf.where(tf.constant(np.asarray(m, bool)), var, tf.zeros_like(var)))
    return layers


def apply_compression_results(model: Any, mask_path: str) -> dict[str, dict[str, np.ndarray]]:
    """Zero the weights of ``model`` (a plain or wrapped Keras model) where the saved masks are False."""
    masks = load_masks(mask_path)
    layers = zero_masked(model, masks, f"mask file {mask_path!r}")
    for name, m in masks.items():
        owners = [layout.resolve(layers, name), layout.slot_owner(layers, name)]  # a recurrent / attention matrix
        for w in [w for o in owners if o is not None for w in getattr(o[0], "__dict__", {}).values()
                  if getattr(w, "slot", None) == o[1]]:
            if hasattr(w, "set_masks") and getattr(w, "ready", False):
                w.set_masks({f"{k}_mask": v for k, v in m.items() if f"{k}_mask" in w.state_variables()})
    return masks


def export_pruned_model(pruner: Any, model_path: str | None = None, mask_path: str | None = None,
                        saved_model_path: str | None = None, tflite_path: str | None = None,
                        compressed_path: str | None = None) -> Any:
    """See :meth:`compressor.tf.TfPruner.export_model`."""
    if model_path is not None and not os.fspath(model_path).endswith(".keras"):
        raise ConfigError(f"model_path must end with '.keras' (Keras 3 format), got {model_path!r}")
    # all or nothing: every artifact goes to a temporary path, moved into place when all are written
    with atomic_paths(model_path, mask_path, saved_model_path, tflite_path, compressed_path, names=(
            "model_path", "mask_path", "saved_model_path", "tflite_path", "compressed_path")) as (
            tmp_model, tmp_masks, tmp_saved, tmp_tflite, tmp_packed):
        if tmp_masks is not None:
            save_masks(pruner, tmp_masks)
        with unwrapped(pruner) as model:
            if tmp_model is not None:
                model.save(tmp_model)
            if tmp_packed is not None:
                from ..cmpk import save_compressed

                save_compressed(model, tmp_packed)
            if tmp_saved is not None:
                model.export(tmp_saved, format="tf_saved_model", verbose=False)
            if tmp_tflite is not None:
                from ..tflite import convert_recurrent

                # recurrent layers convert unrolled (see compressor.tf.tflite)
                blob = convert_recurrent(model, lambda: tf.lite.TFLiteConverter.from_keras_model(model))
                if blob is None:
                    blob = tf.lite.TFLiteConverter.from_keras_model(model).convert()
                with open(tmp_tflite, "wb") as f:
                    f.write(blob)
    return pruner.model
