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
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ModelError
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
def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file, checked against the file's size: every tensor's
    byte range lies inside the file, matches its dtype and shape, and no two overlap."""
    p = os.fspath(path)
    size = os.path.getsize(p)
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{p!r}: truncated safetensors file ({size} bytes, no header length)")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise CheckpointError(f"{p!r}: truncated or corrupted safetensors file (header of {n} bytes, file "
                                  f"of {size})")
        if n > SAFETENSORS_MAX_HEADER:
            raise CheckpointError(f"{p!r}: safetensors header of {n:,} bytes, more than the {SAFETENSORS_MAX_HEADER:,} "
                                  f"allowed (the safetensors format's own cap)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{p!r}: corrupted safetensors header ({e})") from None
        except RecursionError:
            raise CheckpointError(f"{p!r}: corrupted safetensors header (nested too deeply)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{p!r}: corrupted safetensors header (not a JSON object)")
    start, data = 8 + n, size - 8 - n
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
        itemsize = 2 if dtype == "BF16" else np.dtype(DTYPES[dtype]).itemsize
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


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as numpy arrays (BF16 widened to float32)."""
    header, start = read_safetensors_header(path)
    with open(os.fspath(path), "rb") as f:
        raw = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = raw[start + a:start + b]
        if info["dtype"] == "BF16":
            arr = (np.frombuffer(buf, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(buf, np.dtype(DTYPES[info["dtype"]]).newbyteorder("<")).astype(DTYPES[info["dtype"]])
        out[name] = arr.reshape([int(d) for d in info["shape"]])
    return out


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


# ----------------------------------------------------------------------------------------- reading
_PACKED = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
_QFORMATS = (None, "dense", "pack-quantized", "naive-quantized", "mixed-precision")
_SPARSE = ("compressed", "bitmask", "row_offsets", "shape")


def _read_config(folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder!r} is not a checkpoint folder")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{folder!r}: no config.json (a compressed-tensors checkpoint has one)")
    config = _read_json(cfg_path, "config.json")
    qc = config.get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise CheckpointError(f"{cfg_path!r}: quantization_config is a {type(qc).__name__}, not an object")
    if qc and qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{cfg_path!r}: quantization_config.quant_method is {qc.get('quant_method')!r}; "
                              f"this reader knows 'compressed-tensors' only")
    return config, qc


#: caps on what a checkpoint's files may declare: safetensors' own header cap, and config.json / the index
SAFETENSORS_MAX_HEADER = 100_000_000
JSON_MAX_BYTES = 64 << 20


def _read_json(path: str, what: str) -> dict[str, Any]:
    """A JSON object from ``path`` (at most JSON_MAX_BYTES), or CheckpointError naming the file."""
    try:
        size = os.path.getsize(path)
        if size > JSON_MAX_BYTES:
            raise CheckpointError(f"{path!r}: {what} of {size:,} bytes, more than the {JSON_MAX_BYTES:,} allowed")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path!r}: corrupted {what} ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path!r}: corrupted {what} (nested too deeply)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path!r}: corrupted {what} (not a JSON object)")
    return data


def _files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
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
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        raise CheckpointError(f"{folder!r}: files named by the index are missing: {missing}")
    return [os.path.join(folder, n) for n in names]


def _target_matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _scheme_of(qc: dict[str, Any], name: str) -> dict[str, Any]:
    groups = qc.get("config_groups") or {}
    hit = [g for g in groups.values() if any(_target_matches(t, name) for t in g.get("targets", []))]
    if not hit:  # class-name targets ('Linear'): without the model, only a single group is unambiguous
        hit = list(groups.values()) if len(groups) == 1 else []
    if len(hit) != 1 or not isinstance(hit[0].get("weights"), dict):
        raise CheckpointError(f"layer {name!r} holds quantized weights but the config's config_groups give "
                              f"{len(hit)} matching schemes with weights (expected exactly one)")
    return hit[0]["weights"], hit[0].get("format")


@dataclass
class _Layer:
    name: str
    kind: str  # 'pack-quantized', 'sparse-bitmask', 'sparse-24-bitmask', 'dense'
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    stored: int = 0  # bytes in the files


