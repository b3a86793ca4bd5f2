"""ONNX files for the report: the weight of every Conv / Gemm / MatMul / ConvTranspose as onnxruntime gets it
(an integer QDQ export's int8 codes minus the zero point); external data read only from the model's folder.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ...core.errors import BackendNotAvailable, ModelError


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
