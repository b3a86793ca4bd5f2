"""Compressed model files on Keras 3: model weights <-> :mod:`compressor.core.cmpk` (the format is core's).

Weights are named by their path in the model: ``<layer path>/<variable name>`` with layer paths as the TF
backend names layers (:func:`~compressor.tf.compressor.iter_layers`: ``block1/conv``), e.g. ``fc1/kernel``,
``bn/moving_mean``. (Keras' own ``Variable.path`` is not used: it carries the model's name on a built model
and not on the same model loaded from its ``.keras`` file, and drops nested models' names on reload.)

* :func:`model_arrays` -- ``{path: numpy array}`` of a model's weights (trainable and not, e.g. BN moving
  statistics), bit for bit;
* :func:`save_compressed` -- pack them (what ``pruner.export_model(..., compressed_path=...)`` does inside
  its export, on the plain model with masked weights);
* :func:`load_compressed` -- load a compressed file into the ORIGINAL model class: every name, shape and
  dtype is checked before any weight is assigned.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..core.cmpk import PackResult, fits_model, pack, unpack
from ..core.errors import ModelError

__all__ = ["load_compressed", "model_arrays", "save_compressed"]


def _variables(model: Any) -> dict[str, Any]:
    """``{name: variable}`` of every weight of ``model``, in ``model.weights`` order (see the module doc)."""
    from .compressor import iter_layers

    weights = getattr(model, "weights", None)
    if weights is None:
        raise ModelError(f"expected a Keras model or layer, got {type(model).__name__}")
    owner: dict[int, str] = {}
    for path, layer in iter_layers(model):
        for v in layer.weights:
            if len(path) > len(owner.get(id(v), "")) or id(v) not in owner:
                owner[id(v)] = path  # the deepest layer holding it
    out: dict[str, Any] = {}
    for v in weights:
        short = str(v.name).rsplit("/", 1)[-1].split(":")[0]
        name = f"{owner[id(v)]}/{short}" if id(v) in owner else (getattr(v, "path", None) or short)
        if name in out:
            raise ModelError(f"{type(model).__name__} has two weights named {name!r}; give its layers and "
                             f"variables unique names")
        out[name] = v
    return out


def model_arrays(model: Any) -> dict[str, np.ndarray]:
    """``{Keras weight path: numpy array}`` of every weight of ``model`` (host copies)."""
    return {path: np.asarray(v.numpy()) for path, v in _variables(model).items()}


def save_compressed(model: Any, path: str | os.PathLike, codec: str = "auto") -> PackResult:
    """Pack the weights of ``model`` into the compressed file ``path`` (see :func:`compressor.core.cmpk.pack`)."""
    return pack(model_arrays(model), path, codec=codec, backend="tf")


def load_compressed(model: Any, path: str | os.PathLike) -> Any:
    """Load the compressed file ``path`` into ``model``, a built instance of the model it was exported from.

    Weights are matched by name (``<layer path>/<variable>``). Every name, shape and dtype in the file's
    header is checked before any tensor is decoded (the model's weights bound what is decoded), then the
    whole file is decoded and checked; on any mismatch a :class:`~compressor.core.errors.CompressedFileError`
    is raised and no weight is changed. Returns ``model``.
    """
    variables = _variables(model)
    where = repr(os.fspath(path))
    wanted = {name: (tuple(int(d) for d in v.shape), np.dtype(str(v.dtype))) for name, v in variables.items()}

    arrays = unpack(path, check=fits_model(wanted, where, f"model {getattr(model, 'name', '?')!r}",
                                           "load it into a built instance of the model it was exported from"))
    todo = [(v, arrays[name].astype(wanted[name][1], copy=False)) for name, v in variables.items()]
    for v, arr in todo:
        v.assign(arr)
    return model