def _layers(tensors: dict[str, np.ndarray], nbytes: dict[str, int], qc: dict[str, Any]) -> list[_Layer]:
    fmt = qc.get("format") if qc.get("config_groups") else None
    sparse = (qc.get("sparsity_config") or {}).get("format")
    if fmt not in _QFORMATS:
        raise CheckpointError(f"quantization_config.format {fmt!r} is not supported by this reader (supported: "
                              f"{[f for f in _QFORMATS if f]})")
    if sparse not in (None, "dense", "sparse-bitmask", "sparse-24-bitmask"):
        raise CheckpointError(f"sparsity_config.format {sparse!r} is not supported by this reader (supported: "
                              f"'sparse-bitmask', 'sparse-24-bitmask', 'dense')")
    layers: dict[str, _Layer] = {}
    for key in tensors:
        prefix, _, leaf = key.rpartition(".")
        if leaf in _PACKED or (leaf == "weight" and f"{prefix}.weight_scale" in tensors):
            kind = "pack-quantized" if f"{prefix}.weight_packed" in tensors else "naive-quantized"
        elif leaf in _SPARSE and f"{prefix}.compressed" in tensors:
            kind = "sparse-24-bitmask" if f"{prefix}.row_offsets" not in tensors else "sparse-bitmask"
        else:
            prefix, kind = key, "dense"
        layer = layers.setdefault(prefix, _Layer(prefix, kind))
        layer.tensors[leaf if kind != "dense" else ""] = tensors[key]
        layer.stored += nbytes[key]
    for layer in layers.values():
        if layer.kind.endswith("-quantized"):
            group_fmt = _scheme_of(qc, layer.name)[1] if fmt else None
            if (group_fmt or fmt) != layer.kind:
                raise CheckpointError(f"layer {layer.name!r} is stored {layer.kind} but the config says "
                                      f"{group_fmt or fmt!r}")
        if layer.kind.startswith("sparse") and sparse != layer.kind:
            raise CheckpointError(f"layer {layer.name!r} is stored {layer.kind} but sparsity_config.format is "
                                  f"{sparse!r}")
    return list(layers.values())


def _need(layer: _Layer, *keys: str) -> list[np.ndarray]:
    missing = [k for k in keys if k not in layer.tensors]
    if missing:
        raise CheckpointError(f"layer {layer.name!r} ({layer.kind}) lacks {[f'{layer.name}.{k}' for k in missing]}")
    return [layer.tensors[k] for k in keys]


def _shape2(layer: _Layer, key: str) -> tuple[int, int]:
    s = np.asarray(_need(layer, key)[0]).reshape(-1)
    if s.size != 2 or np.any(s < 1):
        raise CheckpointError(f"layer {layer.name!r}: {key} {s.tolist()} is not a 2-D weight shape")
    return int(s[0]), int(s[1])


