"""TFLite flatbuffers for the report, read without TensorFlow: a bounds-checked flatbuffer reader (a truncated
or mutated file is a ModelError, never a crash of the interpreter) and the filter operand of every conv /
fully-connected / batch-matmul op.
"""

from __future__ import annotations

import math
import mmap
import os
from typing import Any

import numpy as np

from ...core.errors import ModelError

#: TFLite schema (tensorflow/lite/schema/schema.fbs): TensorType -> numpy dtype (types without one, e.g.
#: packed INT4, STRING, RESOURCE, are not reported) and the BuiltinOperator codes whose filter is reported
_TFLITE_TYPES = {0: "<f4", 1: "<f2", 2: "<i4", 3: "u1", 4: "<i8", 6: "?", 7: "<i2", 9: "i1", 10: "<f8",
                 12: "<u8", 15: "<u4", 16: "<u2"}
_TFLITE_WEIGHT_OPS = {3: "CONV_2D", 4: "DEPTHWISE_CONV_2D", 9: "FULLY_CONNECTED", 67: "TRANSPOSE_CONV",
                      126: "BATCH_MATMUL"}
#: the most bytes a .tflite file may have for ``compressor report`` (a flatbuffer's own offsets are 32-bit;
#: larger models keep their buffers after it, addressed by 64-bit offsets, which are read too)
TFLITE_MAX_BYTES = 1 << 34


class _Flatbuffer:
    """Bounds-checked reads of a flatbuffer (the TFLite file format): every table, vtable, vector and string
    is checked to lie inside the file before it is read, so a truncated or mutated file raises ModelError
    instead of crashing (tf.lite.Interpreter segfaults on many such files)."""

    def __init__(self, data: bytes | mmap.mmap, where: str) -> None:
        self.data, self.size, self.where = data, len(data), where

    def bad(self, why: str) -> ModelError:
        return ModelError(f"{self.where} is not a valid TFLite model ({why})")

    def num(self, fmt: str, pos: int) -> Any:
        import struct

        if pos < 0 or pos + struct.calcsize(fmt) > self.size:
            raise self.bad(f"offset {pos} runs past the end of the {self.size}-byte file")
        return struct.unpack_from(fmt, self.data, pos)[0]

    def table(self, pos: int) -> tuple[int, int, int, int]:
        """``(table position, vtable position, vtable bytes, table bytes)``."""
        vt = pos - self.num("<i", pos)
        vlen, tlen = self.num("<H", vt), self.num("<H", vt + 2)
        if vlen < 4 or vlen % 2 or vt + vlen > self.size or tlen < 4 or pos + tlen > self.size:
            raise self.bad(f"malformed table at byte {pos}")
        return pos, vt, vlen, tlen

    def field(self, t: tuple[int, int, int, int], i: int) -> int:
        """Position of field ``i`` of table ``t``, or 0 when it is absent."""
        pos, vt, vlen, tlen = t
        if 4 + 2 * i + 2 > vlen:
            return 0
        off = self.num("<H", vt + 4 + 2 * i)
        if off and off + 1 > tlen:
            raise self.bad(f"field {i} of the table at byte {pos} lies outside it")
        return pos + off if off else 0

    def scalar(self, t: tuple[int, int, int, int], i: int, fmt: str, default: int = 0) -> int:
        f = self.field(t, i)
        return self.num(fmt, f) if f else default

    def ref(self, t: tuple[int, int, int, int], i: int) -> int | None:
        f = self.field(t, i)
        return f + self.num("<I", f) if f else None

    def vector(self, t: tuple[int, int, int, int], i: int, itemsize: int) -> tuple[int, int]:
        """``(first element position, length)`` of a vector field (``(0, 0)`` when absent)."""
        p = self.ref(t, i)
        if p is None:
            return 0, 0
        n = self.num("<I", p)
        if p + 4 + n * itemsize > self.size:
            raise self.bad(f"a vector of {n} elements at byte {p} runs past the end of the file")
        return p + 4, n

    def array(self, t: tuple[int, int, int, int], i: int, dtype: str) -> np.ndarray:
        dt = np.dtype(dtype)
        start, n = self.vector(t, i, dt.itemsize)
        return np.frombuffer(self.data, dt, n, start) if n else np.zeros(0, dt)

    def tables(self, t: tuple[int, int, int, int], i: int) -> list[int]:
        start, n = self.vector(t, i, 4)
        return [start + 4 * k + self.num("<I", start + 4 * k) for k in range(n)]

    def string(self, t: tuple[int, int, int, int], i: int) -> str:
        start, n = self.vector(t, i, 1)
        return bytes(self.data[start:start + n]).decode("utf-8", errors="replace")


