"""``fuse_relu`` and ``share_ranges``: a quantized layer whose output feeds only a ReLU quantizes relu(output).

Runtimes fuse Conv+ReLU and quantize after the ReLU (onnxruntime's QDQ fusion, TFLite); quantizing before
it spends half the uint8 codes on negative values the ReLU then drops. With the fusion the output range
is [0, max]: zero point 0, scale max / 255, and the int8 ONNX graph needs no Relu of its own. With
``share_ranges`` a layer whose input is a quantized output (through ReLU / max-pool / flatten) reuses that
grid, so nothing is quantized twice and onnxruntime's graph stays integer from the first QuantizeLinear to
the last DequantizeLinear, as its own ``quantize_static`` makes it.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from compressor.core.errors import ConfigError
from compressor.torch import PtqQuantizer, QAT_Quantizer
from compressor.torch.quantization.bn_fold import find_relu_followers

TYPES = ["input", "weight", "output"]


class Net(nn.Module):
    """Every way of writing a ReLU, plus layers that must NOT fuse."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)   # -> nn.ReLU
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)   # -> F.relu
        self.c3 = nn.Conv2d(4, 4, 3, padding=1)   # -> BN -> torch.relu (fused through a folded BN only)
        self.bn3 = nn.BatchNorm2d(4)
        self.c4 = nn.Conv2d(4, 4, 3, padding=1)   # -> .relu() AND a residual add: two users, no fusion
        self.c5 = nn.Conv2d(4, 4, 3, padding=1)   # -> sigmoid: no fusion
        self.act = nn.ReLU()
        self.fc = nn.Linear(4, 2)                  # -> .relu()

    def forward(self, x):
        x = self.act(self.c1(x))
        x = F.relu(self.c2(x))
        x = torch.relu(self.bn3(self.c3(x)))
        y = self.c4(x)
        x = y.relu() + y
        x = torch.sigmoid(self.c5(x))
        return self.fc(x.mean((2, 3))).relu()


def test_followers_found_for_every_relu_spelling():
    m = Net()
    assert find_relu_followers(m, folded=False) == {"c1", "c2", "bn3", "fc"}  # any module (only wrapped ones use it)
    assert find_relu_followers(m, folded=True) == {"c1", "c2", "c3", "bn3", "fc"}


def test_untraceable_model_is_a_clear_error_for_qat_and_a_warning_for_ptq():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return torch.relu(self.fc(x)) if x.sum() > 0 else self.fc(x)  # data-dependent: fx cannot trace

    cfg = [{"op_types": ["Linear"], "quant_types": TYPES, "quant_bits": 8}]
    with pytest.raises(ConfigError, match="fuse_relu.*torch.fx.*use fuse_relu=False"):
        QAT_Quantizer(Branchy(), cfg, fuse_relu=True)
    with pytest.warns(UserWarning, match=r"cannot be traced with torch.fx .*; so outputs feeding a ReLU are quantized "
                                         r"before it \(fuse_relu\)\. Pass dummy_input= .* or fuse_relu=False"):
        q = PtqQuantizer(Branchy(), cfg, bn_fold=False)
    assert [w.fused_relu for w in q.get_modules_wrapper()] == [False]
    # with a model input the ReLU users are found by running the model once: no warning, the ReLU is fused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = PtqQuantizer(Branchy(), cfg, bn_fold=False, dummy_input=torch.ones(2, 3))
    assert [w.fused_relu for w in q.get_modules_wrapper()] == [True]
    with pytest.raises(ConfigError, match="fuse_relu must be True or False"):
        QAT_Quantizer(Branchy(), cfg, fuse_relu="yes")


def _calibrated(fuse: bool, seed: int = 0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 5)).eval()
    x = torch.randn(32, 3, 6, 6)
    q = PtqQuantizer(m, [{"op_types": ["Conv2d", "Linear"], "quant_types": TYPES, "quant_bits": 8}],
                     fuse_relu=fuse, dummy_input=x[:1])
    q.calibrate([x])
    return m, q, x


