"""Atomic artifact writes: a failed export leaves nothing behind and never touches an existing file.

Every exporter (state dicts, mask and calibration files, ONNX, ``.keras``, SavedModel directories,
weights, TFLite) writes into a temporary path next to the target (same folder, so the final move is a
rename on one file system) and moves it into place only when the whole export succeeded::

    with atomic_paths(model_path, onnx_path) as (tmp_model, tmp_onnx):
        torch.save(state, tmp_model)
        export_onnx(model, tmp_onnx)      # raises: neither file appears, old ones stay as they were

One block is one transaction: the targets are checked first (no two the same file, also through a
symlink or a hard link: :class:`ConfigError`), then, once the body returned, every written temporary is
checked against its target (a file cannot replace a directory nor a directory a file) before anything
moves; the moves themselves keep a backup of every replaced target and put all of them back if one move
fails. So on any failure every old file is byte-identical and no temporary is left.

``None`` targets pass through as ``None`` (optional artifacts). A target that is a symlink is written
through (the link stays, the file it points to is replaced); an overwritten file keeps its permission
bits. A temporary name is ``.tmp-<token>-`` followed by the target's file name, cut at the front when
the whole would exceed 255 bytes, so it keeps the target's extension (Keras checks ``.keras`` and
``.weights.h5``) and any file name the file system accepts also works as a target. A failing write
(full disk, read-only file system, permissions) surfaces as an :class:`OSError` naming the TARGET, also
when the writer wrapped the system error in its own (torch's ``inline_container.cc`` RuntimeError).
A target directory (SavedModel) that already exists is swapped: the old one is renamed aside, the new
one renamed in, then the old one deleted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from .errors import ConfigError

__all__ = ["atomic_path", "atomic_paths", "temp_path_for"]

NAME_MAX = 255  # bytes in one file name (Linux, macOS, Windows)


def temp_path_for(path: str | os.PathLike[str]) -> str:
    """A fresh temporary path in ``path``'s folder whose name ends with (the end of) ``path``'s file name."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    prefix = f".tmp-{uuid.uuid4().hex[:8]}-"
    room = NAME_MAX - len(prefix)
    while len(os.fsencode(name)) > room:  # keep the end (the extension): cut characters at the front
        name = name[max(1, len(os.fsencode(name)) - room):]
    return os.path.join(folder, prefix + name)


def _resolve(path: str | os.PathLike[str]) -> str:
    """Absolute target path; a symlink is followed, so the file it points to is replaced, not the link."""
    p = os.path.abspath(os.fspath(path))
    return os.path.realpath(p) if os.path.islink(p) else p


def _check_distinct(targets: list[str | None], names: Sequence[str] | None) -> None:
    def label(i: int) -> str:
        return names[i] if names is not None and i < len(names) else f"path {i + 1}"

    for i, a in enumerate(targets):
        for j in range(i + 1, len(targets)):
            b = targets[j]
            if a is None or b is None:
                continue
            same = os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))
            if not same and os.path.exists(a) and os.path.exists(b):
                with contextlib.suppress(OSError):
                    same = os.path.samefile(a, b)  # hard links
            if same:
                raise ConfigError(f"{label(i)} and {label(j)} are the same file {a!r}: one export would overwrite "
                                  f"the other; give each artifact its own path")


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


def _is_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _check_commit(tmp: str, target: str) -> None:
    """Refuse, before anything moves, a temporary that cannot take its target's place."""
    if not os.path.lexists(target):
        return
    if _is_dir(target) and not _is_dir(tmp):
        raise IsADirectoryError(21, "cannot write a file there: it is a directory", target)
    if _is_dir(tmp) and not _is_dir(target):
        raise NotADirectoryError(20, "cannot write a directory there: it is an existing file", target)


