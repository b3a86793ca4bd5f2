"""The model, mask and calibration files ``compressor report`` reads: the reader of a model file chosen by
its suffix (:mod:`.torch_files`, :mod:`.keras_files`, ``.npz``, :mod:`.onnx_files`, :mod:`.tflite_files`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ...core.errors import ConfigError, ModelError
from .keras_files import _read_keras
from .onnx_files import _read_onnx
from .tflite_files import _read_tflite
from .torch_files import TORCH_SUFFIXES, _from_state_dict, _to_numpy, _torch_load


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _check_file(path: str, what: str) -> str:
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise ConfigError(f"{what} {p!r} does not exist")
    return p


def _read_npz(path: str, what: str = "model file", error: type[Exception] = ModelError) -> dict[str, np.ndarray]:
    from ...core.npz import load_npz

    return load_npz(path, what, error)


def read_weights(path: str | os.PathLike) -> tuple[list[tuple[str, np.ndarray]], dict[str, np.ndarray]]:
    """``([(layer, weight array)], masks stored in the file)`` of an exported model file."""
    weights, masks, _ = read_weights_info(path)
    return weights, masks


def read_weights_info(path: str | os.PathLike) -> tuple[list[tuple[str, np.ndarray]], dict[str, np.ndarray],
                                                        dict[str, dict[str, Any]]]:
    """:func:`read_weights` plus ``{layer: {'mode', 'bits', 'group_size', 'bytes'}}`` of the Keras-quantized
    layers of a ``.keras`` file (``{}`` for other files), for :func:`layer_stats`'s ``quantized``."""
    p = _check_file(path, "model file")
    quantized: dict[str, dict[str, Any]] = {}
    suffix = _suffix(p)
    if suffix in TORCH_SUFFIXES:
        sd = _torch_load(p)
        if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
            sd = sd["state_dict"]  # common checkpoint layout {'state_dict': ..., 'epoch': ...}
        if not isinstance(sd, dict):
            raise ModelError(f"{p!r} holds a {type(sd).__name__}, not a state_dict")
        weights, masks = _from_state_dict(sd, p)
    elif suffix == ".keras":
        (weights, quantized), masks = _read_keras(p), {}
    elif suffix == ".npz":
        weights = [(k, v) for k, v in _read_npz(p).items() if np.issubdtype(v.dtype, np.floating)]
        masks = {}
    elif suffix == ".onnx":
        weights, masks = _read_onnx(p), {}
    elif suffix == ".tflite":
        weights, masks = _read_tflite(p), {}
    else:
        raise ModelError(f"{p!r}: unsupported model file type {suffix or '(none)'!r}; expected a torch state_dict "
                         f"(.pt/.pth), a Keras model (.keras), a .npz archive of weights, an ONNX model (.onnx) "
                         f"or a TFLite model (.tflite)")
    if not weights:
        raise ModelError(f"{p!r} holds no layer weights")
    return weights, masks, quantized


def read_masks(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Weight masks by layer name from a torch (``.pt``) or TF (``.npz``) mask file."""
    p = _check_file(path, "mask file")
    suffix = _suffix(p)
    if suffix in TORCH_SUFFIXES:
        raw = _torch_load(p)
        if not isinstance(raw, dict) or not all(isinstance(v, dict) and "weight" in v for v in raw.values()):
            raise ConfigError(f"{p!r} is not a mask file (expected {{layer: {{'weight': mask, 'bias': mask}}}})")
        return {k: _to_numpy(v["weight"]).astype(bool) for k, v in raw.items()}
    if suffix == ".npz":
        return {k: v.astype(bool) for k, v in _read_npz(p, "mask file", ConfigError).items() if not k.endswith(":bias")}
    raise ConfigError(f"{p!r}: unsupported mask file type {suffix or '(none)'!r}; expected .pt/.pth or .npz")


def read_calibration(path: str | os.PathLike) -> dict[str, int]:
    """Weight bit width by layer name from a quantizer's calibration export (``.pt`` or ``.json``)."""
    p = _check_file(path, "calibration file")
    if _suffix(p) == ".json":
        try:
            with open(p, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {p!r} as JSON ({e})") from None
    else:
        raw = _torch_load(p)
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ConfigError(f"{p!r} is not a calibration file (expected {{layer: {{'weight_bits': ..., ...}}}})")
    return {k: int(v["weight_bits"]) for k, v in raw.items() if "weight_bits" in v}
