"""Ctrl-C delivered at a chosen step of running code (a counter, not a timer).

:func:`run_interrupted` traces the lines Python runs in the functions it is told (``{file: {function names}}``,
None for every function of a file) and, at the n-th line counted, sends this process a real SIGINT: its handler
runs at once, so the KeyboardInterrupt comes as that line starts (finer than a real Ctrl-C, which Python notices
only at a function's start, a loop's jump back or after a call of C code), and code that holds signals back
(``core.interrupts``) gets it when it lets them through, as with a real Ctrl-C. A ``try:`` line is no place
for it (no real Ctrl-C comes there, and CPython 3.11 would skip the ``finally`` of an exception raised by the
trace function on it): the signal then goes at the next line or function start.
"""

from __future__ import annotations

import linecache
import os
import signal
import sys
from collections.abc import Callable
from typing import Any


def _counted(where: dict[str, set[str] | None]) -> Callable[[Any], bool]:
    def wanted(code: Any) -> bool:
        names = where.get(code.co_filename, False)
        return names is None or (names is not False and code.co_name in names)
    return wanted


def run_interrupted(fn: Callable[[], Any], n: int | None, where: dict[str, set[str] | None]) -> dict[str, Any]:
    """Run ``fn()`` with Ctrl-C at the n-th counted line (None: only count). Returns ``{'lines': counted,
    'sent': whether the SIGINT was sent, 'raised': whether fn raised KeyboardInterrupt}``."""
    state: dict[str, Any] = {"lines": 0, "armed": False, "sent": False, "raised": False}
    wanted = _counted(where)

    def fire() -> None:
        state["armed"], state["sent"] = False, True
        os.kill(os.getpid(), signal.SIGINT)

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            state["lines"] += 1
            if state["lines"] == n:
                state["armed"] = True
            if state["armed"] and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() != "try:":
                fire()
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        if state["armed"]:
            fire()
        return local if wanted(frame.f_code) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        fn()
    except KeyboardInterrupt:
        state["raised"] = True
    finally:
        sys.settrace(previous)
    return state


def count_lines(fn: Callable[[], Any], where: dict[str, set[str] | None]) -> int:
    return run_interrupted(fn, None, where)["lines"]
