"""Issue 29 (items 7-9, readers): crafted and fuzzed files are refused with the library's error, in bounded
memory and work. Here: the .cmpk reader (core.cmpk), .npz mask/weight archives and the TFLite reader
of ``compressor report`` (pure Python, so no interpreter can crash the process).

No test here times the machine (a busy CI machine runs several times slower): the work a reader does is
bounded by what it allocates (tracemalloc's peak, or the address space of the fuzz subprocess) and by the
Python lines it executes (:func:`measured`, :func:`fuzz_loop`), counted in every frame it runs, the standard
library's included: deterministic, and what a reader spends its time on when a crafted file makes it loop.

More fuzz cases by hand: ``COMPRESSOR_FUZZ_CASES=5000 pytest tests/core/test_hostile_files.py -k fuzz``.
"""

from __future__ import annotations

import json
import os
import random
import struct
import sys
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compressor.core import cmpk as K
from compressor.core import huffman as H
from compressor.core.errors import CompressedFileError, ConfigError, ModelError

FUZZ_CASES = int(os.environ.get("COMPRESSOR_FUZZ_CASES", "300"))


def craft(header: dict | None = None, payload: bytes = b"", text: bytes | None = None, hz: bytes | None = None) -> bytes:
    """A .cmpk file with a correct prefix and checksum around any header / payload."""
    if hz is None:
        hz = zlib.compress(text if text is not None else json.dumps(header).encode(), 9)
    out = K._PREFIX.pack(K.MAGIC, K.VERSION, len(hz), len(payload)) + hz + payload
    return out + struct.pack("<I", zlib.crc32(out))


class LineCounter:
    """Counts the Python lines executed while installed (``with LineCounter() as c: ...; c.lines``): every frame
    of the calling thread, library and standard library alike (C code, e.g. numpy's loops, zlib or the json
    parser, is bounded by what it allocates instead). The count is the work, the same on any machine."""

    def __init__(self) -> None:
        self.lines = 0

    def _call(self, frame, event, arg):
        return self._local

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
        return self._local

    def __enter__(self) -> LineCounter:
        self._previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._previous)


def measured(fn, *args, **kw):
    """(exception or None, Python lines executed, peak bytes traced: numpy's buffers included) of ``fn(*args)``."""
    tracemalloc.start()
    err = None
    try:
        with LineCounter() as counter:
            fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - returned to the test, which asserts its type
        err = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return err, counter.lines, peak


def warm_cmpk() -> None:
    """Read a valid file (every codec's decoder) once, so a count that follows is the crafted file's work, not
    the first call's lazy imports."""
    w = np.arange(3000, dtype=np.float32) % 3
    for codec in ("huffman", "zlib", "lzma", "raw"):
        K.unpack_bytes(K.pack_bytes({"w": w, "b": np.ones(3, np.float16)}, codec)[0])


def refused(data: bytes, match: str, **kw) -> tuple[int, int]:
    """(lines, peak bytes) of unpack_bytes refusing ``data``: a CompressedFileError naming it, matching ``match``."""
    warm_cmpk()
    err, lines, peak = measured(K.unpack_bytes, data, "'crafted.cmpk'", **kw)
    assert isinstance(err, CompressedFileError), repr(err)
    assert "'crafted.cmpk'" in str(err) and match in str(err), str(err)
    return lines, peak


def zeros_entry(name: str, shape: list[int], layout: str = "rp") -> list:
    return [name, "<f4", shape, layout, [["n", 0, 0]] * K._STREAMS[layout]]


# ---------------------------------------------------------------------------------------------- crafted .cmpk
def test_huge_declared_shape_is_refused_before_allocating():
    # 1 GiB of float32 zeros declared by a ~110-byte file ('rp': no kept value, positions and values empty)
    data = craft({"v": 1, "t": [zeros_entry("w", [1 << 28])]})
    assert len(data) < 120
    lines, peak = refused(data, "1,073,741,824 bytes")
    assert lines < 1000 and peak < 1 << 20  # (~150 lines: no step per declared value)
    # past any machine: 2**80 values (was MemoryError)
    lines, peak = refused(craft({"v": 1, "t": [zeros_entry("w", [1 << 40, 1 << 40])]}), "bytes")
    assert lines < 1000 and peak < 1 << 20
    refused(craft({"v": 1, "t": [zeros_entry("w", [1 << 60])]}), "bad shape")
    refused(craft({"v": 1, "t": [zeros_entry("w", [1] * 40)]}), "40 axes")


def test_the_decoded_cap_is_stated_and_can_be_raised(tmp_path, monkeypatch):
    w = np.zeros((1024, 1024), np.float32)
    w[0, 0] = 1.0
    data, _ = K.pack_bytes({"w": w})
    assert K.decoded_cap(len(data)) == K.DECODED_BASE + K.DECODED_RATIO * len(data)
    refused(data, "COMPRESSOR_MAX_DECODED_BYTES", max_bytes=1 << 20)  # 4 MiB of tensor, 1 MiB allowed
    out, _ = K.unpack_bytes(data, max_bytes=4 << 20)  # exactly its size
    assert np.array_equal(out["w"], w)
    monkeypatch.setenv("COMPRESSOR_MAX_DECODED_BYTES", str(1 << 20))
    refused(data, "more than the 1,048,576")
    monkeypatch.setenv("COMPRESSOR_MAX_DECODED_BYTES", "lots")
    with pytest.raises(ConfigError, match="COMPRESSOR_MAX_DECODED_BYTES='lots' is not an integer"):
        K.unpack_bytes(data)


