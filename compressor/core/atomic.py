"""Atomic artifact writes: an export lands whole or not at all, also when the process is killed half way.

Every exporter (state dicts, mask and calibration files, ONNX, ``.keras``, SavedModel directories,
weights, TFLite, checkpoint folders) writes into a temporary path next to the target (same folder, so the
final move is a rename on one file system) and moves it into place only when the whole export succeeded::

    with atomic_paths(model_path, onnx_path) as (tmp_model, tmp_onnx):
        torch.save(state, tmp_model)
        export_onnx(model, tmp_onnx)      # raises: neither file appears, old ones stay as they were

One block is one transaction, and so is a :func:`transaction` block around several (``export_model`` with
``hf_path`` and ``model_path``: the checkpoint folder and the files land together). The targets are checked
first (no two the same file, also through a symlink or a hard link, and none inside another:
:class:`ConfigError`), then, once the body returned, every written temporary is checked against its target (a
file cannot replace a directory nor a directory a file) before anything moves.

**A journal makes the moves recoverable.** The transaction holds a lock file ``.txn-<token>.lock`` (an OS lock
on it says the writing process is alive) and a journal ``.txn-<token>.json`` in the first target's folder, and a
``.txn-<token>.ref`` naming them in every other folder it writes into; all its temporaries are named
``.tmp-<token>-<name>``, the old versions it keeps while moving ``.old-<token>-<name>``. The journal says
``writing`` (temporaries being written: no target touched), ``moving`` (the old target kept beside each new one)
or ``committed`` (every new target in place). A replaced file stays in place until the new one is renamed over
it (the old one hard-linked aside first, copied where the file system has no hard links); a replaced folder is
swapped with the new one in one step where the system can (Linux ``renameat2(RENAME_EXCHANGE)``), else renamed
aside and the new one renamed in. A move that fails puts every old target back (Ctrl-C is held back until the
moves or their undoing are complete: :mod:`compressor.core.interrupts`).

If the process is killed, what it left is repaired by the next :func:`atomic_paths` into the same folder (any
export there), by :func:`recover`, or by any compressor call that reads a checkpoint folder: a transaction
whose lock no live process holds is rolled back (``writing`` / ``moving``: temporaries deleted, every old target
put back, every new one removed) or finished (``committed``: the kept old versions deleted). So every target
is, after any kill and the next call, the complete old or the complete new version, all targets of one
transaction the same, and nothing of the transaction is left. (A kill, not a power failure: nothing is
fsync'ed.)

``None`` targets pass through as ``None`` (optional artifacts). A target that is a symlink is written
through (the link stays, the file it points to is replaced); an overwritten file keeps its permission
bits. A temporary name is ``.tmp-<token>-`` followed by the target's file name, cut at the front when
the whole would exceed 255 bytes, so it keeps the target's extension (Keras checks ``.keras`` and
``.weights.h5``) and any file name the file system accepts also works as a target. A failing write
(full disk, read-only file system, permissions) surfaces as an :class:`OSError` naming the TARGET, also
when the writer wrapped the system error in its own (torch's ``inline_container.cc`` RuntimeError).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import json
import os
import re
import shutil
import stat
import sys
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from .errors import ConfigError
from .interrupts import deferred_interrupts

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
try:
    import msvcrt
except ImportError:  # POSIX
    msvcrt = None  # type: ignore[assignment]

__all__ = ["atomic_path", "atomic_paths", "recover", "recover_for_reading", "temp_path_for", "transaction"]

NAME_MAX = 255  # bytes in one file name (Linux, macOS, Windows)

#: the kinds of names a transaction gives its files: ``.<kind>-<token>-<target name>``
_KINDS = ("tmp", "old", "del", "cpy")
_TXN_FILE = re.compile(r"\.txn-([0-9a-f]{8})\.(lock|json|ref)\Z")


def _token() -> str:
    return uuid.uuid4().hex[:8]


def _named(path: str | os.PathLike[str], kind: str, token: str) -> str:
    """``path``'s sibling ``.<kind>-<token>-<name>``, the name cut at the front to fit NAME_MAX bytes."""
    folder, name = os.path.split(os.path.abspath(os.fspath(path)))
    prefix = f".{kind}-{token}-"
    room = NAME_MAX - len(prefix)
    while len(os.fsencode(name)) > room:  # keep the end (the extension): cut characters at the front
        name = name[max(1, len(os.fsencode(name)) - room):]
    return os.path.join(folder, prefix + name)