def _commit_all(pairs: list[tuple[str, str]]) -> None:
    """Move every ``tmp`` onto its ``target``, all or none: each replaced target is kept as a backup until
    all moved, and put back if any move fails."""
    for tmp, target in pairs:
        _check_commit(tmp, target)
    done: list[tuple[str, str | None]] = []  # (target, backup of the old target or None)
    backups: list[str] = []
    try:
        for tmp, target in pairs:
            backup = None
            if os.path.lexists(target):
                backup = temp_path_for(target)
                if _is_dir(target):
                    os.replace(target, backup)  # a directory cannot be swapped in one rename: move it aside
                else:
                    with contextlib.suppress(OSError):  # the permission bits of the replaced file
                        os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
                    try:
                        os.link(target, backup)  # the old file stays reachable; the target is never missing
                    except OSError:
                        shutil.copy2(target, backup)
                backups.append(backup)
            done.append((target, backup))
            os.replace(tmp, target)
    except BaseException:
        for target, backup in reversed(done):
            if backup is None:
                if os.path.lexists(target):
                    _remove(target)
            elif _is_dir(backup):
                if os.path.lexists(target):
                    _remove(target)
                os.replace(backup, target)
            else:
                os.replace(backup, target)
        raise
    finally:
        for b in backups:
            _remove(b)


def _os_error(e: BaseException) -> OSError | None:
    """The system error ``e`` is or wraps (torch reports a failed write as a RuntimeError whose context is it)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _target_of_error(err: OSError, temps: list[str | None], targets: list[str | None]) -> str | None:
    """The target whose temporary the failed write was writing: named by the error or, when the error names
    no file (a write through a file object), the most recently written temporary."""
    pairs = [(t, g) for t, g in zip(temps, targets) if t is not None]
    named = [os.path.abspath(os.fsdecode(n)) for n in (err.filename, err.filename2)
             if isinstance(n, (str, bytes, os.PathLike))]
    for name in named:
        for tmp, target in pairs:
            if name == tmp or name.startswith(tmp + os.sep):
                return target
        if any(name == target for _, target in pairs):
            return name
    if named:
        return None  # a file that is not ours (an input the body read)
    written = [(os.lstat(tmp).st_mtime_ns, i) for i, (tmp, _) in enumerate(pairs) if os.path.lexists(tmp)]
    if written:
        return pairs[max(written)[1]][1]
    return pairs[0][1] if len(pairs) == 1 else None


@contextlib.contextmanager
def atomic_paths(*paths: str | os.PathLike[str] | None, names: Sequence[str] | None = None) -> Iterator[list[Any]]:
    """Temporary paths for ``paths`` (``None`` stays ``None``); the ones the body wrote are moved onto their
    targets, all or none, when the body returns, and all are deleted if it raises (targets untouched).

    ``names``: the arguments the paths came from (``'model_path'``, ...), for the error when two are the same
    file. Missing parent folders are created (and removed again, if still empty, on failure).
    """
    targets = [None if p is None else _resolve(p) for p in paths]
    _check_distinct(targets, names)
    created: list[str] = []
    temps: list[str | None] = []
    try:
        for t in targets:
            if t is not None:
                _make_parents(os.path.dirname(t), created)
        temps = [None if t is None else temp_path_for(t) for t in targets]
        try:
            yield list(temps)
        except (OSError, RuntimeError) as e:
            new = _renamed(e, temps, targets)
            if new is e:
                raise
            raise new from e
        _commit_all([(tmp, target) for tmp, target in zip(temps, targets)
                     if tmp is not None and target is not None and os.path.lexists(tmp)])
    except BaseException:
        _remove_all(temps)
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only if empty
        raise
    _remove_all(temps)


def _remove_all(temps: list[str | None]) -> None:
    for tmp in temps:
        if tmp is not None:
            _remove(tmp)


def _renamed(e: BaseException, temps: list[str | None], targets: list[str | None]) -> BaseException:
    """A failed write as an :class:`OSError` naming its target instead of its temporary (the errno and
    message of the system error), or ``e`` itself when it was no failed write of ours."""
    err = _os_error(e)
    if err is None:
        return e
    target = _target_of_error(err, temps, targets)
    if target is None or (err is e and target == err.filename):
        return e
    return OSError(err.errno, err.strerror, target)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """One-target form of :func:`atomic_paths`: yields the temporary path to write."""
    with atomic_paths(path) as (tmp,):
        yield tmp
