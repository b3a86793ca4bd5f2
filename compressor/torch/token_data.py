"""The torch side of :mod:`compressor.core.token_data` for the streaming one-shot command: a Hugging Face
checkpoint's own tokenizer (``tokenizer.json``, read by the ``tokenizers`` package) to turn text
calibration data into token ids, and ``.pt`` token files written by ``torch.save``.

Typical use: ``calibration_tokens(data, num_samples=n, seq_len=L, tokenize=checkpoint_tokenizer(src_dir),
load_pt=load_token_file)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..core.errors import ConfigError
from ..core.token_data import check_token_array, check_token_layout

__all__ = ["checkpoint_tokenizer", "load_token_file"]

#: the file of a Hugging Face checkpoint holding its fast tokenizer
TOKENIZER_FILE = "tokenizer.json"


def checkpoint_tokenizer(src_dir: str | os.PathLike[str]) -> Callable[[str], list[int]] | None:
    """A function ``text -> token ids`` with the tokenizer of checkpoint ``src_dir`` (its ``tokenizer.json``),
    adding no special tokens (the ids are cut into calibration windows, where a BOS in the middle of a window
    would be noise); None when the checkpoint has no ``tokenizer.json``."""
    path = Path(src_dir) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(f"{os.fspath(path)!r}: reading the checkpoint's tokenizer needs the 'tokenizers' "
                          f"package (pip install tokenizers)") from None
    try:
        tokenizer = Tokenizer.from_file(os.fspath(path))
    except Exception as e:  # noqa: BLE001 - the package's errors are plain Exceptions
        raise ConfigError(f"{os.fspath(path)!r}: not a tokenizer file the 'tokenizers' package reads ({e})") from None

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return tokenize


def load_token_file(path: str | os.PathLike[str], what: str = "--data") -> np.ndarray:
    """The token ids of a ``.pt`` file written by ``torch.save``: an integer tensor ``[sequences, length]``
    (or a dict holding one under ``'input_ids'``), as numpy, memory-mapped where the file allows it. Read
    with ``weights_only=True`` (no code in the file runs); refused like a ``.npy`` array (core's checks: an
    integer dtype, two dimensions); the ids themselves are checked where they are cut
    (:func:`compressor.core.token_data.cut_token_array`)."""
    label = f"{what} {os.fspath(path)!r}"
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file of the legacy (not zip) format cannot be memory-mapped
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds (pickle, zip, weights_only refusals)
        raise ConfigError(f"{label}: not a tensor file torch.load reads with weights_only=True ({e})") from None
    if isinstance(obj, dict) and "input_ids" in obj:
        obj = obj["input_ids"]
    if not isinstance(obj, torch.Tensor):
        raise ConfigError(f"{label}: holds a {type(obj).__name__}, not a tensor of token ids [sequences, length] "
                          f"(or a dict with one under 'input_ids')")
    integer = not (obj.is_floating_point() or obj.is_complex() or obj.dtype == torch.bool)
    check_token_layout(str(obj.dtype).removeprefix("torch."), integer, obj.shape, source=path, what=what)
    array = obj.numpy()
    check_token_array(array, source=path, what=what)
    return array