def test_deeply_nested_header_is_refused_without_recursion_error():
    lines, peak = refused(craft(text=b"[" * 200_000 + b"]" * 200_000), "nested too deeply")
    assert lines < 1000 and peak < 4 << 20  # the 400 KB of text (json's recursion is bounded by the interpreter's)


def test_header_bomb_is_decompressed_with_a_limit():
    text = b'{"v":1,"t":[],"meta":"' + b" " * (64 << 20) + b'"}'  # 64 MiB of header from ~65 KB
    data = craft(text=text)
    assert len(data) < 100_000
    lines, peak = refused(data, "header decompresses to more than")
    cap = K.HEADER_BASE + len(data) // 4
    assert peak < cap + 4 * len(data) + (1 << 20) and lines < 1000


@pytest.mark.parametrize("codec", ["zlib", "lzma"])
def test_stream_bomb_decodes_no_more_than_it_claims(codec):
    raw = bytes(32 << 20)  # 32 MiB of zeros behind a 1000-byte tensor
    coded = zlib.compress(raw, 9) if codec == "zlib" else K._compress("lzma", raw)
    code = K._CODE[codec]
    data = craft({"v": 1, "t": [["b", "|u1", [1000], "x", [[code, len(coded), 1000]]]]}, coded)
    lines, peak = refused(data, "stream is corrupt")
    assert peak < 4 * len(data) + (12 << 20) and lines < 1000  # + lzma's 8 MiB dictionary (fixed by the format)
    # and a stream cannot claim more than its codec can hold (zlib: 1032x)
    data = craft({"v": 1, "t": [["b", "|u1", [1 << 24], "x", [[code, 10, 1 << 24]]]]}, bytes(10))
    refused(data, "cannot hold")


def huffman_stream(n: int, bsize: int, nbytes: int) -> bytes:
    """Two 1-bit codes (symbols 0 and 1) and ``nbytes`` of bits: a stream that is valid for 8 * nbytes symbols."""
    blocks = -(-n // bsize)
    head = struct.pack("<BIB", 0, bsize, 1) + bytes([0x11])  # lengths: symbol 0 -> 1 bit, symbol 1 -> 1 bit
    return head + struct.pack(f"<{blocks - 1}I", *([0] * (blocks - 1))) + bytes(nbytes)


def test_crafted_huffman_stream_fails_before_decoding():
    # 633 bytes claiming a billion symbols with huge blocks (was 18.7 s: a million-step row loop)
    data = huffman_stream(1 << 20, 1 << 20, 620)
    assert len(data) == 627
    cases = [(data, 1 << 20, "bad Huffman stream header"),
             (struct.pack("<BIB", 0, 4096, 1) + bytes([0x11]) + bytes(620), 10 ** 9, "truncated"),
             (huffman_stream(4961, 1024, 604), 4961, "4961 symbols cannot fit in 4832 bits")]
    warm_cmpk()
    for stream, n, match in cases:
        err, lines, peak = measured(H.huffman_decode, stream, n)
        assert isinstance(err, ValueError) and match in str(err), repr(err)
        assert lines < 200 and peak < 64 << 10, (match, lines, peak)  # (~10-45 lines: the header's checks)
    # offsets that cannot hold their blocks' codes (all 0) are refused before decoding
    n = 8 * 600
    err, lines, peak = measured(H.huffman_decode, huffman_stream(n, H._block_size(n), 600), n)
    assert isinstance(err, ValueError) and "do not fit the code lengths" in str(err) and lines < 500, lines
    # the worst a 633-byte stream can do: valid offsets, 8 symbols per byte, a bad code at the very end; a step
    # per symbol position of a block (the row loop: ~9 lines x 1024) is what the doubling decoder saves
    blocks, bsize = -(-n // H._block_size(n)), H._block_size(n)
    ok = struct.pack("<BIB", 0, bsize, 1) + bytes([0x11])
    ok += struct.pack(f"<{blocks - 1}I", *[bsize * i for i in range(1, blocks)]) + bytes(600)
    assert np.array_equal(H.huffman_decode(ok, n), np.zeros(n, np.uint8))
    err, lines, _ = measured(H.huffman_decode, ok, n)
    assert err is None and lines < 1000, lines  # (~320)
    err, lines, _ = measured(H.huffman_decode, ok[:6] + bytes([0x12]) + ok[7:-1] + b"\xff", n - 4)
    assert isinstance(err, ValueError) and lines < 1000, lines  # lengths 1 and 2: "11" is no code
    assert "invalid Huffman code" in str(err) or "do not decode" in str(err), str(err)


def test_a_big_foreign_file_is_refused_after_its_first_bytes(tmp_path):
    big = tmp_path / "model.bin"
    with open(big, "wb") as f:
        f.write(b"PK\x03\x04")
        f.truncate(512 << 20)  # sparse: 512 MiB that take no disk
    warm_cmpk()
    err, lines, peak = measured(K.unpack, big)
    assert isinstance(err, CompressedFileError) and "not a compressed model file" in str(err) and str(big) in str(err)
    assert peak < 1 << 20 and lines < 1000
    # a real prefix that claims another length is refused before reading too
    with open(big, "r+b") as f:
        f.write(K._PREFIX.pack(K.MAGIC, K.VERSION, 10, 10))
    err, lines, peak = measured(K.unpack, big)
    assert isinstance(err, CompressedFileError) and "its header says 44" in str(err) and peak < 1 << 20
    assert lines < 1000


def test_malformed_entries_name_the_tensor():
    cases = {
        "unknown dtype": ["w", "nope", [2], "x", [["n", 0, 8]]],
        "unsupported dtype": ["w", "<c8", [2], "x", [["n", 0, 16]]],
        "bad layout": ["w", "<f4", [2], "x", [["n", 0, 8]]],
        "needs 2 streams": ["w", "<f4", [2], "mp", [["n", 0, 1]]],
        "bad stream record": ["w", "<f4", [2], "ap", [["q", 0, 8]]],
        "malformed entry": ["w", "<f4", [2], "ap"],
        "claims 9 bytes": ["w", "<f4", [2], "ap", [["n", 9, 9]]],
    }
    for match, entry in cases.items():
        refused(craft({"v": 1, "t": [entry]}, bytes(9)), match)


# ---------------------------------------------------------------------------------------------- fuzz .cmpk
def legit_files() -> tuple[list[bytes], int]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 16)).astype(np.float32)
    w[np.abs(w) < 0.8] = 0
    shared = rng.choice(np.float32([-0.5, 0.25, 1.0]), (16, 8))
    shared[:, :3] = 0
    arrays = {"fc.weight": w, "fc.bias": rng.standard_normal(24).astype(np.float16), "emb": shared,
              "steps": np.arange(5, dtype=np.int64), "flag": np.array([True, False])}
    files = [K.pack_bytes(arrays, codec)[0] for codec in ("auto", "huffman", "zlib", "lzma")]
    return files, sum(a.nbytes for a in arrays.values())


