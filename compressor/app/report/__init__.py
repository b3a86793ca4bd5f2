"""Per-layer sparsity / bit-width report of an EXPORTED model file (what ``compressor report`` prints).

Reads, without needing the model's Python class:

* PyTorch ``state_dict`` files (``.pt`` / ``.pth``, loaded with ``weights_only=True``): one row per
  ``<layer>.weight`` tensor; a wrapped model's ``<layer>.module.weight`` and ``<layer>.weight_mask``
  entries are understood too;
* Keras 3 ``.keras`` files: one row per layer with a main weight (kernel, depthwise kernel, embeddings,
  BatchNormalization gamma), layer paths as the TF backend names them (``block1/conv``);
* ``.npz`` archives of weights (``{layer: array}``);
* deployable artifacts, read as the runtime gets them: ONNX (``.onnx``; an integer QDQ export's int8 weight
  codes appear as int8 rows (also when stored as uint8 + 128), its float weights as float rows) and TFLite flatbuffers (``.tflite``; the
  weight operand of every CONV_2D / DEPTHWISE_CONV_2D / FULLY_CONNECTED / BATCH_MATMUL op, int8 in a
  full-integer model; read by a bounds-checked flatbuffer reader, without TensorFlow). Zero codes (code == zero point) count as pruned weights.

File sizes (``--artifact``): the model file and any exported artifacts side by side, in bytes and as a
ratio to the model file, so one report shows sparsity, bits, params, MACs and size together.

Masks (``--masks``): the torch export format ``{layer: {'weight': mask, 'bias': mask}}`` (``.pt``) or
the TF one, ``.npz`` with ``{layer: weight mask, 'layer:bias': bias mask}``. Calibration
(``--calibration``): the torch quantizer's export (``{layer: {'weight_bits': b, ...}}``, ``.pt`` or
``.json``). Without calibration, the bit width is estimated from the number of distinct non-zero
values (``b`` bits hold at most ``2**b`` levels); with too few weights to tell, the dtype's width is
shown. Everything here runs on the host: it is a reporting tool, not part of training.

MACs and parameters, dense vs. after structured speedup (``compressor report --flops``): :func:`file_flops`
loads a ``.keras`` file as is; a torch state_dict needs the model's class (``model_fn``, a
``module:callable`` that builds the model) and an input shape. :func:`pruner_report` is the same for a
live pruner (its sparsity report with the MACs underneath). The speedup always runs on a copy.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...core.errors import BackendNotAvailable, ConfigError, ModelError

__all__ = ["LayerStats", "read_weights", "read_weights_info", "read_masks", "read_calibration", "layer_stats", "format_table", "plot",
           "file_flops", "pruner_report", "parse_input_shape", "file_sizes", "format_sizes"]

TORCH_SUFFIXES = (".pt", ".pth")


@dataclass
class LayerStats:
    """One row of the report."""

    layer: str
    shape: tuple[int, ...]
    params: int
    zeros: int
    sparsity: float  # fraction of weights equal to zero
    masked: float | None  # fraction pruned by the mask file, if one was given
    distinct: int  # distinct non-zero values
    bits: int
    bits_source: str  # 'calibration', 'distinct values' or 'dtype'
    dtype: str = ""  # the stored element type (float32, int8, ...)
    group_size: int | None = None  # Keras-quantized layers: input columns per scale (-1: per channel)
    bytes: int | None = None  # Keras-quantized layers: bytes of codes + scales + zero points (no bias)


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _check_file(path: str, what: str) -> str:
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise ConfigError(f"{what} {p!r} does not exist")
    return p


def _torch_load(path: str) -> Any:
    try:
        import torch
    except ImportError:
        raise BackendNotAvailable(f"reading {path!r} needs torch (pip install 'compressor[torch]')") from None
    from ...core.archives import check_torch_archive
    from ...torch.archive_checks import check_torch_object

    try:
        check_torch_archive(path)  # the zip's directory and pickle, against the caps of core.archives
        obj = torch.load(path, map_location="cpu", weights_only=True)
        check_torch_object(obj, os.path.getsize(path))
        return obj
    except Exception as e:  # pickle errors, zip errors, a pickled nn.Module refused by weights_only, the caps
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot read {path!r} as a torch state_dict ({first[:300]}); save one with "
                         f"torch.save(model.state_dict(), path) or pruner.export_model(path)") from None


def _to_numpy(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        try:
            return t.numpy()
        except TypeError:  # dtypes numpy lacks (float8_*, complex32): widened, as bfloat16 is
            import torch

            return (t.to(torch.complex64) if t.is_complex() else t.float()).numpy()
    return np.asarray(t)


def _from_state_dict(sd: dict[str, Any], path: str) -> tuple[list[tuple[str, np.ndarray]], dict[str, np.ndarray]]:
    """Rows ``(layer, weight)`` and masks found inside a state_dict (wrapped models keep them there)."""
    if not all(isinstance(k, str) for k in sd):
        raise ModelError(f"{path!r} is not a state_dict (keys must be parameter names)")
    weights: list[tuple[str, np.ndarray]] = []
    masks: dict[str, np.ndarray] = {}
    for key, value in sd.items():
        if not hasattr(value, "shape"):
            continue
        parts = [p for p in key.split(".") if p != "module"]  # conv1.module.weight -> conv1.weight
        leaf, layer = parts[-1], ".".join(parts[:-1])
        if leaf == "weight" and np.issubdtype(_to_numpy(value).dtype, np.floating):
            weights.append((layer, _to_numpy(value)))
        elif leaf == "weight_mask":
            masks[layer] = _to_numpy(value).astype(bool)
    return weights, masks


def load_keras(path: str) -> Any:
    """A ``.keras`` file as a Keras model (not compiled); BackendNotAvailable / ModelError otherwise. The
    archive is checked first against the caps of :mod:`compressor.core.archives` (entries, inflated sizes,
    config.json / metadata.json, the weights' declared shapes), so a zip bomb never reaches Keras."""
    import zipfile

    from ...core.archives import ArchiveError, check_keras_archive

    p = os.fspath(path)
    if not os.path.isfile(p):
        raise ModelError(f"Keras model file {p!r} does not exist")
    if not zipfile.is_zipfile(p):
        raise ModelError(f"{p!r} is not a .keras archive: not a zip file (save one with model.save('m.keras'))")
    try:
        _, variable_cap = check_keras_archive(p)
    except ArchiveError as e:
        raise ModelError(f"{p!r} is not a .keras archive Keras may read: {e}") from None
    except OSError as e:
        raise ModelError(f"cannot read {p!r} ({e.strerror or e})") from None
    try:
        import keras
    except ImportError:
        raise BackendNotAvailable(f"reading {p!r} needs tensorflow (pip install 'compressor[tf]')") from None
    budget = _KerasVariableBudget(variable_cap)
    token = _KERAS_BUDGET.set(budget) if _install_keras_budget_hook() else None
    try:
        return keras.saving.load_model(p, compile=False, safe_mode=True)
    except Exception as e:  # noqa: BLE001 - any Keras load failure is bad input
        if budget.refused:  # however Keras wrapped it
            raise ModelError(f"{p!r} is not a .keras archive Keras may read: {budget.refused}") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot load {p!r} as a Keras model ({first[:200]})") from None
    finally:
        if token is not None:
            _KERAS_BUDGET.reset(token)


class _KerasVariableBudget:
    """The bytes the variables Keras creates while :func:`load_keras` runs may hold together."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used, self.refused = cap, 0, ""

    def take(self, shape: Any, dtype: Any) -> None:
        try:
            itemsize = np.dtype(str(dtype)).itemsize
        except TypeError:  # bfloat16, float8_*, int4 (not numpy names): the width in the name
            digits = "".join(c for c in str(dtype) if c.isdigit())
            itemsize = max(1, int(digits) // 8) if digits else 8
        self.used += math.prod(int(d) for d in shape) * itemsize
        if self.used > self.cap:
            self.refused = (f"its config.json builds variables of more than {self.cap:,} bytes, more than its weights "
                            f"entry can fill (a shape bomb)")
            raise ModelError(self.refused)


_KERAS_BUDGET: Any = None


def _install_keras_budget_hook() -> bool:
    """Make Keras' variables check the budget of the load in progress (a context variable: other threads and
    loads outside :func:`load_keras` are not affected) when their shape is set, before their value is
    allocated. Keras has no public hook for this: its private ``Variable._validate_shape`` is wrapped once;
    on a Keras without it, nothing is installed (the zip checks still apply)."""
    global _KERAS_BUDGET
    import contextvars

    try:
        from keras.src.backend.common import variables
    except ImportError:
        return False
    orig = getattr(variables.Variable, "_validate_shape", None)
    if orig is None:
        return False
    if _KERAS_BUDGET is None:
        _KERAS_BUDGET = contextvars.ContextVar("compressor_keras_variable_budget", default=None)
    if getattr(orig, "_compressor_budget", False):
        return True

    def _validate_shape(self: Any, shape: Any) -> Any:
        shape = orig(self, shape)
        budget = _KERAS_BUDGET.get()
        if budget is not None:
            budget.take(shape, getattr(self, "_dtype", "float32"))
        return shape

    _validate_shape._compressor_budget = True  # type: ignore[attr-defined]
    variables.Variable._validate_shape = _validate_shape
    return True


def _read_keras(path: str) -> tuple[list[tuple[str, np.ndarray]], dict[str, dict[str, Any]]]:
    """Rows of a ``.keras`` file, and what its Keras-quantized layers (``int8`` / ``int4`` / ``gptq`` / ``awq``)
    store: their row holds ``code - zero point`` (0 where the weight is 0)."""
    model = load_keras(path)
    import keras

    from ...tf.compressor import iter_layers
    from ...tf.layout import weight_of
    from ...tf.quantization.lowbit import describe_keras_quantized

    rows, quantized = [], {}
    for name, layer in iter_layers(model):
        info = describe_keras_quantized(layer)
        if info is not None:
            rows.append((name, info.pop("offsets")))
            quantized[name] = info
            continue
        w = weight_of(layer)
        if w is not None:
            rows.append((name, np.asarray(keras.ops.convert_to_numpy(w))))
    return rows, quantized


def _read_npz(path: str, what: str = "model file", error: type[Exception] = ModelError) -> dict[str, np.ndarray]:
    from ...core.npz import load_npz

    return load_npz(path, what, error)


def _read_onnx(path: str) -> list[tuple[str, np.ndarray]]:
    """Weights of an ONNX graph: the second input of every Conv / Gemm / MatMul / ConvTranspose, followed
    back through a DequantizeLinear to its integer codes (minus the zero point) when it is quantized."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        raise BackendNotAvailable(f"reading {path!r} needs onnx (pip install 'compressor[onnx]')") from None
    size = os.path.getsize(path)
    if size > ONNX_MAX_BYTES:
        raise ModelError(f"{path!r} has {size:,} bytes, more than the {ONNX_MAX_BYTES:,} an ONNX protobuf may have "
                         f"(larger models keep their weights in external data files)")
    try:
        model = onnx.load(path, load_external_data=False)
        _load_onnx_external_data(model, os.path.dirname(os.path.abspath(path)))
    except ModelError as e:
        raise ModelError(f"cannot read {path!r} as an ONNX model ({e})") from None
    except Exception as e:  # protobuf decode errors, missing external data
        raise ModelError(f"cannot read {path!r} as an ONNX model ({str(e).splitlines()[0][:200] if str(e) else e!r})") from None
    try:
        return _onnx_rows(model, numpy_helper)
    except (IndexError, ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        # a crafted or damaged graph: a node without its inputs, an initializer whose data do not fit its dims
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ModelError(f"{path!r} is not a valid ONNX model ({type(e).__name__}: {first}); check it with "
                         f"onnx.checker.check_model") from None


#: the most bytes a .onnx file may have for ``compressor report``: protobuf's own limit for one message (2 GiB);
#: larger models keep their weights in external data files, read as described in _load_onnx_external_data
ONNX_MAX_BYTES = 1 << 31


def _load_onnx_external_data(model: Any, base_dir: str) -> None:
    """Load the tensors a model keeps in external files, after checking the references: every file is a
    plain relative name inside the model's folder (no ``..``, no absolute path, not a symlink), and the
    regions the tensors name in one file add up to no more than that file's size (so the tensors read hold at
    most what the external files hold; onnx itself checks each region lies inside its file)."""
    from onnx.external_data_helper import (
        ExternalDataInfo,
        _get_all_tensors,
        load_external_data_for_tensor,
        uses_external_data,
    )

    tensors = [t for t in _get_all_tensors(model) if uses_external_data(t)]
    wanted: dict[str, int] = {}
    for t in tensors:
        info = ExternalDataInfo(t)
        loc = info.location
        parts = loc.replace("\\", "/").split("/")
        if not loc or os.path.isabs(loc) or ".." in parts or "\x00" in loc or (len(loc) > 1 and loc[1] == ":"):
            raise ModelError(f"tensor {t.name[:80]!r} names external data {loc[:80]!r} outside the model's folder")
        full = os.path.join(base_dir, loc)
        if os.path.islink(full) or not os.path.isfile(full):
            raise ModelError(f"tensor {t.name[:80]!r}: external data {loc[:80]!r} is not a file in the model's folder")
        have = os.path.getsize(full)
        offset = int(info.offset or 0)
        length = int(info.length) if info.length is not None else have - offset
        if offset < 0 or length < 0 or offset + length > have:
            raise ModelError(f"tensor {t.name[:80]!r}: external data {loc[:80]!r} region {offset:,}+{length:,} lies "
                             f"outside the {have:,}-byte file")
        wanted[full] = wanted.get(full, 0) + length
        if wanted[full] > have:
            raise ModelError(f"tensors read {wanted[full]:,} bytes from the {have:,}-byte external data file "
                             f"{loc[:80]!r} (overlapping regions)")
    for t in tensors:
        load_external_data_for_tensor(t, base_dir)


def _onnx_rows(model: Any, numpy_helper: Any) -> list[tuple[str, np.ndarray]]:
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    for node in g.node:  # constants count as initializers
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            inits[node.output[0]] = node.attribute[0].t
    producers = {o: n for n in g.node for o in n.output}
    rows, seen = [], set()
    for node in g.node:
        if node.op_type not in ("Conv", "Gemm", "MatMul", "ConvTranspose") or len(node.input) < 2:
            continue
        src = node.input[1]
        dq = producers.get(src)
        if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in inits:
            codes = numpy_helper.to_array(inits[dq.input[0]])
            zp = numpy_helper.to_array(inits[dq.input[2]]) if len(dq.input) > 2 and dq.input[2] in inits else None
            name, arr = dq.input[0], codes
            if codes.dtype == np.uint8 and zp is not None and zp.dtype == np.uint8 and np.all(zp == 128):
                # symmetric int8 codes stored as uint8 + 128 (exact u8u8 kernels, see compressor.core.cpu)
                arr = (codes.astype(np.int16) - 128).astype(np.int8)
            elif zp is not None and np.any(zp != 0):  # keep zero codes = zero weights
                axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
                shape = [1] * codes.ndim
                if zp.ndim:
                    shape[axis] = -1
                arr = codes.astype(np.int32) - zp.astype(np.int32).reshape(shape)
        elif src in inits:
            name, arr = src, numpy_helper.to_array(inits[src])
        else:
            continue  # an activation x activation MatMul
        if arr.ndim < 2 or name in seen or arr.dtype.kind not in "biuf":  # (string / complex tensors: no weights)
            continue
        seen.add(name)
        for suffix in (".weight_quantized", ".weight"):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
                break
        rows.append((name, arr))
    return rows


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

    def __init__(self, data: bytes, where: str) -> None:
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
    weights, weights being symmetric). Read with bounds-checked flatbuffer reads (no TensorFlow needed):
    a truncated or mutated file is a ModelError, names that are not UTF-8 are shown with U+FFFD."""
    size = os.path.getsize(path)
    if size > TFLITE_MAX_BYTES:
        raise ModelError(f"{path!r} has {size:,} bytes, more than the {TFLITE_MAX_BYTES:,} a .tflite file may have")
    with open(path, "rb") as f:
        data = f.read()
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


def read_weights(path: str | os.PathLike) -> tuple[list[tuple[str, np.ndarray]], dict[str, np.ndarray]]:
    """``([(layer, weight array)], masks stored in the file)`` of an exported model file."""
    weights, masks, _ = read_weights_info(path)
    return weights, masks


def read_weights_info(path: str | os.PathLike) -> tuple[list[tuple[str, np.ndarray]], dict[str, np.ndarray],
                                                        dict[str, dict[str, Any]]]:
    """:func:`read_weights` plus ``{layer: {'mode', 'bits', 'group_size', 'bytes'}}`` of the Keras-quantized
    layers of a ``.keras`` file (``{}`` for other files), for :func:`layer_stats`'s ``quantized``."""
    p = _check_file(path, "model file")
    quantized: dict[str, dict[str, Any]] = {}
    suffix = _suffix(p)
    if suffix in TORCH_SUFFIXES:
        sd = _torch_load(p)
        if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
            sd = sd["state_dict"]  # common checkpoint layout {'state_dict': ..., 'epoch': ...}
        if not isinstance(sd, dict):
            raise ModelError(f"{p!r} holds a {type(sd).__name__}, not a state_dict")
        weights, masks = _from_state_dict(sd, p)
    elif suffix == ".keras":
        (weights, quantized), masks = _read_keras(p), {}
    elif suffix == ".npz":
        weights = [(k, v) for k, v in _read_npz(p).items() if np.issubdtype(v.dtype, np.floating)]
        masks = {}
    elif suffix == ".onnx":
        weights, masks = _read_onnx(p), {}
    elif suffix == ".tflite":
        weights, masks = _read_tflite(p), {}
    else:
        raise ModelError(f"{p!r}: unsupported model file type {suffix or '(none)'!r}; expected a torch state_dict "
                         f"(.pt/.pth), a Keras model (.keras), a .npz archive of weights, an ONNX model (.onnx) "
                         f"or a TFLite model (.tflite)")
    if not weights:
        raise ModelError(f"{p!r} holds no layer weights")
    return weights, masks, quantized


