"""The compressed model file (Deep Compression's storage, Han et al. 2016): numpy only, no torch/tensorflow.

``pack(arrays, path)`` writes ``{name: numpy array}`` (a pruned, optionally weight-shared model's weights, as
``export_model`` writes them) and :func:`unpack` reads back arrays equal BIT FOR BIT (dtype, shape and every
bit of every value, ``-0.0`` and NaN payloads included). Per floating-point tensor it stores only:

* **positions** of the kept (non-zero) weights, as a **bitmask** (1 bit per weight) or as **relative
  indices** (the number of zeros before each kept weight, one byte per gap, 255 = "255 more zeros and
  continue", as the paper's filler zeros), in row order or in column order (first axis innermost: a
  Linear layer's dead input, e.g. an MNIST corner pixel, is then one run), whichever codes smallest;
  nothing when (almost) no weight is zero;
* **values**: the kept values' bytes, split into byte planes (all first bytes, then all second bytes, ...
  : exponents and signs compress, mantissas mostly do not), or, when the tensor holds few distinct values
  (weight sharing: at most 2**b centroids), a **codebook** of the distinct values plus one index per kept
  weight (one byte up to 256 centroids, two byte planes up to 65536);

(a weight is "zero" when all its bits are: ``-0.0`` is kept as a value, for bit-exactness, so writers should
store pruned weights as ``+0.0``, as both backends' exports do)

and every stream goes through an entropy coder: **huffman** (our canonical, length-limited Huffman coder
below, as in the paper), **zlib** or **lzma** (Python's standard library), or **raw**. ``codec='auto'``
(default) codes each stream with all of them and keeps the smallest, so the file is never larger than
with any single codec; :func:`packed_sizes` reports the file size under each codec for comparison. Other
tensors (integers, bools: e.g. BatchNorm's ``num_batches_tracked``) are stored as their raw bytes through
the same coders.

File layout (little-endian)::

    magic b"CMPK" | u8 version | 3 reserved bytes | u32 header length | u64 payload length
    header: zlib-compressed JSON {"v", "backend", "meta", "t": [[name, dtype, shape, layout, streams]]}
    payload: the streams, back to back
    u32 CRC-32 of everything before it

Reading validates everything (magic, version, lengths, checksum, header, every stream decoding to exactly
its recorded length, positions inside the tensor, indices inside the codebook) before returning anything;
any problem raises :class:`~compressor.core.errors.CompressedFileError` (a ``ValueError``) naming the file
and what is wrong. The backends load the result into a model only after this, so a bad file never leaves
a partly loaded model.

Huffman streams are cut into blocks of up to 4096 symbols whose bit offsets are stored (4 bytes each), so
decoding runs over all blocks at once with numpy (one vectorised table lookup per symbol position of a
block, or orbit doubling over the bits: see :func:`huffman_decode`) instead of one Python step per symbol.
"""

from __future__ import annotations

import json
import lzma
import math
import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .atomic import atomic_path, recover_for_reading
from .errors import CompressedFileError, ConfigError
from .huffman import huffman_decode, huffman_encode

__all__ = [
    "CODECS", "MAGIC", "PackResult", "decoded_cap", "fits_model", "huffman_decode", "huffman_encode", "pack", "pack_bytes", "packed_sizes",
    "read_info", "unpack", "unpack_bytes",
]

MAGIC = b"CMPK"
VERSION = 1
#: the stream coders; ``'auto'`` picks the smallest per stream
CODECS = ("huffman", "zlib", "lzma", "raw")
_CODE = {"raw": "n", "huffman": "h", "zlib": "z", "lzma": "l"}
_NAME = {v: k for k, v in _CODE.items()}
_PREFIX = struct.Struct("<4sB3xIQ")
_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6}]
#: layouts of a tensor: positions (a: none, m: bitmask, r: relative indices) + values (p: byte planes,
#: s: shared codebook + indices); 'x': raw bytes of a non-float tensor
#: (upper-case M / R: positions and values in column order, the first axis innermost)
_STREAMS = {"x": 1, "ap": 1, "as": 2, "mp": 2, "ms": 3, "rp": 2, "rs": 3, "Mp": 2, "Ms": 3, "Rp": 2, "Rs": 3}