def mutations(data: bytes, rng: random.Random):
    """Truncations, byte flips (checksum fixed, so the decoder sees them), header edits (re-compressed)."""
    _, _, hlen, plen = K._PREFIX.unpack_from(data, 0)
    header = json.loads(zlib.decompress(data[K._PREFIX.size:K._PREFIX.size + hlen]))
    payload = data[K._PREFIX.size + hlen:-4]
    kind = rng.randrange(4)
    if kind == 0:  # truncated / appended
        cut = rng.randrange(len(data))
        return data[:cut] if rng.random() < 0.8 else data + bytes(rng.randrange(1, 64))
    if kind == 1:  # payload bytes changed, checksum fixed
        body = bytearray(payload)
        for _ in range(rng.randrange(1, 6)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        return craft(header, bytes(body))
    # header numbers / strings changed
    h = json.loads(json.dumps(header))
    for _ in range(rng.randrange(1, 4)):
        e = rng.choice(h["t"])
        where = rng.randrange(4)
        big = rng.choice([0, 1, 7, 255, 4097, 1 << 20, 1 << 31, 1 << 40, -1, rng.randrange(1 << 16)])
        if where == 0 and e[2]:
            e[2][rng.randrange(len(e[2]))] = big
        elif where == 1:
            s = rng.choice(e[4])
            s[rng.randrange(1, 3)] = big
        elif where == 2:
            e[3] = rng.choice(list(K._STREAMS) + ["zz"])
        else:
            e[1] = rng.choice(["<f4", "<f2", "<i8", "|b1", "<f8", "|u1", ">f4", "O"])
    if kind == 3:  # and the payload swapped between tensors' streams
        return craft(h, payload[::-1])
    return craft(h, payload)


def fuzz_in_subprocess(target: str, cases: int, mem_mb: int = 256, timeout: float = 1800) -> dict:
    """Run ``target`` ('module:function', called as ``function(cases, limit)`` and returning a JSON-able dict)
    in a fresh Python. The function prepares its inputs, then calls ``limit()``, which caps the address
    space (RLIMIT_AS) at what the process uses then + ``mem_mb``: a reader that allocates past the cap
    gets a MemoryError (reported as an unexpected error); one that crashes the interpreter kills only the
    subprocess (the test then fails with its exit code). ``timeout`` is for a hang, not a speed bound (the
    work is bounded in lines, see :func:`fuzz_loop`): pytest-timeout (900 s, pyproject.toml) ends a stuck run
    first, killing the subprocess with the test; the 1800 s default is the backstop without the plugin."""
    import subprocess
    import sys

    module, fn = target.split(":")
    code = (
        "import json, resource\n"
        f"from {module} import {fn} as run\n"
        "def limit():\n"
        "    vm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize:')) * 1024\n"
        f"    cap = vm + {mem_mb} * 2**20\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
        f"print(json.dumps(run({cases}, limit)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(ROOT))
    assert proc.returncode == 0, f"fuzz subprocess died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def fuzz_loop(reader, make_case, cases: int, allowed: tuple[type, ...], legit: list) -> dict:
    """Run ``reader(make_case(rng))`` ``cases`` times: the errors seen by type, the unexpected ones, and the work
    of the costliest case (``worst_lines``: Python lines executed, see :class:`LineCounter`; ``worst_case``: its
    number). ``legit``: the valid inputs the cases are made from, each read once to warm the reader (its first
    imports) and once more counted: ``legit_lines``, the most of them, is the scale the fuzz tests hold the
    worst case to (a crafted file may cost a few times what a real one does, not a step per declared value)."""
    out = {"legit_lines": 0}
    for data in legit:
        reader(data)
        with LineCounter() as counter:
            reader(data)
        out["legit_lines"] = max(out["legit_lines"], counter.lines)
    rng = random.Random(29)
    kinds: dict[str, int] = {}
    unexpected, worst, worst_case = [], 0, -1
    for i in range(cases):
        data = make_case(rng)
        counter = LineCounter()
        try:
            with counter:
                reader(data)
            kind = "ok"
        except allowed as e:
            kind = type(e).__name__
        except Exception as e:  # noqa: BLE001 - what the test reports
            kind = "UNEXPECTED"
            unexpected.append(f"case {i}: {type(e).__name__}: {str(e)[:200]}")
        if counter.lines > worst:
            worst, worst_case = counter.lines, i
        kinds[kind] = kinds.get(kind, 0) + 1
    return {**out, "kinds": kinds, "unexpected": unexpected[:10], "worst_lines": worst, "worst_case": worst_case}


def bounded_work(res: dict) -> bool:
    """A fuzz run's costliest case did at most 4x the Python lines of reading a valid file (+ 2,000 for an error
    path's own): a crafted file may cost a few times what a real one does, never a step per declared value."""
    return res["worst_lines"] <= 4 * res["legit_lines"] + 2000


def fuzz_cmpk(cases: int, limit) -> dict:
    files, raw = legit_files()
    limit()
    return fuzz_loop(lambda d: K.unpack_bytes(d, "'fuzz.cmpk'", 4 * raw), lambda rng: mutations(rng.choice(files), rng),
                     cases, (CompressedFileError,), files)


def test_fuzz_cmpk_reader_bounded():
    files, _ = legit_files()
    for data in files:
        out, _ = K.unpack_bytes(data)
        assert sorted(out) == ["emb", "fc.bias", "fc.weight", "flag", "steps"]
    res = fuzz_in_subprocess("tests.core.test_hostile_files:fuzz_cmpk", FUZZ_CASES, mem_mb=64)
    assert res["unexpected"] == [], res
    assert res["kinds"].get("CompressedFileError", 0) > FUZZ_CASES // 2, res
    assert bounded_work(res), res


# ---------------------------------------------------------------------------------------------- fuzz .tflite
def tflite_mutations(data: bytes, rng: random.Random) -> bytes:
    kind = rng.randrange(3)
    if kind == 0:
        return data[:rng.randrange(len(data))]
    out = bytearray(data)
    for _ in range(rng.randrange(1, 8)):
        at = rng.randrange(len(out) - 4)
        if kind == 1:
            out[at] = rng.randrange(256)
        else:  # a 32-bit offset or length set to something hostile
            out[at:at + 4] = struct.pack("<I", rng.choice([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, len(data), rng.randrange(1 << 32)]))
    return bytes(out)


def fuzz_tflite(cases: int, limit) -> dict:
    """(the TFLite reader is pure Python: tests/tf makes the files, this runs in the fuzz subprocess)"""
    import os
    import tempfile

    from compressor.report import read_weights as rw

    files = []
    for k in ("FLOAT", "INT8"):
        with open(os.environ["H24_TFLITE_" + k], "rb") as f:
            files.append(f.read())
    path = os.path.join(tempfile.mkdtemp(), "fuzz.tflite")

    def read(data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
        rw(path)

    limit()
    return fuzz_loop(read, lambda rng: tflite_mutations(rng.choice(files), rng), cases, (ModelError,), files)


# ---------------------------------------------------------------------------------------------- fuzz .onnx
def onnx_model():
    """A small ONNX graph as the exports write them: a float Conv weight and an int8 QDQ Gemm weight (zero
    point 3; its first row is all zero codes)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    codes = rng.integers(4, 100, (5, 16)).astype(np.int8)
    codes[0] = 3
    inits = [numpy_helper.from_array(w, "conv.weight"), numpy_helper.from_array(codes, "fc.weight_quantized"),
             numpy_helper.from_array(np.array(0.1, np.float32), "fc.scale"),
             numpy_helper.from_array(np.array(3, np.int8), "fc.zp")]
    nodes = [helper.make_node("Conv", ["x", "conv.weight"], ["c"]), helper.make_node("Flatten", ["c"], ["f"]),
             helper.make_node("DequantizeLinear", ["fc.weight_quantized", "fc.scale", "fc.zp"], ["fc.w"]),
             helper.make_node("Gemm", ["f", "fc.w"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    return model


def onnx_mutations(model, rng: random.Random) -> bytes:
    """Truncated / byte-flipped serialisations, and graphs edited through the proto API (inputs dropped,
    dims and raw data changed, attributes and op types swapped)."""
    kind = rng.randrange(3)
    if kind < 2:
        data = bytearray(model.SerializeToString())
        if kind == 0:
            return bytes(data[:rng.randrange(len(data))])
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    m = type(model)()
    m.CopyFrom(model)
    for _ in range(rng.randrange(1, 4)):
        what = rng.randrange(5)
        if what == 0:
            node = rng.choice(m.graph.node)
            del node.input[rng.randrange(len(node.input) + 1):]
        elif what == 1:
            init = rng.choice(m.graph.initializer)
            del init.dims[:]
            init.dims.extend(rng.choice([[], [0], [1 << 40], [2, 3], [5, 16], [-1, 4], [1 << 31, 1 << 31]]))
        elif what == 2:
            init = rng.choice(m.graph.initializer)
            init.raw_data = init.raw_data[:rng.randrange(len(init.raw_data) + 1)]
            init.data_type = rng.choice([1, 2, 3, 6, 7, 8, 10, 11, 16, init.data_type])
        elif what == 3:
            node = rng.choice(m.graph.node)
            node.op_type = rng.choice(["Conv", "Gemm", "MatMul", "DequantizeLinear", "Constant", "Relu"])
        else:
            attr = m.graph.node[2].attribute.add()
            attr.name, attr.type, attr.i = "axis", 2, rng.choice([-3, 0, 1, 7, 1 << 40])
    return m.SerializeToString()


def fuzz_onnx(cases: int, limit) -> dict:
    import tempfile

    from compressor.report import read_weights

    model = onnx_model()
    path = os.path.join(tempfile.mkdtemp(), "fuzz.onnx")

    def read(data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
        read_weights(path)

    limit()
    return fuzz_loop(read, lambda rng: onnx_mutations(model, rng), cases, (ModelError,), [model.SerializeToString()])


# ---------------------------------------------------------------------------------------------- HF checkpoints
def safetensors_bytes(header: dict | bytes, data: bytes = b"") -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_hostile_safetensors_headers_are_checkpoint_errors(tmp_path):
    from compressor.core.compressed_tensors import SAFETENSORS_MAX_HEADER, CheckpointError, read_safetensors

    path = tmp_path / "model.safetensors"
    cases = {
        "nested too deeply": safetensors_bytes(b"[" * 100_000 + b"]" * 100_000),
        "malformed header entry": safetensors_bytes({"w": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}},
                                                    bytes(8)),
        "dtype 'X' is not supported": safetensors_bytes({"w": {"dtype": "X", "shape": [1], "data_offsets": [0, 4]}},
                                                        bytes(4)),
        r"does not match F32 \[1099511627776\]": safetensors_bytes(
            {"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4]}}, bytes(4)),
        "not a JSON object": safetensors_bytes(b"[1]"),
    }
    for match, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=match):
            read_safetensors(path)
    # a header length past the cap, in a (sparse) file long enough to hold it: refused before reading it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", SAFETENSORS_MAX_HEADER + 1))
        f.truncate(SAFETENSORS_MAX_HEADER + 64)
    err, _, peak = measured(read_safetensors, path)
    assert isinstance(err, CheckpointError) and "more than the 100,000,000 allowed" in str(err) and peak < 1 << 20


def test_checkpoint_index_cannot_name_files_outside_the_folder(tmp_path):
    from compressor.core.compressed_tensors import CheckpointError, load_compressed_tensors

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"not \.safetensors files inside the checkpoint folder: \['\.\./outside"):
        load_compressed_tensors(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text("[" * 100_000)
    with pytest.raises(CheckpointError, match="config.json.*nested too deeply"):
        load_compressed_tensors(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text("[]")
    with pytest.raises(CheckpointError, match="config.json.*not a JSON object"):
        load_compressed_tensors(tmp_path / "ckpt")


# ---------------------------------------------------------------------------------------------- fuzz .npz, safetensors
def npz_mutations(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    if rng.random() < 0.3:
        return bytes(out[:rng.randrange(len(out))])
    for _ in range(rng.randrange(1, 6)):
        at = rng.randrange(len(out))
        if rng.random() < 0.5:
            out[at] = rng.randrange(256)
        else:  # digits in the .npy headers' shapes (stored uncompressed by np.savez)
            digits = [i for i, c in enumerate(out) if 48 <= c <= 57]
            out[rng.choice(digits)] = rng.choice(b"0123456789")
    return bytes(out)


def fuzz_npz(cases: int, limit) -> dict:
    import io
    import tempfile

    from compressor.core.npz import load_npz

    buf = io.BytesIO()
    rng = np.random.default_rng(0)
    np.savez(buf, fc=rng.random((16, 8)) > 0.5, **{"fc:bias": np.ones(16, bool), "conv": np.zeros((4, 3, 3, 3), bool)})
    data = buf.getvalue()
    path = os.path.join(tempfile.mkdtemp(), "fuzz.npz")

    def read(d: bytes) -> None:
        with open(path, "wb") as f:
            f.write(d)
        load_npz(path, "mask file", ConfigError, max_bytes=1 << 20)

    limit()
    return fuzz_loop(read, lambda r: npz_mutations(data, r), cases, (ConfigError,), [data])


def fuzz_safetensors(cases: int, limit) -> dict:
    import tempfile

    from compressor.core.compressed_tensors import CheckpointError, read_safetensors, write_safetensors

    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "m.safetensors")
    write_safetensors(path, {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": np.ones(4, np.int8)})
    with open(path, "rb") as f:
        data = f.read()

    def read(d: bytes) -> None:
        with open(path, "wb") as f:
            f.write(d)
        read_safetensors(path)

    limit()
    return fuzz_loop(read, lambda r: npz_mutations(data, r), cases, (CheckpointError,), [data])


@pytest.mark.parametrize("reader", ["fuzz_npz", "fuzz_safetensors"])
def test_fuzz_npz_and_safetensors_readers(reader):
    res = fuzz_in_subprocess(f"tests.core.test_hostile_files:{reader}", FUZZ_CASES, mem_mb=64)
    assert res["unexpected"] == [], res
    assert sum(v for k, v in res["kinds"].items() if k != "ok") > FUZZ_CASES // 3, res
    assert bounded_work(res), res


def test_huffman_both_decoders_round_trip(monkeypatch):
    """The linear decoder has two paths (pointer doubling over bits, numpy steps over block rows): both must
    give back every stream exactly; the cost model picks the rows for many blocks of long codes."""
    used = []
    for fn in ("_huffman_chains", "_huffman_rows"):
        orig = getattr(H, fn)
        monkeypatch.setattr(H, fn, lambda *a, _f=orig, _n=fn: used.append(_n) or _f(*a))
    rng = np.random.default_rng(1)
    for n in (1, 7, 1000, 4097, 70_000, 400_000):
        for dist in ("uniform", "skewed", "two"):
            if dist == "uniform":
                sym = rng.integers(0, 256, n, dtype=np.uint8)
            elif dist == "skewed":
                sym = np.minimum(rng.geometric(0.3, n), 255).astype(np.uint8)
            else:
                sym = (rng.random(n) < 0.01).astype(np.uint8)
            assert np.array_equal(H.huffman_decode(H.huffman_encode(sym), n), sym), (n, dist)
    assert set(used) == {"_huffman_chains", "_huffman_rows"}


# ---------------------------------------------------------------------------------------------- Huffman time bound
def one_bit_file(sizes: list[int], corrupt: bool = False) -> bytes:
    """A .cmpk of one uint8 tensor per size, each a valid Huffman stream of ``size`` bytes of 1-bit codes (8
    symbols per byte: the most symbols a byte can hold); ``corrupt``: the last stream a one-symbol code (bit 1
    is no code) whose last byte is 0xff, so the file fails at its very end."""
    entries, payload = [], b""
    for i, nbytes in enumerate(sizes):
        n = 8 * nbytes
        if corrupt and i == len(sizes) - 1:
            stream = H.huffman_encode(np.zeros(n, np.uint8))[:-1] + b"\xff"
        else:
            stream = H.huffman_encode(np.random.default_rng(i).integers(0, 2, n, dtype=np.uint8))
        entries.append([f"t{i}", "|u1", [n], "x", [["h", len(stream), n]]])
        payload += stream
    return craft({"v": 1, "t": entries}, payload)


def test_many_small_one_bit_huffman_streams_decode_in_bounded_work_per_megabyte():
    # 1-bit codes only (as no encoder writes them for real data): was 2-5 s/MB for streams of 0.6-16 KB, when
    # they were decoded by a numpy step per symbol position of a block (the row loop: ~5.6 M lines per MB of
    # such a file); the doubling decoder makes a few passes per chunk of bits (~90 k lines per MB)
    sizes = [600, 4096, 16384, 1000, 8000, 2500] * 8
    good, bad = one_bit_file(sizes), one_bit_file(sizes, corrupt=True)
    mb = len(good) / 2**20
    out, _ = K.unpack_bytes(good)
    for i, nbytes in enumerate(sizes):
        assert np.array_equal(out[f"t{i}"], np.random.default_rng(i).integers(0, 2, 8 * nbytes, dtype=np.uint8))
    # each line a numpy pass over at most a chunk of bits; memory: the tensors (8x the file) + 4x the file + work
    err, lines, peak = measured(K.unpack_bytes, good)
    assert err is None and peak < 12 * len(good) + (8 << 20), peak
    assert lines / mb < 300_000, lines / mb
    err, lines, _ = measured(K.unpack_bytes, bad)
    assert isinstance(err, CompressedFileError) and "do not decode to their recorded lengths" in str(err), repr(err)
    assert lines / mb < 300_000, lines / mb


def _encode_with(lengths: np.ndarray, sym: np.ndarray, monkeypatch) -> bytes:
    """Our encoder's stream for ``sym`` under the given code lengths (any prefix code, incomplete included)."""
    monkeypatch.setattr(H, "_code_lengths", lambda freq: lengths.copy())
    try:
        return H.huffman_encode(sym)
    finally:
        monkeypatch.undo()


def _decode_rows(data: bytes, n: int) -> np.ndarray:
    """huffman_decode forced onto the row-loop path (the decoder before the doubling one)."""
    orig = H._huffman_chains

    def rows(stream, offsets, counts, total_bits, dec_sym, dec_len, maxl, n):
        return H._huffman_rows(stream, offsets, total_bits, dec_sym, dec_len, maxl, n, int(counts[0]))
    H._huffman_chains = rows
    try:
        return H.huffman_decode(data, n)
    finally:
        H._huffman_chains = orig


def _decode_chains(data: bytes, n: int) -> np.ndarray:
    orig = H._huffman_rows

    def chains(stream, offsets, total_bits, dec_sym, dec_len, maxl, n, bsize):
        counts = np.full(offsets.size, bsize, np.int64)
        counts[-1] = n - (offsets.size - 1) * bsize
        return H._huffman_chains(stream, offsets, counts, total_bits, dec_sym, dec_len, maxl, n)
    H._huffman_rows = chains
    try:
        return H.huffman_decode(data, n)
    finally:
        H._huffman_rows = orig


def _decode_without_small(decode):
    """``decode`` with the few-symbols path switched off (the stream goes to the numpy decoders)."""
    def run(data: bytes, n: int) -> np.ndarray:
        orig = H._SMALL_SYMBOLS
        H._SMALL_SYMBOLS = 0
        try:
            return decode(data, n)
        finally:
            H._SMALL_SYMBOLS = orig
    return run


def _outcome(decode, data: bytes, n: int):
    try:
        return decode(data, n).tobytes()
    except ValueError:
        return "ValueError"


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 256), st.one_of(st.integers(1, 600), st.integers(1, 40_000)),
       st.sampled_from(["uniform", "skewed", "one"]),
       st.integers(0, 2**32 - 1), st.lists(st.integers(0, 10**9), max_size=3))
def test_doubling_decoder_equals_row_decoder_on_random_code_books(k, n, dist, seed, flips):
    rng = np.random.default_rng(seed)
    used = np.sort(rng.choice(256, k, replace=False))
    lengths = np.zeros(256, np.int64)
    lengths[used] = rng.integers(1, 16, k)
    while k > 1 and np.exp2(-lengths[used].astype(float)).sum() > 1:  # make it a prefix code (maybe incomplete)
        lengths[used[np.argmin(lengths[used])]] += 1
    if dist == "uniform":
        sym = rng.choice(used, n).astype(np.uint8)
    elif dist == "skewed":
        sym = used[np.minimum(rng.geometric(0.5, n) - 1, k - 1)].astype(np.uint8)
    else:
        sym = np.full(n, used[np.argmin(lengths[used])], np.uint8)
    with pytest.MonkeyPatch.context() as mp:
        data = _encode_with(lengths, sym, mp)
    rows, chains = _decode_without_small(_decode_rows), _decode_without_small(_decode_chains)
    assert np.array_equal(chains(data, n), sym) and np.array_equal(rows(data, n), sym)
    assert np.array_equal(H.huffman_decode(data, n), sym)  # (the few-symbols path for n <= 512)
    bad = bytearray(data)
    for f in flips:  # damaged streams: every decoder refuses, or all give the same symbols
        bad[f % len(bad)] ^= 1 << (f % 8)
    assert _outcome(chains, bytes(bad), n) == _outcome(rows, bytes(bad), n) == _outcome(H.huffman_decode, bytes(bad), n)


# ---------------------------------------------------------------------------------------------- fuzz HF config / index
_HOSTILE_JSON = [None, True, 0, -1, 1 << 40, 2.5, "", "re:(", "re:.*", "group", "channel", "pack-quantized",
                 "sparse-bitmask", "x" * 300, [], [1, "a"], {}, {"num_bits": 4}, {"targets": "q"}]


def json_mutation(text: bytes, rng: random.Random) -> bytes:
    """A JSON file truncated, byte-flipped, or with values anywhere in it replaced by hostile ones."""
    kind = rng.randrange(4)
    if kind == 0:
        return text[:rng.randrange(len(text))]
    if kind == 1:
        out = bytearray(text)
        for _ in range(rng.randrange(1, 6)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    obj = json.loads(text)
    for _ in range(rng.randrange(1, 4)):
        node = obj
        while isinstance(node, (dict, list)) and node and rng.random() < 0.8:  # walk down to some container
            key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
            if not isinstance(node[key], (dict, list)) or not node[key]:
                break
            node = node[key]
        if isinstance(node, dict) and node:
            key = rng.choice(list(node))
            if kind == 2:
                node[key] = rng.choice(_HOSTILE_JSON)
            else:
                node[rng.choice(["config_groups", "format", "weight_map", "weights", key + "x"])] = node.pop(key)
        elif isinstance(node, list) and node:
            node[rng.randrange(len(node))] = rng.choice(_HOSTILE_JSON)
    return json.dumps(obj).encode()


def fuzz_checkpoint(cases: int, limit) -> dict:
    """load_compressed_tensors on a checkpoint folder whose config.json or index JSON is mutated."""
    import tempfile

    from compressor.core.compressed_tensors import CheckpointError, load_compressed_tensors
    from tests.core.test_compressed_tensors import _checkpoint

    folder = tempfile.mkdtemp()
    _checkpoint(folder, symmetric=False, sparse=True)
    index = os.path.join(folder, "model.safetensors.index.json")
    from compressor.core.compressed_tensors import read_safetensors

    names = sorted(read_safetensors(os.path.join(folder, "model.safetensors")))
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": 1}, "weight_map": {n: "model.safetensors" for n in names}}, f)
    files = {}
    for name in ("config.json", "model.safetensors.index.json"):
        with open(os.path.join(folder, name), "rb") as f:
            files[name] = f.read()
    load_compressed_tensors(folder)  # the unmutated folder reads

    def make(rng: random.Random) -> tuple[str, bytes]:
        name = rng.choice(sorted(files))
        return name, json_mutation(files[name], rng)

    def read(case: tuple[str, bytes]) -> None:
        name, data = case
        for n, d in files.items():
            with open(os.path.join(folder, n), "wb") as f:
                f.write(data if n == name else d)
        load_compressed_tensors(folder)

    limit()
    return fuzz_loop(read, make, cases, (CheckpointError,), [("config.json", files["config.json"])])


def test_fuzz_checkpoint_config_and_index():
    res = fuzz_in_subprocess("tests.core.test_hostile_files:fuzz_checkpoint", FUZZ_CASES, mem_mb=64)
    assert res["unexpected"] == [], res
    assert res["kinds"].get("CheckpointError", 0) > FUZZ_CASES // 3, res
    assert bounded_work(res), res


# ---------------------------------------------------------------------------------------------- fuzz .keras (zip)
def zip_of(entries: list[tuple[str, bytes]], deflated: tuple[str, ...] = ()) -> bytes:
    """A zip of ``entries`` in order (names may repeat), stored or deflated by name."""
    import io
    import warnings
    import zipfile

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 'Duplicate name'
        with zipfile.ZipFile(buf, "w") as z:
            for name, data in entries:
                z.writestr(name, data, zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED)
    return buf.getvalue()


def zip_entries(data: bytes) -> list[tuple[str, bytes]]:
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def directory_mutation(data: bytes, rng: random.Random) -> bytes:
    """Central directory fields of a zip set to random values: sizes, offsets, name lengths, the entry count."""
    out = bytearray(data)
    cds = [i for i in range(len(out) - 4) if out[i:i + 4] == b"PK\x01\x02"]
    eocd = data.rfind(b"PK\x05\x06")
    for _ in range(rng.randrange(1, 4)):
        if rng.random() < 0.2:
            at, width = eocd + rng.choice([8, 10, 12, 16]), 2
        else:
            off = rng.choice([10, 20, 24, 28, 42])
            at, width = rng.choice(cds) + off, 2 if off in (10, 28) else 4
        out[at:at + width] = rng.choice([0, 1, (1 << 8 * width) - 1, rng.randrange(1 << 8 * width)]).to_bytes(
            width, "little")
    return bytes(out)


def keras_mutation(data: bytes, rng: random.Random) -> bytes:
    """A .keras file truncated / byte-flipped, its directory edited, or re-zipped with an entry changed: config
    or metadata JSON mutated, weights bytes flipped, names made hostile, an entry deflated or duplicated."""
    kind = rng.randrange(5)
    if kind == 0:
        return data[:rng.randrange(len(data))] if rng.random() < 0.8 else data + bytes(rng.randrange(1, 64))
    if kind == 1:
        out = bytearray(data)
        for _ in range(rng.randrange(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    if kind == 2:
        return directory_mutation(data, rng)
    entries = zip_entries(data)
    i = rng.randrange(len(entries))
    name, body = entries[i]
    deflated: tuple[str, ...] = ()
    what = rng.randrange(5) if kind == 3 else rng.randrange(2, 5)
    if what == 0 and name.endswith(".json"):
        entries[i] = (name, json_mutation(body, rng))
    elif what <= 1:
        b = bytearray(body)
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        entries[i] = (name, bytes(b))
    elif what == 2:
        entries[i] = (rng.choice(["../" + name, "/" + name, "assets/../../x", "x.py", "a\\..\\b", name.upper(), "assets/a"]), body)
    elif what == 3:
        deflated = (name,)
        if rng.random() < 0.5:
            entries[i] = (name, body + bytes(rng.choice([1 << 10, 1 << 20, 4 << 20])))
    else:
        entries.insert(rng.randrange(len(entries) + 1), (name, rng.choice([body, b"{}", b""])))
    return zip_of(entries, deflated)


def fuzz_keras_archive(cases: int, limit) -> dict:
    """The zip / JSON / h5 checks of a .keras file (pure Python and h5py: no TensorFlow) on mutated files made
    by tests/tf (path in H29_KERAS_FILE)."""
    import tempfile

    from compressor.core.archives import ArchiveError, check_keras_archive

    with open(os.environ["H29_KERAS_FILE"], "rb") as f:
        legit = f.read()
    path = os.path.join(tempfile.mkdtemp(), "fuzz.keras")

    def read(data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
        check_keras_archive(path)

    read(legit)
    limit()
    return fuzz_loop(read, lambda rng: keras_mutation(legit, rng), cases, (ArchiveError,), [legit])
