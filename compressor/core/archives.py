"""Checks of zip archives we did not write, before a framework reads them: Keras ``.keras`` files
and torch ``.pt`` files are zips, and neither ``keras.saving.load_model`` nor ``torch.load`` bounds what an
entry may inflate to, how many entries the directory may list, or (torch) what the pickle may build.

Everything here reads the zip's directory and a few small entries only (no framework needed), so a crafted
file is refused in milliseconds and in memory proportional to its directory. The caps are module constants
(documented in docs/guides/saving.md); a refusal raises :class:`ArchiveError` (a ``ValueError``) whose text
says what is wrong, and the callers turn it into the library's error naming the file.

``.keras`` (:func:`check_keras_archive`): only ``metadata.json``, ``config.json``, ``model.weights.h5`` or
``model.weights.npz`` and ``assets/...`` entries; at most KERAS_MAX_ENTRIES entries; no entry may inflate to
more than ZIP_MAX_RATIO x its stored bytes (above a ZIP_RATIO_FLOOR), all together to more than
KERAS_INFLATE_BASE + KERAS_INFLATE_RATIO x the file's length; ``config.json`` at most KERAS_CONFIG_MAX_BYTES
and ``metadata.json`` at most KERAS_METADATA_MAX_BYTES, each a JSON object; the config at most KERAS_OBJECTS_BASE
+ one Keras object per KERAS_BYTES_PER_OBJECT of the file (building them is Keras' slowest step); and the
weights' datasets (h5) or arrays (npz) may declare at most KERAS_WEIGHTS_RATIO x the weights entry +
KERAS_WEIGHTS_BASE bytes (Keras writes them uncompressed, so a larger declaration is a shape bomb), without
external or virtual datasets; the model's variables, which Keras creates from config.json before it reads any
weight, are held to the same cap (``compressor.app.report.load_keras``: a config naming a 100-GB Dense layer is
refused before it is allocated).

torch ``.pt`` (:func:`check_torch_archive`; after loading, ``compressor.torch.archive_checks.check_torch_object``): ``torch.save`` writes a zip of
stored (uncompressed) entries, so all entries together may inflate to at most TORCH_INFLATE_BASE +
TORCH_INFLATE_RATIO x the file's length, in at most TORCH_MAX_ENTRIES entries; the pickle (``data.pkl``) is
scanned without running it: at most TORCH_PICKLE_OPS_BASE + file length / TORCH_PICKLE_BYTES_PER_OP opcodes
(the weights-only unpickler takes ~7 us and up to ~220 bytes per opcode, so this keeps it under ~0.1 s and
~4x per MB of file) and only the globals a state_dict uses (tensors, storages, dtypes, OrderedDict, ...:
``bytearray(n)``, quantized, sparse, nested, meta and subclass tensors, which ``weights_only`` also allows,
can allocate what the file declares or are not weights, and are refused). After loading, all tensors
together may hold at most TORCH_TENSOR_BASE + TORCH_TENSOR_RATIO x the file's length (views of one storage
count once each: a file of stride-0 views would otherwise expand without bound). Files in torch's legacy
(pre-1.6, non-zip) format are refused.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickletools
import struct
import zipfile
from typing import Any

__all__ = ["ArchiveError", "check_zip", "check_keras_archive", "check_torch_archive",
           "KERAS_MAX_ENTRIES", "KERAS_CONFIG_MAX_BYTES", "KERAS_METADATA_MAX_BYTES", "KERAS_INFLATE_BASE",
           "KERAS_INFLATE_RATIO", "KERAS_OBJECTS_BASE", "KERAS_BYTES_PER_OBJECT", "KERAS_WEIGHTS_BASE", "KERAS_WEIGHTS_RATIO", "ZIP_MAX_RATIO", "ZIP_RATIO_FLOOR",
           "TORCH_MAX_ENTRIES", "TORCH_INFLATE_BASE", "TORCH_INFLATE_RATIO", "TORCH_PICKLE_OPS_BASE",
           "TORCH_PICKLE_BYTES_PER_OP", "TORCH_TENSOR_BASE", "TORCH_TENSOR_RATIO"]


class ArchiveError(ValueError):
    """A zip archive breaks one of the stated caps or is not what its suffix says (the message says how)."""


#: any zip entry: at most ZIP_MAX_RATIO x its stored bytes once inflated, when it inflates past ZIP_RATIO_FLOOR
#: (Keras and torch store entries uncompressed, ratio 1; a re-zipped JSON config reaches ~10-20x)
ZIP_MAX_RATIO = 100
ZIP_RATIO_FLOOR = 1 << 20
#: ``.keras``: entries (metadata, config, weights, assets); the entries inflated together (base + ratio x the
#: file); config.json (~1-2 KB per layer: 16 MiB is ~10,000 layers) and metadata.json (~100 bytes written)
KERAS_MAX_ENTRIES = 4096
KERAS_INFLATE_BASE = 64 << 20
KERAS_INFLATE_RATIO = 4
KERAS_CONFIG_MAX_BYTES = 16 << 20
KERAS_METADATA_MAX_BYTES = 1 << 20
#: ``.keras`` config.json: the Keras objects (dicts with a "class_name": layers, initializers, dtype policies) it
#: may describe, base + one per KERAS_BYTES_PER_OBJECT of the file. Keras takes ~0.8 ms to build a simple
#: one, so this keeps building under ~1 s per MB; a real model's file holds far more per object (every layer
#: has its h5 group, ~2 KB even without weights; MobileNetV2: 791 objects in 14.7 MB)
KERAS_OBJECTS_BASE = 1000
KERAS_BYTES_PER_OBJECT = 768
#: ``.keras`` weights: bytes the h5 datasets / npz arrays may declare (base + ratio x the weights entry)
KERAS_WEIGHTS_BASE = 1 << 20
KERAS_WEIGHTS_RATIO = 4
#: torch ``.pt``: entries (one per storage + 6: 262,144 is far past any state_dict); the entries inflated
#: together (base + ratio x the file); the pickle's opcodes (base + file / bytes-per-op: a state_dict's pickle
#: is ~25 opcodes per tensor, so the base alone allows ~2,600 tensors); the tensors' bytes (base + ratio x file)
TORCH_MAX_ENTRIES = 1 << 18
TORCH_INFLATE_BASE = 1 << 20
TORCH_INFLATE_RATIO = 4
TORCH_PICKLE_OPS_BASE = 1 << 16
TORCH_PICKLE_BYTES_PER_OP = 64
TORCH_TENSOR_BASE = 64 << 20
TORCH_TENSOR_RATIO = 4

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record (22 bytes)
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record (56 bytes)
_LOCATOR64 = struct.Struct("<4sLQL")  # zip64 end of central directory locator (20 bytes)


def _declared_entries(f: Any, size: int) -> int:
    """The entry count the archive's end record states, read before zipfile builds one object per entry."""
    tail = min(size, _EOCD.size + 0xFFFF)
    f.seek(size - tail)
    data = f.read(tail)
    at = data.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(data):
        raise ArchiveError("not a zip archive (no end of central directory record)")
    count = _EOCD.unpack_from(data, at)[4]
    if count == 0xFFFF and at >= _LOCATOR64.size and data[at - _LOCATOR64.size:at - _LOCATOR64.size + 4] == b"PK\x06\x07":
        where = _LOCATOR64.unpack_from(data, at - _LOCATOR64.size)[2]
        if where + _EOCD64.size > size:
            raise ArchiveError(f"its zip64 end record at offset {where:,} lies past the end of the {size:,}-byte file")
        f.seek(where)
        rec = f.read(_EOCD64.size)
        if rec[:4] != b"PK\x06\x06":
            raise ArchiveError("its zip64 end record is damaged")
        count = _EOCD64.unpack(rec)[7]
    return count


