"""A one-shot run over a model that is not in memory: block by block, from a checkpoint on disk to a compressed
checkpoint on disk, resumable after a kill.

The block is the unit of memory, work and failure. For each block in order: its weights are read from the
checkpoint (``io.load_block``), every stage of the recipe observes and compresses it in turn (a stage is a
``(backend, method)`` pair as :func:`~compressor.core.oneshot.driver.run_sequential` takes, e.g. SparseGPT then
GPTQ on the same block), the compressed block computes the next block's inputs, its compressed state is written
(``io.save_block``) and its memory released (``io.release_block``). Nothing holds the whole model: peak memory is
one block + its calibration activations + its statistics. Where the storage writes a block's recorded inputs one
batch at a time (:meth:`BlockIO.dump_input` / :meth:`BlockIO.load_input`), the activations are not held either: each
pass over a block reads its inputs back from the run folder a batch at a time (:class:`RecordedInputs`), and the
block's outputs go to the next block's file as they are computed; the modules before the first block (embeddings)
are in memory only while block 0's inputs are recorded (:meth:`BlockIO.load_outside`), and a Gram matrix of at least
:data:`~compressor.core.oneshot.memory.SPILL_BYTES` waits in the run folder while the block's other layers are
solved (:func:`~compressor.core.oneshot.memory.spilling_to`).

A run's progress lives in a :class:`RunStore` folder beside the output: a ``state.json`` naming the recipe's and
the inputs' fingerprints and how many blocks are done, each finished block's state, and the recorded inputs of
the next block. A killed run started again with the same recipe and data continues at the first unfinished
block; the state is written (file, then ``os.replace`` of ``state.json``) only after the files it names, so a
kill at any point leaves either the old or the new state, never a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..errors import ConfigError, ModelError
from .collective import reduce_statistics
from .memory import Undo, release_freed_heap, spilling_to
from .method import OneShotMethod
from .observe import observers
from .protocol import OneShotBackend

__all__ = ["RunStore", "BlockIO", "RecordedInputs", "run_streamed", "check_stages", "check_folders", "check_disk_space",
           "drop_finished_run"]

STATE_VERSION = 1


class RunStore:
    """The folder of a streamed run's progress: ``state.json`` (``{"version", "key", "blocks", "done"}``),
    ``block-<i>`` (block ``i``'s compressed state, as the backend writes it) and ``inputs-<i>`` (the recorded
    inputs of block ``i``). ``key`` identifies the run (the recipe's hash, the checkpoint's and the data's
    fingerprints): a folder holding another run's state is refused, not mixed in."""

    def __init__(self, folder: str | os.PathLike[str], key: str, blocks: int, writer: bool = True) -> None:
        self.folder = os.fspath(folder)
        self.key = key
        self.blocks = int(blocks)
        #: only the writer (process 0 of a run over several) writes the state; the others read it
        self.writer = writer
        if writer:
            os.makedirs(self.folder, exist_ok=True)
        self.done = 0
        path = self._state_path
        if not writer and not os.path.exists(path):
            raise ModelError(f"{path}: the run's state is missing (process 0 writes it first)")
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    state = json.load(f)
                ok = (isinstance(state, dict) and state.get("version") == STATE_VERSION
                      and isinstance(state.get("done"), int) and 0 <= state["done"] <= self.blocks)
            except (OSError, ValueError):
                ok = False
            if not ok:
                raise ModelError(f"{path}: not the state of a compressor run (remove the folder {self.folder!r} to "
                                 f"start over)")
            if state.get("key") != key or state.get("blocks") != self.blocks:
                raise ModelError(f"{self.folder!r} holds the progress of another run (a different recipe, checkpoint or "
                                 f"calibration data); remove it to start this one")
            self.done = state["done"]
        else:
            self.mark_done(0)  # the folder says whose it is from the start

    @property
    def _state_path(self) -> str:
        return os.path.join(self.folder, "state.json")

    def block_path(self, i: int) -> str:
        return os.path.join(self.folder, f"block-{i:05d}")

    def inputs_path(self, i: int, rank: int = 0) -> str:
        """Block ``i``'s recorded inputs (process ``rank``'s share of the sequences, in a run over several)."""
        return os.path.join(self.folder, f"inputs-{i:05d}" + (f".rank{rank}" if rank else ""))

    def mark_done(self, done: int) -> None:
        """Record that blocks ``0 .. done - 1`` are finished (their files are written and synced before)."""
        if not self.writer:
            self.done = int(done)
            return
        tmp = self._state_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"version": STATE_VERSION, "key": self.key, "blocks": self.blocks, "done": int(done)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._state_path)
        self.done = int(done)