def temp_path_for(path: str | os.PathLike[str]) -> str:
    """A fresh temporary path in ``path``'s folder whose name ends with (the end of) ``path``'s file name."""
    return _named(path, "tmp", _token())


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


def _inside(a: str, b: str) -> bool:
    """``a`` is a path inside the folder ``b``."""
    a, b = (os.path.normcase(os.path.realpath(p)) for p in (a, b))
    return a.startswith(b.rstrip(os.sep) + os.sep)


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


def _ident(path: str) -> list[int] | None:
    """What ``path`` is (device, inode), None when nothing is there: a file or folder keeps it when renamed."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino]


def _check_commit(tmp: str, target: str) -> None:
    """Refuse, before anything moves, a temporary that cannot take its target's place."""
    if not os.path.lexists(target):
        return
    if _is_dir(target) and not _is_dir(tmp):
        raise IsADirectoryError(21, "cannot write a file there: it is a directory", target)
    if _is_dir(tmp) and not _is_dir(target):
        raise NotADirectoryError(20, "cannot write a directory there: it is an existing file", target)


# ------------------------------------------------------------------------------------------- system help
def _load_renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # no glibc 2.28+ / musl 1.1.24+
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: str, b: str) -> bool:
    """Swap what ``a`` and ``b`` name in one step (both exist); False where the system or the file system cannot
    (then the caller renames in two steps)."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), b)


def _lock(fd: int, wait: bool) -> bool:
    """Take the OS lock on the open file ``fd`` (released when the process ends, however it ends)."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            return True
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            return wait  # a file system without locks: the owner goes on, nobody else takes it over
    if msvcrt is not None:
        try:
            msvcrt.locking(fd, msvcrt.LK_LOCK if wait else msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    return wait


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _sweep(folder: str, token: str) -> None:
    """Remove every file or folder of transaction ``token`` in ``folder`` (temporaries, kept old versions)."""
    prefixes = tuple(f".{k}-{token}-" for k in _KINDS)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in sorted(names):
        if name.startswith(prefixes):
            _remove(os.path.join(folder, name))


# ------------------------------------------------------------------------------------------- transactions
class _Transaction:
    """The targets of one export, its lock and journal (see the module docstring)."""

    def __init__(self) -> None:
        self.token: str | None = None
        self.lock_fd: int | None = None
        self.primary: str | None = None
        self.entries: list[dict[str, Any]] = []
        self.folders: list[str] = []
        self.created: list[str] = []
        self.state = "writing"

    # ---- names
    def _path(self, suffix: str, folder: str | None = None) -> str:
        return os.path.join(folder or self.primary or "", f".txn-{self.token}.{suffix}")

    def holds_temp(self, path: str) -> bool:
        """``path`` is a temporary of this transaction (or inside one): written directly, not journalled."""
        if self.token is None:
            return False
        if any(path == e["tmp"] or _inside(path, e["tmp"]) for e in self.entries):
            return True
        folder, name = os.path.split(path)
        return folder in self.folders and name.startswith(f".tmp-{self.token}-")

    def temp_for(self, path: str) -> str:
        return _named(path, "tmp", self.token or _token())

    # ---- journal
    def _write_journal(self, state: str) -> None:
        data = {"version": 1, "state": state, "folders": self.folders, "created": self.created,
                "entries": self.entries}
        part = _named(os.path.join(self.primary, "journal"), "tmp", self.token)
        with open(part, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(part, self._path("json"))

    def _open_lock(self, folder: str, target: str) -> None:
        while True:
            token = _token()
            path = os.path.join(folder, f".txn-{token}.lock")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            except OSError as e:  # the folder cannot be written: say so about the target, not our lock file
                raise OSError(e.errno, e.strerror, target) from None
            _lock(fd, wait=True)
            if _same_file(fd, path):  # not removed by a recovery that took it for a dead one's meanwhile
                self.token, self.lock_fd, self.primary = token, fd, folder
                return
            os.close(fd)

    def add(self, targets: list[str], labels: list[str]) -> list[dict[str, Any]]:
        """Journal ``targets`` (checked against the transaction's other targets) and name their temporaries."""
        known = [(e["target"], e["label"]) for e in self.entries]
        for i, t in enumerate(targets):
            for other, other_label in known + list(zip(targets[:i], labels[:i])):
                if os.path.normcase(os.path.realpath(t)) == os.path.normcase(os.path.realpath(other)):
                    raise ConfigError(f"{other_label} and {labels[i]} are the same file {t!r}: one export would "
                                      f"overwrite the other; give each artifact its own path")
                for a, la, b, lb in ((t, labels[i], other, other_label), (other, other_label, t, labels[i])):
                    if _inside(a, b):
                        raise ConfigError(f"{la} {a!r} is inside {lb} {b!r}, which the same export replaces; write "
                                          f"it elsewhere")
        for t in targets:
            _make_parents(os.path.dirname(t), self.created)
        if self.token is None:
            self._open_lock(os.path.dirname(targets[0]), targets[0])
            self.folders.append(self.primary)
        new = [{"target": t, "tmp": _named(t, "tmp", self.token), "label": lb} for t, lb in zip(targets, labels)]
        self.entries.extend(new)
        folders = [f for f in dict.fromkeys(os.path.dirname(t) for t in targets) if f not in self.folders]
        self.folders.extend(folders)
        self._write_journal("writing")
        for folder in folders:  # where the journal is, for a recovery that starts in this folder
            part = _named(os.path.join(folder, "ref"), "tmp", self.token)
            with open(part, "w", encoding="utf-8") as f:
                f.write(self._path("lock"))
            os.replace(part, self._path("ref", folder))
        return new

    def drop(self, entries: list[dict[str, Any]]) -> None:
        """Forget ``entries`` (their block failed inside a larger transaction) and delete what they wrote."""
        for e in entries:
            _remove(e["tmp"])
        ids = {id(e) for e in entries}
        self.entries = [e for e in self.entries if id(e) not in ids]

    # ---- commit
    def commit(self) -> None:
        pairs = [e for e in self.entries if os.path.lexists(e["tmp"])]
        for e in pairs:
            _check_commit(e["tmp"], e["target"])
        if not pairs:
            self._finish(True)
            return
        with deferred_interrupts():  # Ctrl-C is raised once every target is new, or every one old again
            for e in pairs:
                e["new"], e["old"], e["old_dir"] = _ident(e["tmp"]), _ident(e["target"]), _is_dir(e["target"])
            self.entries = pairs
            self._write_journal("moving")
            self.state = "moving"
            try:
                for e in pairs:
                    self._move(e)
                self._write_journal("committed")
            except BaseException:
                self._rollback()  # if this fails too, the journal stays for the next call to finish it
                self._finish(False)
                raise
            self.state = "committed"
            self._finish(True)

    def _move(self, e: dict[str, Any]) -> None:
        tmp, target = e["tmp"], e["target"]
        if e["old"] is None:
            os.replace(tmp, target)
        elif not e["old_dir"]:
            with contextlib.suppress(OSError):  # the permission bits of the replaced file
                os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
            backup = _named(target, "old", self.token)
            try:
                os.link(target, backup)  # the old file stays reachable; the target is never missing
            except OSError:
                part = _named(target, "cpy", self.token)
                shutil.copy2(target, part)
                os.replace(part, backup)  # a backup is whole or absent
            os.replace(tmp, target)
        elif not _exchange(tmp, target):  # the old folder now under the temporary's name
            os.replace(target, _named(target, "old", self.token))
            os.replace(tmp, target)

    def _rollback(self) -> None:
        """Put every old target back (idempotent: each step looks at what is where, by device and inode)."""
        for e in reversed(self.entries):
            if "new" in e:
                _rollback_entry(e, self.token)

    def _finish(self, committed: bool) -> None:
        """Delete what the transaction kept and wrote beside its targets, then its journal and lock file."""
        if self.token is not None:
            for folder in self.folders:
                _sweep(folder, self.token)
        if self.token is not None:
            for folder in self.folders[1:]:
                _remove(self._path("ref", folder))
            _remove(self._path("json"))
            _remove(self._path("lock"))
        if not committed:  # after the journal files, which may sit in them
            for folder in reversed(self.created):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)  # only if empty
        self.state = "done"

    def abort(self) -> None:
        """The body (or a check before the moves) failed: delete the temporaries; targets were never touched. A
        transaction that failed while moving and could not undo it keeps its journal for the next call."""
        if self.state == "writing":
            self._finish(False)

    def close(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def _rollback_entry(e: dict[str, Any], token: str) -> None:
    target, new, old = e["target"], e["new"], e["old"]
    cur = _ident(target)
    trash = _named(target, "del", token)
    if old is None:
        if cur is not None and cur == new:  # ours: out of the way in one step, then deleted
            _remove(trash)
            os.replace(target, trash)
        return
    if cur == old:
        return
    backup = _named(target, "old", token)
    src = next((p for p in (backup, e["tmp"]) if _ident(p) == old), None)
    if src is None and not e["old_dir"] and os.path.lexists(backup):
        src = backup  # a copied backup (no hard links here): complete, or it would not have this name
    if src is None:
        return
    if not e["old_dir"]:
        os.replace(src, target)
        return
    if cur is not None:
        if _exchange(src, target):
            return
        _remove(trash)
        os.replace(target, trash)
    os.replace(src, target)


_CURRENT: contextvars.ContextVar[_Transaction | None] = contextvars.ContextVar("compressor_transaction", default=None)


@contextlib.contextmanager
def transaction() -> Iterator[None]:
    """Make every :func:`atomic_paths` block inside one transaction: their targets move into place together
    when this block ends, or none does. Inside another transaction it joins that one."""
    if _CURRENT.get() is not None:
        yield
        return
    txn = _Transaction()
    reset = _CURRENT.set(txn)
    try:
        try:
            yield
        except BaseException:
            txn.abort()
            raise
        try:
            txn.commit()
        except BaseException:
            txn.abort()
            raise
    finally:
        txn.close()
        _CURRENT.reset(reset)


# ------------------------------------------------------------------------------------------- recovery
def recover(path: str | os.PathLike[str]) -> None:
    """Repair what a killed export left at ``path`` (a target file or folder, or a folder targets are written
    into): each transaction there whose process is gone is rolled back or, if it had committed, finished. Live
    transactions (another process exporting now) are left alone."""
    p = os.path.abspath(os.fspath(path))
    _recover_folder(os.path.dirname(p))
    if _is_dir(p):
        _recover_folder(p)


def recover_for_reading(path: str | os.PathLike[str]) -> None:
    """:func:`recover` before a reader opens ``path`` (a checkpoint folder, a compressed / mask / calibration file):
    a killed export's leftovers there are finished or undone first, so the reader sees the complete old or the
    complete new version. Where the folder cannot be repaired (read-only, no permission) the reader goes on: the
    targets themselves are whole at every point of a transaction, only its leftovers stay beside them."""
    try:
        recover(path)
    except OSError:
        pass


def _recover_folder(folder: str) -> None:
    try:
        names = os.listdir(folder)
    except OSError:
        return
    found: dict[str, set[str]] = {}
    for name in names:
        m = _TXN_FILE.match(name)
        if m:
            found.setdefault(m.group(1), set()).add(m.group(2))
    for token, kinds in sorted(found.items()):
        if "lock" in kinds:
            lock = os.path.join(folder, f".txn-{token}.lock")
        elif "ref" in kinds:
            try:
                with open(os.path.join(folder, f".txn-{token}.ref"), encoding="utf-8") as f:
                    lock = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            if not _TXN_FILE.match(os.path.basename(lock)) or not os.path.isabs(lock):
                continue
        else:  # a journal without its lock file: not a state this module leaves
            continue
        _recover_transaction(token, lock, folder)


def _recover_transaction(token: str, lock: str, here: str) -> None:
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:  # the transaction is over; its last steps left this folder's reference behind
        with deferred_interrupts():
            _sweep(here, token)
            _remove(os.path.join(here, f".txn-{token}.ref"))
        return
    except OSError:
        return
    try:
        if not _lock(fd, wait=False) or not _same_file(fd, lock):
            return  # its process is alive, or another recovery has just finished it
        txn = _Transaction()
        txn.token, txn.primary = token, os.path.dirname(lock)
        try:
            with open(txn._path("json"), encoding="utf-8") as f:
                journal = json.load(f)
        except (OSError, ValueError):
            journal = {}
        txn.folders = [str(f) for f in journal.get("folders", [])] or [txn.primary]
        txn.created = [str(f) for f in journal.get("created", [])]
        txn.entries = [e for e in journal.get("entries", []) if isinstance(e, dict)]
        state = journal.get("state", "writing")
        with deferred_interrupts():
            if state == "moving":
                txn._rollback()
            txn._finish(state == "committed")
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------- the blocks
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
    targets, all or none, when the body returns (or, inside :func:`transaction`, when that ends), and all are
    deleted if it raises (targets untouched).

    ``names``: the arguments the paths came from (``'model_path'``, ...), for the error when two are the same
    file. Missing parent folders are created (and removed again, if still empty, on failure). What a killed
    export left in a target's folder is repaired first (:func:`recover`).
    """
    targets = [None if p is None else _resolve(p) for p in paths]
    _check_distinct(targets, names)
    labels = [names[i] if names is not None and i < len(names) else f"path {i + 1}" for i in range(len(targets))]
    txn = _CURRENT.get()
    own = txn is None
    if own:
        txn = _Transaction()
        reset = _CURRENT.set(txn)
    temps: list[str | None] = [None] * len(targets)
    nested: list[int] = []  # targets that are temporaries of the transaction: written through one of their own
    added: list[dict[str, Any]] = []
    try:
        real = []
        for i, t in enumerate(targets):
            if t is None:
                continue
            if txn.holds_temp(t):
                temps[i] = txn.temp_for(t)
                nested.append(i)
            else:
                real.append(i)
        if real:
            for folder in dict.fromkeys(os.path.dirname(targets[i]) for i in real):
                _recover_folder(folder)
            added = txn.add([targets[i] for i in real], [labels[i] for i in real])
            for i, e in zip(real, added):
                temps[i] = e["tmp"]
        try:
            yield list(temps)
        except (OSError, RuntimeError) as e:
            new = _renamed(e, temps, targets)
            if new is e:
                raise
            raise new from e
        for i in nested:
            if os.path.lexists(temps[i]):
                _check_commit(temps[i], targets[i])
                if _is_dir(targets[i]):
                    _remove(targets[i])
                os.replace(temps[i], targets[i])
        if own:
            txn.commit()
    except BaseException:
        for i in nested:
            _remove(temps[i])
        if own:
            txn.abort()
        else:
            txn.drop(added)
        raise
    finally:
        if own:
            txn.close()
            _CURRENT.reset(reset)


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
