"""Reading ``.npz`` archives we did not write (mask files, ``compressor report`` / ``pack`` inputs), safely.

numpy's ``np.load`` with ``allow_pickle=False`` refuses pickled members, but it raises raw ``ValueError`` /
``UnpicklingError`` / ``BadZipFile`` on foreign files and allocates whatever shape a member's header declares
before reading it. :func:`load_npz` first checks that the file is a zip of ``.npy`` members, reads every
member's header (numpy's own header reader, capped at 10000 bytes), refuses object dtypes, a declared size
larger than the member, and a total larger than :func:`~compressor.core.packing.decoded_cap` of the file's
size (256 MiB + 256x the file: ``np.savez_compressed`` of zeros is the only legit way past it; pass
``max_bytes`` or set ``COMPRESSOR_MAX_DECODED_BYTES``), and only then loads the arrays. Every failure is
the caller's error type (``ConfigError`` for mask files, ``ModelError`` for model files) naming the file.
"""

from __future__ import annotations

import math
import os
import zipfile

import numpy as np

from .errors import ConfigError

__all__ = ["load_npz"]


def load_npz(path: str | os.PathLike, what: str = "mask file", error: type[Exception] = ConfigError,
             max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """``{name: array}`` of the ``.npz`` archive ``path``, checked as described above before anything is
    allocated; ``error(message)`` for a missing, foreign, pickled, oversized or corrupted file."""
    from .packing import decoded_cap

    p = os.fspath(path)
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

