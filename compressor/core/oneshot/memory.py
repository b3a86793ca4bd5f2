"""Where a one-shot run's memory goes: Gram matrices in pages of their own (:func:`own_pages`), freed heap given
back between blocks (:func:`release_freed_heap`), and the undo copies of changed layers in a temporary file
(:class:`Undo`), so a failed run puts the model back without a second copy of its weights in RAM."""

from __future__ import annotations

import contextlib
import mmap
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..interrupts import deferred_interrupts

#: arrays of at least this many bytes that live long and are freed as a whole (the Gram matrices, which the
#: solvers then factor in place) get pages of their own (:func:`own_pages`)
OWN_PAGES_BYTES = 1 << 20


def own_pages(shape: tuple[int, ...]) -> np.ndarray:
    """A zero float64 array of ``shape`` in an anonymous memory map of its own (below :data:`OWN_PAGES_BYTES`:
    ``np.zeros``). Its pages go back to the OS the moment the array is dropped, and it never sits in the
    allocator's heap between the calibration pass's short-lived buffers: a Gram matrix there (an LLM down
    projection's: 18 MiB at width 1536) left a hole that those buffers split when it was freed, and glibc
    raised its mmap threshold past it, so every later buffer of that size came from the heap too."""
    n = int(np.prod(shape, dtype=np.int64)) * 8
    if n < OWN_PAGES_BYTES:
        return np.zeros(shape)
    try:
        buf = mmap.mmap(-1, n)
    except (OSError, ValueError):  # no anonymous maps here: the allocator's memory
        return np.zeros(shape)
    return np.frombuffer(buf, dtype=np.float64).reshape(shape)


#: a Gram matrix of at least this many bytes waits on disk while the other layers of its block are solved, in a run
#: that gives a folder for it (:func:`spilling_to`; a streamed run: its run folder). A TinyLlama block's down
#: projection's (5632 wide: 242 MiB) is; the 2048-wide ones (32 MiB) are not
SPILL_BYTES = 64 << 20
_SPILL_DIR: list[str | None] = [None]


@contextlib.contextmanager
def spilling_to(folder: str | None) -> Iterator[None]:
    """Within the block: large Gram matrices of layers not being solved wait in an unlinked file in ``folder``
    (None: they stay in memory), see :class:`GramSpill`."""
    before = _SPILL_DIR[0]
    _SPILL_DIR[0] = folder
    try:
        yield
    finally:
        _SPILL_DIR[0] = before