def _bad_name(name: str) -> bool:
    parts = name.replace("\\", "/").split("/")
    return (not name or "\x00" in name or name.startswith(("/", "\\")) or ".." in parts
            or (len(name) > 1 and name[1] == ":"))


def check_zip(path: str, *, max_entries: int, inflate_base: int, inflate_ratio: int,
              max_ratio: int = ZIP_MAX_RATIO, ratio_floor: int = ZIP_RATIO_FLOOR) -> list[zipfile.ZipInfo]:
    """The entries of the zip ``path`` once its directory is checked: at most ``max_entries`` (counted from the
    end record, before the directory is parsed), names without ``..`` / absolute paths / duplicates, stored or
    deflated data lying inside the file, no entry inflating past ``max_ratio`` x its stored bytes (above
    ``ratio_floor``), all together at most ``inflate_base + inflate_ratio`` x the file's length."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            count = _declared_entries(f, size)
            if count > max_entries:
                raise ArchiveError(f"its zip directory lists {count:,} entries, more than the {max_entries:,} allowed")
            with zipfile.ZipFile(f) as z:
                infos = z.infolist()
    except ArchiveError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, NotImplementedError,
            struct.error, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ArchiveError(f"damaged zip archive ({first})") from None
    if len(infos) > max_entries:
        raise ArchiveError(f"its zip directory lists {len(infos):,} entries, more than the {max_entries:,} allowed")
    cap = inflate_base + inflate_ratio * size
    total, seen = 0, set()
    for info in infos:
        name = info.filename
        shown = repr(name[:80])
        if _bad_name(name):
            raise ArchiveError(f"entry {shown} is not a plain relative name (absolute, '..' or NUL)")
        if name in seen:
            raise ArchiveError(f"entry {shown} appears twice")
        seen.add(name)
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ArchiveError(f"entry {shown} uses zip compression method {info.compress_type}; allowed: stored, "
                               f"deflated")
        if info.header_offset < 0 or info.header_offset + 30 + info.compress_size > size:
            raise ArchiveError(f"entry {shown} ({info.compress_size:,} bytes at offset {info.header_offset:,}) runs "
                               f"past the end of the {size:,}-byte file")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise ArchiveError(f"stored entry {shown} claims {info.file_size:,} bytes but holds {info.compress_size:,}")
        if info.file_size > ratio_floor and info.file_size > max_ratio * info.compress_size:
            raise ArchiveError(f"entry {shown} inflates to {info.file_size:,} bytes from {info.compress_size:,}, more "
                               f"than {max_ratio}x (a zip bomb)")
        total += info.file_size
        if total > cap:
            raise ArchiveError(f"its entries inflate to more than the {cap:,} bytes read from a file of "
                               f"{size:,} bytes ({inflate_base:,} + {inflate_ratio}x its length)")
    return infos


def _read_entry(z: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes:
    """The bytes of one entry, at most ``limit`` (checked against what it declares, and read no further)."""
    if info.file_size > limit:
        raise ArchiveError(f"{info.filename[:80]!r} holds {info.file_size:,} bytes, more than the {limit:,} allowed")
    try:
        with z.open(info) as f:
            data = f.read(limit + 1)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:  # bad CRC, bad deflate
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ArchiveError(f"entry {info.filename[:80]!r} is damaged ({first})") from None
    if len(data) > limit:
        raise ArchiveError(f"{info.filename[:80]!r} holds more than the {limit:,} bytes allowed")
    return data


def _json_object(data: bytes, name: str) -> dict[str, Any]:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ArchiveError(f"{name} is not JSON ({str(e)[:120]})") from None
    except RecursionError:
        raise ArchiveError(f"{name} is not JSON Keras reads (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise ArchiveError(f"{name} is not a JSON object")
    return obj


_KERAS_FILES = ("metadata.json", "config.json", "model.weights.h5", "model.weights.npz")


def check_keras_archive(path: str) -> tuple[dict[str, Any], int]:
    """Check a ``.keras`` file as described in the module docstring; ``(its config, the bytes the model's
    variables may hold)`` when it passes: KERAS_WEIGHTS_BASE + KERAS_WEIGHTS_RATIO x the weights entry, since
    every variable is loaded from it (``compressor.app.report.load_keras`` holds Keras to that while it builds
    the model from the config, before any weight is read)."""
    infos = check_zip(path, max_entries=KERAS_MAX_ENTRIES, inflate_base=KERAS_INFLATE_BASE,
                      inflate_ratio=KERAS_INFLATE_RATIO)
    by_name = {i.filename: i for i in infos}
    odd = [n for n in by_name if n not in _KERAS_FILES and not n.startswith("assets/")]
    if odd:
        raise ArchiveError(f"unexpected entry {odd[0][:80]!r} (a .keras archive holds metadata.json, config.json, "
                           f"model.weights.h5 or .npz and assets/)")
    if "config.json" not in by_name:
        raise ArchiveError("no config.json entry")
    weights = [n for n in ("model.weights.h5", "model.weights.npz") if n in by_name]
    if len(weights) != 1:
        raise ArchiveError("no model.weights.h5 / model.weights.npz entry" if not weights else
                           "both model.weights.h5 and model.weights.npz entries")
    with zipfile.ZipFile(path) as z:
        config = _json_object(_read_entry(z, by_name["config.json"], KERAS_CONFIG_MAX_BYTES), "config.json")
        objects, most = _keras_objects(config), KERAS_OBJECTS_BASE + os.path.getsize(path) // KERAS_BYTES_PER_OBJECT
        if objects > most:
            raise ArchiveError(f"its config.json describes {objects:,} Keras objects, more than the {most:,} read from "
                               f"a file of its size ({KERAS_OBJECTS_BASE:,} + 1 per {KERAS_BYTES_PER_OBJECT} bytes)")
        if "metadata.json" in by_name:
            _json_object(_read_entry(z, by_name["metadata.json"], KERAS_METADATA_MAX_BYTES), "metadata.json")
        info = by_name[weights[0]]
        cap = KERAS_WEIGHTS_BASE + KERAS_WEIGHTS_RATIO * info.file_size
        if weights[0].endswith(".h5"):
            _check_h5(z, info, cap)
        else:
            _check_npz(z, info, cap)
    return config, cap


def _keras_objects(config: Any) -> int:
    """Dicts with a "class_name" anywhere in ``config`` (iteratively: the JSON may be deep)."""
    count, stack = 0, [config]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            count += "class_name" in x
            stack.extend(v for v in x.values() if isinstance(v, (dict, list)))
        elif isinstance(x, list):
            stack.extend(v for v in x if isinstance(v, (dict, list)))
    return count


def _check_h5(z: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> None:
    """Every dataset of the weights' h5 file: no external / virtual storage, declared bytes within ``cap``
    together (metadata only: h5py reads no dataset)."""
    try:
        import h5py
    except ImportError:  # Keras needs h5py to read it anyway
        return
    total = 0

    def visit(name: str, obj: Any) -> None:
        nonlocal total
        if isinstance(obj, h5py.Dataset):
            if obj.external or obj.is_virtual:
                raise ArchiveError(f"model.weights.h5: dataset {name[:80]!r} keeps its data outside the file")
            total += math.prod(obj.shape or ()) * obj.dtype.itemsize
            if total > cap:
                raise ArchiveError(f"model.weights.h5: its datasets declare more than {cap:,} bytes, "
                                   f"{KERAS_WEIGHTS_RATIO}x the {info.file_size:,} bytes it holds (a shape bomb)")

    try:
        with z.open(info) as raw:
            src = raw if info.compress_type == zipfile.ZIP_STORED else io.BytesIO(raw.read())
            with h5py.File(src, "r") as h:
                h.visititems(visit)
    except ArchiveError:
        raise
    except Exception as e:  # noqa: BLE001 - h5py raises OSError / KeyError / ValueError / RuntimeError on bad files
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ArchiveError(f"model.weights.h5 is not a readable HDF5 file ({first})") from None


def _check_npz(z: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> None:
    """Every array header of the weights' npz: plain dtypes, declared bytes within the member and ``cap``."""
    import numpy as np

    try:
        with z.open(info) as raw:
            inner = zipfile.ZipFile(io.BytesIO(raw.read()))
        total = 0
        for member in inner.infolist():
            with inner.open(member) as f:
                version = np.lib.format.read_magic(f)
                reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = reader(f)
            nbytes = math.prod(shape) * dtype.itemsize
            if dtype.hasobject or nbytes > member.file_size:
                raise ArchiveError(f"model.weights.npz: array {member.filename[:80]!r} declares {nbytes:,} bytes of "
                                   f"{dtype} in a {member.file_size:,}-byte member")
            total += nbytes
            if total > cap:
                raise ArchiveError(f"model.weights.npz: its arrays declare more than {cap:,} bytes")
    except ArchiveError:
        raise
    except Exception as e:  # noqa: BLE001 - zip / .npy header errors
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ArchiveError(f"model.weights.npz is damaged ({first})") from None