class BlockIO:
    """What a streamed run asks of the model's storage; a backend implements it over its checkpoint format."""

    def load_block(self, block: Any) -> None:
        """Read ``block``'s weights (and its compressors' state, fresh) into memory."""
        raise NotImplementedError

    def save_block(self, block: Any, path: str) -> None:
        """Write ``block``'s compressed state to the file ``path``, synced to disk."""
        raise NotImplementedError

    def release_block(self, block: Any) -> None:
        """Give ``block``'s memory back (its weights leave memory until :meth:`load_block`)."""
        raise NotImplementedError

    def save_inputs(self, inputs: list[Any], path: str) -> None:
        """Write a block's recorded inputs to the file ``path``, synced to disk."""
        raise NotImplementedError

    def load_inputs(self, path: str) -> list[Any]:
        """Read back what :meth:`save_inputs` wrote."""
        raise NotImplementedError

    # optional: recorded inputs one batch at a time (both or neither; then save_inputs / load_inputs are not used)
    def dump_input(self, inp: Any) -> bytes:
        """One batch of a block's recorded inputs as bytes (:meth:`load_input` reads them back)."""
        raise NotImplementedError

    def load_input(self, data: bytes) -> Any:
        """The batch :meth:`dump_input` wrote."""
        raise NotImplementedError

    def inputs_recorded(self, first: Any) -> None:
        """Called with the first batch of the recorded inputs of a block after the first, as they are written."""

    # optional: the modules before the first block (embeddings), in memory only while block 0's inputs are made
    def load_outside(self) -> None:
        """Read the weights the model's forward needs before its first block."""

    def release_outside(self) -> None:
        """Give back what :meth:`load_outside` read."""


def _records(io: BlockIO) -> bool:
    """Does ``io`` write recorded inputs one batch at a time?"""
    return type(io).dump_input is not BlockIO.dump_input and type(io).load_input is not BlockIO.load_input


#: the end of a file of recorded inputs: the JSON list of the records' offsets, its length, this mark
_RECORDS_MARK = b"CMPRECv1"


class _RecordWriter:
    """A file of records (bytes) written one after the other, with their offsets at the end; it appears under
    its name, synced, only when :meth:`close` is called (a killed run leaves a ``.tmp`` file that is overwritten)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.f = open(path + ".tmp", "wb")
        self.offsets: list[int] = []

    def add(self, data: bytes) -> None:
        self.offsets.append(self.f.tell())
        self.f.write(data)

    def close(self) -> None:
        index = json.dumps([*self.offsets, self.f.tell()]).encode()
        self.f.write(index + struct.pack("<Q", len(index)) + _RECORDS_MARK)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.path + ".tmp", self.path)

    def abort(self) -> None:
        self.f.close()
        try:
            os.remove(self.path + ".tmp")
        except OSError:
            pass


class RecordedInputs(Sequence):
    """A block's recorded inputs read from their file one batch at a time (each read anew: nothing is kept)."""

    def __init__(self, path: str, load: Callable[[bytes], Any]) -> None:
        self.path, self.load = path, load
        with open(path, "rb") as f:
            f.seek(0, 2)
            end = f.tell()
            tail = len(_RECORDS_MARK) + 8
            f.seek(max(end - tail, 0))
            last = f.read(tail)
            if end < tail or last[8:] != _RECORDS_MARK:
                raise ModelError(f"{path}: not a file of recorded inputs (remove the run folder to start over)")
            (n,) = struct.unpack("<Q", last[:8])
            f.seek(end - tail - n)
            self.offsets = json.loads(f.read(n))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        with open(self.path, "rb") as f:
            f.seek(self.offsets[i])
            data = f.read(self.offsets[i + 1] - self.offsets[i])
        return self.load(data)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            release_freed_heap()  # the last batch's buffers: the next one starts on a trimmed heap
            yield self[i]


def _record_first(lead: OneShotBackend, io: BlockIO, batches: Sequence[Any], path: str) -> None:
    """Block 0's inputs, computed a batch at a time and written to ``path``."""
    w = _RecordWriter(path)
    try:
        for b in batches:
            for inp in lead.first_inputs([b]):
                w.add(io.dump_input(inp))
            release_freed_heap()
    except BaseException:
        w.abort()
        raise
    w.close()


def _advance_recorded(lead: OneShotBackend, io: BlockIO, block: Any, inputs: RecordedInputs, path: str) -> None:
    """The block's outputs on its recorded ``inputs``, a batch at a time, written to ``path`` (the next block's
    inputs)."""
    w = _RecordWriter(path)
    try:
        for k, inp in enumerate(inputs):
            out = lead.advance(block, [inp])[0]
            if k == 0:
                io.inputs_recorded(out)
            w.add(io.dump_input(out))
            del inp, out
    except BaseException:
        w.abort()
        raise
    w.close()


