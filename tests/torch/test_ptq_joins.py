"""Quantized joins (issue 27): residual adds, products, concatenations and average pooling between quantized
layers get their own output range in ``PtqQuantizer``, so onnxruntime runs them as integer kernels
(QLinearAdd / QLinearMul / QLinearConcat / QLinearAveragePool / QLinearGlobalAveragePool) with no float op
left between DequantizeLinear and QuantizeLinear; the artifact agrees with the fake-quant torch model."""

from __future__ import annotations

import collections
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError
from compressor.core.quant_joins import JOIN_KINDS, join_rule, quantize_join
from compressor.torch import PtqQuantizer

pytestmark = pytest.mark.torch
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

CFG = [{"op_types": ["Conv2d", "Linear"], "quant_types": ["input", "weight", "output"], "quant_bits": 8}]


class Block(nn.Module):
    """A CIFAR ResNet basic block: bias-free convs + BatchNorm, ``relu(y + x)``."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + x)


class ResidualNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.b1, self.b2 = Block(8), Block(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.b2(self.b1(torch.relu(self.stem(x)))).mean((2, 3)))


class BranchNet(nn.Module):
    """Depthwise + pointwise branches joined by concat and by a product, then three kinds of pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pw = nn.Conv2d(8, 8, 1)
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        a, b = torch.relu(self.dw(x)), torch.relu(self.pw(x))
        x = torch.cat([a, b, a * b], 1)
        x = self.pool(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _randomize_bn(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(0.1 * torch.randn(m.num_features, generator=g))
            m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g))


def _export(model: nn.Module, tmp_path, quantize_joins: bool = True):
    torch.manual_seed(0)
    _randomize_bn(model)
    model.eval()
    x = torch.randn(96, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    q = PtqQuantizer(model, CFG, quantize_joins=quantize_joins).calibrate(x[:64])
    with torch.no_grad():
        fake = model(x[64:]).numpy()
    path = os.path.join(tmp_path, "m.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.export_model(os.path.join(tmp_path, "m.pth"), onnx_path=path, dummy_input=x[:1])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = os.path.join(tmp_path, "m.opt.onnx")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    out = sess.run(None, {sess.get_inputs()[0].name: x[64:].numpy()})[0]
    ops = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
    return q, fake, out, ops


def test_core_join_rule() -> None:
    assert set(JOIN_KINDS) == {"add", "mul", "concat", "avgpool", "global_avgpool"}
    assert quantize_join("add", [True, True]).output == "own"
    assert quantize_join("add", [True, False]) is None  # a float input: the add stays float
    assert quantize_join("add", [True]) is None  # x + constant
    assert quantize_join("avgpool", [True]).output == "input"
    assert quantize_join("global_avgpool", [True]).relu_folds is False
    assert join_rule("concat").inputs_share_output == {"onnxruntime": False, "tflite": True}
    assert quantize_join("softmax", [True]) is None
    with pytest.raises(ValueError, match="unknown join kind 'softmax'"):
        join_rule("softmax")


def test_residual_adds_are_integer(tmp_path) -> None:
    q, fake, out, ops = _export(ResidualNet(), tmp_path)
    assert [(r["kind"], r["scope"], r["integer"]) for r in q.join_report] == [
        ("add", "b1", True), ("add", "b2", True), ("global_avgpool", "", True)]
    # the ReLU after each add is folded into its range: zero point 0 (uint8)
    zps = [float(zp) for _, zp in q._joins.qparams.values()]
    assert zps[:2] == [0.0, 0.0]
    # the layers reading an add's output share its grid
    assert q._join_inputs == {"b2.conv1": 2, "fc": 7}  # calls counted: relu, relu, add, relu, ...
    # every op integer: only the model input's Q and the logits' DQ stay float-facing
    assert ops == {"QuantizeLinear": 1, "QLinearConv": 5, "QLinearAdd": 2, "QLinearGlobalAveragePool": 1,
                   "Reshape": 1, "QGemm": 1, "DequantizeLinear": 1}
    step = float(q.get_modules_wrapper()[-1].output_scale)
    assert np.abs(out - fake).max() <= step * 1.01
    assert (out.argmax(1) == fake.argmax(1)).mean() >= 0.95


def test_concat_mul_pooling_depthwise_are_integer(tmp_path) -> None:
    q, fake, out, ops = _export(BranchNet(), tmp_path)
    assert [(r["kind"], r["integer"]) for r in q.join_report] == [
        ("mul", True), ("concat", True), ("avgpool", True), ("global_avgpool", True)]
    assert ops == {"QuantizeLinear": 1, "QLinearConv": 3, "QLinearMul": 1, "QLinearConcat": 1,
                   "QLinearAveragePool": 1, "QLinearGlobalAveragePool": 1, "Flatten": 1, "QGemm": 1,
                   "DequantizeLinear": 1}
    opt = onnx.load(os.path.join(tmp_path, "m.opt.onnx"))
    groups = sorted(a.i for n in opt.graph.node if n.op_type == "QLinearConv" for a in n.attribute if a.name == "group")
    assert groups == [1, 1, 8]  # the depthwise conv runs as QLinearConv with group=8
    step = float(q.get_modules_wrapper()[-1].output_scale)
    assert np.abs(out - fake).max() <= step * 1.01
    assert (out.argmax(1) == fake.argmax(1)).mean() >= 0.95


def test_quantize_joins_false_keeps_float_add(tmp_path) -> None:
    q, fake, out, ops = _export(ResidualNet(), tmp_path, quantize_joins=False)
    assert q.join_report == [] and "QLinearAdd" not in ops and ops["Add"] == 2
    with pytest.raises(ConfigError, match="quantize_joins must be True or False"):
        PtqQuantizer(ResidualNet(), CFG, quantize_joins="yes")


def test_join_with_a_parameter_input_stays_float() -> None:
    class PosNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)
            self.pos = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.fc1(x) + self.pos)

    q = PtqQuantizer(PosNet(), CFG).calibrate(torch.randn(8, 4))
    assert q.join_report == [{"kind": "add", "scope": "", "integer": False,
                              "reason": "an input is not on a quantization grid (a float tensor or a parameter)"}]
    assert q._joins is None


