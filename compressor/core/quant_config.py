"""Per-layer, per-quant-type quantization settings resolved from a config entry (bits, dtype, scheme).

Defaults when ``quant_dtype`` / ``quant_scheme`` are absent follow NNI's QAT_Quantizer, which the seeds
describe: ``'uint'`` and ``'per_tensor_affine'`` for every quant type (8 bits: [0, 255], zero point
chosen so 0 is exact). The torch.ao-style setup is ``quant_dtype: {'weight': 'int', 'output': 'uint'}``
with ``quant_scheme: {'weight': 'per_channel_symmetric', 'output': 'per_tensor_affine'}``.
Signed ints use the narrow range (int8: [-127, 127]).

Which axis holds the channels of a per-channel scheme depends on the backend's layouts: each backend's
``settings.resolve_spec`` starts from :func:`base_spec` and fills in ``axis`` / ``channels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import quant as cq
from .errors import ConfigError

__all__ = ["DEFAULT_DTYPE", "DEFAULT_SCHEME", "QuantSpec", "base_spec", "per_type"]

DEFAULT_DTYPE = "uint"
DEFAULT_SCHEME = "per_tensor_affine"


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor of one layer is quantized."""

    quant_type: str
    bits: int
    dtype: str
    scheme: str
    qmin: int
    qmax: int
    symmetric: bool
    axis: int | None  # channel axis (the backend says of which view), None = per tensor
    channels: int | None  # number of channels for per-channel scales (None while unknown)

    @property
    def per_channel(self) -> bool:
        return self.axis is not None


def per_type(config: dict[str, Any], key: str, quant_type: str, default: str) -> str:
    """``config[key]`` for ``quant_type``: the value itself, or its entry when it is a ``{type: value}`` dict."""
    v = config.get(key, default)
    if isinstance(v, dict):
        return v.get(quant_type, default)
    return v


def base_spec(config: dict[str, Any], quant_type: str, name: str, default_dtype: str = DEFAULT_DTYPE,
              default_scheme: str = DEFAULT_SCHEME, narrow: bool = True,
              what: str = "quantizer") -> tuple[QuantSpec, bool]:
    """``(per-tensor spec, per_channel)`` of ``quant_type`` for layer ``name`` under ``config``: bits,
    dtype, scheme and integer range resolved; ``per_channel`` says the backend must fill in the channel
    ``axis`` and ``channels``. ConfigError if the bits, dtype or scheme are impossible."""
    bits = config["quant_bits"][quant_type]
    dtype = per_type(config, "quant_dtype", quant_type, default_dtype)
    scheme = per_type(config, "quant_scheme", quant_type, default_scheme)
    try:
        qmin, qmax = cq.quant_range(bits, dtype, narrow=narrow)
        per_channel, symmetric = cq.parse_scheme(scheme)
    except ValueError as e:
        raise ConfigError(f"{what}: layer {name!r}, {quant_type}: {e}") from None
    return QuantSpec(quant_type, bits, dtype, scheme, qmin, qmax, symmetric, None, None), per_channel
