"""A group size that does not divide a layer's input width is handled exactly: the one-shot quantizers make
groups of ``group_size`` columns with a narrower last one (48 over 160 columns: 48, 48, 48, 16), and
``pack_weights`` packs those groups (it used to rebuild the width as ``ceil(in / groups)`` = 40 and dequantize
with the wrong groups: relative error 0.05-0.2, no error raised)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from compressor.core.errors import ModelError
from compressor.torch import AwqQuantizer, GptqQuantizer, PackedLinear, RtnQuantizer, pack_weights
from compressor.torch.quantization.lowbit import oneshot_codes

pytestmark = [pytest.mark.torch]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(160, 64), nn.ReLU(), nn.Linear(64, 32)).eval()


X = torch.randn(64, 160, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("quantizer", [RtnQuantizer, GptqQuantizer, AwqQuantizer])
@pytest.mark.parametrize("scheme", ["symmetric", "affine"])
def test_pack_weights_uses_the_quantizers_groups_when_the_group_size_does_not_divide(quantizer, scheme):
    model = _model()
    q = quantizer(model, [{"quant_bits": 4, "group_size": 48, "quant_scheme": scheme, "op_types": ["Linear"]}])
    q.calibrate() if quantizer is RtnQuantizer else q.calibrate([X], progress=False)
    wrappers = q.get_modules_wrapper()
    want = []
    for w in wrappers:
        codes = oneshot_codes(w).to(torch.int64)
        n_in = codes.shape[1]
        g = torch.arange(n_in) // 48  # 160 columns: groups 0..3, the last of 16; 64 columns: 48 + 16
        assert w.weight_group_scale.shape[1] == -(-n_in // 48)
        want.append((codes, (codes - w.weight_group_zero_point[:, g]).double() * w.weight_group_scale[:, g].double()))
    with torch.no_grad():
        ref = model(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no int4 kernel group divides 48 and 160: reference path
        pack_weights(model, compute_dtype=torch.float32)
    packed = [model[0], model[2]]
    for m, (codes, deq) in zip(packed, want):
        assert isinstance(m, PackedLinear) and m.group_size == 48
        assert torch.equal(m.codes().to(torch.int64), codes)
        assert torch.equal(m.dequantized_weight(torch.float64), deq)
    with torch.no_grad():
        out = model(X)
    assert float((out - ref).abs().max() / ref.abs().max()) < 2e-6


def test_from_codes_groups_are_consecutive_columns_with_a_narrow_last_one():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-7, 8, (16, 100), generator=g, dtype=torch.int32)
    scale = torch.rand(16, 3, generator=g) + 0.5  # 100 columns in groups of 40: 40, 40, 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        m = PackedLinear.from_codes(codes, scale, torch.zeros(16, 3, dtype=torch.int32), 4, 40, signed=True,
                                    compute_dtype=torch.float32)
    cols = torch.arange(100) // 40
    assert torch.equal(m.dequantized_weight(torch.float64), codes.double() * scale.double()[:, cols])
    with pytest.raises(ValueError, match=r"scale / zero_point must be \[16, 3\], got \(16, 4\)"):
        PackedLinear.from_codes(codes, torch.ones(16, 4), torch.zeros(16, 4), 4, 40, signed=True)


def test_a_wrapper_whose_scales_do_not_fit_its_group_size_is_refused():
    model = _model()
    q = RtnQuantizer(model, [{"quant_bits": 4, "group_size": 48, "op_types": ["Linear"]}])
    q.calibrate()
    w = q.get_modules_wrapper()[0]
    w.quant_spec = type(w.quant_spec)(4, True, 32)  # as if the spec changed after calibration: 5 groups, 4 held
    with pytest.raises(ModelError, match=r"layer '0' has 4 scale groups over 160 input columns, which its group "
                                         r"size 32 does not give \(ceil\(160 / 32\) = 5\)"):
        pack_weights(model)
    assert isinstance(model[0], nn.Module) and not isinstance(model[0], PackedLinear)