def _one_sequence(lead: OneShotBackend, inputs: Sequence[Any]) -> list[Any]:
    """The first sequence of ``inputs`` (the probe of :meth:`~OneShotBackend.shared_inputs`: which layers read the
    same tensor is a property of the block's code, and its later calls are checked), or the first batch where the
    backend cannot cut one."""
    first = inputs[0]
    try:
        rows = lead.batch_rows(first)
        return [first if rows in (None, 1) else lead.take_rows(first, [0])]
    except NotImplementedError:
        return [first]


def _say(progress: Any) -> Callable[[str], None]:
    if progress is None or progress is False:
        return lambda msg: None
    if callable(progress):
        return progress
    import sys

    out = sys.stderr if progress is True else progress
    return lambda msg: print(msg, file=out, flush=True)


def check_stages(stages: Sequence[tuple[OneShotBackend, OneShotMethod]], batches: Sequence[Any]) -> None:
    """What a streamed run refuses before it starts: no blocks, a selected layer outside every block (a streamed run
    has no whole-model pass), no calibration data for a method that needs it."""
    if not stages:
        raise ConfigError("a streamed one-shot run needs at least one stage")
    if not list(stages[0][0].blocks()):
        raise ModelError("no repeated blocks (decoder layers) were found in the model: a streamed run compresses "
                         "block by block; give sequential_targets with the block class name")
    for backend, method in stages:
        rest = backend.block_layers(None)
        if rest:
            raise ConfigError(f"{type(method).__name__}: layers outside the decoder blocks are selected "
                              f"({[t.name for t in rest][:4]}); a streamed run compresses blocks only: exclude them "
                              f"(e.g. {{op_names: [lm_head], exclude: true}})")
        if method.statistics is not None and not batches:
            raise ConfigError(f"{type(method).__name__}: the calibration set is empty; give a few hundred sequences")


def run_streamed(stages: Sequence[tuple[OneShotBackend, OneShotMethod]], io: BlockIO, batches: Sequence[Any],
                 store: RunStore, progress: Any = True, samples: int | None = None) -> list[dict[str, Any]]:
    """Compress every block of the model with the recipe's ``stages`` in order, one block in memory at a time,
    resuming after ``store.done`` finished blocks. The stages' backends share one model (the first one finds the
    blocks and runs them); a selected layer outside every block is an error (a streamed run has no whole-model
    pass: exclude it, e.g. ``{op_names: [lm_head], exclude: true}``). Returns the report rows of the blocks
    compressed by this call. ``progress``: True (stderr), False / None, a file, or a function of one line;
    ``samples``: the number of calibration sequences, shown in it."""
    check_stages(stages, batches)
    lead = stages[0][0]
    coll = lead.collective
    say = _say(progress if coll.rank == 0 else None)
    blocks = list(lead.blocks())
    if len(blocks) != store.blocks:
        raise ModelError(f"the model has {len(blocks)} blocks, the run's state counts {store.blocks}")
    rows: list[dict[str, Any]] = []
    start = store.done
    records = _records(io)
    inputs: Sequence[Any] | None = (io.load_inputs(store.inputs_path(start, coll.rank))
                                    if 0 < start < len(blocks) and not records else None)
    t_run = time.perf_counter()
    for i, (name, block) in enumerate(blocks):
        if i < start:
            continue
        t0 = time.perf_counter()
        io.load_block(block)
        try:
            if records:
                here = store.inputs_path(i, coll.rank)
                if i == 0:
                    io.load_outside()
                    try:
                        _record_first(lead, io, batches, here)
                    finally:
                        io.release_outside()
                inputs = RecordedInputs(here, io.load_input)
            elif inputs is None:
                io.load_outside()
                try:
                    inputs = lead.first_inputs(batches)
                finally:
                    io.release_outside()
            n_layers = 0
            for backend, method in stages:
                tasks = backend.block_layers(block)
                n_layers += len(tasks)
                if not tasks:
                    continue
                accs: dict[str, Any] = {}
                if method.statistics is not None:
                    shared = backend.shared_inputs(block, _one_sequence(lead, inputs), tasks)
                    accs, observe = observers(method, tasks, shared)
                    backend.run_block(block, inputs, observe)
                    observe = None
                    reduce_statistics(coll, accs)  # over several processes: every process's sequences
                undo = Undo(_NoUndo())
                # a method that reads the inputs itself (AWQ's search) gets them in memory
                held = inputs if not records or type(method).compress_block is OneShotMethod.compress_block \
                    else list(inputs)
                with spilling_to(store.folder if records else None):
                    method.compress_block(backend, block, held, tasks, accs, rows, name, undo)
                accs = {}
                held = None
                release_freed_heap()
            if i + 1 < len(blocks):
                if records:
                    _advance_recorded(lead, io, block, inputs, store.inputs_path(i + 1, coll.rank))
                else:
                    inputs = lead.advance(block, inputs)
            if coll.rank == 0:  # every process holds the same compressed block
                io.save_block(block, store.block_path(i))
            if i + 1 < len(blocks) and not records:
                io.save_inputs(inputs, store.inputs_path(i + 1, coll.rank))
        finally:
            io.release_block(block)
        coll.barrier()  # every process's files are written before the state names them
        store.mark_done(i + 1)
        coll.barrier()  # ... and the state is written before any process drops the inputs it replaces
        if os.path.exists(store.inputs_path(i, coll.rank)):  # the inputs of a finished block are not read again
            os.remove(store.inputs_path(i, coll.rank))
        release_freed_heap()
        done, total = i + 1, len(blocks)
        elapsed = time.perf_counter() - t_run
        eta = elapsed / (done - start) * (total - done)
        shown = f", {samples} samples" if samples is not None else ""
        say(f"block {done}/{total} {name}: {n_layers} layer(s){shown}, {time.perf_counter() - t0:.1f} s, elapsed "
            f"{elapsed:.0f} s, ETA {eta:.0f} s{_rss()}")
    return rows


