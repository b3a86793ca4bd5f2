"""PackedLinear picks its path by the number of input rows: the weight-only kernels below ``dequant_rows``
(decode), the weight dequantized from the kernel's own resident form and the float matmul from there on
(prefill; the kernels are compute-bound and 1.4-2.7x slower than a bf16 matmul there), always the float path for
int4 in float32 (the kernel's float32 path is a scalar loop). The dequantized weight is the one the kernel computes
with, bit for bit; speed is measured in benchmarks/lowbit_torch.py (``sweep_table``)."""

from __future__ import annotations

import pytest
import torch

from compressor.core.oneshot import QuantSpec, rtn_quantize
from compressor.torch import PackedLinear
from compressor.torch.quantization.lowbit import DEQUANT_ROWS

pytestmark = [pytest.mark.torch]


def _packed(n: int, k: int, bits: int, group: int | None, symmetric: bool = True, **kw) -> PackedLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    q = rtn_quantize(w.double().numpy(), QuantSpec(bits, symmetric, group))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    return PackedLinear.from_codes(torch.from_numpy(q.codes).to(torch.int32), torch.from_numpy(q.scale).float(),
                                   torch.from_numpy(q.zero_point).to(torch.int32), bits, group, bias=bias,
                                   signed=symmetric, **kw)


def _kernel_weight_by_hand(m: PackedLinear) -> torch.Tensor:
    """``(u - 8) * s + zero`` per kernel group, from the canonical codes and the kernel's scale / zero pairs."""
    n, k = m.out_features, m.in_features
    u = m.codes() + (8 if m.signed else 0)
    g = torch.arange(k) // m._kg
    s = m._sz[g, :n, 0].t()
    z = m._sz[g, :n, 1].t()
    return torch.addcmul(z, (u - 8).to(m.compute_dtype), s)


@pytest.mark.parametrize("n, k, group, symmetric, dtype", [
    (128, 256, 128, True, torch.bfloat16), (192, 256, 64, False, torch.bfloat16),
    (120, 128, None, True, torch.float32),  # out padded to 128 rows for the kernel: the padding is cut
    (64, 512, 32, False, torch.float32)])
def test_int4_dequantized_weight_is_the_kernels_bit_for_bit(n, k, group, symmetric, dtype):
    m = _packed(n, k, 4, group, symmetric, compute_dtype=dtype)
    assert m.kernel == "int4" and m._deq_scales is not None
    assert torch.equal(m._kernel_weight(), _kernel_weight_by_hand(m))


def test_the_path_follows_the_number_of_rows_in_bfloat16():
    m = _packed(128, 256, 4, 128)
    assert m.dequant_rows == DEQUANT_ROWS[("int4", torch.bfloat16)] == 128
    w = m._kernel_weight()
    for rows in (1, 127, 128, 200):
        x = torch.randn(2, rows, 256, generator=torch.Generator().manual_seed(rows)) if rows == 200 else \
            torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        xb = x.reshape(-1, 256).to(torch.bfloat16)
        with torch.no_grad():
            got = m(x).reshape(-1, 128)
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, m._wq, m._kg, m._sz).float() + m.bias
        floatmm = torch.nn.functional.linear(xb, w).float() + m.bias
        want = floatmm if xb.shape[0] >= 128 else kernel
        assert torch.equal(got, want), rows
    ref = x.reshape(-1, 256).double() @ m.dequantized_weight(torch.float64).t() + m.bias.double()
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 2e-2  # bf16 rounding
    m.dequant_rows = None  # the kernel at every size
    with torch.no_grad():
        assert torch.equal(m(x).reshape(-1, 128), kernel)


@pytest.mark.parametrize("rows", [1, 4])
def test_float32_int4_always_dequantizes_and_equals_the_fake_quant_layer_to_float32_rounding(rows):
    m = _packed(64, 512, 4, 32, symmetric=False, compute_dtype=torch.float32)
    assert m.dequant_rows == 1
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = m(x)
    assert torch.equal(got, torch.nn.functional.linear(x, m._kernel_weight()) + m.bias)
    ref = x.double() @ m.dequantized_weight(torch.float64).t() + m.bias.double()
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 2e-6


def test_int8_weight_only_dequantizes_too_affine_codes_included():
    for symmetric in (True, False):
        m = _packed(48, 72, 8, None, symmetric)  # 72 columns: the kernel's copy is padded to 80
        assert m.kernel == "int8" and m.dequant_rows == 32
        x = torch.randn(40, 72, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            got = m(x)
        w = m._kernel_weight()
        assert w.shape == (48, 72)
        assert torch.equal(got, torch.nn.functional.linear(x.to(torch.bfloat16), w).float() + m.bias)
        ref = x.double() @ m.dequantized_weight(torch.float64).t() + m.bias.double()
        assert float((got.double() - ref).abs().max() / ref.abs().max()) < 2e-2


def test_a_kernel_layout_it_cannot_unpack_keeps_the_kernel():
    m = _packed(96, 128, 4, 64)  # 96 rows: not the 64-row block layout
    assert m.kernel == "int4" and m._deq_scales is None
    x = torch.randn(160, 128, generator=torch.Generator().manual_seed(3))
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        got = m(x)
    assert torch.equal(got, torch.ops.aten._weight_int4pack_mm_for_cpu(xb, m._wq, m._kg, m._sz).float() + m.bias)


def test_state_dict_round_trip_keeps_the_dequantized_path():
    m = _packed(128, 256, 4, 128, symmetric=False)
    fresh = PackedLinear(256, 128, 4, 128, signed=False)
    fresh.load_state_dict(m.state_dict())
    x = torch.randn(160, 256, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(fresh(x), m(x))
    assert torch.equal(fresh._kernel_weight(), m._kernel_weight())
