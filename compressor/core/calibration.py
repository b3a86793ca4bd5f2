"""The calibration config of a quantized model, backend-agnostic: records and their checks.

The config maps layer name -> ``{'quant_types', 'module_type', '<type>_bits', '<type>_scale',
'<type>_zero_point', '<type>_qmin', '<type>_qmax', 'tracked_min_<type>', 'tracked_max_<type>'}`` (host
floats/ints; scale and zero point are lists for per-channel schemes, in output-channel order), the same
on both backends. The backends read their tensors to the host and write loaded values back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .errors import ConfigError
from .quant import describe

__all__ = ["calibration_record", "check_calibration_layers", "check_calibration_type", "loadable_keys"]


def calibration_record(quant_types: Iterable[str], module_type: str, bits: Mapping[str, int],
                       qparams: Callable[[str], tuple[Any, Any, int, int] | None],
                       tracked: Callable[[str], Any]) -> dict[str, Any]:
    """One layer's record. ``qparams(t)``: host ``(scale, zero_point, qmin, qmax)`` (float64 arrays) of
    quant type ``t``, or None when it has none; ``tracked(key)``: the host value of a tracked-range
    state ``tracked_min_<t>`` / ``tracked_max_<t>``, or None when the layer has no such state."""
    quant_types = list(quant_types)
    entry: dict[str, Any] = {"quant_types": quant_types, "module_type": module_type}
    for t in quant_types:
        entry[f"{t}_bits"] = int(bits[t])
        qp = qparams(t)
        if qp is not None:
            d = describe(*qp)
            entry.update({f"{t}_scale": d["scale"], f"{t}_zero_point": d["zero_point"],
                          f"{t}_qmin": d["qmin"], f"{t}_qmax": d["qmax"]})
        for key in (f"tracked_min_{t}", f"tracked_max_{t}"):
            value = tracked(key)
            if value is not None:
                entry[key] = value
    return entry


def check_calibration_layers(what: str, calibration_config: Any, wrapped: Iterable[str],
                             allowed: str = "a dict {layer name: record}") -> None:
    """Refuse a calibration config that is not a dict or names layers the quantizer does not wrap."""
    if not isinstance(calibration_config, dict):
        raise ConfigError(f"{what}: calibration config must be {allowed}, got {type(calibration_config).__name__}")
    wrapped = set(wrapped)
    unknown = sorted(set(calibration_config) - wrapped)
    if unknown:
        raise ConfigError(f"{what}: calibration config names layers {unknown} that this quantizer does not wrap; "
                          f"wrapped: {sorted(wrapped)}")


def check_calibration_type(what: str, name: str, quant_type: str, entry: Mapping[str, Any], bits: int,
                           qrange: tuple[int, int] | None) -> None:
    """Refuse a record whose bits or integer range for ``quant_type`` differ from the layer's config
    (``bits``; ``qrange``: the layer's ``(qmin, qmax)``, None when it has none)."""
    t = quant_type
    recorded = entry.get(f"{t}_bits")
    if recorded is not None and int(recorded) != bits:
        raise ConfigError(f"{what}: layer {name!r}: calibration {t}_bits = {recorded}, but the config quantizes "
                          f"{t} at {bits} bits")
    if qrange is not None and f"{t}_qmin" in entry and (entry[f"{t}_qmin"], entry[f"{t}_qmax"]) != tuple(qrange):
        raise ConfigError(f"{what}: layer {name!r}: calibration {t} range "
                          f"[{entry[f'{t}_qmin']}, {entry[f'{t}_qmax']}] differs from [{qrange[0]}, {qrange[1]}]")


def loadable_keys(quant_type: str) -> tuple[str, str, str, str]:
    """The record keys of ``quant_type`` that are loaded back into a layer's state."""
    t = quant_type
    return f"{t}_scale", f"{t}_zero_point", f"tracked_min_{t}", f"tracked_max_{t}"
