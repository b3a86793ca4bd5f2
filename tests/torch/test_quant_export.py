"""export_model: plain float state_dict -> original class, calibration round trip, QDQ ONNX vs onnxruntime,
BN folding."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from compressor import ConfigError
from compressor.torch import BNNQuantizer, DoReFaQuantizer, LsqQuantizer, NaiveQuantizer, QAT_Quantizer


class Net(nn.Module):
    def __init__(self, bn: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, bias=not bn)
        self.bn = nn.BatchNorm2d(4) if bn else nn.Identity()
        self.relu = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(self.flat(self.relu(self.bn(self.conv(x)))))


def train(model, q, steps=6, seed=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    q.hook_optimizer(opt)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 1, 8, 8, generator=g)
    y = torch.randint(0, 5, (16,), generator=g)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    return torch.randn(8, 1, 8, 8, generator=g)


WEIGHT_ONLY = {
    "qat": (QAT_Quantizer, {"quant_types": ["weight"], "quant_bits": 8}),
    "qat-int-per-channel": (QAT_Quantizer, {"quant_types": ["weight"], "quant_bits": 4, "quant_dtype": "int",
                                            "quant_scheme": "per_channel_symmetric"}),
    "naive": (NaiveQuantizer, {"quant_types": ["weight"], "quant_bits": 8}),
    "dorefa": (DoReFaQuantizer, {"quant_types": ["weight"], "quant_bits": 3}),
}


@pytest.mark.parametrize("name", list(WEIGHT_ONLY))
def test_weight_only_export_loads_into_original_class(name, tmp_path):
    cls, cfg = WEIGHT_ONLY[name]
    torch.manual_seed(0)
    model = Net()
    q = cls(model, [{**cfg, "op_types": ["default"]}])
    x = train(model, q)
    with torch.no_grad():
        expected = model(x)
    cal = q.export_model(tmp_path / "m.pt", tmp_path / "c.pt")
    assert set(cal) == {"conv", "fc"} and cal["conv"]["weight_bits"] == cfg["quant_bits"]
    plain = Net()
    plain.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x), expected, atol=1e-6, rtol=1e-6)
    assert torch.load(tmp_path / "c.pt", weights_only=True) == cal
    assert model.training is False and isinstance(model.conv, nn.Module) and hasattr(model.conv, "module")


ACTIVATIONS = {
    "qat": (QAT_Quantizer, {"quant_types": ["weight", "input", "output"], "quant_bits": 8}),
    "qat-mixed": (QAT_Quantizer, {"quant_types": ["weight", "output"], "quant_bits": {"weight": 4, "output": 6},
                                  "quant_dtype": {"weight": "int"},
                                  "quant_scheme": {"weight": "per_channel_symmetric", "output": "per_tensor_affine"}}),
    "bnn": (BNNQuantizer, {"quant_types": ["weight", "output"], "quant_bits": 1}),
    "lsq": (LsqQuantizer, {"quant_types": ["weight", "input", "output"], "quant_bits": 8}),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_export_reload_with_calibration_gives_same_outputs(name, tmp_path):
    cls, cfg = ACTIVATIONS[name]
    config = [{**cfg, "op_types": ["default"]}]
    torch.manual_seed(0)
    model = Net()
    q = cls(model, config)
    x = train(model, q)
    with torch.no_grad():
        expected = model(x)
    q.export_model(tmp_path / "m.pt", tmp_path / "c.pt")
    fresh = Net()
    fresh.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    q2 = cls(fresh, config)
    q2.load_calibration_config(torch.load(tmp_path / "c.pt", weights_only=True))
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), expected, atol=1e-6, rtol=1e-6)


def test_calibration_config_content_and_errors(tmp_path):
    torch.manual_seed(0)
    model = Net()
    cfg = [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["Conv2d"]}]
    q = QAT_Quantizer(model, cfg)
    model(torch.randn(2, 1, 8, 8))
    cal = q.export_model(tmp_path / "m.pt")
    entry = cal["conv"]
    w = q.get_modules_wrapper()[0]
    assert entry["output_bits"] == 8 and (entry["output_qmin"], entry["output_qmax"]) == (0, 255)
    assert entry["tracked_min_output"] == w.tracked_min_output.item()
    assert entry["output_scale"] == pytest.approx(w.output_scale.item())
    assert entry["weight_zero_point"] == int(w.weight_zero_point.item())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = copy.deepcopy(cal)
    bad["conv"]["output_bits"] = 4
    with pytest.raises(ConfigError, match="output_bits"):
        q.load_calibration_config(bad)
    with pytest.raises(ConfigError, match="does not wrap"):
        q.load_calibration_config({**cal, "nope": {}})
    bad = copy.deepcopy(cal)
    bad["conv"]["tracked_min_output"] = [0.0, 1.0]
    with pytest.raises(ConfigError, match="shape"):
        q.load_calibration_config(bad)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing written on error


def onnx_check(q, model, x, path, **kwargs):
    import onnx
    import onnxruntime as ort

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.export_model(path.with_suffix(".pt"), onnx_path=path, input_shape=tuple(x.shape), **kwargs)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    outs = []
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        outs.append(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        want = model(x).numpy()
    return ops, outs, want


ONNX_CASES = {
    # default (dynamo) exporter: per-channel int8 weights, 8-bit input, 5-bit output (uint8 QDQ + clamp)
    "dynamo": ({"quant_bits": {"weight": 8, "input": 8, "output": 5},
                "quant_dtype": {"weight": "int", "input": "uint", "output": "uint"},
                "quant_scheme": {"weight": "per_channel_symmetric", "input": "per_tensor_affine",
                                 "output": "per_tensor_affine"}}, {}),
    # TorchScript exporter: 4-bit narrow int weights (int8 QDQ + clamp), defaults elsewhere
    "torchscript": ({"quant_bits": {"weight": 4, "input": 8, "output": 8}, "quant_dtype": {"weight": "int"}},
                    {"dynamo": False}),
}


@pytest.mark.parametrize("name", list(ONNX_CASES))
def test_onnx_qdq_matches_pytorch(name, tmp_path):
    cfg, kwargs = ONNX_CASES[name]
    torch.manual_seed(0)
    model = Net()
    q = QAT_Quantizer(model, [{"quant_types": ["weight", "input", "output"], **cfg, "op_types": ["default"]}])
    x = train(model, q)
    ops, (plain, optimized), want = onnx_check(q, model, x, tmp_path / "m.onnx", **kwargs)
    assert ops.count("QuantizeLinear") >= 4 and ops.count("QuantizeLinear") == ops.count("DequantizeLinear")
    # ORT executing the graph as written gives the fake-quantized model's outputs
    np.testing.assert_allclose(plain, want, atol=1e-5, rtol=0)
    # with its optimizations ORT runs integer kernels between the QDQ pairs (requantization): ~1 step off
    np.testing.assert_allclose(optimized, want, atol=0.05, rtol=0)
    assert model.training is False and q.get_modules_wrapper()[0].export_mode is False


def test_bn_folding_trains_and_exports_to_original_class(tmp_path):
    torch.manual_seed(0)
    model = Net(bn=True)
    cfg = [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["Conv2d"]}]
    q = QAT_Quantizer(model, cfg, bn_fold=True)
    w = q.get_modules_wrapper()[0]
    assert w.bn_module is not None and not isinstance(model.bn, nn.BatchNorm2d)
    bn_before = w.bn_module.running_mean.clone()
    x = train(model, q, steps=8)
    assert not torch.equal(w.bn_module.running_mean, bn_before)  # BN keeps learning its statistics
    with torch.no_grad():
        expected = model(x)
    q.export_model(tmp_path / "m.pt")
    plain = Net(bn=True)
    plain.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    plain.eval()
    # the exported conv holds the folded quantized weight, the BN adds the folded bias; the output is
    # quantized after the BN, so the reloaded model is wrapped with folding as well (its BN is an identity now)
    q2 = QAT_Quantizer(plain, cfg, bn_fold=True)
    q2.load_calibration_config(q.export_model(tmp_path / "m2.pt"))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), expected, atol=1e-5, rtol=1e-5)
    q._unwrap_model()
    assert isinstance(model.bn, nn.BatchNorm2d) and isinstance(model.conv, nn.Conv2d)


def test_bn_fold_weight_only_export_equals_folded_conv(tmp_path):
    torch.manual_seed(0)
    model = Net(bn=True)
    q = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2d"]}],
                      dummy_input=torch.randn(1, 1, 8, 8))  # NNI's switch
    x = train(model, q)
    with torch.no_grad():
        expected = model(x)
    q.export_model(tmp_path / "m.pt")
    plain = Net(bn=True)
    plain.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x), expected, atol=1e-5, rtol=1e-5)


def test_onnx_needs_input_shape(tmp_path):
    model = Net()
    q = NaiveQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}])
    with pytest.raises(ValueError, match="input_shape"):
        q.export_model(tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx")


def test_export_model_without_model_path_writes_only_the_onnx_file(tmp_path):
    from compressor import ConfigError
    from compressor.torch import PtqQuantizer

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    q = PtqQuantizer(m, [{"op_types": ["Linear"], "quant_types": ["input", "weight", "output"], "quant_bits": 8}])
    q.calibrate([torch.randn(8, 4) for _ in range(2)])
    calib = q.export_model(None, onnx_path=tmp_path / "m.onnx", input_shape=(1, 4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    assert sorted(calib) == ["0", "2"]
    with pytest.raises(ConfigError, match="nothing to write"):
        q.export_model(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
