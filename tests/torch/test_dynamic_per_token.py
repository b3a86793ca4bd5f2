"""``activation='dynamic'`` quantizes activations per token (one scale per row of the last axis, as
llmcompressor's W8A8 dynamic scheme): one outlier token leaves every other token's error at its own int8 level.
``PtqQuantizer`` (the fake-quant model and its int8 ONNX graph in onnxruntime) and ``pack_weights``'s
``PackedLinear``; the bounds are computed from each row's own max |x|. With one scale per tensor (before) the
other rows' relative error was 0.5-1.1."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from compressor.torch import PtqQuantizer, RtnQuantizer, pack_weights
from compressor.torch.quantization.ptq import dynamic_fake_quant

pytestmark = [pytest.mark.torch]

K, N, ROWS, OUTLIER = 64, 32, 8, 3


def _x() -> torch.Tensor:
    x = torch.randn(2, ROWS // 2, K, generator=torch.Generator().manual_seed(0))
    x[OUTLIER // (ROWS // 2), OUTLIER % (ROWS // 2)] *= 1000.0  # one token 1000x the others
    return x


def _linear() -> nn.Linear:
    """Weights exactly on their per-channel int8 grid (codes * 0.01, every row reaching +-127): the weight
    quantization is exact (to float32 rounding) and the output error is the activations' alone."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (N, K), generator=g)
    codes[:, 0] = 127
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(codes.float() * 0.01)
        lin.bias.copy_(torch.randn(N, generator=g))
    return lin.eval()


def _row_bounds(x: torch.Tensor, w: torch.Tensor, levels: int) -> torch.Tensor:
    """Max output error of each row, ``[rows, N]``, when each input element is off by at most ``max|x_row| /
    levels``: ``sum_k |w[n, k]| * max|x_row| / levels``, plus float32 slack (1e-5 of the row's output scale)."""
    xr = x.reshape(-1, K).double()
    m = xr.abs().amax(1, keepdim=True)
    bound = m / levels * w.double().abs().sum(1)[None, :]
    return bound * (1 + 1e-5) + 1e-5 * (xr.abs() @ w.double().abs().t())


def test_fake_quant_error_of_each_row_is_bounded_by_its_own_max():
    x = _x().reshape(-1, K)
    err = (dynamic_fake_quant(x) - x).abs().double()
    m = x.abs().amax(1).double()
    # uint8 grid of the rows divided by their max (within [-1, 1]): step <= 2 m / 255, error <= m / 255
    assert bool((err.amax(1) <= m / 255 * (1 + 1e-6)).all())
    others = [r for r in range(ROWS) if r != OUTLIER]
    assert float(err[others].amax(1).max()) < 0.02  # the others' max |x| is ~2.5; the outlier's is ~2500
    per_tensor_step = float(x.max() - x.min()) / 255  # what one scale per tensor would give them
    assert per_tensor_step > 10.0  # 14.4: half of it would be every other row's error
    assert torch.equal(dynamic_fake_quant(torch.zeros(3, K)), torch.zeros(3, K))


def test_ptq_dynamic_rows_keep_their_own_int8_error_in_the_model_and_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    lin = _linear()
    model = nn.Sequential(lin).eval()
    x = _x()
    with torch.no_grad():
        ref = lin(x).reshape(-1, N).double()
    q = PtqQuantizer(model, [{"op_types": ["Linear"], "quant_types": ["input", "weight"], "quant_bits": 8}],
                     activation="dynamic")
    with torch.no_grad():
        fake = model(x).reshape(-1, N).double()
    bound = _row_bounds(x, lin.weight.detach(), 255)
    assert bool(((fake - ref).abs() <= bound).all())
    path = os.path.join(tmp_path, "m.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.export_model(os.path.join(tmp_path, "m.pt"), onnx_path=path, dummy_input=x)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]).reshape(-1, N).double()
    assert bool(((got - ref).abs() <= bound).all())
    assert float((got - fake).abs().max() / fake.abs().max()) < 1e-5
    # another batch size (the export's dynamic axis): the row max is taken over the last axis
    x2 = torch.randn(3, ROWS // 2, K, generator=torch.Generator().manual_seed(5))
    got2 = sess.run(None, {sess.get_inputs()[0].name: x2.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got2, model(x2).numpy(), rtol=1e-5, atol=1e-5)


def test_packed_dynamic_rows_keep_their_own_int8_error():
    lin = _linear()
    model = nn.Sequential(lin).eval()
    x = _x()
    q = RtnQuantizer(model, [{"op_types": ["Linear"], "quant_bits": 8}])
    q.calibrate()
    pack_weights(model, compute_dtype=torch.float32, activation="dynamic")
    packed = model[0]
    assert packed.kernel == "int8-dynamic"
    w = packed.dequantized_weight(torch.float64)
    with torch.no_grad():
        got = model(x).reshape(-1, N).double()
    want = x.reshape(-1, K).double() @ w.t() + packed.bias.double()
    # the kernel's activations are 7-bit unsigned (reduce_range) over rows divided by their max: error <= m / 127
    assert bool(((got - want).abs() <= _row_bounds(x, w, 127)).all())
    others = [r for r in range(ROWS) if r != OUTLIER]
    rel = (got - want).norm(dim=1) / want.norm(dim=1)
    assert float(rel[others].max()) < 0.05
    assert torch.equal(model(torch.zeros(2, K)), packed.bias.expand(2, N))
