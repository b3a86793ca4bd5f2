"""The compressed-tensors checkpoint format (Hugging Face / vLLM), in numpy only: write, read, report.

A checkpoint is a folder with ``config.json`` (its ``quantization_config`` entry says how each layer is
stored) and ``*.safetensors`` files. What this module knows of the format (compressed-tensors 0.20; the
sparse formats of compressed-tensors <= 0.14, which 0.15+ no longer read):

* ``pack-quantized`` (integer weight-only, 1..8 bits): ``<layer>.weight_packed`` int32 ``[out, ceil(in * b
  / 32)]``, each row's codes ``c + 2^(b-1)`` (signed codes ``c`` in ``[-2^(b-1), 2^(b-1) - 1]``) as one
  little-endian bit stream, ``b`` bits each; ``<layer>.weight_scale`` ``[out, groups]`` (the model's float
  dtype), ``<layer>.weight_shape`` int64 ``[2]``; asymmetric: ``<layer>.weight_zero_point`` int32, the
  signed zero points packed the same way along the OUTPUT axis (``[ceil(out * b / 32), groups]``). The
  layer computes with ``(c - zp) * scale`` per group (``strategy`` ``group``: ``group_size`` must divide
  ``in``; ``channel``: one group per row).
* ``sparse-bitmask``: ``<layer>.compressed`` (the non-zero values, row-major), ``<layer>.bitmask`` uint8
  ``[out, ceil(in / 8)]`` (little bit order), ``<layer>.row_offsets`` int64 ``[out]``, ``<layer>.shape``.
* ``sparse-24-bitmask``: ``<layer>.compressed`` ``[out, in / 2]`` (two kept values of every 4),
  ``<layer>.bitmask``, ``<layer>.shape`` int64 ``[2, 1]``.

The safetensors container is read and written here too (8-byte little-endian header length, a JSON header
of ``{name: {dtype, shape, data_offsets}}``, the raw little-endian bytes), so the reader and the report need
neither torch nor the ``safetensors`` package. Every read checks the file against its header (truncation,
overlapping or out-of-file offsets, sizes vs shapes) and the tensors against the config before anything
is returned.

What the reader (:func:`load_compressed_tensors`, :func:`checkpoint_report`) refuses, with a
:class:`CheckpointError` naming the file (or config.json) and the layer or tensor, rather than return weights
it cannot decode exactly:

* a file that is not a regular file (FIFO, device, folder; a link to one), or that cannot be read;
* a layer lacking a tensor its format needs: a tensor of a compressed format (``weight_packed``,
  ``weight_scale``, ``weight_shape``, ``weight_zero_point``; ``compressed``, ``bitmask``, ``row_offsets`` when
  the config names a sparse format) makes its layer that format, so a missing scale or values tensor is an
  error, never raw codes or a raw bitmask returned as the weight; a plain ``<layer>.weight`` of integers, or
  of a layer a quantized config group names exactly, is refused too; ``weight_g_idx`` (activation order) is
  not applied, so it is refused;
* a tensor whose dtype or shape differs from what config.json implies (codes, scales, zero points, shapes,
  bitmasks, values, row offsets); packed codes or zero points with bits set in the padding past the last code
  (a 4-bit tensor read as 2 bits fills the same words), naive codes or zero points outside ``num_bits``, a
  symmetric layer holding non-zero zero points;
* a config value of the wrong type: ``symmetric`` and ``dynamic`` must be JSON booleans (``"false"`` is
  refused, naming the key and the value), ``num_bits`` an int in 1..8, ``group_size`` an int dividing the
  input columns;
* a ``re:`` target outside the subset matched here (see :class:`_Regex`: an automaton, linear in the name,
  never Python's backtracking ``re``), longer than TARGET_MAX_CHARS, of more than TARGET_MAX_STATES states, or
  targets taking more than MATCH_MAX_STEPS steps in all;
* a safetensors header of more than HEADER_BASE + a quarter of its file's tensor data (refused before it is
  read), a tensor of more than MAX_DIMS axes;
* weights decoding to more than :func:`decoded_cap` bytes (DECODED_BASE + DECODED_RATIO x the files' size:
  the 4-bit weights of a float32 model decode to 8x their bytes, 2-bit ones to 16x; raise it with
  ``max_bytes=`` or COMPRESSOR_MAX_DECODED_BYTES), checked from the headers before anything is decoded.

Files are memory-mapped, not read: a tensor's bytes are touched only when it is decoded, CHUNK values at a
time, so the reader holds the decoded weights (:func:`load_compressed_tensors`; the report holds none) plus
a few MiB.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .atomic import recover_for_reading
from .cmpk import env_decoded_cap
from .errors import ConfigError, ModelError
from .oneshot.codes import stored_code_width, stored_codes_to_full

__all__ = [
    "CheckpointError", "pack_int32", "pack_stored_int32", "unpack_int32", "pack_bitmask", "unpack_bitmask", "read_safetensors",
    "read_safetensors_header", "write_safetensors", "quant_args", "pack_quantized_entries", "naive_quantized_entries",
    "bitmask_entries", "sparse24_entries", "is_24_sparse", "load_compressed_tensors", "checkpoint_report",
    "format_checkpoint_report", "DTYPES",
]


class CheckpointError(ModelError):
    """A compressed-tensors checkpoint that is corrupted, inconsistent or in a format this reader lacks."""


#: safetensors dtype names -> numpy dtypes (BF16 is read as its bit pattern and widened to float32)
DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k != "BF16"}


# ----------------------------------------------------------------------------------------- bit packing
def pack_int32(codes: np.ndarray, bits: int) -> np.ndarray:
    """Signed ``bits``-bit codes ``[rows, cols]`` -> int32 ``[rows, ceil(cols * bits / 32)]``: per row the
    values ``code + 2^(bits-1)`` as one little-endian bit stream (compressed-tensors' dense packing)."""
    c = np.asarray(codes)
    if c.ndim != 2:
        raise ValueError(f"pack_int32: codes must be 2-D, got shape {c.shape}")
    if not 1 <= bits <= 8:
        raise ValueError(f"pack_int32: bits must be in 1..8, got {bits}")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if c.size and (c.min() < lo or c.max() > hi):
        raise ValueError(f"pack_int32: codes outside the signed {bits}-bit range [{lo}, {hi}]")
    rows, cols = c.shape
    u = (c.astype(np.int64) - lo).astype(np.uint8)
    stream = ((u[:, :, None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(rows, cols * bits)
    padded = math.ceil(cols / 32) * 32 * bits
    stream = np.pad(stream, ((0, 0), (0, padded - cols * bits)))
    words = np.packbits(stream, axis=1, bitorder="little").view("<u4").astype(np.uint32)
    return words[:, :math.ceil(cols * bits / 32)].view(np.int32).copy()


def pack_stored_int32(stored: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """:func:`pack_int32` of signed codes as the one-shot quantizer wrappers keep them
    (:func:`~compressor.core.oneshot.codes.store_codes`: ``[rows, ceil(cols / 2)]`` int8 at 4 bits or fewer).
    At 4 bits the wrappers' nibbles are already in compressed-tensors' order (column ``2k`` low, ``2k + 1`` high,
    little-endian words), so each word is four stored bytes with every nibble's top bit flipped (two's complement
    ``v`` to ``v + 8``): the codes are converted once, from the layout they are kept in to the checkpoint's,
    without a byte per code in between. Other widths are unpacked to one code per entry and packed."""
    s = np.asarray(stored)
    if bits != 4:
        return pack_int32(stored_codes_to_full(s, bits, cols), bits)
    width = stored_code_width(cols, bits)
    if s.ndim != 2 or s.dtype != np.int8 or s.shape[1] != width:
        raise ValueError(f"pack_stored_int32: 4-bit codes of {cols} columns are kept as int8 [rows, {width}], got "
                         f"{s.dtype} of shape {s.shape}")
    words = math.ceil(cols / 8)
    b = np.zeros((s.shape[0], 4 * words), dtype=np.uint8)
    b[:, :width] = s.view(np.uint8) ^ 0x88
    if cols % 2:  # the odd last column's partner nibble is padding: zero bits, as pack_int32 pads
        b[:, width - 1] &= 0x0F
    return b.view("<u4").view(np.int32).copy()


def unpack_int32(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """Inverse of :func:`pack_int32`: int8 codes ``[rows, cols]``."""
    p = np.ascontiguousarray(packed, dtype=np.int32)
    if p.ndim != 2:
        raise ValueError(f"unpack_int32: packed must be 2-D, got shape {p.shape}")
    rows, words = p.shape
    if words != math.ceil(cols * bits / 32):
        raise ValueError(f"unpack_int32: {words} words per row cannot hold {cols} codes of {bits} bits "
                         f"(expected {math.ceil(cols * bits / 32)})")
    stream = np.unpackbits(p.astype("<i4").view(np.uint8), axis=1, bitorder="little")[:, :cols * bits]
    u = (stream.reshape(rows, cols, bits).astype(np.int32) << np.arange(bits, dtype=np.int32)).sum(axis=2)
    return (u - (1 << (bits - 1))).astype(np.int8)


def pack_bitmask(mask: np.ndarray) -> np.ndarray:
    """Bool ``[rows, cols]`` -> uint8 ``[rows, ceil(cols / 8)]`` (little bit order)."""
    return np.packbits(np.asarray(mask, dtype=bool), axis=-1, bitorder="little")


def unpack_bitmask(bits: np.ndarray, cols: int) -> np.ndarray:
    return np.unpackbits(np.asarray(bits, dtype=np.uint8), axis=-1, count=cols, bitorder="little").astype(bool)


# ----------------------------------------------------------------------------------------- safetensors
#: caps on what a checkpoint's files may declare (see the module docstring): safetensors' own header cap; a
#: header at most HEADER_BASE + a quarter of the tensor data it describes (real headers take ~100 bytes per
#: tensor, their tensors far more); at most MAX_DIMS axes per tensor; config.json / the index at most
#: JSON_MAX_BYTES
SAFETENSORS_MAX_HEADER = 100_000_000
HEADER_BASE = 1 << 20
MAX_DIMS = 32
JSON_MAX_BYTES = 64 << 20
_MAX_TENSOR_BYTES = 1 << 60


def _open_regular(path: str, what: str) -> Any:
    """``path`` opened for binary reading once it is known to be a regular file (a FIFO would block, a device
    or ``/proc`` file would read without end or fail); any OSError is a CheckpointError naming the file."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path!r}: {what} is not a regular file (a directory, FIFO, socket or device); "
                                  f"a checkpoint's files must be regular files")
        f = open(path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced between the two looks
            f.close()
            raise CheckpointError(f"{path!r}: {what} is not a regular file")
        return f
    except OSError as e:
        raise CheckpointError(f"{path!r}: cannot read {what} ({e.strerror or e})") from None


def _read_exactly(f: Any, n: int, path: str) -> bytes:
    try:
        data = f.read(n)
    except OSError as e:  # an unreadable file that claims a size (e.g. a link to /proc/self/mem)
        raise CheckpointError(f"{path!r}: cannot read the safetensors file ({e.strerror or e})") from None
    if len(data) != n:
        raise CheckpointError(f"{path!r}: truncated safetensors file (it ended while its header was read)")
    return data


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file, checked against the file's size: every tensor's
    byte range lies inside the file, matches its dtype and shape, and no two overlap. Refused before the
    header is read: a file that is not a regular file, and a header longer than SAFETENSORS_MAX_HEADER or
    than HEADER_BASE + a quarter of the tensor data behind it."""
    p = os.fspath(path)
    with _open_regular(p, "the safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:  # checked before reading: a /proc file claims 0 bytes and may fail on read
            raise CheckpointError(f"{p!r}: truncated safetensors file ({size} bytes, no header length)")
        n = int.from_bytes(_read_exactly(f, 8, p), "little")
        if n <= 0 or 8 + n > size:
            raise CheckpointError(f"{p!r}: truncated or corrupted safetensors file (header of {n} bytes, file "
                                  f"of {size})")
        if n > SAFETENSORS_MAX_HEADER:
            raise CheckpointError(f"{p!r}: safetensors header of {n:,} bytes, more than the {SAFETENSORS_MAX_HEADER:,} "
                                  f"allowed (the safetensors format's own cap)")
        data = size - 8 - n
        if n > HEADER_BASE + data // 4:
            raise CheckpointError(f"{p!r}: safetensors header of {n:,} bytes for {data:,} bytes of tensor data, more "
                                  f"than the {HEADER_BASE + data // 4:,} allowed ({HEADER_BASE:,} + a quarter of the "
                                  f"data: a real header takes ~100 bytes per tensor)")
        try:
            header = json.loads(_read_exactly(f, n, p).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{p!r}: corrupted safetensors header ({e})") from None
        except RecursionError:
            raise CheckpointError(f"{p!r}: corrupted safetensors header (nested too deeply)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{p!r}: corrupted safetensors header (not a JSON object)")
    start = 8 + n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], list(info["shape"]), info["data_offsets"]
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{p!r}: tensor {name!r}: malformed header entry {str(info)[:200]}") from None
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(f"{p!r}: tensor {name!r}: dtype {dtype!r} is not supported by this reader "
                                  f"(supported: {sorted(DTYPES)})")
        if len(shape) > MAX_DIMS:
            raise CheckpointError(f"{p!r}: tensor {name!r}: shape of {len(shape)} axes (at most {MAX_DIMS})")
        itemsize = 2 if dtype == "BF16" else np.dtype(DTYPES[dtype]).itemsize
        if math.prod(max(d, 1) for d in shape) * itemsize >= _MAX_TENSOR_BYTES:
            raise CheckpointError(f"{p!r}: tensor {name!r}: shape {shape} is too large (over {_MAX_TENSOR_BYTES:,} bytes "
                                  f"counting its non-zero axes)")
        if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b) or b - a != itemsize * math.prod(shape):
            raise CheckpointError(f"{p!r}: tensor {name!r}: byte range {a}..{b} does not match {dtype} {shape}")
        if b > data:
            raise CheckpointError(f"{p!r}: truncated safetensors file: tensor {name!r} ends at byte {b} of the "
                                  f"data, which has {data}")
        spans.append((a, b, name))
    spans.sort()
    for (_, b0, n0), (a1, _, n1) in zip(spans, spans[1:]):
        if a1 < b0:
            raise CheckpointError(f"{p!r}: corrupted safetensors header: tensors {n0!r} and {n1!r} overlap")
    return header, start


class _Stored:
    """One tensor of a safetensors file, memory-mapped (nothing is read until a piece of it is asked for):
    ``dtype`` is what it reads as (BF16 widened to float32), ``get(index)`` a piece of it in memory."""

    __slots__ = ("raw", "bf16", "shape", "dtype", "nbytes", "path")

    def __init__(self, raw: np.ndarray, kind: str, nbytes: int, path: str) -> None:
        self.raw, self.bf16, self.shape, self.nbytes, self.path = raw, kind == "BF16", tuple(raw.shape), nbytes, path
        self.dtype = np.dtype(np.float32) if self.bf16 else np.dtype(DTYPES[kind])

    def flat(self) -> _Stored:
        """The same tensor seen as 1-D (still mapped)."""
        f = copy.copy(self)
        f.raw, f.shape = self.raw.reshape(-1), (self.size,)
        return f

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def get(self, index: Any = ...) -> np.ndarray:
        part = self.raw[index]
        if self.bf16:
            return (part.astype(np.uint32) << 16).view(np.float32)
        return part.astype(self.dtype)  # little-endian bytes -> a native array of its own


def _mapped(path: str) -> dict[str, _Stored]:
    """The tensors of a safetensors file (header checked), memory-mapped: ``{name: _Stored}``."""
    header, start = read_safetensors_header(path)
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    region = np.zeros(0, np.uint8)
    if end:
        try:
            with _open_regular(path, "the safetensors file") as f:
                region = np.memmap(f, dtype=np.uint8, mode="r", offset=start, shape=(end,))
        except (ValueError, OSError) as e:  # the file changed since its header was read
            raise CheckpointError(f"{path!r}: cannot map the safetensors file ({e})") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        kind = info["dtype"]
        dt = np.dtype("<u2") if kind == "BF16" else np.dtype(DTYPES[kind]).newbyteorder("<")
        shape = [int(d) for d in info["shape"]]
        raw = region[a:b].view(dt).reshape(shape) if b > a else np.zeros(shape, dt)
        out[name] = _Stored(raw, kind, b - a, path)
    return out


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as numpy arrays (BF16 widened to float32), each read from the
    memory-mapped file into an array of its own (the file is not read into memory as a whole)."""
    return {name: t.get() for name, t in _mapped(os.fspath(path)).items()}


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str] | None = None, bf16: frozenset[str] | set[str] = frozenset()) -> int:
    """Write ``tensors`` (numpy arrays) as a safetensors file (names sorted, data contiguous, header padded
    to 8 bytes); names in ``bf16`` hold bfloat16 bit patterns as uint16. Returns the file size."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset, arrays = 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        is_bf16 = name in bf16 and arr.dtype == np.uint16
        if arr.dtype not in _NAMES and not is_bf16:
            raise ValueError(f"write_safetensors: tensor {name!r} has dtype {arr.dtype}, not one of "
                             f"{sorted(str(d) for d in _NAMES)} (or bfloat16 bit patterns as uint16 named in bf16)")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        kind = "BF16" if is_bf16 else _NAMES[arr.dtype]
        header[name] = {"dtype": kind, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(os.fspath(path), "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for arr in arrays:  # straight from the arrays' memory: no second copy of the tensors
            f.write(memoryview(arr.reshape(-1)).cast("B"))
    return 8 + len(text) + offset


# ----------------------------------------------------------------------------------------- writing
def quant_args(bits: int, group_size: int | None, symmetric: bool) -> dict[str, Any]:
    """The ``weights`` entry of a compressed-tensors scheme for integer weight-only quantization."""
    return {"num_bits": int(bits), "type": "int", "symmetric": bool(symmetric),
            "strategy": "channel" if group_size is None else "group", "group_size": group_size,
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
            "observer_kwargs": {}}


def pack_quantized_entries(name: str, codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, bits: int,
                           symmetric: bool, scale_dtype: Any = np.float32, *,
                           stored_cols: int | None = None) -> dict[str, np.ndarray]:
    """The ``pack-quantized`` tensors of layer ``name`` from our codes (``[out, in]``; symmetric: signed,
    affine: unsigned ``[0, 2^b - 1]`` with unsigned zero points ``[out, groups]``); affine codes and zero
    points are shifted by ``-2^(b-1)`` into compressed-tensors' signed range, which leaves ``code - zp``
    unchanged. ``stored_cols``: symmetric ``codes`` are in the quantizer wrappers' layout for that many input
    columns (:func:`pack_stored_int32`)."""
    if stored_cols is not None:
        if not symmetric:
            raise ValueError("pack_quantized_entries: stored_cols is for symmetric codes")
        packed = pack_stored_int32(codes, bits, stored_cols)
        shape = (np.asarray(codes).shape[0], stored_cols)
    else:
        c = np.asarray(codes).astype(np.int32)
        shift = 0 if symmetric else 1 << (bits - 1)
        packed, shape = pack_int32(c - shift, bits), c.shape
    out = {f"{name}.weight_packed": packed,
           f"{name}.weight_scale": np.asarray(scale).astype(scale_dtype),
           f"{name}.weight_shape": np.asarray(shape, dtype=np.int64)}
    if not symmetric:
        zp = np.asarray(zero_point).astype(np.int32) - shift
        out[f"{name}.weight_zero_point"] = np.ascontiguousarray(pack_int32(zp.T, bits).T)
    return out


def naive_quantized_entries(name: str, codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, bits: int,
                            symmetric: bool, scale_dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """The ``naive-quantized`` tensors of layer ``name``: ``<layer>.weight`` int8 signed codes (one byte
    each), ``<layer>.weight_scale``, asymmetric: ``<layer>.weight_zero_point`` int8 ``[out, groups]``
    (unpacked). Used for asymmetric layers: compressed-tensors 0.20 loads ``pack-quantized`` zero points
    unpacked, so an asymmetric packed checkpoint does not reload through transformers."""
    shift = 0 if symmetric else 1 << (bits - 1)
    out = {f"{name}.weight": (np.asarray(codes).astype(np.int32) - shift).astype(np.int8),
           f"{name}.weight_scale": np.asarray(scale).astype(scale_dtype)}
    if not symmetric:
        out[f"{name}.weight_zero_point"] = (np.asarray(zero_point).astype(np.int32) - shift).astype(np.int8)
    return out


def is_24_sparse(weight: np.ndarray) -> bool:
    """True when every 4 consecutive inputs of each row hold at most 2 non-zeros (and 4 divides ``in``)."""
    w = np.asarray(weight)
    return w.ndim == 2 and w.shape[1] % 4 == 0 and bool(np.all(
        np.count_nonzero(w.reshape(w.shape[0], -1, 4), axis=2) <= 2))


def bitmask_entries(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
    """The ``sparse-bitmask`` tensors of layer ``name``'s float weight ``[out, in]``."""
    w = np.asarray(weight)
    mask = w != 0
    counts = mask.sum(axis=1)
    return {f"{name}.compressed": w[mask], f"{name}.bitmask": pack_bitmask(mask),
            f"{name}.row_offsets": (np.cumsum(counts) - counts).astype(np.int64),
            f"{name}.shape": np.asarray(w.shape, dtype=np.int64)}


def sparse24_entries(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
    """The ``sparse-24-bitmask`` tensors of a 2:4 float weight ``[out, in]``: in each group of 4 the two
    non-zeros are kept (a group with fewer keeps zeros at its lowest free positions, so every row holds
    exactly ``in / 2`` values)."""
    w = np.asarray(weight)
    if not is_24_sparse(w):
        raise ValueError(f"layer {name!r}: the weight is not 2:4 sparse")
    g = w.reshape(w.shape[0], -1, 4)
    nz = g != 0
    # rank the positions: non-zeros first, then by position; keep the first two of each group
    order = np.argsort(~nz, axis=2, kind="stable")[:, :, :2]
    keep = np.zeros_like(nz)
    np.put_along_axis(keep, order, True, axis=2)
    mask = keep.reshape(w.shape)
    return {f"{name}.compressed": w[mask].reshape(w.shape[0], w.shape[1] // 2),
            f"{name}.bitmask": pack_bitmask(mask), f"{name}.shape": np.asarray(w.shape, dtype=np.int64).reshape(2, 1)}


# ----------------------------------------------------------------------------------------- re: targets
#: ``re:`` targets of config.json are not run by Python's backtracking ``re`` (``re:([\w.]+)+X`` would take
#: minutes on one layer name) but by an automaton built here from the same syntax, which gives the same
#: answer as ``re.match`` in steps linear in the name: literals, ``.``, classes (``[...]``, ``\d``, ``\w``,
#: ``\s`` and their negations), groups (``(...)``, ``(?:...)``, ``(?P<name>...)``), ``|``, the quantifiers
#: ``* + ? {m,n}`` (greedy or lazy), ``^``, ``$``, ``\A``, ``\Z``. Refused: backreferences, lookarounds,
#: ``\b`` / ``\B``, inline flags, atomic groups and possessive quantifiers, a pattern over TARGET_MAX_CHARS
#: characters or TARGET_MAX_STATES automaton states (``{m,n}`` copies its body), and a checkpoint whose
#: targets take more than MATCH_MAX_STEPS automaton steps to match against its layer names.
TARGET_MAX_CHARS = 1000
TARGET_MAX_STATES = 4000
MATCH_MAX_STEPS = 20_000_000
_SUPPORTED = ("literals, '.', classes, groups, '|', quantifiers * + ? {m,n}, '^', '$', '\\A' and '\\Z'")


class _Budget:
    """Automaton steps left for matching one checkpoint's ``re:`` targets against its layer names."""

    def __init__(self, where: str = "config.json") -> None:
        self.left, self.where = MATCH_MAX_STEPS, where

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise CheckpointError(f"{self.where!r}: matching the re: targets against the layer names takes more "
                                  f"than {MATCH_MAX_STEPS:,} automaton steps (MATCH_MAX_STEPS); use fewer or simpler "
                                  f"targets")


class _Regex:
    """One ``re:`` target as a Thompson automaton, matched like ``re.match`` (anchored at the name's start, any
    end) by a lazily built DFA whose states and moves are kept between names."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        if len(pattern) > TARGET_MAX_CHARS:
            self._refuse(f"is {len(pattern):,} characters long (at most {TARGET_MAX_CHARS:,})")
        try:
            re.compile(pattern)  # what re itself refuses is refused the same way; compiling never backtracks
        except (re.error, OverflowError, RecursionError) as e:
            self._refuse(f"is not a valid regular expression ({e})")
        self.states: list[tuple] = []  # ('c', atom, next) | ('e', nexts) | ('a', anchor, next) | ('m',)
        self.atoms: dict[str, Any] = {}
        self.pos = 0
        try:
            tree = self._alt()
            self.accept = self._new(("m",))
            self.start = self._emit(tree, self.accept)
        except RecursionError:
            self._refuse("is nested too deeply")
        self._closures: dict[tuple, frozenset[int]] = {}
        self._moves: dict[tuple, frozenset[int]] = {}

    def _refuse(self, why: str) -> None:
        raise CheckpointError(f"re: target {self.pattern[:100]!r}{'...' if len(self.pattern) > 100 else ''} {why}")

    # ---- parsing (the pattern is valid for re: only the constructs' extents are found here)
    def _peek(self, k: int = 0) -> str:
        i = self.pos + k
        return self.pattern[i] if i < len(self.pattern) else ""

    def _alt(self) -> tuple:
        branches = [self._seq()]
        while self._peek() == "|":
            self.pos += 1
            branches.append(self._seq())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _seq(self) -> tuple:
        items = []
        while self._peek() not in ("", "|", ")"):
            items.append(self._quantified(self._atom()))
        return ("cat", items)

    def _repeat_bounds(self) -> tuple[int, int | None] | None:
        """``(min, max)`` of the ``{...}`` at pos, consumed, or None when it is a literal '{' (as re reads it)."""
        p, i = self.pattern, self.pos + 1
        if i < len(p) and p[i] == "}":
            return None
        j = i
        while j < len(p) and p[j].isdigit() and p[j].isascii():
            j += 1
        lo, hi = p[i:j], None
        if j < len(p) and p[j] == ",":
            k = j + 1
            while k < len(p) and p[k].isdigit() and p[k].isascii():
                k += 1
            hi, j = p[j + 1:k], k
        else:
            hi = lo
        if j >= len(p) or p[j] != "}":
            return None
        self.pos = j + 1
        return (int(lo) if lo else 0), (int(hi) if hi else None)

    def _quantified(self, node: tuple) -> tuple:
        c = self._peek()
        if c in ("*", "+", "?"):
            self.pos += 1
            bounds: tuple[int, int | None] | None = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
            bounds = self._repeat_bounds()
            if bounds is None:
                return node
        else:
            return node
        if self._peek() == "?":
            self.pos += 1  # lazy: the same names match
        elif self._peek() == "+":
            self._refuse("uses a possessive quantifier, which this reader does not match (supported: "
                         f"{_SUPPORTED})")
        return ("rep", node, *bounds)

    def _atom(self) -> tuple:
        p, c = self.pattern, self._peek()
        if c == "(":
            if p.startswith("(?:", self.pos):
                self.pos += 3
            elif p.startswith("(?P<", self.pos):
                self.pos = p.index(">", self.pos) + 1
            elif p.startswith("(?", self.pos):
                self._refuse(f"uses {p[self.pos:self.pos + 3]!r} (lookarounds, inline flags, comments, atomic "
                             f"groups and backreferences are not supported; supported: {_SUPPORTED})")
            else:
                self.pos += 1
            node = self._alt()
            self.pos += 1  # ')'
            return node
        if c == "[":
            j = self.pos + 1
            if p[j] == "^":
                j += 1
            if p[j] == "]":
                j += 1
            while p[j] != "]":
                j += 2 if p[j] == "\\" else 1
            return self._char(p[self.pos:j + 1], j + 1)
        if c == "^":
            self.pos += 1
            return ("anchor", "start")
        if c == "$":
            self.pos += 1
            return ("anchor", "dollar")
        if c == ".":
            return self._char(".", self.pos + 1)
        if c == "\\":
            return self._escape()
        return self._char(re.escape(c), self.pos + 1)  # '{' not starting a repeat, ']', '}' and the rest

    def _escape(self) -> tuple:
        p, i = self.pattern, self.pos + 1
        e = p[i]
        if e == "A":
            self.pos = i + 1
            return ("anchor", "start")
        if e == "Z":
            self.pos = i + 1
            return ("anchor", "end")
        if e in "dDwWsSafnrtv" or not (e.isascii() and e.isalnum()):
            return self._char(p[self.pos:i + 1], i + 1)
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width is not None:
            return self._char(p[self.pos:i + 1 + width], i + 1 + width)
        if e == "N":
            j = p.index("}", i)
            return self._char(p[self.pos:j + 1], j + 1)
        if e == "0":
            j = i + 1
            while j < min(i + 3, len(p)) and p[j] in "01234567":
                j += 1
            return self._char(p[self.pos:j], j)
        if e in "1234567" and p[i + 1:i + 2] in tuple("01234567") and p[i + 2:i + 3] in tuple("01234567"):
            return self._char(p[self.pos:i + 3], i + 3)  # a three-digit octal escape
        what = "a backreference" if e.isdigit() else f"'\\{e}'"
        self._refuse(f"uses {what}, which this reader does not match (supported: {_SUPPORTED})")
        raise AssertionError  # unreachable

    def _char(self, text: str, end: int) -> tuple:
        """A one-character atom (its regex text, matched by re on single characters only)."""
        self.pos = end
        if text not in self.atoms:
            self.atoms[text] = re.compile(text)
        return ("char", text)

    # ---- the automaton, built backwards from each node's continuation
    def _new(self, state: tuple) -> int:
        if len(self.states) >= TARGET_MAX_STATES:
            self._refuse(f"needs more than {TARGET_MAX_STATES:,} automaton states (its {{m,n}} repeats copy their "
                         f"body)")
        self.states.append(state)
        return len(self.states) - 1

    def _emit(self, node: tuple, nxt: int) -> int:
        kind = node[0]
        if kind == "char":
            return self._new(("c", self.atoms[node[1]], nxt))
        if kind == "anchor":
            return self._new(("a", node[1], nxt))
        if kind == "cat":
            for item in reversed(node[1]):
                nxt = self._emit(item, nxt)
            return nxt
        if kind == "alt":
            return self._new(("e", tuple(self._emit(b, nxt) for b in node[1])))
        _, body, lo, hi = node
        if hi is None:  # a loop: the body, back to the fork
            fork = self._new(("e", ()))
            self.states[fork] = ("e", (self._emit(body, fork), nxt))
            tail = fork
        else:
            tail = nxt
            for _ in range(hi - lo):
                tail = self._new(("e", (self._emit(body, tail), nxt)))
        for _ in range(lo):
            tail = self._emit(body, tail)
        return tail

    # ---- matching
    def _closure(self, states: frozenset[int], ctx: tuple[bool, bool, bool], budget: _Budget) -> frozenset[int]:
        key = (states, ctx)
        got = self._closures.get(key)
        if got is None:
            seen, stack = set(states), list(states)
            while stack:
                s = self.states[stack.pop()]
                if s[0] == "e":
                    nexts: tuple[int, ...] = s[1]
                elif s[0] == "a" and ctx[("start", "dollar", "end").index(s[1])]:
                    nexts = (s[2],)
                else:
                    continue
                for t in nexts:
                    if t not in seen:
                        seen.add(t)
                        stack.append(t)
            budget.spend(len(seen))
            got = self._closures[key] = frozenset(s for s in seen if self.states[s][0] in ("c", "m"))
        return got

    def match(self, name: str, budget: _Budget) -> bool:
        """``re.match(pattern, name) is not None``, in at most ``len(name) + 1`` moves."""
        n = len(name)

        def ctx(i: int) -> tuple[bool, bool, bool]:
            return i == 0, i == n or (i == n - 1 and name[-1] == "\n"), i == n

        cur = self._closure(frozenset((self.start,)), ctx(0), budget)
        for i, ch in enumerate(name):
            if self.accept in cur:
                return True
            if not cur:
                return False
            budget.spend(1)
            key = (cur, ch)
            step = self._moves.get(key)
            if step is None:
                step = self._moves[key] = frozenset(
                    s[2] for s in map(self.states.__getitem__, cur) if s[0] == "c" and s[1].fullmatch(ch))
                budget.spend(len(cur))
            cur = self._closure(step, ctx(i + 1), budget)
        return self.accept in cur


class _Targets:
    """The config's targets matched against layer names: exact names, class names (never equal to a layer
    name) and ``re:`` patterns (:class:`_Regex`), each pattern compiled once and each answer kept."""

    def __init__(self, where: str = "config.json") -> None:
        self.where, self.budget = where, _Budget(where)
        self._regex: dict[str, _Regex] = {}
        self._answers: dict[tuple[str, str], bool] = {}

    def matches(self, target: Any, name: str) -> bool:
        if not isinstance(target, str):
            raise CheckpointError(f"a target {target!r} of the config is not a string")
        if not target.startswith("re:"):
            return target == name
        key = (target, name)
        got = self._answers.get(key)
        if got is None:
            rx = self._regex.get(target)
            if rx is None:
                try:
                    rx = self._regex[target] = _Regex(target[3:])
                except CheckpointError as e:
                    raise CheckpointError(f"{self.where!r}: {e}") from None
            got = self._answers[key] = rx.match(name, self.budget)
        return got


# ----------------------------------------------------------------------------------------- reading
#: the tensors that make a layer quantized / sparse (``<layer>.<leaf>``); a quantized layer's codes are
#: ``weight_packed`` (pack-quantized) or ``weight`` (naive-quantized), a sparse layer's ``shape`` joins them
_QUANT_LEAVES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
_SPARSE_LEAVES = ("compressed", "bitmask", "row_offsets")
_QFORMATS = (None, "dense", "pack-quantized", "naive-quantized", "mixed-precision")
_QUANTIZED = ("pack-quantized", "naive-quantized")
_SPARSE_FORMATS = ("sparse-bitmask", "sparse-24-bitmask")
#: the decoded weights together at most DECODED_BASE + DECODED_RATIO x the files' size (see the module
#: docstring), raised with ``max_bytes=`` or COMPRESSOR_MAX_DECODED_BYTES; decoded CHUNK values at a time
DECODED_BASE = 32 << 20
DECODED_RATIO = 16
CHUNK = 1 << 16


def decoded_cap(files_bytes: int, max_bytes: int | None = None) -> int:
    """The most bytes of weights :func:`load_compressed_tensors` / :func:`checkpoint_report` decode from
    checkpoint files of ``files_bytes`` bytes: ``max_bytes``, else the environment variable
    COMPRESSOR_MAX_DECODED_BYTES, else DECODED_BASE + DECODED_RATIO x ``files_bytes``."""
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        return max_bytes
    env = env_decoded_cap()
    return env if env is not None else DECODED_BASE + DECODED_RATIO * int(files_bytes)


def _read_json(path: str, what: str) -> dict[str, Any]:
    """A JSON object from the regular file ``path`` (at most JSON_MAX_BYTES), or CheckpointError naming it."""
    with _open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > JSON_MAX_BYTES:
            raise CheckpointError(f"{path!r}: {what} of {size:,} bytes, more than the {JSON_MAX_BYTES:,} allowed")
        try:
            raw = f.read(size + 1)
            while size < len(raw) <= JSON_MAX_BYTES:  # it holds more than its size says (a /proc file): up to the cap
                more = f.read(1 << 20)
                if not more:
                    break
                raw += more
        except OSError as e:
            raise CheckpointError(f"{path!r}: cannot read {what} ({e.strerror or e})") from None
    if len(raw) > JSON_MAX_BYTES:
        raise CheckpointError(f"{path!r}: {what} of more than the {JSON_MAX_BYTES:,} bytes allowed")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path!r}: corrupted {what} ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path!r}: corrupted {what} (nested too deeply)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path!r}: corrupted {what} (not a JSON object)")
    return data


def _read_config(folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder!r} is not a checkpoint folder")
    if not os.path.lexists(cfg_path):
        raise CheckpointError(f"{folder!r}: no config.json (a compressed-tensors checkpoint has one)")
    config = _read_json(cfg_path, "config.json")
    qc = config.get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise CheckpointError(f"{cfg_path!r}: quantization_config is a {type(qc).__name__}, not an object")
    if qc and qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{cfg_path!r}: quantization_config.quant_method is {qc.get('quant_method')!r}; "
                              f"this reader knows 'compressed-tensors' only")
    return config, qc


def _files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.lexists(index):
        weight_map = _read_json(index, "index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index!r}: corrupted index (no weight_map object)")
        if not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index!r}: corrupted index (weight_map values must be file names)")
        names = sorted(set(weight_map.values()), key=str)
        bad = [n for n in names if not (isinstance(n, str) and n.endswith(".safetensors") and os.path.basename(n) == n
                                        and n not in (".", ".."))]
        if bad:
            raise CheckpointError(f"{index!r}: the index names files that are not .safetensors files inside the "
                                  f"checkpoint folder: {[str(b)[:80] for b in bad[:4]]}")
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(f"{folder!r}: no .safetensors files (pickled checkpoints are not read)")
    missing = [n for n in names if not os.path.lexists(os.path.join(folder, n))]
    if missing:
        raise CheckpointError(f"{folder!r}: files named by the index are missing: {missing}")
    return [os.path.join(folder, n) for n in names]  # each refused by _open_regular unless a regular file


@dataclass
class _Layer:
    name: str
    kind: str  # 'pack-quantized', 'naive-quantized', 'sparse-bitmask', 'sparse-24-bitmask', 'dense'
    tensors: dict[str, _Stored] = field(default_factory=dict)  # by leaf ('' for a dense tensor)
    stored: int = 0  # bytes in the files
    where: str = ""  # the file of its first tensor
    scheme: tuple[str, dict[str, Any]] | None = None  # quantized: (config group, its weights args)

    def bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.where!r}: layer {self.name!r} ({self.kind}): {why}")


class _Config:
    """config.json's quantization_config, checked where it is read: ``re:`` targets matched by :class:`_Targets`,
    values of the wrong type named with their key."""

    def __init__(self, path: str, qc: dict[str, Any]) -> None:
        self.path, self.qc, self.targets = path, qc, _Targets(path)
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
            raise self.bad("config_groups must be an object of {group name: scheme object}")
        for g, scheme in groups.items():
            t = scheme.get("targets", [])
            if not isinstance(t, list) or not all(isinstance(x, str) for x in t):
                raise self.bad(f"config_groups.{g}.targets is {str(t)[:100]}, expected a list of strings")
        self.groups: dict[str, dict[str, Any]] = groups
        self.format = qc.get("format") if groups else None
        sc = qc.get("sparsity_config") or {}
        if not isinstance(sc, dict):
            raise self.bad(f"sparsity_config is a {type(sc).__name__}, not an object")
        self.sparse = sc.get("format")
        if self.format not in _QFORMATS:
            raise self.bad(f"quantization_config.format {self.format!r} is not supported by this reader (supported: "
                           f"{[f for f in _QFORMATS if f]})")
        if self.sparse not in (None, "dense", *_SPARSE_FORMATS):
            raise self.bad(f"sparsity_config.format {self.sparse!r} is not supported by this reader (supported: "
                           f"'sparse-bitmask', 'sparse-24-bitmask', 'dense')")
        ignore = qc.get("ignore") or []
        self.ignore = set(ignore) if isinstance(ignore, list) and all(isinstance(x, str) for x in ignore) else set()

    def bad(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path!r}: {why}")

    def group_format(self, group: str) -> Any:
        return self.groups[group].get("format") or self.format

    def scheme_of(self, name: str) -> tuple[str, dict[str, Any]]:
        """``(group name, weights args)`` of the one config group whose targets match layer ``name``."""
        hit = [g for g, s in self.groups.items() if any(self.targets.matches(t, name) for t in s.get("targets", []))]
        if not hit:  # class-name targets ('Linear'): without the model, only a single group is unambiguous
            hit = list(self.groups) if len(self.groups) == 1 else []
        if len(hit) != 1 or not isinstance(self.groups[hit[0]].get("weights"), dict):
            raise self.bad(f"layer {name!r} holds quantized weights but config_groups give {len(hit)} matching "
                           f"schemes with weights (expected exactly one)")
        return hit[0], self.groups[hit[0]]["weights"]

    def named_target(self, name: str) -> str | None:
        """The quantized config group naming layer ``name`` exactly in its targets (not in ``ignore``)."""
        if name in self.ignore:
            return None
        return next((g for g, s in self.groups.items() if name in s.get("targets", [])
                     and self.group_format(g) in _QUANTIZED), None)

    def weight_args(self, layer: _Layer) -> tuple[int, bool, str, int | None]:
        """``(bits, symmetric, strategy, group_size)`` of a quantized layer's scheme, every value checked."""
        group, args = layer.scheme  # type: ignore[misc]

        def wrong(key: str, expected: str) -> CheckpointError:
            return self.bad(f"config_groups.{group}.weights.{key} is {args.get(key)!r} (used by layer "
                            f"{layer.name!r}); expected {expected}")

        bits, sym, strategy, gs = args.get("num_bits"), args.get("symmetric", True), args.get("strategy"), \
            args.get("group_size")
        if args.get("type", "int") != "int":
            raise wrong("type", "'int' (this reader decodes integer weights only)")
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise wrong("num_bits", "an int in 1..8")
        if not isinstance(sym, bool):
            raise wrong("symmetric", "true or false (a JSON boolean, not a string or number)")
        dynamic = args.get("dynamic", False)
        if dynamic is not None and not isinstance(dynamic, bool):
            raise wrong("dynamic", "false (a JSON boolean)")
        if dynamic:
            raise wrong("dynamic", "false (weights quantized dynamically store no scales to decode)")
        if args.get("actorder") in (True, "group"):
            raise wrong("actorder", "null, 'weight' or 'static' (activation-order group indices, weight_g_idx, are "
                        "not applied by this reader)")
        if strategy not in ("group", "channel"):
            raise wrong("strategy", "'group' or 'channel' (the strategies this reader decodes)")
        if strategy == "group" and (isinstance(gs, bool) or not isinstance(gs, int) or gs < 1):
            raise wrong("group_size", "a positive int for strategy 'group'")
        return bits, sym, strategy, gs if strategy == "group" else None


def _layers(tensors: dict[str, _Stored], cfg: _Config) -> list[_Layer]:
    """The checkpoint's tensors grouped by layer and format: a tensor of a compressed layer's format (see
    _QUANT_LEAVES, _SPARSE_LEAVES) makes its layer that format, whatever else is missing; the config must
    agree with every layer's format."""
    sparse_on = cfg.sparse in _SPARSE_FORMATS
    quant = {k.rpartition(".")[0] for k in tensors if k.rpartition(".")[2] in _QUANT_LEAVES}
    sparse = {k.rpartition(".")[0] for k in tensors
              if k.rpartition(".")[2] in _SPARSE_LEAVES and (sparse_on or k.endswith(".compressed"))}
    layers: dict[tuple[bool, str], _Layer] = {}
    for key, t in tensors.items():
        prefix, _, leaf = key.rpartition(".")
        if prefix in quant and (leaf in _QUANT_LEAVES or leaf == "weight"):
            kind = "quantized"
        elif prefix in sparse and (leaf in _SPARSE_LEAVES or leaf == "shape"):
            kind = "sparse"
        else:
            prefix, leaf, kind = key, "", "dense"
        layer = layers.setdefault((kind == "dense", prefix), _Layer(prefix, kind, where=t.path))
        layer.tensors[leaf] = t
        layer.stored += t.nbytes
    outputs = {layer.name for (dense, _), layer in layers.items() if dense}
    for (_, name), layer in layers.items():
        leaves = sorted(f"{name}.{k}" for k in layer.tensors)
        if layer.kind == "quantized":
            if name in sparse:
                raise layer.bad("holds both quantized and sparse tensors; this reader decodes one format per layer")
            stored = "pack-quantized" if "weight_packed" in layer.tensors else "naive-quantized"
            if not cfg.groups:
                layer.kind = stored
                raise layer.bad(f"holds quantized tensors {leaves} but the config has no "
                                f"quantization_config.config_groups")
            layer.scheme = cfg.scheme_of(name)
            fmt = cfg.group_format(layer.scheme[0])
            if fmt not in _QUANTIZED:
                layer.kind = stored
                raise layer.bad(f"holds quantized tensors {leaves} but config group {layer.scheme[0]!r} says format "
                                f"{fmt!r}")
            layer.kind = fmt
            if stored == "pack-quantized" and fmt == "naive-quantized":
                raise layer.bad(f"is stored pack-quantized ({name}.weight_packed) but the config says {fmt!r}")
            if "weight" in layer.tensors and fmt == "pack-quantized":
                raise layer.bad(f"holds {name}.weight beside the pack-quantized tensors {leaves}")
            if "weight_g_idx" in layer.tensors:
                raise layer.bad(f"holds {name}.weight_g_idx (activation-order group indices), which this reader "
                                f"does not apply")
        elif layer.kind == "sparse":
            stored = "sparse-24-bitmask" if "row_offsets" not in layer.tensors else "sparse-bitmask"
            layer.kind = cfg.sparse if sparse_on else stored
            if not sparse_on:
                raise layer.bad(f"is stored {stored} but sparsity_config.format is {cfg.sparse!r}")
            if f"{name}.weight" in outputs:
                raise layer.bad(f"is stored {layer.kind} and also as a dense {name}.weight")
        else:
            t = layer.tensors[""]
            prefix, _, leaf = name.rpartition(".")
            if leaf == "weight" and cfg.groups:
                group = cfg.named_target(prefix)
                if group is not None:
                    raise CheckpointError(
                        f"{layer.where!r}: layer {prefix!r} is a target of config group {group!r} "
                        f"({cfg.group_format(group)}) but is stored as a plain {name}: the tensors that format needs "
                        f"({prefix}.weight_packed / {prefix}.weight, {prefix}.weight_scale) are missing")
                if t.dtype.kind in "iu" and any(cfg.group_format(g) in _QUANTIZED for g in cfg.groups):
                    raise CheckpointError(
                        f"{layer.where!r}: {name!r} holds {t.dtype} values (quantized codes?) but there is no "
                        f"{prefix}.weight_scale: a quantized layer needs its scales")
    return list(layers.values())


def _need(layer: _Layer, *keys: str) -> list[_Stored]:
    missing = [f"{layer.name}.{k}" for k in keys if k not in layer.tensors]
    if missing:
        raise layer.bad(f"lacks {missing}, which the {layer.kind} format needs")
    return [layer.tensors[k] for k in keys]


def _shape2(layer: _Layer, key: str) -> tuple[int, int]:
    (t,) = _need(layer, key)
    if t.dtype.kind not in "iu" or t.size != 2:
        raise layer.bad(f"{layer.name}.{key} is {t.dtype} {list(t.shape)}, expected 2 integers (the weight's shape)")
    s = t.get().reshape(-1)
    if np.any(s < 1) or np.any(s >= _MAX_TENSOR_BYTES):
        raise layer.bad(f"{layer.name}.{key} {s.tolist()} is not a 2-D weight shape")
    return int(s[0]), int(s[1])


def _blocks(rows: int, cols: int) -> Iterator[tuple[int, int, int, int]]:
    """``(r0, r1, c0, c1)`` tiles of about CHUNK values covering ``[rows, cols]``; columns split at multiples
    of 32 (a word of packed codes of any width starts there)."""
    cstep = cols if cols <= CHUNK else max(32, CHUNK // 32 * 32)
    rstep = max(1, CHUNK // max(cstep, 1))
    for r0 in range(0, rows, rstep):
        for c0 in range(0, cols, cstep):
            yield r0, min(rows, r0 + rstep), c0, min(cols, c0 + cstep)


def _check_padding(layer: _Layer, packed: _Stored, n: int, bits: int, key: str, what: str) -> None:
    """The bits past the ``n`` codes of ``bits`` bits in the last word of each ``what`` (row / column) of
    ``packed`` are zero, as compressed-tensors (and this module) pad: set bits mean the data holds more or wider
    codes than the config says (a 4-bit tensor read as 2 bits fits the same words)."""
    used = n * bits % 32
    if not used or not packed.size:
        return
    last = packed.get(np.s_[:, -1]) if what == "row" else packed.get(np.s_[-1, :])
    bad = np.flatnonzero(last.view(np.uint32) >> np.uint32(used))
    if bad.size:
        raise layer.bad(f"{layer.name}.{key} has bits set past the {n} codes of {bits} bits of {what} {int(bad[0])} "
                        f"(the padding is zero as written): the codes are wider or more than the config's num_bits "
                        f"and shape say")


def _zero_points(layer: _Layer, out: int, groups: int, bits: int) -> np.ndarray:
    """The signed zero points ``[out, groups]`` (int32) of an asymmetric quantized layer, checked."""
    (zpp,) = _need(layer, "weight_zero_point")
    if layer.kind == "naive-quantized":
        if zpp.shape != (out, groups) or zpp.dtype.kind not in "iu":
            raise layer.bad(f"weight_zero_point is {zpp.dtype} {list(zpp.shape)}, expected integers {[out, groups]}")
        zp = zpp.get().astype(np.int64)
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if zp.size and (zp.min() < lo or zp.max() > hi):
            raise layer.bad(f"zero points outside the signed {bits}-bit range [{lo}, {hi}]")
        return zp.astype(np.int32)
    if zpp.dtype != np.int32 or zpp.shape != (math.ceil(out * bits / 32), groups):
        raise layer.bad(f"weight_zero_point is {zpp.dtype} {list(zpp.shape)}, expected int32 "
                        f"{[math.ceil(out * bits / 32), groups]}")
    _check_padding(layer, zpp, out, bits, "weight_zero_point", "column")
    return unpack_int32(np.ascontiguousarray(zpp.get().T), bits, out).T.astype(np.int32)


_Decoded = tuple[tuple[int, ...], np.dtype, dict[str, Any], Callable[[], Iterator[tuple[Any, np.ndarray]]]]


def _decode(layer: _Layer, cfg: _Config) -> _Decoded:
    """``(shape, dtype, facts for the report, blocks)`` of one layer's float weight, its tensors checked against
    the config here (dtypes, shapes); ``blocks()`` yields ``(index, values)`` pieces of the weight (an index
    of ``out.reshape(-1)`` for a dense tensor, of ``out`` otherwise) and checks the values as it reads them."""
    n = layer.name
    if layer.kind == "dense":
        t = layer.tensors[""]

        def dense() -> Iterator[tuple[Any, np.ndarray]]:
            flat = t.flat()
            for a in range(0, t.size, CHUNK):
                yield np.s_[a:a + CHUNK], flat.get(np.s_[a:a + CHUNK])

        return t.shape, t.dtype, {"dtype": str(t.dtype)}, dense
    if layer.kind in _QUANTIZED:
        bits, sym, strategy, gs = cfg.weight_args(layer)
        (scale,) = _need(layer, "weight_scale")
        if layer.kind == "pack-quantized":
            out, cols = _shape2(layer, "weight_shape")
            (q,) = _need(layer, "weight_packed")
            if q.dtype != np.int32 or q.shape != (out, math.ceil(cols * bits / 32)):
                raise layer.bad(f"weight_packed is {q.dtype} {list(q.shape)}, expected int32 "
                                f"{[out, math.ceil(cols * bits / 32)]} for weight_shape {[out, cols]} at {bits} bits")
        else:
            (q,) = _need(layer, "weight")
            if q.dtype != np.int8 or q.ndim != 2:
                raise layer.bad(f"{n}.weight is {q.dtype} {list(q.shape)}, expected 2-D int8 codes")
            out, cols = q.shape
        if strategy == "group":
            if cols % gs:  # type: ignore[operator]
                raise cfg.bad(f"config_groups.{layer.scheme[0]}.weights.group_size {gs} does not divide the {cols} "  # type: ignore[index]
                              f"input columns of layer {n!r}")
            groups = cols // gs  # type: ignore[operator]
        else:
            groups, gs = 1, cols
        if scale.shape != (out, groups) or scale.dtype.kind != "f":
            raise layer.bad(f"weight_scale is {scale.dtype} {list(scale.shape)}, expected a float {[out, groups]}")
        zp = None
        if not sym:
            zp = _zero_points(layer, out, groups, bits)
        elif "weight_zero_point" in layer.tensors:  # older writers kept zeros for symmetric layers: only zeros
            zpp = layer.tensors["weight_zero_point"]
            try:
                nonzero = bool(np.any(_zero_points(layer, out, groups, bits)))
            except CheckpointError:
                nonzero = zpp.dtype.kind not in "iu" or zpp.size != out * groups or bool(np.any(zpp.get()))
            if nonzero:
                raise layer.bad(f"config group {layer.scheme[0]!r} says symmetric, but {n}.weight_zero_point holds "  # type: ignore[index]
                                f"non-zero zero points (is 'symmetric' right?)")
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        packed = layer.kind == "pack-quantized"
        if packed:  # the bits past each row's last code are zero (the writer pads so): else num_bits is wrong
            _check_padding(layer, q, cols, bits, "weight_packed", "row")

        def quantized() -> Iterator[tuple[Any, np.ndarray]]:
            s32 = None
            for r0, r1, c0, c1 in _blocks(out, cols):
                if c0 == 0:
                    s32 = scale.get(np.s_[r0:r1]).astype(np.float32)
                if packed:
                    w0 = c0 * bits // 32
                    codes = unpack_int32(q.get(np.s_[r0:r1, w0:w0 + math.ceil((c1 - c0) * bits / 32)]), bits,
                                         c1 - c0).astype(np.int32)
                else:
                    codes = q.get(np.s_[r0:r1, c0:c1]).astype(np.int32)
                    if codes.size and (codes.min() < lo or codes.max() > hi):
                        raise layer.bad(f"codes outside the signed {bits}-bit range [{lo}, {hi}]")
                gidx = np.arange(c0, c1) // gs
                z = np.zeros((r1 - r0, 1), np.int32) if zp is None else zp[r0:r1][:, gidx]
                yield np.s_[r0:r1, c0:c1], ((codes - z) * s32[:, gidx]).astype(scale.dtype)  # type: ignore[index]

        facts = {"bits": bits, "group_size": gs if strategy == "group" else None, "symmetric": sym,
                 "dtype": str(scale.dtype)}
        return (out, cols), scale.dtype, facts, quantized
    # sparse
    out, cols = _shape2(layer, "shape")
    values, bitmask = _need(layer, "compressed", "bitmask")
    if bitmask.dtype != np.uint8 or bitmask.shape != (out, math.ceil(cols / 8)):
        raise layer.bad(f"bitmask is {bitmask.dtype} {list(bitmask.shape)}, expected uint8 {[out, math.ceil(cols / 8)]}")
    if values.dtype.kind != "f":
        raise layer.bad(f"compressed (the kept values) is {values.dtype}, expected a float dtype")
    if layer.kind == "sparse-bitmask":
        (offsets,) = _need(layer, "row_offsets")
        if values.ndim != 1:
            raise layer.bad(f"compressed is {list(values.shape)}, expected 1-D (the kept values, row-major)")
        if offsets.shape != (out,) or offsets.dtype.kind not in "iu":
            raise layer.bad(f"row_offsets is {offsets.dtype} {list(offsets.shape)}, expected integers [{out}]")
    elif values.shape != (out, cols // 2) or cols % 4:
        raise layer.bad(f"2:4 values are {list(values.shape)}, expected {[out, cols // 2]}")
    flat = values.flat()
    rstep = max(1, CHUNK // cols)

    def sparse() -> Iterator[tuple[Any, np.ndarray]]:
        counts = np.zeros(out, np.int64)
        for r0 in range(0, out, rstep):
            counts[r0:r0 + rstep] = unpack_bitmask(bitmask.get(np.s_[r0:r0 + rstep]), cols).sum(axis=1)
        starts = np.concatenate([[0], np.cumsum(counts)])
        if values.size != int(starts[-1]):
            raise layer.bad(f"{values.size} stored values but the bitmask marks {int(starts[-1])}")
        if layer.kind == "sparse-bitmask" and not np.array_equal(offsets.get(), starts[:-1]):
            raise layer.bad("row_offsets do not match the bitmask")
        for r0 in range(0, out, rstep):
            r1 = min(out, r0 + rstep)
            mask = unpack_bitmask(bitmask.get(np.s_[r0:r1]), cols)
            w = np.zeros((r1 - r0, cols), dtype=values.dtype)
            w[mask] = flat.get(np.s_[int(starts[r0]):int(starts[r1])])
            yield np.s_[r0:r1], w

    return (out, cols), values.dtype, {"dtype": str(values.dtype)}, sparse


_Sink = Callable[[_Layer, tuple[int, ...], np.dtype, dict[str, Any], Iterator[tuple[Any, np.ndarray]]], None]


def _load(folder: str, max_bytes: int | None, sink: _Sink) -> tuple[dict[str, Any], int]:
    """Check the checkpoint in ``folder`` (config, files, every layer's tensors, the decoded size against
    :func:`decoded_cap`), then decode it layer by layer into ``sink``; ``(config, files' size)``."""
    folder = os.fspath(folder)
    decoded_cap(0, max_bytes)  # a bad max_bytes / COMPRESSOR_MAX_DECODED_BYTES before any file is opened
    recover_for_reading(folder)  # a killed export into this folder: finished or undone before it is read
    config, qc = _read_config(folder)
    cfg_path = os.path.join(folder, "config.json")
    tensors: dict[str, _Stored] = {}
    size = 0
    for path in _files(folder):
        for k, v in _mapped(path).items():
            if k in tensors:
                raise CheckpointError(f"{folder!r}: tensor {k!r} is stored twice ({tensors[k].path!r} and {path!r})")
            tensors[k] = v
        size += os.path.getsize(path)
    cap = decoded_cap(size, max_bytes)
    try:
        cfg = _Config(cfg_path, qc)
        plans = [(layer, *_decode(layer, cfg)) for layer in _layers(tensors, cfg)]
        total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, _, _ in plans)
        if total > cap:
            raise CheckpointError(f"{folder!r}: its weights decode to {total:,} bytes, more than the {cap:,} this "
                                  f"reader decodes from {size:,} bytes of files ({DECODED_BASE:,} + {DECODED_RATIO}x "
                                  f"the files; pass max_bytes= or set COMPRESSOR_MAX_DECODED_BYTES to read it)")
        for layer, shape, dtype, facts, blocks in plans:
            sink(layer, shape, dtype, facts, blocks())
    except CheckpointError:
        raise
    except (AttributeError, TypeError, KeyError, IndexError, ValueError, OverflowError) as e:
        # a quantization_config of the wrong shape (a number where an object belongs)
        raise CheckpointError(f"{cfg_path!r}: corrupted quantization_config ({type(e).__name__}: {str(e)[:200]})") from None
    return config, size


def load_compressed_tensors(folder: str | os.PathLike, *, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """The float weights of a compressed-tensors checkpoint folder, by the model's own parameter names
    (``<layer>.weight``; other tensors as stored). Raises :class:`CheckpointError` (a ``ModelError``) for
    a truncated / corrupted file, a layer lacking a tensor its format needs, tensors that do not match their
    shapes or the config, a config value of the wrong type, or a format this reader lacks; nothing is
    returned then. The weights may decode to at most :func:`decoded_cap` bytes (``max_bytes`` raises it)."""
    out: dict[str, np.ndarray] = {}

    def keep(layer: _Layer, shape: tuple[int, ...], dtype: np.dtype, facts: dict[str, Any],
             blocks: Iterator[tuple[Any, np.ndarray]]) -> None:
        w = np.empty(shape, dtype)
        target = w.reshape(-1) if layer.kind == "dense" else w
        for index, values in blocks:
            target[index] = values
        out[layer.name if layer.kind == "dense" else f"{layer.name}.weight"] = w

    _load(os.fspath(folder), max_bytes, keep)
    return out


def checkpoint_report(folder: str | os.PathLike, *, max_bytes: int | None = None) -> dict[str, Any]:
    """Per layer (every stored weight of two or more dimensions, and every compressed one): ``format``,
    ``bits``, ``group_size``, ``symmetric``, ``sparsity`` (of the decoded weight), ``bytes`` stored,
    ``dense_bytes`` (the same weight as a float tensor of the checkpoint's float dtype); totals over ALL
    tensors (``bytes`` vs ``dense_bytes``: the float checkpoint of the same model; ``ratio`` None when that is
    0) and the files' size. The weights are decoded a piece at a time, counted and dropped; the same checks
    and cap as :func:`load_compressed_tensors`."""
    rows: list[tuple[_Layer, tuple[int, ...], np.dtype, dict[str, Any], int]] = []

    def count(layer: _Layer, shape: tuple[int, ...], dtype: np.dtype, facts: dict[str, Any],
              blocks: Iterator[tuple[Any, np.ndarray]]) -> None:
        rows.append((layer, shape, dtype, facts, sum(int(np.count_nonzero(values)) for _, values in blocks)))

    config, size = _load(os.fspath(folder), max_bytes, count)
    item = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}.get(
        str(config.get("torch_dtype") or config.get("dtype") or "float32"), 4)
    layers, stored, dense = [], 0, 0
    for layer, shape, dtype, facts, nonzero in rows:
        numel = math.prod(shape)
        d = numel * (item if dtype.kind == "f" else dtype.itemsize)
        stored += layer.stored
        dense += d
        if layer.kind == "dense" and len(shape) < 2:
            continue
        layers.append({"layer": layer.name if layer.kind == "dense" else f"{layer.name}.weight",
                       "format": layer.kind, "shape": list(shape), "bits": facts.get("bits"),
                       "group_size": facts.get("group_size"), "symmetric": facts.get("symmetric"),
                       "sparsity": float(1.0 - nonzero / numel) if numel else 0.0,
                       "bytes": layer.stored, "dense_bytes": d})
    return {"layers": layers, "total": {"bytes": stored, "dense_bytes": dense, "files_bytes": size,
                                        "ratio": stored / dense if dense else None}}


def _shown(name: str) -> str:
    """A name as it can be printed on any terminal: lone surrogates and other unencodable characters escaped."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def format_checkpoint_report(rep: dict[str, Any]) -> str:
    lines = [f"{'layer':<44} {'format':<18} {'bits':>4} {'group':>5} {'sym':>4} {'sparsity':>8} {'bytes':>12} "
             f"{'float':>12}"]
    for r in rep["layers"]:
        sym = "" if r["symmetric"] is None else ("yes" if r["symmetric"] else "no")
        lines.append(f"{_shown(r['layer']):<44} {r['format']:<18} {r['bits'] or '':>4} {r['group_size'] or '':>5} "
                     f"{sym:>4} {r['sparsity']:>8.1%} {r['bytes']:>12,} {r['dense_bytes']:>12,}")
    t = rep["total"]
    ratio = "no float weights" if t["ratio"] is None else f"{t['ratio']:.1%}"
    lines.append(f"total: {t['bytes']:,} bytes of tensors vs {t['dense_bytes']:,} as a float checkpoint "
                 f"({ratio}); files {t['files_bytes']:,} bytes")
    return "\n".join(lines)