def test_ptq_output_range_is_the_relu_output_range():
    m, q, x = _calibrated(True)
    conv, fc = q.get_modules_wrapper()
    assert (conv.fused_relu, fc.fused_relu) == (True, False)
    with torch.no_grad():
        raw = F.conv2d(x, conv.module.weight, conv.module.bias)
    hi = raw.clamp_min(0).max()
    # min-max over relu(raw): [0, hi] -> uint8 with zero point 0 and scale hi / 255
    assert float(conv.output_zero_point) == 0.0
    torch.testing.assert_close(conv.output_scale, hi / 255, rtol=1e-6, atol=0)
    _, unfused, _ = _calibrated(False)
    c_unfused = unfused.get_modules_wrapper()[0]
    assert float(c_unfused.output_zero_point) > 0  # half the codes spent below zero
    assert float(c_unfused.output_scale) > float(conv.output_scale)
    # fused, the wrapper's output is already >= 0 and on the grid: the model's ReLU changes nothing
    with torch.no_grad():
        y = conv(x)
    assert float(y.min()) >= 0.0
    torch.testing.assert_close(torch.relu(y), y, rtol=0, atol=0)


def test_int8_onnx_has_no_separate_relu_and_matches_the_fake_quant_model(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    m, q, x = _calibrated(True)
    path = tmp_path / "m.onnx"
    q.export_model(str(tmp_path / "m.pt"), onnx_path=str(path))
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    assert "QLinearConv" in ops and "Relu" not in ops and "Conv" not in ops, ops
    with torch.no_grad():
        want = m(x).numpy()
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.99
    step = float(q.get_modules_wrapper()[1].output_scale)
    assert np.abs(got - want).max() <= 2 * step  # within two quantization steps of the last layer


def _lenet(share: bool):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from examples.models_torch import lenet_5

    torch.manual_seed(0)
    m = lenet_5(10, 28).eval()
    x = torch.randn(64, 1, 28, 28)
    q = PtqQuantizer(m, [{"op_types": ["Conv2d", "Linear"], "quant_types": TYPES, "quant_bits": 8}],
                     share_ranges=share, dummy_input=x[:1])
    q.calibrate([x[:32], x[32:]])
    return m, q, x


@pytest.mark.parametrize("share", [True, False])
def test_shared_ranges_keep_the_onnx_graph_integer(tmp_path, share):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    m, q, x = _lenet(share)
    w = {w.name: w for w in q.get_modules_wrapper()}
    if share:
        # conv2 <- pool1 <- conv1; fc1 <- flatten <- pool2 <- conv2; fc2 <- relu1 <- fc1 (fused)
        assert q.shared_inputs() == {"conv2": "conv1", "fc1": "conv2", "fc2": "fc1"}
        for name, src in q.shared_inputs().items():
            assert torch.equal(w[name].input_scale, w[src].output_scale), name
            assert torch.equal(w[name].input_zero_point, w[src].output_zero_point), name
    else:
        assert q.shared_inputs() == {}
        assert not torch.equal(w["conv2"].input_scale, w["conv1"].output_scale)
    q.export_model(str(tmp_path / "m.pt"), onnx_path=str(tmp_path / "m.onnx"))
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = ort.InferenceSession(str(tmp_path / "m.onnx"), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    quantize_ops = ops.count("QuantizeLinear") + ops.count("DequantizeLinear")
    assert ops.count("QLinearConv") == 2 and ops.count("QGemm") == 2
    if share:  # one QuantizeLinear at the input, one DequantizeLinear at the output, integer in between
        assert quantize_ops == 2 and "MaxPool" not in ops, ops
    else:  # requantization between the layers: float max-pool between DQ and Q
        assert quantize_ops > 2, ops
    with torch.no_grad():
        want = m(x).numpy()
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.95