def read_masks(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Weight masks by layer name from a torch (``.pt``) or TF (``.npz``) mask file."""
    p = _check_file(path, "mask file")
    suffix = _suffix(p)
    if suffix in TORCH_SUFFIXES:
        raw = _torch_load(p)
        if not isinstance(raw, dict) or not all(isinstance(v, dict) and "weight" in v for v in raw.values()):
            raise ConfigError(f"{p!r} is not a mask file (expected {{layer: {{'weight': mask, 'bias': mask}}}})")
        return {k: _to_numpy(v["weight"]).astype(bool) for k, v in raw.items()}
    if suffix == ".npz":
        return {k: v.astype(bool) for k, v in _read_npz(p, "mask file", ConfigError).items() if not k.endswith(":bias")}
    raise ConfigError(f"{p!r}: unsupported mask file type {suffix or '(none)'!r}; expected .pt/.pth or .npz")


def read_calibration(path: str | os.PathLike) -> dict[str, int]:
    """Weight bit width by layer name from a quantizer's calibration export (``.pt`` or ``.json``)."""
    p = _check_file(path, "calibration file")
    if _suffix(p) == ".json":
        try:
            with open(p, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {p!r} as JSON ({e})") from None
    else:
        raw = _torch_load(p)
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ConfigError(f"{p!r} is not a calibration file (expected {{layer: {{'weight_bits': ..., ...}}}})")
    return {k: int(v["weight_bits"]) for k, v in raw.items() if "weight_bits" in v}


def _bits(weight: np.ndarray, nonzero: np.ndarray) -> tuple[int, int, str]:
    """(distinct non-zero values, bits, how the bits were found) without calibration."""
    distinct = int(np.unique(nonzero).size)
    if weight.dtype.kind in "iu":  # stored integer codes: the container is the bit width
        return distinct, int(weight.dtype.itemsize * 8), "dtype"
    levels = distinct + (1 if nonzero.size < weight.size else 0)
    # many repeats (fewer levels than half the non-zero weights) only happen on a quantization grid
    if 0 < distinct <= max(1, nonzero.size // 2) and levels <= 2**16:
        return distinct, max(1, math.ceil(math.log2(levels))), "distinct values"
    return distinct, int(weight.dtype.itemsize * 8), "dtype"


def layer_stats(weights: list[tuple[str, np.ndarray]], masks: dict[str, np.ndarray] | None = None,
                calibration: dict[str, int] | None = None,
                quantized: dict[str, dict[str, Any]] | None = None) -> list[LayerStats]:
    """Rows of the report. Masks and calibration entries must name layers of the model (ConfigError).
    ``quantized`` (:func:`read_weights_info`): the bits, group size and stored bytes of Keras-quantized layers
    (their weight rows are ``code - zero point``); with it, every row gets its stored bytes."""
    quantized = quantized or {}
    masks = masks or {}
    calibration = calibration or {}
    names = {n for n, _ in weights}
    for what, table in (("mask", masks), ("calibration", calibration)):
        unknown = sorted(set(table) - names)
        if unknown:
            raise ConfigError(f"{what} file names layers the model does not have: {unknown}; "
                              f"model layers: {sorted(names)}")
    rows = []
    for name, w in weights:
        flat = w.reshape(-1)
        nonzero = flat[flat != 0]
        zeros = int(flat.size - nonzero.size)
        masked = None
        if name in masks:
            m = masks[name]
            if m.shape != w.shape:
                raise ConfigError(f"mask of layer {name!r} has shape {m.shape}, the weight {w.shape}")
            masked = float(1.0 - m.mean()) if m.size else 0.0
        distinct, bits, source = _bits(w, nonzero)
        if name in calibration:
            bits, source = calibration[name], "calibration"
        dtype, group, nbytes = str(w.dtype), None, (int(w.nbytes) if quantized else None)
        if name in quantized:
            q = quantized[name]
            bits, source, dtype = int(q["bits"]), f"keras {q['mode']}", f"int{int(q['bits'])}"
            group, nbytes = int(q["group_size"]), int(q["bytes"])
        rows.append(LayerStats(name, tuple(int(s) for s in w.shape), int(flat.size), zeros,
                               zeros / flat.size if flat.size else 0.0, masked, distinct, bits, source,
                               dtype, group, nbytes))
    return rows


def format_table(rows: list[LayerStats]) -> str:
    """A plain-text table with a total row; ``~`` marks bit widths estimated from distinct values."""
    head = ["layer", "shape", "params", "zeros", "sparsity", "masked", "bits"]
    sized = any(r.bytes is not None for r in rows)
    if sized:
        head += ["group", "bytes"]
    body = []
    for r in rows:
        stored = r.dtype or "float"
        bits = {"calibration": f"{r.bits}", "distinct values": f"~{r.bits}",
                "dtype": f"{r.bits} ({stored})"}.get(r.bits_source, f"{r.bits} ({r.bits_source})")
        body.append([r.layer, "x".join(map(str, r.shape)) or "scalar", str(r.params), str(r.zeros),
                     f"{r.sparsity:.2%}", "-" if r.masked is None else f"{r.masked:.2%}", bits])
        if sized:
            body[-1] += ["-" if r.group_size is None else ("channel" if r.group_size == -1 else str(r.group_size)),
                         "-" if r.bytes is None else f"{r.bytes:,}"]
    params = sum(r.params for r in rows)
    zeros = sum(r.zeros for r in rows)
    with_mask = [r for r in rows if r.masked is not None]
    masked = (sum(r.masked * r.params for r in with_mask) / sum(r.params for r in with_mask)) if with_mask else None
    body.append(["total", "", str(params), str(zeros), f"{zeros / params:.2%}" if params else "-",
                 "-" if masked is None else f"{masked:.2%}", ""])
    stored = sum(r.bytes or 0 for r in rows)
    if sized:
        body[-1] += ["", f"{stored:,}"]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(head), line(["-" * w for w in widths])]
    out += [line(r) for r in body[:-1]] + [line(["-" * w for w in widths]), line(body[-1])]
    if sized and params:
        out.append(f"weights: {stored:,} bytes stored vs {4 * params:,} bytes as float32 "
                   f"({stored / (4 * params):.3f}x; biases not counted)")
    if any(r.bits_source == "distinct values" for r in rows):
        out.append("~ bits estimated from the number of distinct values (pass --calibration for exact widths)")
    return "\n".join(out)


def file_sizes(paths: list[str | os.PathLike]) -> list[dict[str, Any]]:
    """``[{'path', 'bytes', 'ratio'}]``: each file's size on disk (a SavedModel directory: all its files)
    and its ratio to the first one."""
    out: list[dict[str, Any]] = []
    for path in paths:
        p = os.fspath(path)
        if os.path.isdir(p):
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
        elif os.path.isfile(p):
            size = os.path.getsize(p)
        else:
            raise ConfigError(f"artifact {p!r} does not exist")
        out.append({"path": p, "bytes": int(size)})
    base = out[0]["bytes"] if out else 0
    for row in out:
        row["ratio"] = row["bytes"] / base if base else None
    return out


def format_sizes(sizes: list[dict[str, Any]]) -> str:
    """``file  bytes  x of the first`` lines of :func:`file_sizes`."""
    if not sizes:
        return ""
    wp = max(len(r["path"]) for r in sizes)
    wb = max(len(f"{r['bytes']:,}") for r in sizes)
    head = sizes[0]["path"]
    lines = []
    for r in sizes:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}x {os.path.basename(head)}"
        lines.append(f"file  {r['path']:<{wp}}  {r['bytes']:>{wb},} bytes  {ratio}".rstrip())
    return "\n".join(lines)


def as_dicts(rows: list[LayerStats]) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts (``group_size`` / ``bytes`` only where known: Keras-quantized files)."""
    out = []
    for r in rows:
        d = {**asdict(r), "shape": list(r.shape)}
        for key in ("group_size", "bytes"):  # Keras-quantized files only
            if d[key] is None:
                del d[key]
        out.append(d)
    return out


def plot(rows: list[LayerStats], path: str | os.PathLike) -> None:
    """Bar chart of per-layer sparsity (and mask sparsity) saved to ``path`` (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendNotAvailable("--plot needs matplotlib (pip install 'compressor[demo]')") from None
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(rows) + 2), 3.5))
    has_mask = any(r.masked is not None for r in rows)
    width = 0.4 if has_mask else 0.8
    ax.bar(x - (width / 2 if has_mask else 0), [r.sparsity for r in rows], width, label="zero weights")
    if has_mask:
        ax.bar(x + width / 2, [r.masked or 0.0 for r in rows], width, label="masked")
    ax.set_xticks(x, [r.layer for r in rows], rotation=45, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("sparsity")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(os.fspath(path))
    except OSError as e:
        raise ConfigError(f"cannot write plot {os.fspath(path)!r} ({e.strerror or e})") from None
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------- MACs / params
def pruner_report(pruner: Any, dummy_input: Any = None, strict: bool = False) -> Any:
    """``pruner``'s sparsity report (see ``pruner.report()``) with ``report.flops``: MACs per sample and
    parameters of the dense model and of a sped-up copy (``speedup_model`` on a copy; the pruner and its
    model are not modified). torch needs ``dummy_input`` (one forward's input); Keras does not."""
    from ...core.registry import backend_for

    backend = backend_for(getattr(pruner, "bound_model", getattr(pruner, "model", pruner)))
    if backend == "torch":
        if dummy_input is None:
            raise ConfigError("pruner_report on a torch pruner needs dummy_input (one forward's input)")
        from ...torch.pruning.report import sparsity_report

        return sparsity_report(pruner, dummy_input=dummy_input, strict=strict)
    if dummy_input is not None:
        raise ConfigError("pruner_report on a Keras pruner takes no dummy_input (shapes are in the model)")
    from ...tf.pruning.report import sparsity_report as tf_report

    refresh = getattr(pruner, "_refresh_ready", None)
    if refresh is not None:
        refresh()
    return tf_report(pruner, flops=True, strict=strict)


def parse_input_shape(text: str) -> tuple[int, ...]:
    """``'1,3,32,32'`` (or ``1x3x32x32``) -> ``(1, 3, 32, 32)``; ConfigError on anything else."""
    parts = [p for p in text.replace("x", ",").replace(" ", "").split(",") if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise ConfigError(f"--input-shape {text!r}: expected positive integers such as 1,3,32,32")
    return shape


def _import_model_fn(spec: str) -> Any:
    import importlib
    import sys

    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"--model-fn {spec!r}: expected MODULE:CALLABLE (e.g. mypkg.models:resnet18)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn: Any = importlib.import_module(module)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--model-fn {spec!r}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"--model-fn {spec!r} is not callable")
    return fn


def _torch_model(path: str, model_fn: str) -> Any:
    """The model built by ``model_fn`` with the state_dict of ``path`` loaded (wrapped keys unwrapped)."""
    sd = _torch_load(path)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ModelError(f"{path!r} holds a {type(sd).__name__}, not a state_dict")
    state = {}
    for key, value in sd.items():
        parts = [p for p in key.split(".") if p != "module"]
        if parts[-1] in ("weight_mask", "bias_mask"):
            continue
        state[".".join(parts)] = value
    model = _import_model_fn(model_fn)()
    try:
        model.load_state_dict(state)
    except Exception as e:  # missing / unexpected keys, shape mismatches
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{path!r} does not fit the model of --model-fn {model_fn!r} ({first})") from None
    return model


def file_flops(path: str | os.PathLike, masks: str | os.PathLike | None = None,
               input_shape: tuple[int, ...] | None = None, model_fn: str | None = None) -> dict[str, Any]:
    """MACs per sample and parameters of an exported model as it is ("dense") and after ``speedup_model``
    (masks from ``masks`` or, for a wrapped torch state_dict, from the file; without masks, channels whose
    weights are all zero go): a :func:`~compressor.core.report.flops_summary` dict. ``.keras`` files load
    as they are; a torch state_dict needs ``model_fn`` (``'module:callable'`` returning the model) and
    ``input_shape`` (with the batch dimension, e.g. ``(1, 3, 32, 32)``)."""
    from ...core.report import flops_summary

    p = _check_file(path, "model file")
    m = None if masks is None else _check_file(masks, "mask file")
    suffix = _suffix(p)
    if suffix == ".keras":
        model = load_keras(p)
        from ...tf.speedup import speedup_model

        _, rep = speedup_model(model, masks=m, strict=False, return_report=True)
        return flops_summary(rep.macs_before, rep.params_before, rep.macs_after, rep.params_after, rep.notes)
    if suffix in TORCH_SUFFIXES:
        if model_fn is None or input_shape is None:
            raise ConfigError(f"MACs of {p!r} need the model's class and an input: pass --model-fn MODULE:CALLABLE "
                              f"and --input-shape (e.g. 1,3,32,32); a state_dict holds no architecture")
        import torch

        from ...torch.speedup import speedup_model, speedup_report

        model = _torch_model(p, model_fn)
        wrapped_masks: dict[str, dict[str, Any]] = {}
        if m is None:  # a wrapped model's state_dict carries its masks
            raw = _torch_load(p)
            raw = raw["state_dict"] if isinstance(raw, dict) and isinstance(raw.get("state_dict"), dict) else raw
            for key, value in raw.items():
                parts = [q for q in key.split(".") if q != "module"]
                if parts[-1] in ("weight_mask", "bias_mask"):
                    wrapped_masks.setdefault(".".join(parts[:-1]), {})[parts[-1][:-5]] = value
        model.eval()
        small = speedup_model(model, torch.zeros(input_shape), masks=m if m is not None else (wrapped_masks or None),
                              strict=False)
        rep = speedup_report(small)
        return flops_summary(rep.macs_before, rep.params_before, rep.macs_after, rep.params_after, rep.notes)
    raise ConfigError(f"{p!r}: MACs need a Keras model (.keras) or a torch state_dict (.pt/.pth) with --model-fn")
