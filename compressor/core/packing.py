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

import heapq
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

from .atomic import atomic_path
from .errors import CompressedFileError, ConfigError

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
_MAX_LEN = 15  # Huffman code length limit: 4-bit lengths, a 32768-entry decoding table
_LZMA_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 6}]
#: layouts of a tensor: positions (a: none, m: bitmask, r: relative indices) + values (p: byte planes,
#: s: shared codebook + indices); 'x': raw bytes of a non-float tensor
#: (upper-case M / R: positions and values in column order, the first axis innermost)
_STREAMS = {"x": 1, "ap": 1, "as": 2, "mp": 2, "ms": 3, "rp": 2, "rs": 3, "Mp": 2, "Ms": 3, "Rp": 2, "Rs": 3}


# ------------------------------------------------------------------------------------------------ Huffman
def _code_lengths(freq: np.ndarray, limit: int = _MAX_LEN) -> np.ndarray:
    """Huffman code length per symbol (0 = unused) for counts ``freq``, at most ``limit`` bits: when the
    tree is deeper, the counts are halved (keeping every used symbol) and the tree rebuilt."""
    freq = freq.astype(np.int64)
    used = np.flatnonzero(freq)
    lengths = np.zeros(freq.size, np.int64)
    if used.size == 0:
        return lengths
    if used.size == 1:
        lengths[used[0]] = 1
        return lengths
    f = freq.copy()
    while True:
        heap = [(int(f[s]), int(s), (int(s),)) for s in used]  # (weight, tie-break, symbols below)
        heapq.heapify(heap)
        depth = dict.fromkeys(map(int, used), 0)
        while len(heap) > 1:
            w1, t1, a = heapq.heappop(heap)
            w2, t2, b = heapq.heappop(heap)
            for s in a + b:
                depth[s] += 1
            heapq.heappush(heap, (w1 + w2, min(t1, t2), a + b))
        if max(depth.values()) <= limit:
            for s, d in depth.items():
                lengths[s] = d
            return lengths
        f[used] = np.maximum(f[used] // 2, 1)


def _canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical Huffman codes (shorter first, then by symbol) for the code ``lengths``."""
    codes = np.zeros(lengths.size, np.int64)
    order = sorted((int(L), s) for s, L in enumerate(lengths) if L)
    code, prev = 0, order[0][0] if order else 0
    for L, s in order:
        code <<= L - prev
        prev = L
        codes[s] = code
        code += 1
    return codes


def _block_size(n: int) -> int:
    return int(min(4096, max(1024, math.ceil(n / 16))))


def huffman_encode(symbols: np.ndarray) -> bytes:
    """Canonical Huffman code of a byte stream (uint8 array): code lengths (4 bits per symbol up to the
    largest used), the bit offsets of the blocks after the first, then the bits (MSB first)."""
    sym = np.ascontiguousarray(symbols, np.uint8).reshape(-1)
    n = sym.size
    freq = np.bincount(sym, minlength=256)
    lengths = _code_lengths(freq)
    codes = _canonical_codes(lengths)
    top = int(np.flatnonzero(lengths).max()) + 1 if n else 1
    nib = np.zeros(top + (top & 1), np.uint8)
    nib[:top] = lengths[:top]
    table = (nib[0::2] << 4) | nib[1::2]
    bsize = _block_size(n)
    sym_len = lengths[sym]
    starts = np.concatenate([[0], np.cumsum(sym_len)])
    total_bits = int(starts[-1])
    block_offsets = starts[bsize:n:bsize]
    wide = total_bits >= 2**32
    head = struct.pack("<BIB", int(wide), bsize, top - 1) + table.tobytes()
    head += block_offsets.astype("<u8" if wide else "<u4").tobytes()
    out = bytearray()
    carry = np.zeros(0, np.uint8)
    chunk = 1 << 18
    for lo in range(0, n, chunk):
        s = sym[lo:lo + chunk]
        L = lengths[s]
        c = codes[s]
        cnt = int(L.sum())
        owner = np.repeat(np.arange(s.size), L)
        within = np.arange(cnt) - np.repeat(np.cumsum(L) - L, L)
        bits = ((c[owner] >> (L[owner] - 1 - within)) & 1).astype(np.uint8)
        bits = np.concatenate([carry, bits])
        whole = bits.size - bits.size % 8
        out += np.packbits(bits[:whole]).tobytes()
        carry = bits[whole:]
    if carry.size:
        out += np.packbits(carry).tobytes()
    return head + bytes(out)


def huffman_decode(data: bytes, n: int) -> np.ndarray:
    """Inverse of :func:`huffman_encode` for a stream of ``n`` symbols; ValueError when the data do not
    decode to exactly ``n`` symbols filling every block exactly.

    Bounded before any work: every code is at least 1 bit, so ``n`` may not exceed the stream's bits; the
    block size must be the one the encoder chooses for ``n`` (so a row loop runs at most 4096 steps, each
    vectorised over the blocks, and the doubling at most 12 passes). Time is linear in the stream's bits
    (also for 8 symbols per byte), memory about ``n`` + a constant per 2**18 bits."""
    if n == 0:
        return np.zeros(0, np.uint8)
    if len(data) < 6:
        raise ValueError("Huffman stream too short")
    wide, bsize, top = struct.unpack_from("<BIB", data, 0)
    top += 1
    if wide not in (0, 1) or bsize != _block_size(n):
        raise ValueError("bad Huffman stream header")
    pos = 6
    tbytes = (top + 1) // 2
    if len(data) < pos + tbytes:
        raise ValueError("Huffman stream truncated (code lengths)")
    table = np.frombuffer(data, np.uint8, tbytes, pos)
    pos += tbytes
    lengths = np.zeros(256, np.int64)
    nib = np.empty(tbytes * 2, np.int64)
    nib[0::2], nib[1::2] = table >> 4, table & 15
    lengths[:top] = nib[:top]
    used = np.flatnonzero(lengths)
    if used.size == 0 or lengths.max() > _MAX_LEN:
        raise ValueError("bad Huffman code lengths")
    if used.size > 1 and np.exp2(-lengths[used].astype(np.float64)).sum() > 1.0 + 1e-12:
        raise ValueError("Huffman code lengths are not a prefix code")
    nblocks = math.ceil(n / bsize)
    odt = np.dtype("<u8" if wide else "<u4")
    if len(data) < pos + (nblocks - 1) * odt.itemsize:
        raise ValueError("Huffman stream truncated (block offsets)")
    offsets = np.concatenate([[0], np.frombuffer(data, odt, nblocks - 1, pos).astype(np.int64)])
    pos += (nblocks - 1) * odt.itemsize
    total_bits = (len(data) - pos) * 8
    if n * int(lengths[used].min()) > total_bits:
        raise ValueError(f"{n} symbols cannot fit in {total_bits} bits")
    if np.any(np.diff(offsets) < 0) or offsets[-1] > total_bits:
        raise ValueError("bad Huffman block offsets")
    minl, maxl = int(lengths[used].min()), int(lengths.max())
    sizes = np.diff(np.concatenate([offsets, [total_bits]]))
    counts = np.full(nblocks, bsize, np.int64)
    counts[-1] = n - (nblocks - 1) * bsize
    # every block's bits must hold its symbols' codes (the last one up to 7 padding bits more)
    if np.any(sizes < counts * minl) or np.any(sizes[:-1] > counts[:-1] * maxl) or sizes[-1] > counts[-1] * maxl + 7:
        raise ValueError("Huffman block offsets do not fit the code lengths")
    dec_sym, dec_len = _decoding_tables(lengths, used, maxl)
    # two ways to decode, both linear; take the cheaper by a cost model (microseconds, fitted on a loaded
    # CPU): a numpy step per symbol position of a block row (~21 us + 65 ns per block; good with many blocks
    # of long codes), or orbit doubling over the bits (~4 ns per bit and pass, ceil(log2(block size)) + 8
    # passes, whatever the code lengths and however few the blocks). The doubling bounds the worst case: a
    # crafted stream of 1-bit codes (8 symbols per byte) costs it ~0.1 us per bit, ~0.7 s per MB loaded
    rows_cost = (bsize if nblocks > 1 else n) * (21 + 0.065 * nblocks)
    chains_cost = total_bits * 0.004 * ((int(counts.max()) - 1).bit_length() + 8)
    stream = np.frombuffer(data, np.uint8, total_bits // 8, pos)
    if nblocks == 1 and n <= _SMALL_SYMBOLS:  # a few symbols: numpy's fixed cost per pass would dominate
        return _huffman_small(stream, total_bits, dec_sym, dec_len, maxl, n)
    if chains_cost < rows_cost:
        return _huffman_chains(stream, offsets, counts, total_bits, dec_sym, dec_len, maxl, n)
    return _huffman_rows(stream, offsets, total_bits, dec_sym, dec_len, maxl, n, bsize)


def _decoding_tables(lengths: np.ndarray, used: np.ndarray, maxl: int) -> tuple[np.ndarray, np.ndarray]:
    """Symbol and code length (0: no code) for each value of the next ``maxl`` bits (2**maxl entries: 256
    for 8-bit codes, at most 32768), built without a Python step per symbol: in canonical order (shorter
    codes first, then by symbol) a code's ``maxl``-bit left-aligned value is the sum of ``2**(maxl - L)``
    over the codes before it, so each symbol owns the next ``2**(maxl - L)`` entries."""
    order = used[np.lexsort((used, lengths[used]))]
    width = np.left_shift(1, maxl - lengths[order])
    filled = int(width.sum())  # < 2**maxl for an incomplete code: the rest stays "no code"
    dec_sym = np.zeros(1 << maxl, np.uint8)
    dec_len = np.zeros(1 << maxl, np.int64)
    dec_sym[:filled] = np.repeat(order.astype(np.uint8), width)
    dec_len[:filled] = np.repeat(lengths[order], width)
    return dec_sym, dec_len


_SMALL_SYMBOLS = 512  # streams of at most this many symbols (one block) are decoded by _huffman_small


def _huffman_small(stream: np.ndarray, total_bits: int, dec_sym: np.ndarray, dec_len: np.ndarray, maxl: int,
                   n: int) -> np.ndarray:
    """:func:`huffman_decode` for a one-block stream of a few symbols, a Python step per symbol on one integer
    holding the stream's bits: the same codes, checks and errors as :func:`_huffman_rows` (which pads the
    stream with zero bits), without numpy's fixed cost per step (~0.25 ms per tiny tensor otherwise)."""
    bits = int.from_bytes(stream.tobytes(), "big") << maxl  # maxl zero bits of padding, as the rows decoder
    top = total_bits  # bit index (from the left) of the padding's start
    mask = (1 << maxl) - 1
    out = bytearray(n)
    p = 0
    for i in range(n):
        if p > top:  # past the padding: what the rows decoder reads as zeros never decodes to the recorded length
            raise ValueError("Huffman blocks do not decode to their recorded lengths")
        w = (bits >> (top - p)) & mask
        length = int(dec_len[w])
        if not length:
            raise ValueError("invalid Huffman code in stream")
        out[i] = int(dec_sym[w])
        p += length
    if p > total_bits or total_bits - p >= 8:
        raise ValueError("Huffman blocks do not decode to their recorded lengths")
    return np.frombuffer(bytes(out), np.uint8).copy()


