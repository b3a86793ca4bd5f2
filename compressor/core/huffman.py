"""The canonical, length-limited Huffman coder of the compressed model file (:mod:`compressor.core.cmpk`), as Deep
Compression codes weights and indices (Han et al. 2016): numpy only.

A stream is cut into blocks of up to 4096 symbols whose bit offsets are stored (4 bytes each), so decoding runs
over all blocks at once with numpy (one vectorised table lookup per symbol position of a block, or orbit doubling
over the bits: see :func:`huffman_decode`) instead of one Python step per symbol. Code lengths are limited to
:data:`_MAX_LEN` bits (4-bit lengths in the stream header, a 32768-entry decoding table), and a stream that does
not decode to exactly its recorded length is a ``ValueError`` before anything is returned."""

from __future__ import annotations

import heapq
import math
import struct

import numpy as np

__all__ = ["huffman_encode", "huffman_decode"]

_MAX_LEN = 15  # Huffman code length limit: 4-bit lengths, a 32768-entry decoding table


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
