"""``.npz`` archives keyed by user names (layer / tensor names): writing them so every name survives, and
reading ones we did not write safely.

Writing: ``np.savez(f, **arrays)`` passes the names as keyword arguments, so a name equal to one of its own
parameters (``file``, ``allow_pickle``) raises a ``TypeError`` or, worse, is swallowed as the option and
silently missing from the file. :func:`save_npz` writes each array as its own ``<name>.npy`` entry of the
zip archive instead (the layout ``np.load`` reads), so every name round-trips; pickled (object) arrays
are refused.

Reading: numpy's ``np.load`` with ``allow_pickle=False`` refuses pickled members, but it raises raw
``ValueError`` / ``UnpicklingError`` / ``BadZipFile`` on foreign files and allocates whatever shape a member's
header declares before reading it. :func:`load_npz` first checks that the file is a zip of ``.npy`` members,
reads every member's header (numpy's own header reader), refuses object dtypes, a declared size larger than
the member, and a total larger than :func:`~compressor.core.cmpk.decoded_cap` of the file's size
(256 MiB + 256x the file: ``np.savez_compressed`` of zeros is the only legit way past it; pass ``max_bytes``
or set ``COMPRESSOR_MAX_DECODED_BYTES``), and only then loads the arrays. Every failure is the caller's error
type (``ConfigError`` for mask files, ``ModelError`` for model files) naming the file.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

from .atomic import recover_for_reading
from .errors import ConfigError

__all__ = ["load_npz", "save_npz"]


def save_npz(file: str | os.PathLike[str] | IO[bytes], arrays: Mapping[str, Any]) -> None:
    """Write ``arrays`` (``{name: array}``) to ``file`` (a path or a binary file object) as an uncompressed
    ``.npz`` that ``np.load(file, allow_pickle=False)`` reads back under the same names."""
    with zipfile.ZipFile(file, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            if not isinstance(name, str):
                raise TypeError(f"save_npz: array names must be str, got {name!r}")
            with zf.open(name + ".npy", mode="w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)


def load_npz(path: str | os.PathLike, what: str = "mask file", error: type[Exception] = ConfigError,
             max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """``{name: array}`` of the ``.npz`` archive ``path``, checked as described above before anything is
    allocated; ``error(message)`` for a missing, foreign, pickled, oversized or corrupted file."""
    from .cmpk import decoded_cap

    p = os.fspath(path)
    recover_for_reading(p)  # a killed export of this file: finished or undone before it is read
    if not os.path.isfile(p):
        raise error(f"{what} {p!r} does not exist")
    if not zipfile.is_zipfile(p):
        raise error(f"cannot read {p!r} as a .npz archive (the {what} is not a zip file; write one with np.savez "
                    f"or export_model)")
    cap = decoded_cap(os.path.getsize(p), max_bytes)
    try:
        with zipfile.ZipFile(p) as z:
            total = 0
            for info in z.infolist():
                name = info.filename[:-4] if info.filename.endswith(".npy") else None
                if name is None:
                    raise error(f"cannot read {p!r} as a .npz archive (the {what}'s member {info.filename[:80]!r} is "
                                f"not a .npy file)")
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                    elif version == (2, 0):
                        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                    else:
                        raise error(f"{what} {p!r}: array {name!r} has .npy format version {version}; allowed: 1.0, 2.0")
                if dtype.hasobject:
                    raise error(f"{what} {p!r}: array {name!r} holds Python objects (pickled data), which are never "
                                f"loaded; masks and weights are numeric arrays")
                nbytes = math.prod(shape) * dtype.itemsize
                if nbytes > info.file_size:
                    raise error(f"{what} {p!r}: array {name!r} declares shape {shape} ({nbytes:,} bytes), its member "
                                f"holds {info.file_size:,} bytes")
                total += nbytes
            if total > cap:
                raise error(f"{what} {p!r}: its arrays hold {total:,} bytes, more than the {cap:,} read from a "
                            f"file of its size (set COMPRESSOR_MAX_DECODED_BYTES to read it)")
        with np.load(p, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except error:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, NotImplementedError, RuntimeError,
            SyntaxError) as e:  # corrupted members, unsupported compression, bad .npy headers
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise error(f"cannot read {p!r} as a .npz archive ({what}: {first})") from None
