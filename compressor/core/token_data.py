"""Calibration token ids for the streaming one-shot command (``--data PATH``), as an int64 array
``[num_samples, seq_len]``; numpy only.

The forms a user holds, by ``PATH``:

* a ``.npy`` file: an integer array ``[sequences, length]`` of token ids, memory-mapped (only the part used is
  read). The first ``num_samples`` sequences are used, each cut to its first ``seq_len`` tokens (as a
  tokenizer's truncation keeps the start): the user chose and ordered them.
* a ``.pt`` / ``.pth`` file: the same, written by ``torch.save``; read by the torch backend's loader, passed as
  ``load_pt`` (:func:`compressor.torch.token_data.load_token_file`).
* a text file (any other suffix, UTF-8) or a folder of them (recursively, in sorted path order; hidden
  files and folders and files that are not UTF-8 text are skipped): tokenized with ``tokenize`` (the
  checkpoint's tokenizer, no special tokens) into one stream of ids, file after file, of at most
  ``max_text_tokens`` tokens (default :data:`TEXT_READ_FACTOR` x ``num_samples * seq_len``, never fewer than
  ``num_samples * seq_len``: a huge corpus is read, and its files looked at, only that far). ``num_samples``
  windows of ``seq_len`` consecutive tokens are cut from the stream, spread evenly over it
  (:func:`token_windows`: the first starts at token 0, the last ends at the stream's end), never overlapping:
  a stream shorter than ``num_samples * seq_len`` is refused with the largest ``num_samples`` and ``seq_len``
  it allows, rather than repeating tokens (which would weigh them twice in the statistics) or silently
  calibrating on fewer samples than asked (llmcompressor warns and takes fewer).
  A file is tokenized whole up to :data:`TEXT_CHUNK_BYTES`; a larger one in pieces of whole lines of about
  that size.

Every refusal is a :class:`~compressor.core.errors.ConfigError` naming the data (``what`` and the path), what
is wrong and what is allowed.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError

__all__ = [
    "TEXT_CHUNK_BYTES", "TEXT_READ_FACTOR", "calibration_tokens", "check_token_array", "check_token_layout",
    "cut_token_array", "text_token_stream", "token_windows",
]

#: suffixes read as arrays by numpy / by the torch backend's ``load_pt``
NUMPY_SUFFIXES = (".npy",)
TORCH_SUFFIXES = (".pt", ".pth")
#: text data: the stream is read up to this many times the tokens the windows need (``max_text_tokens``)
TEXT_READ_FACTOR = 8
#: text data: a file up to this size is tokenized in one call; a larger one in pieces of whole lines
TEXT_CHUNK_BYTES = 4 << 20
#: bytes of a file looked at to tell text from binary in a folder
_SNIFF_BYTES = 8192

_ALLOWED = ("an integer array [sequences, length] of token ids (.npy, or .pt with torch), or UTF-8 text "
            "(a file or a folder) tokenized with the checkpoint's tokenizer")


def _label(source: str | os.PathLike[str], what: str) -> str:
    return f"{what} {os.fspath(source)!r}"


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def check_token_layout(dtype: str, is_integer: bool, shape: Sequence[int], *, source: str | os.PathLike[str],
                       what: str = "--data") -> None:
    """Refuse token ids that are not integers (``dtype`` names the type, e.g. ``'float32'``) or not 2-D
    ``[sequences, length]``. Split from :func:`check_token_array` so a framework's tensors get the same
    messages without becoming numpy first (a bfloat16 tensor cannot)."""
    label = _label(source, what)
    if not is_integer:
        raise ConfigError(f"{label}: token ids must be integers, got dtype {dtype}; allowed: {_ALLOWED}")
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2:
        hint = (" (one stream of ids: cut it into rows first, e.g. ids[:n * L].reshape(n, L))"
                if len(shape) == 1 else "")
        raise ConfigError(f"{label}: token ids must be a 2-D array [sequences, length], got shape {shape}{hint}")


def check_token_array(array: np.ndarray, *, source: str | os.PathLike[str], what: str = "--data") -> None:
    """Refuse a numpy array of token ids that is not an integer array ``[sequences, length]`` (the values are
    checked by :func:`cut_token_array`, on the part used only)."""
    check_token_layout(str(array.dtype), bool(np.issubdtype(array.dtype, np.integer)), array.shape,
                       source=source, what=what)


def _check_ids(ids: np.ndarray, label: str, vocab_size: int | None) -> np.ndarray:
    """``ids`` (any integer dtype) as int64, refusing negative ids, ids above int64 and ids >= ``vocab_size``;
    the message gives the first bad id's position."""
    def where(bad: np.ndarray) -> str:
        pos = [int(p) for p in np.unravel_index(int(np.flatnonzero(bad)[0]), ids.shape)]
        return f"position {pos[0]}" if len(pos) == 1 else f"row {pos[0]}, column {pos[1]}"

    if ids.size and np.issubdtype(ids.dtype, np.signedinteger) and ids.min() < 0:
        bad = ids < 0
        raise ConfigError(f"{label}: token ids must be >= 0, got {int(ids[bad][0])} at {where(bad)}")
    if ids.size and ids.dtype == np.uint64 and ids.max() > np.iinfo(np.int64).max:
        bad = ids > np.iinfo(np.int64).max
        raise ConfigError(f"{label}: token id {int(ids[bad][0])} at {where(bad)} does not fit int64")
    out = np.ascontiguousarray(ids, dtype=np.int64)
    if vocab_size is not None and out.size and out.max() >= vocab_size:
        bad = out >= vocab_size
        raise ConfigError(f"{label}: token id {int(out[bad][0])} at {where(bad)} is outside the vocabulary "
                          f"(vocab_size {vocab_size}: ids 0..{vocab_size - 1})")
    return out


