"""Atomic artifact writes: a failed export leaves nothing behind and never touches an existing file.

Every exporter (state dicts, mask and calibration files, ONNX, ``.keras``, SavedModel directories,
weights, TFLite) writes into a temporary path next to the target (same folder, so the final move is a
rename on one file system) and moves it into place only when the whole export succeeded::

    with atomic_paths(model_path, onnx_path) as (tmp_model, tmp_onnx):
        torch.save(state, tmp_model)
        export_onnx(model, tmp_onnx)      # raises: neither file appears, old ones stay as they were

``None`` targets pass through as ``None`` (optional artifacts). A temporary name keeps the target's
whole file name as its end (``.tmp-<token>-model.weights.h5``), so writers that check the extension
(Keras: ``.keras``, ``.weights.h5``) accept it. A target directory (SavedModel) that already exists is
swapped: the old one is renamed aside, the new one renamed in, then the old one deleted (restored if the
rename fails).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

__all__ = ["atomic_path", "atomic_paths", "temp_path_for"]


def temp_path_for(path: str | os.PathLike[str]) -> str:
    """A fresh temporary path in ``path``'s folder whose name ends with ``path``'s file name."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".tmp-{uuid.uuid4().hex[:12]}-{name}")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        with contextlib.suppress(OSError):
            os.remove(path)


def _make_parents(folder: str, created: list[str]) -> None:
    missing = []
    while folder and not os.path.isdir(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    for d in reversed(missing):
        os.mkdir(d)
        created.append(d)


def _commit(tmp: str, target: str) -> None:
    """Move ``tmp`` onto ``target`` (a file replaces atomically; a directory is swapped)."""
    if os.path.isdir(tmp) and os.path.isdir(target) and not os.path.islink(target):
        old = temp_path_for(target)
        os.replace(target, old)
        try:
            os.replace(tmp, target)
        except BaseException:
            os.replace(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    if os.path.isdir(target) and not os.path.islink(target):
        raise IsADirectoryError(f"cannot write a file at {target!r}: it is a directory")
    os.replace(tmp, target)


@contextlib.contextmanager
def atomic_paths(*paths: str | os.PathLike[str] | None) -> Iterator[list[Any]]:
    """Temporary paths for ``paths`` (``None`` stays ``None``); each one the body wrote is moved onto its
    target when the body returns, and all of them are deleted if it raises (targets untouched).

    Missing parent folders are created (and removed again, if still empty, when the body raises).
    """
    targets = [None if p is None else os.path.abspath(os.fspath(p)) for p in paths]
    created: list[str] = []
    for t in targets:
        if t is not None:
            _make_parents(os.path.dirname(t), created)
    temps = [None if t is None else temp_path_for(t) for t in targets]
    try:
        yield list(temps)
    except BaseException:
        for tmp in temps:
            if tmp is not None:
                _remove(tmp)
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only if empty
        raise
    try:
        for tmp, target in zip(temps, targets):
            if tmp is not None and os.path.lexists(tmp):
                _commit(tmp, target)
    finally:
        for tmp in temps:
            if tmp is not None:
                _remove(tmp)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """One-target form of :func:`atomic_paths`: yields the temporary path to write."""
    with atomic_paths(path) as (tmp,):
        yield tmp