# ---------------------------------------------------------------------------------------------- torch
#: the globals a state_dict / mask / calibration file's pickle may name (besides torch's dtypes and storage
#: classes): containers and the rebuild functions of dense tensors and parameters
_TORCH_GLOBALS = {
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "complex"), ("_codecs", "encode"),
    ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"),
}


#: torch's dtype names (torch 2.13; a pickle names a tensor's dtype as ``torch.<name>``); core imports no torch
_TORCH_DTYPES = frozenset((
    "bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 complex32 complex64 "
    "double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
    "float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 long qint32 "
    "qint8 quint2x4 quint4x2 quint8 short uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8").split())


def _torch_global_ok(module: str, name: str) -> bool:
    if (module, name) in _TORCH_GLOBALS:
        return True
    if module != "torch":
        return False
    return name.endswith("Storage") or name in _TORCH_DTYPES


def check_torch_archive(path: str) -> None:
    """Check a torch ``.pt`` file as described in the module docstring, before ``torch.load`` reads it."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(512)
    if not zipfile.is_zipfile(path):
        if head[:1] == b"\x80" or head[257:262] == b"ustar":
            raise ArchiveError("it is in torch's legacy format (before torch 1.6, or _use_new_zipfile_serialization="
                               "False), which is not read: load it with a trusted torch and torch.save it again")
        raise ArchiveError("not a torch file (torch.save writes a zip archive)")
    infos = check_zip(path, max_entries=TORCH_MAX_ENTRIES, inflate_base=TORCH_INFLATE_BASE,
                      inflate_ratio=TORCH_INFLATE_RATIO)
    if not infos:
        raise ArchiveError("an empty zip archive")
    prefix = infos[0].filename.split("/", 1)[0]
    pkl = next((i for i in infos if i.filename == f"{prefix}/data.pkl"), None)
    if pkl is None:
        raise ArchiveError(f"no {prefix[:80]}/data.pkl entry (not written by torch.save)")
    budget = TORCH_PICKLE_OPS_BASE + size // TORCH_PICKLE_BYTES_PER_OP
    with zipfile.ZipFile(path) as z:
        data = _read_entry(z, pkl, TORCH_INFLATE_BASE + TORCH_INFLATE_RATIO * size)
    _scan_pickle(data, budget)


def _scan_pickle(data: bytes, budget: int) -> None:
    """Walk the pickle's opcodes without running them: at most ``budget`` of them, only allowed globals."""
    import pickle

    ops = 0
    try:
        for op, arg, _ in pickletools.genops(data):
            ops += 1
            if ops > budget:
                raise ArchiveError(f"its pickle has more than {budget:,} opcodes, the most read from a file of its "
                                   f"size (a state_dict needs ~25 per tensor)")
            if op.name == "GLOBAL":
                module, _, name = str(arg).partition(" ")
                module = "builtins" if module == "__builtin__" else module  # protocol 2 writes Python 2's name
                if not _torch_global_ok(module, name):
                    raise pickle.UnpicklingError(f"the pickle names {module}.{name}, which is not a dense tensor, "
                                                 f"storage or container; only state_dicts of tensors are read")
            elif op.name == "STACK_GLOBAL":
                raise pickle.UnpicklingError("the pickle builds a global from the stack (STACK_GLOBAL), which "
                                             "torch.save never writes")
    except (ArchiveError, pickle.UnpicklingError):
        raise
    except (ValueError, EOFError, struct.error, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ArchiveError(f"its pickle is damaged ({first})") from None
