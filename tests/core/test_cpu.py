"""Which 8-bit weight type gives exact onnxruntime integer kernels on a CPU (compressor.core.cpu)."""

from __future__ import annotations

from compressor.core.cpu import cpu_flags, exact_onnx_weight_dtype, u8s8_saturates

AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
VNNI = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd asimddp\n"


def test_flags_are_read_from_cpuinfo_text():
    assert cpu_flags(AVX2) == {"fpu", "sse", "sse2", "avx", "avx2", "fma"}
    assert cpu_flags(ARM) == {"fp", "asimd", "asimddp"}
    assert cpu_flags("model name : x\n") is None


def test_only_x86_without_vnni_saturates():
    assert u8s8_saturates("x86_64", cpu_flags(AVX2)) is True
    assert u8s8_saturates("AMD64", cpu_flags(VNNI)) is False
    assert u8s8_saturates("x86_64", {"avx2", "avx_vnni"}) is False  # AVX-VNNI (Alder Lake and later)
    assert u8s8_saturates("aarch64", cpu_flags(ARM)) is False
    assert u8s8_saturates("x86_64", None) is True  # flags unknown: exactness first


def test_this_machine_gets_a_valid_choice():
    assert exact_onnx_weight_dtype() in ("int8", "uint8")
    assert (exact_onnx_weight_dtype() == "uint8") == u8s8_saturates(flags=cpu_flags())