def _decode(layer: _Layer, qc: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any]]:
    """(float weight, facts for the report) of one layer, checked against the config."""
    n = layer.name
    if layer.kind == "dense":
        w = layer.tensors[""]
        return w, {"dtype": str(w.dtype)}
    if layer.kind.endswith("-quantized"):
        args = _scheme_of(qc, n)[0]
        bits, sym, strategy, gs = args.get("num_bits"), args.get("symmetric", True), args.get("strategy"), args.get("group_size")
        if args.get("type", "int") != "int" or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise CheckpointError(f"layer {n!r}: {layer.kind} needs an int scheme of 1..8 bits, got {args}")
        (scale,) = _need(layer, "weight_scale")
        if layer.kind == "pack-quantized":
            out, cols = _shape2(layer, "weight_shape")
            (packed,) = _need(layer, "weight_packed")
            if packed.dtype != np.int32 or packed.shape != (out, math.ceil(cols * bits / 32)):
                raise CheckpointError(f"layer {n!r}: weight_packed is {packed.dtype} {list(packed.shape)}, expected "
                                      f"int32 {[out, math.ceil(cols * bits / 32)]} for weight_shape {[out, cols]} at "
                                      f"{bits} bits")
            codes = unpack_int32(packed, bits, cols).astype(np.int32)
        else:
            (q,) = _need(layer, "weight")
            if q.dtype != np.int8 or q.ndim != 2:
                raise CheckpointError(f"layer {n!r}: naive-quantized weight is {q.dtype} {list(q.shape)}, expected "
                                      f"2-D int8")
            out, cols = q.shape
            codes = q.astype(np.int32)
        if strategy == "group":
            if not isinstance(gs, int) or gs < 1 or cols % gs:
                raise CheckpointError(f"layer {n!r}: group_size {gs!r} does not divide the {cols} input columns")
            groups = cols // gs
        elif strategy == "channel":
            groups, gs = 1, cols
        else:
            raise CheckpointError(f"layer {n!r}: weight strategy {strategy!r} is not supported by this reader "
                                  f"(supported: 'group', 'channel')")
        if scale.shape != (out, groups) or not np.issubdtype(scale.dtype, np.floating):
            raise CheckpointError(f"layer {n!r}: weight_scale is {scale.dtype} {list(scale.shape)}, expected a float "
                                  f"{[out, groups]}")
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        if codes.size and (codes.min() < lo or codes.max() > hi):
            raise CheckpointError(f"layer {n!r}: codes outside the signed {bits}-bit range [{lo}, {hi}]")
        zp = np.zeros((out, groups), np.int32)
        if not sym:
            (zpp,) = _need(layer, "weight_zero_point")
            if layer.kind == "naive-quantized":
                if zpp.shape != (out, groups) or not np.issubdtype(zpp.dtype, np.integer):
                    raise CheckpointError(f"layer {n!r}: weight_zero_point is {zpp.dtype} {list(zpp.shape)}, expected "
                                          f"integers {[out, groups]}")
                zp = zpp.astype(np.int32)
            else:
                if zpp.dtype != np.int32 or zpp.shape != (math.ceil(out * bits / 32), groups):
                    raise CheckpointError(f"layer {n!r}: weight_zero_point is {zpp.dtype} {list(zpp.shape)}, expected "
                                          f"int32 {[math.ceil(out * bits / 32), groups]}")
                zp = unpack_int32(np.ascontiguousarray(zpp.T), bits, out).T.astype(np.int32)
        gidx = np.arange(cols) // gs
        w = ((codes - zp[:, gidx]) * scale.astype(np.float32)[:, gidx]).astype(scale.dtype)
        facts = {"bits": bits, "group_size": gs if strategy == "group" else None, "symmetric": bool(sym),
                 "dtype": str(scale.dtype)}
        return w, facts
    # sparse
    out, cols = _shape2(layer, "shape")
    values, bits = _need(layer, "compressed", "bitmask")
    if bits.dtype != np.uint8 or bits.shape != (out, math.ceil(cols / 8)):
        raise CheckpointError(f"layer {n!r}: bitmask is {bits.dtype} {list(bits.shape)}, expected uint8 "
                              f"{[out, math.ceil(cols / 8)]}")
    mask = unpack_bitmask(bits, cols)
    flat = values.reshape(-1)
    if flat.size != int(mask.sum()):
        raise CheckpointError(f"layer {n!r}: {flat.size} stored values but the bitmask marks {int(mask.sum())}")
    if layer.kind == "sparse-bitmask":
        (offsets,) = _need(layer, "row_offsets")
        counts = mask.sum(axis=1)
        if offsets.shape != (out,) or not np.array_equal(offsets, np.cumsum(counts) - counts):
            raise CheckpointError(f"layer {n!r}: row_offsets do not match the bitmask")
    elif values.shape != (out, cols // 2) or cols % 4:
        raise CheckpointError(f"layer {n!r}: 2:4 values are {list(values.shape)}, expected {[out, cols // 2]}")
    w = np.zeros((out, cols), dtype=values.dtype)
    w[mask] = flat
    return w, {"dtype": str(values.dtype)}


def _load(folder: str) -> tuple[dict[str, Any], list[tuple[_Layer, np.ndarray, dict[str, Any]]], int]:
    folder = os.fspath(folder)
    config, qc = _read_config(folder)
    tensors: dict[str, np.ndarray] = {}
    nbytes: dict[str, int] = {}
    size = 0
    for path in _files(folder):
        size += os.path.getsize(path)
        header, _ = read_safetensors_header(path)
        for k, v in read_safetensors(path).items():
            if k in tensors:
                raise CheckpointError(f"{folder!r}: tensor {k!r} is stored twice")
            tensors[k] = v
            a, b = header[k]["data_offsets"]
            nbytes[k] = b - a
    try:
        rows = [(layer, *_decode(layer, qc)) for layer in _layers(tensors, nbytes, qc)]
    except CheckpointError:
        raise
    except (AttributeError, TypeError, KeyError, IndexError, ValueError, OverflowError, re.error) as e:
        # a quantization_config of the wrong shape (a number where an object belongs, a bad target regex)
        raise CheckpointError(f"{os.path.join(folder, 'config.json')!r}: corrupted quantization_config "
                              f"({type(e).__name__}: {str(e)[:200]})") from None
    return config, rows, size


def load_compressed_tensors(folder: str | os.PathLike) -> dict[str, np.ndarray]:
    """The float weights of a compressed-tensors checkpoint folder, by the model's own parameter names
    (``<layer>.weight``; other tensors as stored). Raises :class:`CheckpointError` (a ``ModelError``) for
    a truncated / corrupted file, tensors that do not match their shapes or the config, or a format this
    reader lacks; nothing is returned then."""
    _, rows, _ = _load(os.fspath(folder))
    out = {}
    for layer, w, _ in rows:
        out[layer.name if layer.kind == "dense" else f"{layer.name}.weight"] = w
    return out


def checkpoint_report(folder: str | os.PathLike) -> dict[str, Any]:
    """Per layer (every stored weight of two or more dimensions, and every compressed one): ``format``,
    ``bits``, ``group_size``, ``symmetric``, ``sparsity`` (of the decoded weight), ``bytes`` stored,
    ``dense_bytes`` (the same weight as a float tensor of the checkpoint's float dtype); totals over ALL
    tensors (``bytes`` vs ``dense_bytes``: the float checkpoint of the same model) and the files' size."""
    config, rows, size = _load(os.fspath(folder))
    dtype = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
    item = dtype.get(str(config.get("torch_dtype") or config.get("dtype") or "float32"), 4)
    layers, stored, dense = [], 0, 0
    for layer, w, facts in rows:
        d = w.size * (item if np.issubdtype(w.dtype, np.floating) else w.itemsize)
        stored += layer.stored
        dense += d
        if layer.kind == "dense" and w.ndim < 2:
            continue
        layers.append({"layer": layer.name if layer.kind == "dense" else f"{layer.name}.weight",
                       "format": layer.kind, "shape": list(w.shape), "bits": facts.get("bits"),
                       "group_size": facts.get("group_size"), "symmetric": facts.get("symmetric"),
                       "sparsity": float(1.0 - np.count_nonzero(w) / w.size) if w.size else 0.0,
                       "bytes": layer.stored, "dense_bytes": d})
    return {"layers": layers, "total": {"bytes": stored, "dense_bytes": dense, "files_bytes": size,
                                        "ratio": stored / dense if dense else None}}


def format_checkpoint_report(rep: dict[str, Any]) -> str:
    lines = [f"{'layer':<44} {'format':<18} {'bits':>4} {'group':>5} {'sym':>4} {'sparsity':>8} {'bytes':>12} "
             f"{'float':>12}"]
    for r in rep["layers"]:
        sym = "" if r["symmetric"] is None else ("yes" if r["symmetric"] else "no")
        lines.append(f"{r['layer']:<44} {r['format']:<18} {r['bits'] or '':>4} {r['group_size'] or '':>5} {sym:>4} "
                     f"{r['sparsity']:>8.1%} {r['bytes']:>12,} {r['dense_bytes']:>12,}")
    t = rep["total"]
    lines.append(f"total: {t['bytes']:,} bytes of tensors vs {t['dense_bytes']:,} as a float checkpoint "
                 f"({t['ratio']:.1%}); files {t['files_bytes']:,} bytes")
    return "\n".join(lines)