# ------------------------------------------------------------------------------------------------ codecs
def _compress(codec: str, data: bytes) -> bytes:
    if codec == "raw":
        return data
    if codec == "zlib":
        return zlib.compress(data, 9)
    if codec == "lzma":
        return lzma.compress(data, format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
    if codec == "huffman":
        return huffman_encode(np.frombuffer(data, np.uint8))
    raise ValueError(f"unknown codec {codec!r}; allowed: {['auto', *CODECS]}")


#: the most bytes one coded byte can decode to, per codec (what a stream can hold): raw 1; Huffman 8 (every
#: code is at least 1 bit); zlib's deflate at most 1032; LZMA2 (preset 6) about 6900 on long zero runs
_EXPANSION = {"n": (1, 0), "h": (8, 0), "z": (1032, 64), "l": (10000, 1 << 16)}


def _stream_capacity(code: str, clen: int) -> int:
    """The most bytes a ``code`` stream of ``clen`` coded bytes can decode to."""
    ratio, extra = _EXPANSION[code]
    return clen * ratio + extra


def _decompress(code: str, data: bytes, n: int) -> bytes:
    """``data`` decoded to exactly ``n`` bytes, never producing more than ``n + 1`` (incremental, with
    max_length); ValueError otherwise."""
    if code == "n":
        out = data
    elif code == "z":
        d = zlib.decompressobj()
        out = d.decompress(data, n + 1)
        if not d.eof or d.unused_data:
            raise ValueError("zlib stream incomplete or followed by stray bytes")
    elif code == "l":
        d = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_LZMA_FILTERS)
        out = d.decompress(data, n + 1)
        if not d.eof or d.unused_data:
            raise ValueError("lzma stream incomplete or followed by stray bytes")
    elif code == "h":
        out = huffman_decode(data, n).tobytes()
    else:
        raise ValueError(f"unknown codec code {code!r}")
    if len(out) != n:
        raise ValueError(f"decodes to {len(out)} bytes, expected {n}")
    return out


def _best(data: bytes, codec: str) -> tuple[str, bytes]:
    """(codec code, coded bytes): ``codec``, or with 'auto' the smallest of all (first wins a tie)."""
    if codec != "auto":
        return _CODE[codec], _compress(codec, data)
    best = ("n", data)
    if data:
        for c in ("huffman", "zlib", "lzma"):
            coded = _compress(c, data)
            if len(coded) < len(best[1]):
                best = (_CODE[c], coded)
    return best


# ------------------------------------------------------------------------------------------------ tensors
def _uint(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"<u{dtype.itemsize}")


