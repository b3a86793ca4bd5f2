"""The compressed model file (core, numpy only): bit-exact round trips, the Huffman coder, the layouts it
picks, and clear errors for bad files."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from compressor.core import cmpk as K
from compressor.core import huffman as H
from compressor.core.errors import CompressedFileError

RNG = np.random.default_rng(3)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def pruned(shape, kept, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape).astype(np.float32)
    w[rng.random(shape) >= kept] = 0
    return w


def test_huffman_code_lengths_are_the_optimal_ones():
    # counts 1, 1, 2, 4, 8: the classic skewed tree, lengths 4, 4, 3, 2, 1
    freq = np.zeros(256, np.int64)
    freq[[10, 11, 12, 13, 14]] = [1, 1, 2, 4, 8]
    assert H._code_lengths(freq)[[10, 11, 12, 13, 14]].tolist() == [4, 4, 3, 2, 1]
    codes = H._canonical_codes(H._code_lengths(freq))
    # canonical: the shortest code is 0, then increasing within each length
    assert codes[[14, 13, 12, 10, 11]].tolist() == [0b0, 0b10, 0b110, 0b1110, 0b1111]
    symbols = np.repeat(np.array([10, 11, 12, 13, 14], np.uint8), [1, 1, 2, 4, 8])
    enc = H.huffman_encode(symbols)
    # 1*4 + 1*4 + 2*3 + 4*2 + 8*1 = 30 bits -> 4 bytes of code after the header
    header = 6 + (15 // 2 + 1)  # flags, block size, top symbol, 15 nibble-packed lengths
    assert len(enc) == header + 4
    np.testing.assert_array_equal(H.huffman_decode(enc, symbols.size), symbols)


def test_huffman_lengths_are_limited_to_15_bits():
    counts = np.maximum((2.0 ** -np.arange(1, 30) * 1e6).astype(np.int64), 1)
    freq = np.zeros(256, np.int64)
    freq[:29] = counts
    lengths = H._code_lengths(freq)
    assert lengths.max() == 15 and (lengths[:29] > 0).all()
    assert np.sum(2.0 ** -lengths[:29]) <= 1.0  # still a prefix code


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.uint8, st.integers(0, 9000), elements=st.integers(0, 20)))
def test_huffman_round_trip(symbols):
    np.testing.assert_array_equal(H.huffman_decode(H.huffman_encode(symbols), symbols.size), symbols)


def test_huffman_rejects_a_damaged_stream():
    symbols = RNG.integers(0, 50, 5000).astype(np.uint8)
    enc = H.huffman_encode(symbols)
    with pytest.raises(ValueError):
        H.huffman_decode(enc[:-40], symbols.size)
    with pytest.raises(ValueError):
        H.huffman_decode(enc, symbols.size + 3000)


@pytest.mark.parametrize("codec", ["auto", *K.CODECS])
def test_round_trip_is_bit_exact_for_every_dtype(codec):
    arrays = {
        "fc.weight": pruned((30, 40), 0.1),
        "fc.bias": RNG.normal(size=30).astype(np.float32),
        "odd": np.array([-0.0, 0.0, np.nan, np.inf, -1.5], np.float32),  # -0.0 and NaN are kept as they are
        "half": RNG.normal(size=(3, 5)).astype(np.float16),
        "double": pruned((7,), 0.5).astype(np.float64),
        "bn.num_batches_tracked": np.array(12, np.int64),
        "flags": np.array([True, False, True]),
        "i8": np.array([-3, 0, 7], np.int8),
        "empty": np.zeros((0, 4), np.float32),
        "zeros": np.zeros((5, 5), np.float32),
    }
    out, _ = K.unpack_bytes(K.pack_bytes(arrays, codec)[0])
    assert list(out) == list(arrays)
    for name, a in arrays.items():
        assert same_bits(out[name], a), name


def test_auto_is_never_larger_than_one_codec():
    arrays = {"w": pruned((100, 200), 0.08), "b": RNG.normal(size=100).astype(np.float32)}
    sizes = K.packed_sizes(arrays)
    assert sizes["auto"] <= min(sizes[c] for c in K.CODECS)
    assert sizes["raw"] < (100 * 200 + 100) * 4  # sparse layout beats the dense bytes even uncoded


def test_layouts_chosen_by_size():
    dense = RNG.normal(size=(16, 16)).astype(np.float32)
    sparse = pruned((200, 300), 0.05)
    shared = sparse.copy()
    centroids = np.linspace(-1, 1, 16, dtype=np.float32)
    shared[shared != 0] = centroids[RNG.integers(0, 16, int((shared != 0).sum()))]
    summary = {s["name"]: s for s in K.pack_bytes({"dense": dense, "sparse": sparse, "shared": shared})[1]}
    assert summary["dense"]["layout"] == "ap"  # nothing zero: no positions stored
    assert summary["sparse"]["layout"][0] in "mr" and summary["sparse"]["layout"][1] == "p"
    assert summary["shared"]["layout"][1] == "s"  # 16 distinct values: codebook + one index per weight
    # 5 % kept: about 3000 kept weights; shared values need well under a byte each
    assert summary["shared"]["bytes"] < summary["sparse"]["bytes"] / 2


def test_relative_indices_with_long_gaps():
    w = np.zeros(2000, np.float32)
    w[[0, 254, 255, 256, 700, 1999]] = [1, 2, 3, 4, 5, 6]  # gaps 0, 253, 0, 0, 443 (> 255), 1298 (> 5 * 255)
    stream = K._relative(np.flatnonzero(w))
    np.testing.assert_array_equal(K._unrelative(stream, w.size), np.flatnonzero(w))
    assert list(stream[:5]) == [0, 253, 0, 0, 255]
    out, _ = K.unpack_bytes(K.pack_bytes({"w": w}, "raw")[0])
    assert same_bits(out["w"], w)


def test_pack_file_and_read_info(tmp_path):
    arrays = {"a.weight": pruned((64, 64), 0.1), "a.bias": np.ones(64, np.float32)}
    path = tmp_path / "m.cmpk"
    res = K.pack(arrays, path, backend="torch", meta={"note": "x"})
    assert res.bytes == os.path.getsize(path) and res.raw_bytes == 64 * 64 * 4 + 64 * 4 and res.ratio > 3
    out = K.unpack(path)
    assert all(same_bits(out[k], v) for k, v in arrays.items())
    info = K.read_info(path)
    assert info["backend"] == "torch" and info["meta"] == {"note": "x"}
    assert [t["name"] for t in info["tensors"]] == ["a.weight", "a.bias"]
    assert not [p for p in os.listdir(tmp_path) if p != "m.cmpk"]  # no temporary file left behind


def test_bad_files_raise_compressed_file_error(tmp_path):
    path = tmp_path / "m.cmpk"
    K.pack({"w": pruned((50, 50), 0.2)}, path)
    data = path.read_bytes()
    cases = {
        "truncated": data[:-10],
        "appended": data + b"x",
        "flipped": data[:60] + bytes([data[60] ^ 0xFF]) + data[61:],
        "foreign": b"PK\x03\x04" + data[4:],
        "empty": b"",
    }
    for what, content in cases.items():
        bad = tmp_path / f"{what}.cmpk"
        bad.write_bytes(content)
        with pytest.raises(CompressedFileError) as e:
            K.unpack(bad)
        assert isinstance(e.value, ValueError) and str(bad) in str(e.value), what
    with pytest.raises(CompressedFileError, match="does not exist"):
        K.unpack(tmp_path / "missing.cmpk")


def test_a_consistent_but_wrong_header_is_refused():
    """A file whose checksum is right but whose streams do not fit the shapes (written by a buggy tool)."""
    import json
    import struct
    import zlib

    data, _ = K.pack_bytes({"w": np.ones((4, 4), np.float32)}, "raw")
    _, _, hlen, plen = K._PREFIX.unpack_from(data, 0)
    header = json.loads(zlib.decompress(data[K._PREFIX.size:K._PREFIX.size + hlen]))
    header["t"][0][2] = [4, 5]  # 20 values, 16 stored
    hz = zlib.compress(json.dumps(header).encode())
    body = data[K._PREFIX.size + hlen:-4]
    out = K._PREFIX.pack(K.MAGIC, K.VERSION, len(hz), len(body)) + hz + body
    out += struct.pack("<I", zlib.crc32(out))
    with pytest.raises(CompressedFileError, match="'w'"):
        K.unpack_bytes(out)


def test_unsupported_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="'c'.*complex"):
        K.pack_bytes({"c": np.ones(3, np.complex64)})
    with pytest.raises(ValueError, match="codec"):
        K.pack_bytes({"w": np.ones(3, np.float32)}, codec="gzip")


def test_column_order_when_whole_inputs_are_pruned():
    """A Linear weight [out, in] whose dead inputs (columns) are all zero codes smaller in column order."""
    rng = np.random.default_rng(5)
    w = pruned((300, 784), 0.3, seed=5)
    w[:, rng.random(784) < 0.4] = 0  # 40 % of the inputs never fire: their whole columns are pruned
    data, summary = K.pack_bytes({"w": w}, "huffman")
    assert summary[0]["layout"][0] in "MR"
    out, _ = K.unpack_bytes(data)
    assert same_bits(out["w"], w)
    row_only = K.pack_bytes({"w": np.ascontiguousarray(w.reshape(-1))}, "huffman")[0]  # 1-D: row order only
    assert len(data) < len(row_only)