class MobileBlock(nn.Module):
    """MobileNetV2-style: TF 'same' padding as an explicit F.pad, ReLU6, a stride-2 depthwise conv."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(3, 16, 1)
        self.dw = nn.Conv2d(16, 16, 3, stride=2, groups=16)
        self.project = nn.Conv2d(16, 8, 1)
        self.act = nn.ReLU6()
        self.fc = nn.Linear(8 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.expand(x))
        x = self.act(self.dw(nn.functional.pad(x, (0, 1, 0, 1))))
        return self.fc(torch.flatten(self.project(x), 1))


def test_relu6_and_zero_pad_fold_into_integer_convs(tmp_path) -> None:
    q, fake, out, ops = _export(MobileBlock(), tmp_path)
    assert {w.name: w.fused_relu for w in q.get_modules_wrapper()} == {
        "expand": "relu6", "dw": "relu6", "project": False, "fc": False}
    # no float Pad (moved into the depthwise conv's pads) and no Clip (the ReLU6 range) left
    assert ops == {"QuantizeLinear": 1, "QLinearConv": 3, "Flatten": 1, "QGemm": 1, "DequantizeLinear": 1}
    opt = onnx.load(os.path.join(tmp_path, "m.opt.onnx"))
    pads = [list(a.ints) for n in opt.graph.node if n.op_type == "QLinearConv" for a in n.attribute if a.name == "pads"]
    assert [0, 0, 1, 1] in pads
    scale = float(q.get_modules_wrapper()[0].output_scale)
    assert float(q.get_modules_wrapper()[0].output_zero_point) == 0 and 255 * scale <= 6.0 + 1e-5
    step = float(q.get_modules_wrapper()[-1].output_scale)
    assert np.abs(out - fake).max() <= step * 1.01