def _planes(bits: np.ndarray) -> bytes:
    """Unsigned little-endian values -> their byte planes (all byte 0s, then all byte 1s, ...)."""
    b = bits.astype(bits.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(bits.size, bits.dtype.itemsize)
    return np.ascontiguousarray(b.T).tobytes()


def _unplanes(data: bytes, dtype: np.dtype, count: int) -> np.ndarray:
    size = _uint(dtype).itemsize
    planes = np.frombuffer(data, np.uint8).reshape(size, count)
    return np.ascontiguousarray(planes.T).view(_uint(dtype)).reshape(-1)


def _relative(idx: np.ndarray) -> bytes:
    """Gaps (zeros before each kept index) as bytes: 255 = 255 more zeros and continue."""
    gaps = np.diff(np.concatenate([[-1], idx])) - 1
    q, r = np.divmod(gaps, 255)
    counts = q + 1
    out = np.full(int(counts.sum()), 255, np.uint8)
    out[np.cumsum(counts) - 1] = r
    return out.tobytes()


def _unrelative(data: bytes, numel: int) -> np.ndarray:
    sym = np.frombuffer(data, np.uint8).astype(np.int64)
    if sym.size and sym[-1] == 255:
        raise ValueError("relative indices end inside a gap")
    term = np.flatnonzero(sym != 255)
    prev = np.concatenate([[-1], term[:-1]])
    gaps = sym[term] + 255 * (term - prev - 1)
    idx = np.cumsum(gaps + 1) - 1
    if idx.size and idx[-1] >= numel:
        raise ValueError("relative indices run past the end of the tensor")
    return idx


def _value_options(vals: np.ndarray) -> dict[str, list[bytes]]:
    opts = {"p": [_planes(vals)]}
    if vals.size:
        book, inv = np.unique(vals, return_inverse=True)
        if book.size <= 65536 and book.size * 2 <= vals.size:
            idx = inv.astype(np.uint8 if book.size <= 256 else np.dtype("<u2")).reshape(-1)
            opts["s"] = [_planes(book), _planes(idx) if idx.dtype.itemsize > 1 else idx.tobytes()]
    return opts


def _encode_tensor(name: str, arr: np.ndarray, codec: str) -> tuple[list[Any], list[bytes]]:
    """Header entry and coded streams of one tensor."""
    a = np.asarray(arr)
    if a.dtype.kind not in "biuf" or a.dtype.itemsize > 8:
        raise ValueError(f"tensor {name!r}: dtype {a.dtype} cannot be packed; allowed: bool, integers, "
                         f"float16/32/64 (cast bfloat16 to float32 first)")
    dt = a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype
    flat = np.ascontiguousarray(a.reshape(-1)).astype(dt, copy=False)
    coded: list[tuple[str, bytes, int]] = []
    if a.dtype.kind != "f":
        code, c = _best(flat.tobytes(), codec)
        layout, coded = "x", [(code, c, flat.nbytes)]
    else:
        bits = flat.view(_uint(dt))
        keep = bits != 0
        k = int(keep.sum())
        # candidates: (position codes, position streams, values in that order); positions and values are
        # coded independently, so each order's best positions + best values is its best layout
        candidates: list[tuple[str, list[bytes], np.ndarray]] = []
        if k == bits.size or 16 * (bits.size - k) < bits.size:  # under 1/16 zeros: the dense layout may win
            candidates.append(("a", [], bits))
        if k < bits.size:
            orders = [("mr", bits, keep)]
            if a.ndim >= 2 and a.shape[0] > 1:  # also column order: e.g. a dead input's weights are one run
                col = np.ascontiguousarray(bits.reshape(a.shape[0], -1).T).reshape(-1)
                orders.append(("MR", col, col != 0))
            for codes, b, kp in orders:
                candidates.append((codes, [np.packbits(kp).tobytes(), _relative(np.flatnonzero(kp))], b[kp]))
        best_layout, best_streams, best_size = None, None, None
        for codes, pos_streams, vals in candidates:
            if codes == "a":
                pos_code, pc = "a", []
            else:
                coded_pos = [(c, [(*_best(s, codec), len(s))]) for c, s in zip(codes, pos_streams)]
                pos_code, pc = min(coded_pos, key=lambda x: len(x[1][0][1]))
            for v, vstreams in _value_options(vals).items():
                vc = [(*_best(s, codec), len(s)) for s in vstreams]
                size = sum(len(c) for _, c, _ in pc + vc)
                if best_size is None or size < best_size:
                    best_layout, best_streams, best_size = pos_code + v, pc + vc, size
        layout, coded = best_layout, best_streams
    entry = [name, dt.str, list(a.shape), layout, [[c, len(d), n] for c, d, n in coded]]
    return entry, [d for _, d, _ in coded]


def _decode_tensor(entry: Any, streams: list[bytes]) -> np.ndarray:
    name, dts, shape, layout, _ = entry
    dt = np.dtype(dts)
    numel = math.prod(shape)
    if layout == "x":
        if len(streams[0]) != numel * dt.itemsize:
            raise ValueError(f"holds {len(streams[0])} bytes for {numel} values of {dt}")
        return np.frombuffer(streams[0], dt).reshape(shape).copy()
    pos, val = layout
    column = pos in "MR"
    pos = pos.lower()
    if pos == "a":
        idx, k, rest = None, numel, streams
    elif pos == "m":
        if len(streams[0]) != (numel + 7) // 8:
            raise ValueError("bitmask has the wrong length")
        keep = np.unpackbits(np.frombuffer(streams[0], np.uint8), count=numel).astype(bool)
        if numel % 8 and np.unpackbits(np.frombuffer(streams[0][-1:], np.uint8))[numel % 8:].any():
            raise ValueError("bitmask padding bits are set")
        idx = np.flatnonzero(keep)
        k, rest = idx.size, streams[1:]
    else:
        idx = _unrelative(streams[0], numel)
        k, rest = idx.size, streams[1:]
    udt = _uint(dt)
    if val == "p":
        if len(rest[0]) != k * dt.itemsize:
            raise ValueError(f"holds {len(rest[0])} value bytes for {k} kept values of {dt}")
        vals = _unplanes(rest[0], dt, k)
    else:
        if len(rest[0]) % dt.itemsize or not rest[0]:
            raise ValueError("codebook has the wrong length")
        book = _unplanes(rest[0], dt, len(rest[0]) // dt.itemsize)
        wide = book.size > 256
        if len(rest[1]) != k * (2 if wide else 1):
            raise ValueError(f"holds {len(rest[1])} index bytes for {k} kept values")
        ind = (_unplanes(rest[1], np.dtype("<u2"), k) if wide else np.frombuffer(rest[1], np.uint8)).astype(np.int64)
        if ind.size and ind.max() >= book.size:
            raise ValueError("a codebook index is out of range")
        vals = book[ind]
    if idx is not None and pos != "a" and np.any(vals == 0):
        raise ValueError("a kept value is zero")
    if idx is None:
        bits = vals
    else:
        bits = np.zeros(numel, udt)
        bits[idx] = vals
    if column:
        if len(shape) < 2 or shape[0] == 0:
            raise ValueError("column order needs a tensor with at least 2 axes")
        bits = bits.reshape(-1, shape[0]).T
    return np.ascontiguousarray(bits).view(dt).reshape(shape).copy()


# ------------------------------------------------------------------------------------------------ files
@dataclass
class PackResult:
    """What :func:`pack` wrote: the file size, the arrays' raw size, and per tensor its layout and codecs."""

    path: str
    bytes: int
    raw_bytes: int
    tensors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Raw array bytes / file bytes."""
        return self.raw_bytes / max(self.bytes, 1)


def pack_bytes(arrays: Mapping[str, Any], codec: str = "auto", backend: str | None = None,
               meta: Mapping[str, Any] | None = None) -> tuple[bytes, list[dict[str, Any]]]:
    """The file content for ``arrays`` and a per-tensor summary (see :func:`pack`)."""
    if codec != "auto" and codec not in CODECS:
        raise ValueError(f"codec = {codec!r} is invalid; allowed: {['auto', *CODECS]}")
    if not isinstance(arrays, Mapping):
        raise TypeError(f"arrays must be a mapping {{name: array}}, got {type(arrays).__name__}")
    entries, payload, summary = [], [], []
    for name, arr in arrays.items():
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be strings, got {name!r}")
        entry, streams = _encode_tensor(name, np.asarray(arr), codec)
        entries.append(entry)
        payload += streams
        summary.append({"name": name, "dtype": entry[1], "shape": tuple(entry[2]), "layout": entry[3],
                        "codecs": [_NAME[s[0]] for s in entry[4]], "raw_bytes": int(np.asarray(arr).nbytes),
                        "bytes": sum(s[1] for s in entry[4])})
    header = {"v": VERSION, "backend": backend, "meta": dict(meta or {}), "t": entries}
    hz = zlib.compress(json.dumps(header, separators=(",", ":")).encode(), 9)
    body = b"".join(payload)
    out = _PREFIX.pack(MAGIC, VERSION, len(hz), len(body)) + hz + body
    return out + struct.pack("<I", zlib.crc32(out)), summary


def _atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file next to it: ``path`` is the old file or the whole
    new one, never a partial write."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def pack(arrays: Mapping[str, Any], path: str | os.PathLike, codec: str = "auto", backend: str | None = None,
         meta: Mapping[str, Any] | None = None) -> PackResult:
    """Write ``arrays`` (``{name: numpy array}``) to the compressed file ``path`` (atomically).

    ``codec``: 'auto' (smallest per stream), 'huffman', 'zlib', 'lzma' or 'raw'. ``backend`` ('torch' /
    'tf') and ``meta`` (JSON-able) are recorded in the header. Returns a :class:`PackResult`.
    """
    data, summary = pack_bytes(arrays, codec, backend, meta)
    p = os.fspath(path)
    _atomic_write(p, data)
    raw = sum(s["raw_bytes"] for s in summary)
    return PackResult(p, len(data), raw, summary)


def packed_sizes(arrays: Mapping[str, Any], codecs: tuple[str, ...] = ("auto", *CODECS)) -> dict[str, int]:
    """File size in bytes of ``arrays`` packed with each codec (nothing is written)."""
    return {c: len(pack_bytes(arrays, c)[0]) for c in codecs}


#: caps of the reader (stated, so a crafted file cannot make it allocate more than about 4x its own size
#: plus the tensors it holds): the header's JSON text may be at most HEADER_BASE + a quarter of the file
#: (real headers are ~100 bytes per tensor; 1 MiB is ~8000 tensors); a tensor at most MAX_DIMS axes;
#: without a model to check against (``unpack``, ``read_info``, ``compressor unpack``) the tensors together
#: at most ``DECODED_BASE + DECODED_RATIO x`` the file's size (a pruned model stores 5-50x less than its
#: raw bytes; an all-zero tensor up to ~1000x), raised with ``max_bytes=`` or the environment variable
#: ``COMPRESSOR_MAX_DECODED_BYTES``. ``load_compressed`` checks every name, shape and dtype against the
#: model first, so the model's own tensors bound what it decodes.
HEADER_BASE = 1 << 20
MAX_DIMS = 32
DECODED_BASE = 256 << 20
DECODED_RATIO = 256
_MAX_DIM = 1 << 48


def env_decoded_cap() -> int | None:
    """The decoded-size cap the environment variable COMPRESSOR_MAX_DECODED_BYTES sets for every reader of compressed
    files (``.cmpk``, compressed-tensors checkpoints), or None when it is not set."""
    env = os.environ.get("COMPRESSOR_MAX_DECODED_BYTES")
    if not env:
        return None
    try:
        return int(env)
    except ValueError:
        raise ConfigError(f"COMPRESSOR_MAX_DECODED_BYTES={env!r} is not an integer number of bytes") from None


def decoded_cap(file_bytes: int, max_bytes: int | None = None) -> int:
    """The most tensor bytes :func:`unpack` decodes from a file of ``file_bytes`` bytes (see the caps above)."""
    if max_bytes is not None:
        return int(max_bytes)
    env = env_decoded_cap()
    return env if env is not None else DECODED_BASE + DECODED_RATIO * int(file_bytes)


def _check_prefix(head: bytes, size: int, where: str) -> tuple[int, int]:
    """``(header length, payload length)`` from the first bytes of a file of ``size`` bytes."""
    def bad(why: str) -> CompressedFileError:
        return CompressedFileError(f"{where}: {why}")

    if size < _PREFIX.size + 4 or len(head) < _PREFIX.size:
        raise bad(f"too short to be a compressed model file ({size} bytes)")
    magic, version, hlen, plen = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise bad(f"not a compressed model file (magic {bytes(magic)!r}, expected {MAGIC!r}); write one with "
                  f"export_model(..., compressed_path=...) or 'compressor pack'")
    if version != VERSION:
        raise bad(f"format version {version} is not supported (this compressor reads version {VERSION})")
    expected = _PREFIX.size + hlen + plen + 4
    if size != expected:
        raise bad(f"file has {size} bytes, its header says {expected} (truncated or appended to)")
    return hlen, plen


def _parse(data: bytes | memoryview, where: str) -> tuple[dict[str, Any], memoryview]:
    def bad(why: str) -> CompressedFileError:
        return CompressedFileError(f"{where}: {why}")

    view = memoryview(data).cast("B")
    hlen, plen = _check_prefix(bytes(view[:_PREFIX.size]), len(view), where)
    (crc,) = struct.unpack_from("<I", view, len(view) - 4)
    if zlib.crc32(view[:-4]) != crc:
        raise bad("checksum mismatch: the file is corrupted")
    cap = HEADER_BASE + len(view) // 4
    try:
        d = zlib.decompressobj()
        text = d.decompress(view[_PREFIX.size:_PREFIX.size + hlen], cap + 1)
        if len(text) > cap:
            raise bad(f"header decompresses to more than {cap} bytes (the cap for a {len(view)}-byte file: "
                      f"{HEADER_BASE} + a quarter of the file)")
        if not d.eof or d.unused_data:
            raise bad("unreadable header (zlib stream incomplete or followed by stray bytes)")
        header = json.loads(text)
    except RecursionError:
        raise bad("unreadable header (nested too deeply)") from None
    except (zlib.error, ValueError) as e:
        if isinstance(e, CompressedFileError):
            raise
        raise bad(f"unreadable header ({e})") from None
    payload = view[_PREFIX.size + hlen:_PREFIX.size + hlen + plen]
    if not isinstance(header, dict) or not isinstance(header.get("t"), list):
        raise bad("header has no tensor list")
    return header, payload


def _check_entry(e: Any) -> str | None:
    """Why a header entry is malformed, or None."""
    if not (isinstance(e, list) and len(e) == 5 and isinstance(e[0], str) and isinstance(e[1], str)
            and isinstance(e[2], list) and isinstance(e[3], str) and isinstance(e[4], list)):
        return "malformed entry"
    try:
        dt = np.dtype(e[1])
    except (TypeError, ValueError, SyntaxError):
        return f"unknown dtype {e[1][:40]!r}"
    if dt.kind not in "biuf" or dt.itemsize > 8 or dt.byteorder == ">":
        return f"unsupported dtype {e[1][:40]!r}"
    if len(e[2]) > MAX_DIMS:
        return f"shape has {len(e[2])} axes (at most {MAX_DIMS})"
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _MAX_DIM for d in e[2]):
        return f"bad shape {str(e[2])[:80]}"
    if e[3] not in _STREAMS or (e[3] != "x") != (dt.kind == "f"):
        return f"bad layout {e[3][:8]!r} for dtype {dt}"
    if len(e[4]) != _STREAMS[e[3]]:
        return f"layout {e[3]!r} needs {_STREAMS[e[3]]} streams, header lists {len(e[4])}"
    for s in e[4]:
        if not (isinstance(s, list) and len(s) == 3 and s[0] in _NAME
                and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in s[1:])):
            return f"bad stream record {str(s)[:80]}"
    return None


def _stream_bound(entry: list[Any], i: int, numel: int) -> tuple[int, int]:
    """``(least, most)`` raw bytes stream ``i`` of a well-formed entry can have for ``numel`` values."""
    size = np.dtype(entry[1]).itemsize
    layout = entry[3]
    n_pos = 0 if layout[0] in "ax" else 1
    if layout == "x" or (layout[0] == "a" and layout[1] == "p"):
        return numel * size, numel * size  # the raw bytes / all values' byte planes
    if i < n_pos:
        if layout[0] in "mM":
            return (numel + 7) // 8, (numel + 7) // 8  # the bitmask
        return 0, numel + numel // 255 + 1  # relative indices: one byte per kept value + 255-gap fillers
    if layout[1] == "p":
        return 0, numel * size
    if i == n_pos:  # codebook: at most one entry per value
        return size, max(numel, 1) * size
    return 0, numel * 2  # codebook indices (1 or 2 bytes per kept value)


def _plan(header: dict[str, Any], payload_len: int, where: str, max_bytes: int | None,
          check: Any) -> list[tuple[list[Any], list[tuple[str, int, int, int]]]]:
    """Every entry validated and every stream placed and bounded, before anything is decoded:
    ``[(entry, [(code, start, coded length, raw length)])]``."""
    plan, names, pos, total = [], set(), 0, 0
    for e in header["t"]:
        why = _check_entry(e)
        name = e[0] if isinstance(e, list) and e and isinstance(e[0], str) else "?"
        if why is not None:
            raise CompressedFileError(f"{where}: tensor {name!r}: {why}")
        if name in names:
            raise CompressedFileError(f"{where}: tensor {name!r} appears twice")
        names.add(name)
        numel = math.prod(e[2])
        nbytes = numel * np.dtype(e[1]).itemsize
        total += nbytes
        streams = []
        for i, (code, clen, rlen) in enumerate(e[4]):
            if pos + clen > payload_len:
                raise CompressedFileError(f"{where}: tensor {name!r}: streams run past the payload")
            least, most = _stream_bound(e, i, numel)
            if not least <= rlen <= most:
                raise CompressedFileError(f"{where}: tensor {name!r}: stream {i} claims {rlen} bytes; a "
                                          f"{e[3]!r} tensor of shape {e[2]} needs {least}..{most}")
            if rlen > _stream_capacity(code, clen):
                raise CompressedFileError(f"{where}: tensor {name!r}: a {_NAME[code]} stream of {clen} bytes "
                                          f"cannot hold the {rlen} bytes it claims")
            streams.append((code, pos, clen, rlen))
            pos += clen
        plan.append((e, streams))
    if pos != payload_len:
        raise CompressedFileError(f"{where}: {payload_len - pos} payload bytes belong to no tensor")
    if check is not None:
        check({e[0]: (tuple(e[2]), np.dtype(e[1])) for e, _ in plan})
    elif total > max_bytes:
        raise CompressedFileError(f"{where}: its tensors hold {total:,} bytes, more than the {max_bytes:,} this "
                                  f"reader decodes from a file of its size (pass max_bytes= or set "
                                  f"COMPRESSOR_MAX_DECODED_BYTES to read it, or load it into its model with "
                                  f"load_compressed, which checks the shapes first)")
    return plan


def unpack_bytes(data: bytes, where: str = "compressed file", max_bytes: int | None = None,
                 check: Any = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``({name: array}, header)`` of a compressed file's content; CompressedFileError when anything is off.

    Every entry, stream length and the total size are checked before any tensor is decoded (see the caps
    above: at most :func:`decoded_cap` bytes, or ``max_bytes``). ``check`` (optional): called with
    ``{name: (shape, dtype)}`` before decoding, to refuse a file that does not fit a model (it raises);
    the size cap is then the caller's (the model's tensors)."""
    view = memoryview(data).cast("B")
    header, payload = _parse(view, where)
    plan = _plan(header, len(payload), where, decoded_cap(len(view), max_bytes), check)
    out: dict[str, np.ndarray] = {}
    for e, placed in plan:
        name = e[0]
        streams = []
        for code, start, clen, rlen in placed:
            try:
                streams.append(_decompress(code, payload[start:start + clen], rlen))
            except (ValueError, zlib.error, lzma.LZMAError, EOFError) as err:
                raise CompressedFileError(f"{where}: tensor {name!r}: {_NAME[code]} stream is corrupt ({err})") from None
        try:
            out[name] = _decode_tensor(e, streams)
        except ValueError as err:
            raise CompressedFileError(f"{where}: tensor {name!r}: {err}") from None
    return out, header


def _read(path: str | os.PathLike) -> tuple[bytes, str]:
    """The file's bytes, after checking its first bytes (magic, version, lengths vs its size on disk): a
    file that is not one is refused without being read whole."""
    p = os.fspath(path)
    recover_for_reading(p)  # a killed export of this file: finished or undone before it is read
    if not os.path.isfile(p):
        what = "is a directory, not a file" if os.path.isdir(p) else "does not exist"
        raise CompressedFileError(f"compressed file {p!r} {what}")
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_PREFIX.size)
            _check_prefix(head, size, repr(p))
            data = bytearray(size)
            data[:len(head)] = head
            got = len(head) + f.readinto(memoryview(data)[len(head):])
    except OSError as e:
        raise CompressedFileError(f"cannot read compressed file {p!r} ({e.strerror or e})") from None
    if got != size:
        raise CompressedFileError(f"{p!r}: file changed while being read ({got} of {size} bytes)")
    return data, p


def fits_model(wanted: Mapping[str, tuple[tuple[int, ...], np.dtype]], where: str, model: str,
               hint: str) -> Any:
    """A ``check=`` callback for :func:`unpack`: refuse a file that does not fit a model from its header alone,
    before any tensor is decoded. ``wanted`` is ``{name: (shape, dtype)}`` of the model's tensors, ``model``
    names the model in the message and ``hint`` says how to load the file instead."""

    def check(declared: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        missing = [k for k in wanted if k not in declared]
        unexpected = [k for k in declared if k not in wanted]
        if missing or unexpected:
            raise CompressedFileError(
                f"{where} does not fit {model}: missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({hint})")
        for key, (shape, want) in wanted.items():
            got_shape, got = declared[key]
            if tuple(got_shape) != tuple(shape):
                raise CompressedFileError(f"{where}: {key!r} has shape {tuple(got_shape)}, the model's is {tuple(shape)}")
            if np.dtype(got).newbyteorder("=") != np.dtype(want).newbyteorder("="):
                raise CompressedFileError(f"{where}: {key!r} is {got}, the model's is {want}")

    return check


def unpack(path: str | os.PathLike, max_bytes: int | None = None, check: Any = None) -> dict[str, np.ndarray]:
    """``{weight name: numpy array}`` stored in the compressed file ``path``, bit for bit as packed (torch:
    state_dict keys; tf: Keras weight paths). Raises CompressedFileError (a ValueError) for a missing,
    truncated, corrupted or foreign file, before returning anything. ``max_bytes`` / ``check``: see
    :func:`unpack_bytes`."""
    data, p = _read(path)
    return unpack_bytes(data, repr(p), max_bytes, check)[0]


def read_info(path: str | os.PathLike, max_bytes: int | None = None) -> dict[str, Any]:
    """The header of a compressed file (backend, meta, per tensor: name, dtype, shape, layout, codecs,
    bytes), after validating the whole file."""
    data, p = _read(path)
    arrays, header = unpack_bytes(data, repr(p), max_bytes)
    tensors = [{"name": e[0], "dtype": e[1], "shape": tuple(e[2]), "layout": e[3],
                "codecs": [_NAME[s[0]] for s in e[4]], "bytes": sum(s[1] for s in e[4]),
                "raw_bytes": int(arrays[e[0]].nbytes)} for e in header["t"]]
    return {"backend": header.get("backend"), "meta": header.get("meta", {}), "bytes": len(data),
            "raw_bytes": sum(t["raw_bytes"] for t in tensors), "tensors": tensors}
