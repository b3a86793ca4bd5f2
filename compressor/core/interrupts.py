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
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["deferred_interrupts"]


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