def _huffman_rows(stream: np.ndarray, offsets: np.ndarray, total_bits: int, dec_sym: np.ndarray,
                  dec_len: np.ndarray, maxl: int, n: int, bsize: int) -> np.ndarray:
    """:func:`huffman_decode`'s symbol loop as one numpy step per symbol position, over all blocks at once
    (one gather of the 24 bits at each block's position: 4 bytes of work array per stream byte)."""
    nbytes, nblocks = stream.size, offsets.size
    buf = np.zeros(nbytes + 3, np.uint32)
    buf[:nbytes] = stream
    words = (buf[:-2] << 16) | (buf[1:-1] << 8) | buf[2:]
    del buf
    out = np.empty((nblocks, bsize), np.uint8)
    p = offsets.copy()
    last = n - (nblocks - 1) * bsize  # symbols in the last block
    shift, mask = 24 - maxl, (1 << maxl) - 1
    for i in range(bsize if nblocks > 1 else last):
        sel = slice(None) if i < last else slice(0, nblocks - 1)
        q = p[sel]
        word = words[np.minimum(q >> 3, nbytes)].astype(np.int64)  # a damaged stream may run past its end: caught below
        window = (word >> (shift - (q & 7))) & mask
        L = dec_len[window]
        if not L.all():
            raise ValueError("invalid Huffman code in stream")
        out[sel, i] = dec_sym[window]
        p[sel] = q + L
    ends = np.concatenate([offsets[1:], [p[-1]]])
    if not np.array_equal(p, ends) or p[-1] > total_bits or total_bits - p[-1] >= 8:
        raise ValueError("Huffman blocks do not decode to their recorded lengths")
    return out.reshape(-1)[:n]