class _NoUndo:
    """A streamed run changes no user model in place (the model is built from the checkpoint for the run): no undo
    copies are kept."""

    @staticmethod
    def snapshot(task: Any) -> None:
        return None


def _rss() -> str:
    """``, RSS <MiB>`` of this process where /proc says it (Linux), else nothing."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return f", RSS {pages * os.sysconf('SC_PAGE_SIZE') / 2**20:.0f} MiB"
    except (OSError, ValueError, IndexError, AttributeError):
        return ""


def check_folders(src: str | os.PathLike[str], out: str | os.PathLike[str], output: str, what: str = "oneshot",
                  first: bool = True) -> tuple[str, str]:
    """The absolute ``(src, out)`` of a streamed run, refused before anything is written: SRC_DIR not a folder,
    OUT_DIR inside it, OUT_DIR existing (``first``: the process that may remove a finished run's leftover folder
    ``OUT_DIR.partial`` then, see :func:`drop_finished_run`; ``output``: the name of the output's folder in it),
    OUT_DIR's folder missing."""
    src, out = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(out))
    if not os.path.isdir(src):
        raise ConfigError(f"{what}: SRC_DIR {src!r} is not a folder")
    if out == src or out.startswith(src + os.sep):
        raise ConfigError(f"{what}: OUT_DIR {out!r} is inside SRC_DIR {src!r}; the source is never written to")
    if os.path.lexists(out):
        if first:
            drop_finished_run(out + ".partial", output)
        raise ConfigError(f"{what}: OUT_DIR {out!r} exists; give a new folder (the output appears there, whole, at "
                          f"the end)")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ConfigError(f"{what}: the folder of OUT_DIR, {parent!r}, does not exist")
    return src, out


def check_disk_space(out: str, source_bytes: int, tokens: int, hidden: int, what: str = "oneshot") -> None:
    """Refuse a run the disk beside ``out`` cannot hold: the output and the run folder's block states (each at
    most the source's ``source_bytes``) and one block's recorded inputs (``tokens`` x ``hidden`` float32, twice)."""
    need = 2 * source_bytes + 2 * tokens * hidden * 4
    free = shutil.disk_usage(os.path.dirname(out)).free
    if free < need:
        raise ConfigError(f"{what}: {free / 2**30:.2f} GiB free beside OUT_DIR, the run needs about {need / 2**30:.2f} "
                          f"GiB (the output and the run folder's block states, each at most the source's "
                          f"{source_bytes / 2**30:.2f} GiB, and one block's recorded inputs)")


def drop_finished_run(work: str, output: str) -> None:
    """A run killed between OUT_DIR's rename and the removal of its run folder ``work`` left that folder behind, its
    work done: remove it (only a folder whose state says every block is finished and that holds no output folder
    ``output`` of ours)."""
    try:
        with open(os.path.join(work, "state", "state.json"), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return
    if isinstance(state, dict) and state.get("done") == state.get("blocks") and not os.path.exists(
            os.path.join(work, output)):
        shutil.rmtree(work, ignore_errors=True)
