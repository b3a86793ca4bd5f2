"""What the local CPU's integer kernels can do exactly (numpy-free, stdlib only).

onnxruntime's x86 kernels for uint8 activations x int8 weights (U8S8) sum pairs of products in saturating
16-bit lanes unless the CPU has VNNI (AVX512-VNNI / AVX-VNNI): on AVX2-only CPUs a wide layer's result can be
off by several percent (OpenVINO documents the same "saturation issue"). uint8 x uint8 kernels widen first
and are exact everywhere. The int8 ONNX export therefore asks here which weight type gives exact results on
the machine it runs on (``onnx_weight_dtype='auto'``).
"""

from __future__ import annotations

import functools
import platform

X86 = ("x86_64", "amd64", "i386", "i686", "x86")


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU feature flags of ``/proc/cpuinfo`` (or of ``cpuinfo`` text); None where they cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def u8s8_saturates(machine: str | None = None, flags: set[str] | None = None) -> bool:
    """True where onnxruntime's u8 x s8 kernels may saturate: an x86 CPU without VNNI, or an x86 CPU whose
    flags cannot be read (assume the worst: exactness over speed). False on VNNI CPUs and non-x86 (ARM)."""
    machine = (machine if machine is not None else platform.machine()).lower()
    if machine not in X86:
        return False
    if flags is None:
        return True
    return not ({"avx512_vnni", "avx_vnni", "avx512vnni", "avxvnni"} & flags)


@functools.lru_cache(maxsize=1)
def exact_onnx_weight_dtype() -> str:
    """``'int8'`` where onnxruntime's u8s8 kernels are exact on this machine, else ``'uint8'``."""
    return "uint8" if u8s8_saturates(flags=cpu_flags()) else "int8"
