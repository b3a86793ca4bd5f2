"""The row record of ``compressor demo --lm`` (:mod:`compressor.app.demo_lm`), in its own module so the backend
harnesses that build rows (:mod:`compressor.app.demo_lm_torch`, :mod:`compressor.app.demo_lm_tf`) import
it without importing the driver that imports them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LmRow"]


@dataclass
class LmRow:
    """One method on one backend, measured on its shipped artifact (sizes in bytes, times in seconds)."""

    key: str
    label: str
    ppl: float  # of the artifact reloaded from its file
    ppl_model: float | None  # of the compressed model before shipping (masked / fake-quant weights)
    file_bytes: int  # bytes of the file the row's size is measured on
    file_what: str  # what that file is
    compress_s: float = 0.0
    decode_s: float | None = None  # median seconds per generated token
    decode_range: tuple[float, float] | None = None
    kernel: str = ""  # what computes the shipped layers
    file: str = ""  # the file's name (in ``save_dir`` when one was given)
