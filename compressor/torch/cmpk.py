"""Compressed model files on PyTorch: state_dict <-> :mod:`compressor.core.cmpk` (the format is core's).

* :func:`state_dict_arrays` -- ``{key: numpy array}`` of a state_dict, bit for bit (on the CPU);
* :func:`save_compressed` -- pack a state_dict (what ``pruner.export_model(..., compressed_path=...)`` does
  with the state_dict it writes to ``model_path``);
* :func:`load_compressed` -- load a compressed file into the ORIGINAL model class: every key, shape and
  dtype is checked against ``model.state_dict()`` before any weight is written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.cmpk import PackResult, fits_model, pack, unpack
from ..core.errors import CompressedFileError, ModelError

__all__ = ["load_compressed", "save_compressed", "state_dict_arrays"]


def state_dict_arrays(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The tensors of ``state`` as numpy arrays on the host (same dtype and bits; non-tensor entries are
    refused). bfloat16 has no numpy dtype: cast such a model to float32 first."""
    out: dict[str, np.ndarray] = {}
    for key, value in state.items():
        if not torch.is_tensor(value):
            raise ValueError(f"state_dict entry {key!r} is a {type(value).__name__}, not a tensor; only tensors are packed")
        if value.dtype == torch.bfloat16:
            raise ValueError(f"state_dict entry {key!r} is bfloat16, which numpy (and the compressed format) "
                             f"cannot hold; cast the model to float32 before exporting")
        out[key] = value.detach().cpu().contiguous().numpy()
    return out


def save_compressed(state: Mapping[str, Any], path: str | os.PathLike, codec: str = "auto") -> PackResult:
    """Pack a state_dict into the compressed file ``path`` (see :func:`compressor.core.cmpk.pack`)."""
    return pack(state_dict_arrays(state), path, codec=codec, backend="torch")


def load_compressed(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load the compressed file ``path`` (``export_model(..., compressed_path=...)``, ``compressor pack``)
    into ``model``, a plain instance of the model class it was exported from. Every key, shape and dtype
    in the file's header is checked against ``model.state_dict()`` before any tensor is decoded (so the
    model's own tensors bound what is decoded), then the whole file is decoded and checked; on any mismatch a
    :class:`~compressor.core.errors.CompressedFileError` is raised and the model is left untouched.
    Returns ``model``."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"load_compressed: model must be a torch.nn.Module, got {type(model).__name__}")
    target = model.state_dict()
    where = repr(os.fspath(path))
    wanted: dict[str, Any] = {}
    for key, have in target.items():
        if have.dtype == torch.bfloat16:
            raise CompressedFileError(f"{where}: the model's {key!r} is bfloat16, which the compressed format cannot "
                                      f"hold; load into a float32 instance of the model")
        wanted[key] = (tuple(have.shape), torch.empty(0, dtype=have.dtype).numpy().dtype)

    arrays = unpack(path, check=fits_model(wanted, where, type(model).__name__,
                                           "load it into a plain instance of the model class it was exported from"))
    state: dict[str, torch.Tensor] = {}
    for key, (_, want) in wanted.items():
        state[key] = torch.from_numpy(np.array(arrays[key], dtype=want, order="C"))  # (keeps 0-d arrays 0-d)
    _check_ties(target, state, where)
    model.load_state_dict(state, strict=True)
    return model


def _check_ties(target: dict[str, torch.Tensor], state: dict[str, torch.Tensor], where: str) -> None:
    """Keys the model ties (one tensor under two names: an LM head and its embedding) must hold one value in
    the file too; otherwise which one the model got would depend on the load order."""
    first: dict[tuple, str] = {}
    for key, have in target.items():
        if have.numel() == 0:
            continue
        tie = (have.untyped_storage().data_ptr(), have.storage_offset(), tuple(have.shape), tuple(have.stride()))
        other = first.setdefault(tie, key)
        if other != key and not torch.equal(state[other], state[key]):
            raise CompressedFileError(f"{where}: {other!r} and {key!r} are one tied tensor in the model but hold "
                                      f"different values in the file")