_CHUNK_BITS = 1 << 18  # bits decoded per vectorised pass (a constant few MiB of work arrays)
_SHIFTS = np.arange(8, dtype=np.int32)


def _huffman_chains(stream: np.ndarray, offsets: np.ndarray, counts: np.ndarray, total_bits: int,
                    dec_sym: np.ndarray, dec_len: np.ndarray, maxl: int, n: int) -> np.ndarray:
    """:func:`huffman_decode`'s symbol loop without a Python step per symbol or per block row.

    For every bit position of a run of whole blocks (at most _CHUNK_BITS bits) the code starting there is
    looked up at once (from one 24-bit word per byte: its length L; 0 = no code), giving the map
    ``next = position + L``. A block's symbols start at its offset's orbit under that map: all blocks'
    orbits are grown together by doubling (round r appends the map iterated 2**r times to every orbit
    point found so far, then squares the map), ceil(log2(block size)) rounds: per round one gather over
    the bits and one over the orbit points, so the cost is a few numpy passes per bit plus ~2 per symbol,
    whatever the code lengths (1-bit codes: 8 symbols per byte) and however few the blocks. A block must
    end exactly where the next one starts (the last one within 8 bits of the end) and no code may start on
    an invalid bit pattern (the map sends it, and anything past the run, to an absorbing point)."""
    out = np.empty(n, np.uint8)
    nblocks = offsets.size
    ends = np.concatenate([offsets[1:], [total_bits]])
    mask = (1 << maxl) - 1
    shifts = (24 - maxl) - _SHIFTS
    # no code: a length that sends the map past any run (a run holds at most _CHUNK_BITS + one block's bits)
    dec_len32 = np.where(dec_len > 0, dec_len, 1 << 30).astype(np.int32)
    k = 0  # symbols written
    b0 = 0
    while b0 < nblocks:
        b1 = b0 + 1 + int(np.searchsorted(ends[b0 + 1:], offsets[b0] + _CHUNK_BITS, side="right"))
        lo, hi = int(offsets[b0]), int(ends[b1 - 1])
        span = hi - lo
        first, stop = lo >> 3, (hi + 7) >> 3  # the bytes holding bits lo..hi-1
        buf = np.zeros(stop - first + 2, np.int32)
        piece = stream[first:stop]
        buf[:piece.size] = piece
        word = (buf[:-2] << 16) | (buf[1:-1] << 8) | buf[2:]  # the 24 bits from each byte on
        del buf
        window = ((word[:, None] >> shifts) & mask).reshape(-1)[lo & 7:(lo & 7) + span]  # next maxl bits, per bit
        del word
        length = dec_len32[window]
        # the map over 0..span+1: span + 1 = invalid (absorbing); a code may end at span, not past it
        jump = np.empty(span + 2, np.int32)
        np.add(np.arange(span, dtype=np.int32), length, out=jump[:span])
        np.minimum(jump[:span], span + 1, out=jump[:span])
        jump[span:] = span + 1
        cnt = counts[b0:b1]
        width = b1 - b0
        rounds = (int(cnt.max()) - 1).bit_length()
        # the map squared `a` times (each a pass over the run's bits), checkpoints every 2**a symbols by a
        # row loop of the last power (2**(rounds - a) steps over the blocks), then every symbol by doubling
        # from the checkpoints with the kept powers; `a` minimises the estimated cost (us, as above)
        a = min(range(rounds + 1), key=lambda a: min(a, rounds - 1) * span * 0.004
                + ((1 << (rounds - a)) - 1) * (6 + 0.004 * width))
        powers = [jump]
        for _ in range(min(a, rounds - 1)):
            powers.append(powers[-1].take(powers[-1]))
        del jump
        q = 1 << (rounds - a)
        orbit = np.empty((1 << a, q, width), np.int32)  # [t, i, b]: block b's symbol i * 2**a + t
        rows = orbit[0]
        rows[0] = offsets[b0:b1] - lo
        step = powers[a] if q > 1 else None
        for i in range(1, q):
            step.take(rows[i - 1], out=rows[i])
        for r in range(a):
            powers[r].take(orbit[:1 << r], out=orbit[1 << r:2 << r])
        del powers, step, rows
        table = orbit.transpose(1, 0, 2).reshape(-1, width)  # row j, column b: block b's j-th symbol
        del orbit
        last = table[cnt - 1, np.arange(width)]  # each block's last symbol: where it starts, then where it ends
        final = last + np.take(length, last, mode="clip")  # past the run when it is none or starts no code
        ok = final == ends[b0:b1] - lo
        if b1 == nblocks:  # the last block ends within 8 bits of the stream's end
            ok[-1] = final[-1] <= span and span - final[-1] < 8
        if not ok.all():
            raise ValueError("Huffman blocks do not decode to their recorded lengths")
        # every orbit point before a block's end is a valid code start (else its end would be the absorbing
        # point); every block but the stream's last holds bsize symbols
        starts = np.concatenate([table[:cnt[0], :-1].T.reshape(-1), table[:cnt[-1], -1]])
        m = starts.size
        out[k:k + m] = dec_sym[window[starts]]
        k += m
        b0 = b1
    if k != n:
        raise ValueError("Huffman blocks do not decode to their recorded lengths")
    return out


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


def decoded_cap(file_bytes: int, max_bytes: int | None = None) -> int:
    """The most tensor bytes :func:`unpack` decodes from a file of ``file_bytes`` bytes (see the caps above)."""
    if max_bytes is not None:
        return int(max_bytes)
    env = os.environ.get("COMPRESSOR_MAX_DECODED_BYTES")
    if env:
        try:
            return int(env)
        except ValueError:
            raise ConfigError(f"COMPRESSOR_MAX_DECODED_BYTES={env!r} is not an integer number of bytes") from None
    return DECODED_BASE + DECODED_RATIO * int(file_bytes)


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