class GramSpill:
    """The Gram matrices (:data:`SPILL_BYTES` or more) of a block's layers written to a temporary file while other
    layers are solved, read back (into pages of their own) when their layer's turn comes: a block's peak holds one
    large matrix, not its down projection's beside the solve of another layer. Bytes out, the same bytes back.
    Active only inside :func:`spilling_to` with a folder."""

    def __init__(self) -> None:
        self.folder = _SPILL_DIR[0]
        self.file: Any = None
        self.where: dict[int, tuple[int, tuple[int, ...]]] = {}

    def put(self, acc: Any) -> None:
        """Spill ``acc``'s Gram matrix (its upper part's blocks, when large and a folder is set)."""
        blocks = getattr(acc, "gram_blocks", None)
        if (self.folder is None or blocks is None or sum(b.nbytes for b in blocks) < SPILL_BYTES
                or id(acc) in self.where):
            return
        if self.file is None:
            self.file = tempfile.TemporaryFile(prefix="gram-", dir=self.folder)
        f = self.file
        f.seek(0, 2)
        self.where[id(acc)] = (f.tell(), [b.shape for b in blocks])
        for b in blocks:
            f.write(memoryview(np.ascontiguousarray(b)).cast("B"))
        acc.gram_blocks = None

    def get(self, acc: Any) -> None:
        """Put ``acc``'s spilled Gram matrix back (a no-op when it was not spilled)."""
        spot = self.where.pop(id(acc), None)
        if spot is None:
            return
        offset, shapes = spot
        self.file.seek(offset)
        blocks = []
        for shape in shapes:
            g = own_pages(shape)
            view = memoryview(g).cast("B")
            got = 0
            while got < len(view):
                n = self.file.readinto(view[got:])
                if not n:
                    raise OSError("the spilled Gram matrix was cut short")
                got += n
            blocks.append(g)
        acc.gram_blocks = blocks

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _glibc_trim() -> Callable[[], Any] | None:
    """glibc's ``malloc_trim`` (None elsewhere): see :func:`release_freed_heap`."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl, no libc.so.6
        return None


_TRIM = _glibc_trim()


def release_freed_heap() -> None:
    """Give the heap pages freed since the last call back to the OS (glibc ``malloc_trim(0)``; a no-op where
    there is none). Between blocks a calibration run frees a block's worth of activations, statistics and
    solver copies; glibc keeps most of it (its mmap threshold grows with the first frees, so later
    activation-sized buffers come from the heap), and the next block's peak stacks on top: measured on the
    trained byte-level Llama of examples/RESULTS.md (128 windows, max of 2 runs each), peak extra memory SparseGPT 129 -> 102 MiB, GPTQ 132 -> 96,
    Wanda 92 -> 87."""
    if _TRIM is not None:
        _TRIM(0)


class _Spill:
    """The arrays of the undo copies in an anonymous temporary file (host RAM holds one layer's copy at a time,
    not a second copy of every compressed weight); arrays are written as they come and read back only by a
    rollback. Without a usable temporary directory the arrays are kept in memory (copied)."""

    MIN_BYTES = 1 << 16  # smaller arrays (masks of tiny layers, scalars) stay in memory

    def __init__(self) -> None:
        self.file: Any = None
        self.failed = False

    def _open(self) -> Any:
        if self.file is None and not self.failed:
            try:
                self.file = tempfile.TemporaryFile(prefix="compressor-undo-")
            except OSError:
                self.failed = True
        return self.file

    def put(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.nbytes < self.MIN_BYTES or obj.dtype.hasobject or self._open() is None:
                return np.array(obj, copy=True)
            f = self.file
            f.seek(0, 2)
            offset = f.tell()
            f.write(np.ascontiguousarray(obj).tobytes())
            return _Spilled(offset, obj.shape, obj.dtype)
        if type(obj) is dict:
            return {k: self.put(v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(self.put(v) for v in obj)
        return obj

    def get(self, obj: Any) -> Any:
        if isinstance(obj, _Spilled):
            self.file.seek(obj.offset)
            n = int(np.prod(obj.shape, dtype=np.int64)) * obj.dtype.itemsize
            return np.frombuffer(self.file.read(n), dtype=obj.dtype).reshape(obj.shape).copy()
        if type(obj) is dict:
            return {k: self.get(v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(self.get(v) for v in obj)
        return obj

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


@dataclass(frozen=True)
class _Spilled:
    offset: int
    shape: tuple
    dtype: np.dtype


class Undo:
    """Host copies of what a run changes, taken per layer just before its first change (the backend's optional
    ``snapshot(task)`` / ``restore(task, copy)``); :meth:`rollback` puts them back, newest first, so a run that
    fails part way leaves the model as it found it. The copies' numpy arrays go to a temporary file
    (:class:`_Spill`): the backup costs disk, not a second copy of the weights in RAM; a snapshot may hand over
    views of the live arrays, they are written out at once."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.saved: list[tuple[Any, Any]] = []
        self.names: set[str] = set()
        self.spill = _Spill()

    def before(self, task: Any) -> None:
        """Copy what ``task``'s layer holds now; call it before the layer's first change (the record comes first,
        so an interrupt at any point after it is undone by :meth:`rollback`)."""
        if task.name not in self.names:
            saved = self.backend.snapshot(task)
            if saved is not None:
                self.saved.append((task, self.spill.put(saved)))
            self.names.add(task.name)

    def rollback(self) -> None:
        """Put every copied layer back, newest first, after the backend's optional ``drop_transients()`` (what a
        pass had in place when it was interrupted: hooks, swapped tensors). Ctrl-C meanwhile is raised once all
        are back; a layer whose restore raised stays listed, so calling again finishes the rest."""
        with deferred_interrupts():
            drop = getattr(self.backend, "drop_transients", None)
            if drop is not None:
                drop()
            while self.saved:
                task, saved = self.saved[-1]
                self.backend.restore(task, self.spill.get(saved))
                self.saved.pop()
            self.close()

    def close(self) -> None:
        self.saved, self.names = [], set()
        self.spill.close()


def _compact(weight: Any) -> np.ndarray:
    """A weight kept only to be written back: float32 where that holds every value exactly (the weights of a
    float32 / bf16 / fp16 model; half the bytes of the float64 canonical copy), float64 otherwise."""
    a = np.asarray(weight, np.float64)
    b = a.astype(np.float32)
    return b if np.array_equal(b, a) else a