def _read_tflite(path: str) -> list[tuple[str, np.ndarray]]:
    """Weights of a TFLite flatbuffer: the filter operand of every conv / fully-connected / batch-matmul op
    of the main subgraph (raw stored values: int8 codes in an integer model; zero codes are the zero
    weights, weights being symmetric). The file is memory-mapped, never read whole into memory. Read with
    bounds-checked flatbuffer reads (no TensorFlow needed):
    a truncated or mutated file is a ModelError, names that are not UTF-8 are shown with U+FFFD."""
    size = os.path.getsize(path)
    if size > TFLITE_MAX_BYTES:
        raise ModelError(f"{path!r} has {size:,} bytes, more than the {TFLITE_MAX_BYTES:,} a .tflite file may have")
    with open(path, "rb") as f:
        # memory-mapped, not read: only the tables walked and the weights reported are paged in (the arrays
        # returned are views of the mapping, which stays open while they are referenced)
        data: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    size = len(data)
    fb = _Flatbuffer(data, repr(path))
    if size < 8 or data[4:8] != b"TFL3":
        raise fb.bad("no 'TFL3' file identifier at byte 4" if size >= 8 else f"{size} bytes")
    model = fb.table(fb.num("<I", 0))
    subgraphs = fb.tables(model, 2)
    if not subgraphs:
        raise fb.bad("no subgraph")
    codes = []
    for oc in map(fb.table, fb.tables(model, 1)):
        codes.append(max(fb.scalar(oc, 0, "<b"), fb.scalar(oc, 3, "<i")))  # deprecated_builtin_code, builtin_code
    buffers = fb.tables(model, 4)
    graph = fb.table(subgraphs[0])
    tensors = fb.tables(graph, 0)
    rows, seen = [], set()
    for op in map(fb.table, fb.tables(graph, 3)):
        code_index = fb.scalar(op, 0, "<I")
        if code_index >= len(codes):
            raise fb.bad(f"an operator uses opcode {code_index}, the model has {len(codes)}")
        inputs = fb.array(op, 1, "<i4")
        if codes[code_index] not in _TFLITE_WEIGHT_OPS or inputs.size < 2:
            continue
        idx = int(inputs[1])  # the filter (TRANSPOSE_CONV: output_shape, filter, input)
        if idx < 0 or idx in seen:
            continue
        if idx >= len(tensors):
            raise fb.bad(f"an operator reads tensor {idx}, the subgraph has {len(tensors)}")
        t = fb.table(tensors[idx])
        dtype = _TFLITE_TYPES.get(fb.scalar(t, 1, "<b"))
        buf_index = fb.scalar(t, 2, "<I")
        if dtype is None or fb.field(t, 6) or buf_index == 0:  # no numpy type, sparse, or not a constant
            continue
        if buf_index >= len(buffers):
            raise fb.bad(f"tensor {idx} uses buffer {buf_index}, the model has {len(buffers)}")
        buf = fb.table(buffers[buf_index])
        start, nbytes = fb.vector(buf, 0, 1)
        offset, length = fb.scalar(buf, 1, "<Q"), fb.scalar(buf, 2, "<Q")
        if offset > 1:  # a large model's buffer stored after the flatbuffer
            if offset + length > size:
                raise fb.bad(f"buffer {buf_index} runs past the end of the file")
            start, nbytes = offset, length
        if not nbytes:
            continue  # not a constant (activation operand)
        shape = [int(d) for d in fb.array(t, 0, "<i4")]
        name = fb.string(t, 3) or f"tensor_{idx}"
        item = np.dtype(dtype).itemsize
        if any(d < 0 for d in shape) or math.prod(shape) * item != nbytes:
            raise fb.bad(f"tensor {name!r} has shape {shape} of {dtype}, its buffer {nbytes} bytes")
        arr = np.frombuffer(data, dtype, nbytes // item, start).reshape(shape)
        if arr.ndim < 2:
            continue
        seen.add(idx)
        q = fb.ref(t, 4)
        zp = np.zeros(0, np.int64)
        axis = 0
        if q is not None:
            qt = fb.table(q)
            zp, axis = fb.array(qt, 3, "<i8"), fb.scalar(qt, 6, "<i")
        if arr.dtype.kind in "iu" and zp.size and np.any(zp != 0):
            if not 0 <= axis < arr.ndim or zp.size not in (1, arr.shape[axis]):
                raise fb.bad(f"tensor {name!r}: {zp.size} zero points along axis {axis} of shape {shape}")
            shape_zp = [1] * arr.ndim
            if zp.size > 1:
                shape_zp[axis] = -1
            arr = arr.astype(np.int32) - zp.astype(np.int32).reshape(shape_zp)
        rows.append((name, arr))
    return rows
