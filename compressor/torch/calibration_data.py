"""Calibration data in the forms PyTorch users hold (a tensor of token ids, a tuple of positional inputs, a dict /
``BatchEncoding`` of keyword inputs, or a DataLoader / list / iterable of those), as model-input batches on the
model's device: what the one-shot compressors and post-training quantization calibrate on."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..core.errors import ConfigError, ModelError

_FORMS = ("a tensor, a tuple of positional inputs, a dict of keyword inputs (Hugging Face BatchEncoding), or "
          "a DataLoader / list / iterable of those")


def forward_inputs(batch: Any, i: int, what: str, positional: int | None = None,
                   expected: str | None = None) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of the model's forward for one calibration batch.

    A tensor is the one positional input; a Mapping (dict, Hugging Face ``BatchEncoding``) holds keyword
    inputs. A tuple / list: with ``positional=None`` all its elements are positional inputs; with
    ``positional=1`` it is ``(inputs, *targets)`` -- its first element is the input (a tensor, a dict, or a
    tuple of positional inputs) and the rest (labels) is ignored; with ``positional=n >= 2`` its first n
    elements are the positional inputs."""
    want = expected or _FORMS
    if torch.is_tensor(batch):
        return (batch,), {}
    if isinstance(batch, Mapping):
        bad = [k for k in batch if not isinstance(k, str)]
        if bad:
            raise ModelError(f"{what}: batch {i} is a dict with non-string keys {bad!r}; a dict batch maps the "
                             f"forward's keyword-argument names to inputs")
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise ModelError(f"{what}: batch {i} is an empty {type(batch).__name__}; expected {want}")
        if positional is None:
            return tuple(batch), {}
        if positional >= 2:
            if len(batch) < positional:
                raise ModelError(f"{what}: batch {i} has {len(batch)} elements, the model takes {positional} "
                                 f"positional inputs; expected {want}")
            return tuple(batch[:positional]), {}
        first = batch[0]
        if isinstance(first, (tuple, list)):
            return tuple(first), {}
        if torch.is_tensor(first) or isinstance(first, Mapping):
            return forward_inputs(first, i, what, positional, expected)
        batch = first
    raise ModelError(f"{what}: batch {i} is a {type(batch).__name__}, expected {want}")


def _tensors(args: tuple, kwargs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for j, a in enumerate(args):
        if torch.is_tensor(a):
            yield f"input {j}", a
    for k, v in kwargs.items():
        if torch.is_tensor(v):
            yield k, v


def _batch_size(args: tuple, kwargs: dict[str, Any]) -> int:
    for _, t in _tensors(args, kwargs):
        if t.dim() >= 1:
            return int(t.shape[0])
    return 1


def _head(args: tuple, kwargs: dict[str, Any], n: int, size: int) -> tuple[tuple, dict[str, Any]]:
    def cut(v: Any) -> Any:
        return v[:n] if torch.is_tensor(v) and v.dim() >= 1 and int(v.shape[0]) == size else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def calibration_batches(data: Any, what: str, *, num_samples: int | None = None, num_batches: int | None = None,
                        positional: int | None = None, expected: str | None = None, hint: str | None = None,
                        tuple_is_batch: bool = True) -> Iterator[tuple[int, tuple, dict[str, Any]]]:
    """``(index, args, kwargs)`` per calibration batch of ``data``: a tensor, a dict / ``BatchEncoding``, a
    tuple, or a DataLoader / list / any iterable of those (see :func:`forward_inputs` for ``positional``).

    ``num_batches`` stops after that many batches; ``num_samples`` after that many sequences (the leading
    axis of the batch's tensors; the last batch is cut). A floating tensor with NaN / inf, or an empty one (0
    sequences or 0 tokens), is a :class:`ConfigError` naming the batch; no data at all is a ConfigError once the
    data is exhausted.
    ``hint``: what the no-data errors tell the user to do; ``tuple_is_batch``: ``data`` given as a tuple is one
    batch of positional inputs (False: an iterable of batches)."""
    hint = hint or f"give a few hundred sequences as {_FORMS}"
    for key, v in (("num_samples", num_samples), ("num_batches", num_batches)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ConfigError(f"{what}: {key} must be a positive int or None, got {v!r}")
    if data is None:
        raise ConfigError(f"{what}: no calibration data given; {hint}")
    if torch.is_tensor(data) or isinstance(data, Mapping) or (tuple_is_batch and isinstance(data, tuple)):
        data = [data]
    elif not isinstance(data, Iterable) or isinstance(data, (str, bytes)):
        raise ConfigError(f"{what}: calibration data must be {expected or _FORMS}, got {type(data).__name__}; {hint}")
    seen = samples = 0
    for i, batch in enumerate(data):
        if (num_batches is not None and seen >= num_batches) or (num_samples is not None and samples >= num_samples):
            break
        args, kwargs = forward_inputs(batch, i, what, positional, expected)
        for name, t in _tensors(args, kwargs):
            if t.dim() >= 1 and 0 in t.shape:  # no sequence (or no token): the model would fail inside
                raise ConfigError(f"{what}: calibration batch {i} ({name}) is empty (shape {tuple(t.shape)}); {hint}")
            if t.is_floating_point() or t.is_complex():
                if not bool(torch.isfinite(t).all()):
                    raise ConfigError(f"{what}: calibration batch {i} ({name}) contains NaN or inf")
        size = _batch_size(args, kwargs)
        if num_samples is not None and samples + size > num_samples:
            args, kwargs = _head(args, kwargs, num_samples - samples, size)
            size = num_samples - samples
        samples += size
        seen += 1
        yield i, args, kwargs
    if seen == 0:
        raise ConfigError(f"{what}: the calibration data yielded no batch; {hint}")


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _to(v: Any, device: torch.device) -> Any:
    if torch.is_tensor(v):
        return v.to(device)
    if isinstance(v, (tuple, list)):
        return type(v)(_to(x, device) for x in v)
    if isinstance(v, dict):
        return {k: _to(x, device) for k, x in v.items()}
    return v