def cut_token_array(array: np.ndarray, *, num_samples: int, seq_len: int, source: str | os.PathLike[str],
                    what: str = "--data", vocab_size: int | None = None) -> np.ndarray:
    """The first ``num_samples`` rows of ``array`` (token ids ``[sequences, length]``, e.g. memory-mapped), each
    cut to its first ``seq_len`` ids, as a fresh int64 array; refuses too few or too short sequences and bad
    ids (negative, or >= ``vocab_size`` when given) in that part."""
    num_samples, seq_len = _positive(num_samples, "num_samples"), _positive(seq_len, "seq_len")
    check_token_array(array, source=source, what=what)
    label = _label(source, what)
    rows, length = array.shape
    if rows < num_samples:
        raise ConfigError(f"{label}: holds {rows} sequences, num_samples = {num_samples} asks for more; give "
                          f"more sequences or ask for at most {rows}")
    if length < seq_len:
        raise ConfigError(f"{label}: its sequences have {length} tokens, seq_len = {seq_len} asks for more; give "
                          f"longer sequences or ask for a seq_len of at most {length}")
    return _check_ids(np.asarray(array[:num_samples, :seq_len]), label, vocab_size)


def token_windows(stream: np.ndarray, *, num_samples: int, seq_len: int, source: str | os.PathLike[str],
                  what: str = "--data") -> np.ndarray:
    """``num_samples`` windows of ``seq_len`` consecutive ids of the 1-D ``stream``, spread evenly: window ``i``
    starts at ``i * (T - seq_len) // (num_samples - 1)`` (``T``: the stream's length), so the first starts at
    0 and the last ends at ``T``; windows never overlap, so ``T < num_samples * seq_len`` is refused."""
    num_samples, seq_len = _positive(num_samples, "num_samples"), _positive(seq_len, "seq_len")
    total = int(stream.shape[0])
    need = num_samples * seq_len
    if total < need:
        raise ConfigError(
            f"{_label(source, what)}: the text gives {total} tokens; {num_samples} windows of {seq_len} tokens "
            f"need {need} (windows never overlap, no token is used twice); give more text, or ask for at most "
            f"{total // seq_len} samples (num_samples) or a seq_len of at most {total // num_samples}")
    if num_samples == 1:
        starts = [0]
    else:
        starts = [i * (total - seq_len) // (num_samples - 1) for i in range(num_samples)]
    out = np.empty((num_samples, seq_len), dtype=np.int64)
    for i, s in enumerate(starts):
        out[i] = stream[s:s + seq_len]
    return out


def _is_text(path: Path) -> bool:
    """Whether ``path`` looks like UTF-8 text: no NUL byte and valid UTF-8 in its first bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError:
        return False
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _SNIFF_BYTES)
    except UnicodeDecodeError:
        return False
    return True


def _walk(folder: Path) -> Iterator[Path]:
    """The files under ``folder`` in sorted path order (name by name, depth first), hidden ones left out."""
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            yield from _walk(entry)
        elif entry.is_file():
            yield entry


def _text_files(path: Path, label: str) -> Iterator[Path]:
    """The text files of ``path``: itself, or a folder's in sorted path order, hidden ones and binary ones
    skipped (looked at lazily, so a huge folder is listed and sniffed only as far as it is read)."""
    if not path.is_dir():
        if not _is_text(path):
            raise ConfigError(f"{label}: neither a .npy / .pt token array nor UTF-8 text; allowed: {_ALLOWED}")
        yield path
        return
    found = False
    for file in _walk(path):
        if _is_text(file):
            found = True
            yield file
    if not found:
        raise ConfigError(f"{label}: the folder holds no UTF-8 text files (hidden and binary files are skipped); "
                          f"allowed: {_ALLOWED}")


def _pieces(path: Path, label: str, chunk_bytes: int) -> Iterator[str]:
    """The text of ``path`` in pieces of whole lines of about ``chunk_bytes`` (one piece for a smaller file)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, offset = "", 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            try:
                text = carry + decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise ConfigError(f"{label}: {os.fspath(path)!r} is not UTF-8 text (byte {offset + e.start}); "
                                  f"allowed: {_ALLOWED}") from None
            offset += len(block)
            if not block:
                if text:
                    yield text
                return
            cut = text.rfind("\n") + 1
            if cut == 0 and len(text) < 4 * chunk_bytes:
                carry = text  # one long line so far: keep it whole
                continue
            cut = cut or len(text)
            yield text[:cut]
            carry = text[cut:]


def text_token_stream(path: str | os.PathLike[str], tokenize: Callable[[str], Sequence[int]], *, max_tokens: int,
                      what: str = "--data", chunk_bytes: int = TEXT_CHUNK_BYTES) -> np.ndarray:
    """The token ids (int64, 1-D) of the text file or folder ``path``, file after file in sorted order, at most
    ``max_tokens`` of them: reading stops once the stream has that many."""
    label = _label(path, what)
    max_tokens = _positive(max_tokens, "max_tokens")
    parts: list[np.ndarray] = []
    total = 0
    for file in _text_files(Path(path), label):
        for piece in _pieces(file, label, chunk_bytes):
            ids = np.asarray(tokenize(piece))
            if ids.size == 0:
                continue
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise ConfigError(f"{label}: the tokenizer must return a list of int ids, got "
                                  f"{ids.dtype} of shape {ids.shape} for {os.fspath(file)!r}")
            parts.append(_check_ids(ids, f"{label}: tokenizer output for {os.fspath(file)!r}", None))
            total += ids.size
            if total >= max_tokens:
                return np.concatenate(parts)[:max_tokens]
    if not parts:
        raise ConfigError(f"{label}: the text gives no tokens; allowed: {_ALLOWED}")
    return np.concatenate(parts)


def calibration_tokens(path: str | os.PathLike[str], *, num_samples: int, seq_len: int,
                       tokenize: Callable[[str], Sequence[int]] | None = None,
                       load_pt: Callable[[Path], np.ndarray] | None = None, vocab_size: int | None = None,
                       max_text_tokens: int | None = None, what: str = "--data") -> np.ndarray:
    """Calibration token ids ``[num_samples, seq_len]`` (int64) from ``path``: a ``.npy`` array, a ``.pt`` array
    (read by ``load_pt``, the torch backend's loader), or a text file or folder tokenized by ``tokenize``; see the
    module docstring for how each is cut. ``vocab_size`` (the checkpoint's) refuses ids it does not have;
    ``max_text_tokens`` bounds how far text is read. ConfigError on anything else, before any output exists."""
    num_samples, seq_len = _positive(num_samples, "num_samples"), _positive(seq_len, "seq_len")
    p = Path(path)
    label = _label(path, what)
    if not p.exists():
        raise ConfigError(f"{label}: no such file or folder")
    suffix = p.suffix.lower() if p.is_file() else ""
    if suffix in NUMPY_SUFFIXES:
        try:
            array = np.load(p, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{label}: not a readable .npy array ({e}); allowed: {_ALLOWED}") from None
        return cut_token_array(array, num_samples=num_samples, seq_len=seq_len, source=path, what=what,
                               vocab_size=vocab_size)
    if suffix in TORCH_SUFFIXES:
        if load_pt is None:
            raise ConfigError(f"{label}: a {suffix} token file is read by the torch backend "
                              f"(compressor.torch.token_data.load_token_file); without it, save the ids with "
                              f"numpy.save as .npy")
        return cut_token_array(load_pt(p), num_samples=num_samples, seq_len=seq_len, source=path, what=what,
                               vocab_size=vocab_size)
    if tokenize is None:
        next(_text_files(p, label))  # binary data or a folder without text: say that first
        raise ConfigError(f"{label}: text data needs the checkpoint's tokenizer (tokenizer.json), and there is "
                          f"none; or give the token ids as an integer array [sequences, length] (.npy / .pt)")
    need = num_samples * seq_len
    budget = max(need, max_text_tokens if max_text_tokens is not None else TEXT_READ_FACTOR * need)
    stream = text_token_stream(p, tokenize, max_tokens=budget, what=what)
    windows = token_windows(stream, num_samples=num_samples, seq_len=seq_len, source=path, what=what)
    return _check_ids(windows, label, vocab_size)
