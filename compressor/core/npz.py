"""``.npz`` writing for arrays keyed by user names (layer / tensor names).

``np.savez(f, **arrays)`` passes the names as keyword arguments, so a name equal to one of its own
parameters (``file``, ``allow_pickle``) raises a ``TypeError`` or, worse, is swallowed as the option and
silently missing from the file. :func:`save_npz` writes each array as its own ``<name>.npy`` entry of the
zip archive instead (the layout ``np.load`` reads), so every name round-trips; pickled (object) arrays
are refused.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

__all__ = ["save_npz"]


def save_npz(file: str | os.PathLike[str] | IO[bytes], arrays: Mapping[str, Any]) -> None:
    """Write ``arrays`` (``{name: array}``) to ``file`` (a path or a binary file object) as an uncompressed
    ``.npz`` that ``np.load(file, allow_pickle=False)`` reads back under the same names."""
    with zipfile.ZipFile(file, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            if not isinstance(name, str):
                raise TypeError(f"save_npz: array names must be str, got {name!r}")
            with zf.open(name + ".npy", mode="w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)
