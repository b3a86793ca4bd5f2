"""Ctrl-C held back while a model or a file is being put back together.

Code that changes a model in place records each change before making it, and undoes the recorded changes when
anything (a ``KeyboardInterrupt`` included) interrupts it. The undo itself must not be cut short by a second
Ctrl-C, or the model would be left half restored: :func:`deferred_interrupts` holds SIGINT back while its body
runs and raises the ``KeyboardInterrupt`` when the body has finished (the undo complete). The same guard keeps
the few renames that commit an export together (:mod:`compressor.core.atomic`).

Only the main thread receives signals in Python; elsewhere (and where no Python handler can be installed) the
guard does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["deferred_interrupts", "undone_on_error", "record_undo", "undo_active", "commit_changes"]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """SIGINT received while the body runs is delivered (as ``KeyboardInterrupt``, or whatever handler was
    installed) once the body is done; nested uses deliver it when the outermost ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.getsignal(signal.SIGINT)
    except (ValueError, AttributeError):
        previous = None
    if previous is None:  # a handler installed outside Python: it cannot be put back, so leave it alone
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        received.append(signum)

    try:
        signal.signal(signal.SIGINT, hold)
    except (ValueError, OSError):  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            _deliver(previous)


def _deliver(handler: Any) -> None:
    """Run what SIGINT would have run: the Python handler (``default_int_handler`` raises KeyboardInterrupt), or
    the signal again under the system's default action."""
    if handler is signal.SIG_IGN:
        return
    if handler is signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)
        return
    handler(signal.SIGINT, None)


# ------------------------------------------------------------------------------------------- undo on error
class _UndoLog:
    def __init__(self) -> None:
        self.undo: list[Any] = []
        self.keys: set[Any] = set()
        self.changed = False
        self.committed = False


_LOG: contextvars.ContextVar[_UndoLog | None] = contextvars.ContextVar("compressor_undo", default=None)


@contextlib.contextmanager
def undone_on_error() -> Iterator[None]:
    """A change made in place in the body is first recorded with :func:`record_undo`; if the body raises (Ctrl-C
    included) before :func:`commit_changes`, every recorded change is undone, newest first, with Ctrl-C held
    back until the model is whole again. Changes after the commit stay (the body finished its irreversible
    step; what is left is bookkeeping). Nested blocks join the outermost."""
    if _LOG.get() is not None:
        yield
        return
    log = _UndoLog()
    token = _LOG.set(log)
    try:
        yield
    except BaseException:
        if not log.committed:
            with deferred_interrupts():
                for undo in reversed(log.undo):
                    undo()
        raise
    finally:
        _LOG.reset(token)


def undo_active() -> bool:
    """Inside an :func:`undone_on_error` block that has not committed: in-place changes are to be recorded (or
    postponed to the commit)."""
    log = _LOG.get()
    return log is not None and not log.committed


def record_undo(key: Any, undo: Any, change: bool = True) -> None:
    """Record how to undo a change about to be made (``undo()``), once per ``key`` (the first record holds the
    value from before the block); nothing outside an :func:`undone_on_error` block or after its commit.
    ``change=False``: state kept beside the model (a flag, a counter), put back too, but no change that
    :func:`commit_changes` would make final."""
    log = _LOG.get()
    if log is None or log.committed or key in log.keys:
        return
    log.keys.add(key)
    log.undo.append(undo)
    log.changed = log.changed or change


def commit_changes() -> None:
    """The block's recorded changes are final from here (call it under :func:`deferred_interrupts` together with
    the irreversible step it stands for). Before any change is recorded it does nothing: the step then only
    repeats what the model already holds (masking weights with the masks they already have)."""
    log = _LOG.get()
    if log is not None and log.changed:
        log.committed = True
