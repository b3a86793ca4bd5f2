"""Killing an export before its k-th file-system operation, for every k (tests of compressor.core.atomic).

``run_killed(export, targets, k, hard)`` counts every call of the functions in :data:`OPS` (renames, links,
removals, folder creation and removal, copies, the folder swap) while ``export()`` runs, and raises
:class:`Killed` (a BaseException, as KeyboardInterrupt) instead of the k-th. ``hard``: every later operation
raises too, so nothing the dying export tries in its ``except`` / ``finally`` blocks reaches the disk (a killed
process does nothing more); otherwise only the k-th fails (an interrupt the export's own code handles).

What each target holds is read as a tree (``tree``: bytes of a file, ``{name: tree}`` of a folder, None when
absent); the complete new version of each target is what its temporary held when the transaction began to
commit (a spy on the commit), so exports that are not byte-reproducible (a ``.keras`` zip's timestamp) are
judged exactly too.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from compressor.core import atomic

OPS = [(os, "replace"), (os, "rename"), (os, "link"), (os, "unlink"), (os, "remove"), (os, "rmdir"), (os, "mkdir"),
       (shutil, "copy2"), (shutil, "copyfile"), (shutil, "copytree"), (shutil, "rmtree"), (shutil, "move"),
       (atomic, "_exchange")]


class Killed(BaseException):
    """The process died before this file-system operation."""


def tree(path: str) -> Any:
    if os.path.islink(path):
        return ("link", os.readlink(path))
    if os.path.isdir(path):
        return {n: tree(os.path.join(path, n)) for n in sorted(os.listdir(path))}
    if os.path.exists(path):
        with open(path, "rb") as f:
            return f.read()
    return None


def listing(folder: str) -> list[str]:
    return sorted(os.listdir(folder))


@contextmanager
def counted(k: int | None, hard: bool, no_exchange: bool = False):
    """Patch :data:`OPS`; yields the state dict (``n``: operations so far, ``killed``)."""
    state = {"n": 0, "killed": False}
    saved = [(mod, name, getattr(mod, name)) for mod, name in OPS]

    def wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def op(*args: Any, **kwargs: Any) -> Any:
            if state["killed"] and hard:
                raise Killed(f"{name} after the kill")
            state["n"] += 1
            if k is not None and state["n"] == k:
                state["killed"] = True
                raise Killed(f"before operation {k}: {name}{args!r}")
            if name == "_exchange" and no_exchange:
                return False
            return fn(*args, **kwargs)
        return op

    for mod, name, fn in saved:
        setattr(mod, name, wrap(fn, name))
    try:
        yield state
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextmanager
def commit_spy():
    """Records ``{target: tree of its temporary}`` when a transaction starts to commit."""
    new: dict[str, Any] = {}
    original = atomic._Transaction.commit

    def commit(self: Any) -> None:
        for e in self.entries:
            if os.path.lexists(e["tmp"]):
                new[e["target"]] = tree(e["tmp"])
        return original(self)

    atomic._Transaction.commit = commit
    try:
        yield new
    finally:
        atomic._Transaction.commit = original


def count_ops(export: Callable[[], Any]) -> int:
    """How many counted operations a whole (unkilled) run of ``export`` makes."""
    with counted(None, False) as state:
        export()
    return state["n"]


def run_killed(export: Callable[[], Any], targets: list[str], k: int | None, hard: bool,
               no_exchange: bool = False) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Run ``export`` killed before operation ``k`` (None: not killed). Returns ``(trees of the targets right
    after, the new versions seen at commit, whether it was killed)``."""
    with commit_spy() as new, counted(k, hard, no_exchange) as state:
        try:
            export()
        except Killed:
            pass
    return {t: tree(t) for t in targets}, new, state["killed"]


def verdict(now: Any, old: Any, new: Any) -> str:
    if now == old:
        return "old"
    if new is not None and now == new:
        return "new"
    return "broken"


def check_killed_export(export: Callable[[], Any], targets: list[str], folders: list[str], k: int, hard: bool,
                        no_exchange: bool = False) -> str:
    """Kill ``export`` before operation ``k``; every target must be the whole old or the whole new version right
    after (a replaced folder too, where the system swaps folders in one step), and after :func:`atomic.recover`
    all targets the same version and no file of the transaction left in ``folders``. Returns 'old' or 'new'."""
    targets = [os.path.abspath(t) for t in targets]
    old = {t: tree(t) for t in targets}
    before = {f: listing(f) if os.path.isdir(f) else None for f in folders}
    after, new, killed = run_killed(export, targets, k, hard, no_exchange)
    assert killed, f"operation {k} was never reached"
    for t in targets:
        if no_exchange and isinstance(old[t], dict) and after[t] is None:
            continue  # the two-rename swap of a folder: absent until recovered
        assert verdict(after[t], old[t], new.get(t)) != "broken", f"kill before operation {k}: {t} is neither version"
    for t in targets:
        atomic.recover(t)
    states = {t: verdict(tree(t), old[t], new.get(t)) for t in targets}
    assert "broken" not in states.values(), f"kill before operation {k}: after recovery {states}"
    assert len(set(states.values())) == 1, f"kill before operation {k}: targets disagree after recovery: {states}"
    names = {os.path.basename(t) for t in targets}
    for f in folders:
        if before[f] is None:
            assert not os.path.exists(f) or set(listing(f)) <= names, f"kill before operation {k}: {listing(f)}"
            continue
        assert set(listing(f)) <= set(before[f]) | names, \
            f"kill before operation {k}: left in {f}: {sorted(set(listing(f)) - set(before[f]) - names)}"
    return next(iter(states.values()))


def check_every_kill(export: Callable[[], Any], targets: list[str], folders: list[str], reset: Callable[[], None],
                     exchange_variants: bool = False) -> dict[str, int]:
    """:func:`check_killed_export` for every operation of a whole run, hard and soft kills (and, with
    ``exchange_variants``, without the one-step folder swap too); ``reset()`` puts the old versions back before
    each run. Returns how many runs ended old / new."""
    reset()
    n = count_ops(export)
    out = {"old": 0, "new": 0, "ops": n}
    variants = [(True, False), (False, False)] + ([(True, True)] if exchange_variants else [])
    for hard, no_exchange in variants:
        for k in range(1, n + 1):
            reset()
            out[check_killed_export(export, targets, folders, k, hard, no_exchange)] += 1
    return out
