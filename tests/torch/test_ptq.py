"""PtqQuantizer: post-training quantization calibrated with core observers, frozen scales, BN folding,
integer ONNX export, and refusal of bad calibration data."""

from __future__ import annotations

import copy
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import compressor
from compressor.core import observers as cobs
from compressor.core import quant as cq
from compressor.core.errors import ConfigError, ModelError
from compressor.core.matching import DefaultSkipWarning
from compressor.torch import PtqQuantizer
from compressor.torch.quantization.bn_fold import fold_factor
from compressor.torch.quantization.fakequant import ops

pytestmark = pytest.mark.torch

ALL = ["weight", "input", "output"]


def cfg(types=ALL, op_types=("Conv2d", "Linear")):
    return [{"op_types": list(op_types), "quant_types": list(types), "quant_bits": 8}]


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 32, 3, padding=1)
        self.relu = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        return self.fc(self.flat(self.relu(self.conv2(x))))


def cnn(seed=0):
    torch.manual_seed(seed)
    model = CNN()
    with torch.no_grad():  # non-trivial BN statistics
        model.bn1.running_mean.uniform_(-0.5, 0.5)
        model.bn1.running_var.uniform_(0.5, 2.0)
        model.bn1.weight.uniform_(0.5, 1.5)
        model.bn1.bias.uniform_(-0.3, 0.3)
    return model.eval()


def hand_linear():
    model = nn.Sequential(nn.Linear(4, 3))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[0.5, -1.0, 0.25, 0.0], [2.0, 0.1, -0.3, 0.7], [-0.2, 0.2, 0.05, -0.6]]))
        model[0].bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.0, 1.5, -1.0, 2.0], [-0.5, 0.25, 2.5, -1.5]])
    return model, x


def runtime_fq(x, scale, zp, qmin=0, qmax=255):
    """onnxruntime's QuantizeLinear -> DequantizeLinear: (clip(round(x / s) + zp) - zp) * s."""
    return (torch.clamp(torch.round(x / scale) + zp, qmin, qmax) - zp) * scale


def int32_grid(bias, wr):
    """The bias as the int8 export writes it: codes round(b / s) with s = float32(input_scale * weight_scale)."""
    s = (wr.input_scale.double() * wr.weight_scale.double()).float()
    return torch.round(bias.double() / s.double()).float() * s


# ------------------------------------------------------------------------------------------- hand case


def test_hand_case_exact_scales_and_fake_quant_outputs():
    model, x = hand_linear()
    with torch.no_grad():
        y = model(x)
    w = model[0].weight.detach().clone()
    q = PtqQuantizer(model, cfg(op_types=["Linear"]))
    assert q.calibrate(x) is q and q.calibrated
    wr = q.get_modules_wrapper()[0]
    # weights: per-channel symmetric int8 [-127, 127]
    torch.testing.assert_close(wr.weight_scale, w.abs().amax(1) / 127, rtol=0, atol=0)
    assert torch.equal(wr.weight_zero_point, torch.zeros(3))
    # activations: per-tensor affine uint8 from the observed min/max
    for t, v in (("input", x), ("output", y)):
        s, z = cq.qparams(ops, v.min(), v.max(), 0, 255, False)
        assert torch.equal(getattr(wr, f"{t}_scale"), s) and torch.equal(getattr(wr, f"{t}_zero_point"), z)
        assert float(getattr(wr, f"tracked_min_{t}")) == float(v.min())
        assert float(getattr(wr, f"tracked_max_{t}")) == float(v.max())
    # eval output = the integer kernel's computation: activations rounded as onnxruntime's QuantizeLinear
    # (round(x / s) + zp), core fake-quant weights, the bias on the int32 grid input_scale * weight_scale
    xq = runtime_fq(x, wr.input_scale, wr.input_zero_point)
    wq = cq.fake_quantize(ops, w, wr.weight_scale.reshape(-1, 1), wr.weight_zero_point.reshape(-1, 1), -127, 127)
    want = runtime_fq(xq @ wq.T + int32_grid(model[0].bias.detach(), wr), wr.output_scale, wr.output_zero_point)
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # scales are frozen: other data through the model (train or eval mode) changes nothing
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model(torch.randn(5, 4) * 10)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("method", sorted(cobs.OBSERVERS))
def test_each_observer_gives_the_core_range(method):
    model, x = hand_linear()
    batches = [x, x * 0.5 + 0.1, torch.linspace(-3, 2, 16).reshape(4, 4)]
    with torch.no_grad():
        outs = [model(b) for b in batches]
    kw = {"percentile": 90.0, "grid_size": 20}
    q = PtqQuantizer(model, cfg(op_types=["Linear"]), observer=method, **kw)
    q.calibrate(iter([(b, 0) for b in batches]))  # (x, y) tuples, first element used
    wr = q.get_modules_wrapper()[0]
    extra = {"percentile": {"percentile": 90.0}, "mse": {"grid_size": 20}}.get(method, {})
    for t, data in (("input", batches), ("output", outs)):
        obs = cobs.make_observer(ops, method, "activation", **extra)
        for b in data:
            obs.observe(b)
        lo, hi = obs.range()
        torch.testing.assert_close(getattr(wr, f"tracked_min_{t}"), lo, rtol=0, atol=0)
        torch.testing.assert_close(getattr(wr, f"tracked_max_{t}"), hi, rtol=0, atol=0)
        s, z = obs.qparams()
        assert torch.equal(getattr(wr, f"{t}_scale"), s) and torch.equal(getattr(wr, f"{t}_zero_point"), z)


def test_num_batches_and_config_overrides():
    model, x = hand_linear()
    c = cfg(op_types=["Linear"])
    c[0]["quant_dtype"] = {"weight": "uint"}
    c[0]["quant_scheme"] = {"weight": "per_tensor_affine"}
    q = PtqQuantizer(model, c)
    gen = (x * (i + 1) for i in range(5))
    q.calibrate(gen, num_batches=2)
    assert q.calibration_batches == 2
    wr = q.get_modules_wrapper()[0]
    w = wr.weight.detach()
    s, z = cq.qparams(ops, w.min(), w.max(), 0, 255, False)
    assert wr.weight_scale.shape == () and torch.equal(wr.weight_scale, s) and torch.equal(wr.weight_zero_point, z)
    assert float(wr.tracked_max_input) == float((2 * x).max())


def test_dispatch_through_registry():
    model, x = hand_linear()
    q = compressor.PtqQuantizer(model, cfg(op_types=["Linear"]))
    assert isinstance(q, PtqQuantizer)
    assert q.calibrate(x).calibrated


# ------------------------------------------------------------------------------------------- BN folding


def test_bn_folding_preserves_the_float_output_and_quantizes_the_folded_weight():
    model = cnn()
    original = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = original(x)
        # the folded conv alone reproduces conv -> bn (eval)
        f = fold_factor(original.bn1)
        wf = original.conv1.weight * f.reshape(-1, 1, 1, 1)
        bf = original.bn1.bias + (original.conv1.bias - original.bn1.running_mean) * f
        torch.testing.assert_close(nn.functional.conv2d(x, wf, bf, padding=1), original.bn1(original.conv1(x)),
                                   rtol=0, atol=1e-5)
    q = PtqQuantizer(model, cfg(), bn_fold=True)
    assert isinstance(model.bn1, nn.Identity)  # the BN now runs inside conv1's wrapper
    with torch.no_grad(), q.float_mode():
        torch.testing.assert_close(model(x), want, rtol=0, atol=1e-5)
    q.calibrate(x)
    assert model.training is False
    conv1 = next(w for w in q.get_modules_wrapper() if w.name == "conv1")
    torch.testing.assert_close(conv1.weight_scale, wf.abs().amax((1, 2, 3)) / 127, rtol=1e-6, atol=0)
    with torch.no_grad():
        out = model(x)
    assert (out - want).abs().max() < 0.1 * want.abs().max()  # quantized, yet close


# ------------------------------------------------------------------------------------------- export

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def trained_cnn(steps=25):
    """A float model trained briefly on a synthetic task (logits with margins), in eval mode."""
    model = cnn()
    g = torch.Generator().manual_seed(1)
    proto = torch.randn(10, 3, 8, 8, generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        y = torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(proto[y] + 0.8 * torch.randn(32, 3, 8, 8, generator=g)), y).backward()
        opt.step()
    return model.eval(), proto, g


def test_int8_onnx_export(tmp_path):
    model, proto, g = trained_cnn()
    float_model = copy.deepcopy(model)
    q = PtqQuantizer(model, cfg())
    with pytest.raises(RuntimeError, match=r"calibrate\(\)|calibrate\(data\)"):
        q.export_model(tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx", input_shape=(1, 3, 8, 8))
    assert list(tmp_path.iterdir()) == []
    calib = [proto[torch.randint(0, 10, (16,), generator=g)] + 0.8 * torch.randn(16, 3, 8, 8, generator=g)
             for _ in range(4)]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(calib)), batch_size=16)
    q.calibrate(loader)
    path = tmp_path / "int8.onnx"
    q.export_model(tmp_path / "m.pt", onnx_path=path, input_shape=(1, 3, 8, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(float_model, (torch.randn(1, 3, 8, 8),), str(tmp_path / "f.onnx"), dynamo=False,
                          input_names=["input"], dynamic_axes={"input": {0: "batch"}})
    assert os.path.getsize(path) <= 0.35 * os.path.getsize(tmp_path / "f.onnx")
    # the exported state_dict loads into the original class
    CNN().load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))

    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    so.intra_op_num_threads = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    op_types = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    assert "QLinearConv" in op_types and "QGemm" in op_types, op_types
    y = torch.randint(0, 10, (256,), generator=g)
    x = proto[y] + 0.8 * torch.randn(256, 3, 8, 8, generator=g)
    with torch.no_grad():
        want = model(x).numpy()
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert got.shape == (256, 10)
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.99


def test_fake_quant_model_computes_what_the_int8_graph_computes(tmp_path):
    """Rounding ties and the int32 bias: the calibrated model and its int8 ONNX graph give the same outputs,
    bit for bit, also on inputs exactly halfway between two codes (an odd zero point: round(x / s + zp) and
    onnxruntime's round(x / s) + zp differ there) -- one such flip per layer was enough to change the
    prediction of a random-weight HF MobileNetV2."""
    model, _ = hand_linear()
    s_in = 2.0**-6  # input range [-59 s, 196 s]: scale 2^-6 exactly, zero point 59 (odd)
    calib = torch.tensor([[-59 * s_in, 196 * s_in, 0.0, 1.0], [0.5, -0.25, 2.0, 3.0]])
    q = PtqQuantizer(model, cfg(op_types=["Linear"])).calibrate(calib)
    wr = q.get_modules_wrapper()[0]
    assert float(wr.input_scale) == s_in and float(wr.input_zero_point) == 59
    ties = torch.tensor([[0.5, 1.5, 2.5, -0.5], [4.5, -1.5, 10.5, 100.5]]) * s_in
    with torch.no_grad():  # codes 59 + round-half-even(t), not round-half-even(t + 59)
        assert torch.equal(q._quantize("input", ties, wr) / s_in,
                           torch.tensor([[0.0, 2.0, 2.0, 0.0], [4.0, -2.0, 10.0, 100.0]]))
    # the bias the layer adds is on the int32 grid input_scale * weight_scale (as the integer kernel's)
    w, b = model[0].weight.detach(), model[0].bias.detach()
    wq = cq.fake_quantize(ops, w, wr.weight_scale.reshape(-1, 1), wr.weight_zero_point.reshape(-1, 1), -127, 127)
    xq = runtime_fq(ties, wr.input_scale, wr.input_zero_point)
    with torch.no_grad():
        want = model(ties)
        assert torch.equal(want, runtime_fq(xq @ wq.T + int32_grid(b, wr), wr.output_scale, wr.output_zero_point))
        assert not torch.equal(int32_grid(b, wr), b)
    want = want.numpy()
    path = tmp_path / "int8.onnx"
    q.export_model(tmp_path / "m.pt", onnx_path=path, input_shape=(1, 4))
    codes = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    assert codes["0.bias_quantized"].dtype == np.int32
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        got = sess.run(None, {sess.get_inputs()[0].name: ties.numpy()})[0]
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------------- bad input


def test_bad_calibration_data_leaves_the_model_untouched():
    model = cnn()
    model.train()
    model.conv2.eval()  # mixed modes are restored as they were
    q = PtqQuantizer(model, cfg(), dummy_input=torch.randn(1, 3, 8, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def unchanged():
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert model.training and model.fc.training and not model.conv2.training
        assert not q.calibrated

    with pytest.raises(ConfigError, match="calibrate with at least one batch"):
        q.calibrate(None)
    with pytest.raises(ConfigError, match="calibrate with at least one batch"):
        q.calibrate([])
    with pytest.raises(ConfigError, match="calibrate with at least one batch"):
        q.calibrate(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(0, 3, 8, 8))))
    unchanged()
    good = torch.randn(2, 3, 8, 8)
    with pytest.raises(ModelError, match=r"batch 1 \(shape \(2, 3, 4, 4\).*dummy_input \(shape \(1, 3, 8, 8\)"):
        q.calibrate([good, torch.randn(2, 3, 4, 4)])  # second batch fails after the first was observed
    unchanged()
    with pytest.raises(ModelError, match=r"dtype torch.int64.*RuntimeError"):
        q.calibrate(torch.ones(2, 3, 8, 8, dtype=torch.long))
    unchanged()
    with pytest.raises(ModelError, match="batch 0 is a str"):
        q.calibrate(["not a tensor"])
    unchanged()
    with pytest.raises(RuntimeError, match=r"calibrate\(data\)"):
        model(good)  # evaluating as quantized before calibration
    model.eval()
    with pytest.raises(RuntimeError, match=r"calibrate\(data\)"):
        model(good)
    model.train()
    model.conv2.eval()
    q.calibrate(good)
    assert q.calibrated and model.training and not model.conv2.training


def test_bad_arguments():
    model, _ = hand_linear()
    with pytest.raises(ConfigError, match="unknown observer"):
        PtqQuantizer(model, cfg(op_types=["Linear"]), observer="histogram")
    with pytest.raises(ConfigError, match="percentile"):
        PtqQuantizer(model, cfg(op_types=["Linear"]), percentile=150)
    assert isinstance(model[0], nn.Linear)  # not wrapped


class DepthwiseConv(nn.Conv2d):
    """As HF EfficientNet's EfficientNetDepthwiseConv2d: a Conv2d subclass that only sets groups."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, 3, padding=1, groups=channels)


class ScaledConv(nn.Conv2d):
    """A Conv2d subclass with its own forward: not a Conv2d for 'default'."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_conv2d_subclass_without_own_forward_is_default_and_runs_in_an_integer_kernel(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), DepthwiseConv(8), nn.ReLU(), ScaledConv(8, 4, 1)).eval()
    x = torch.randn(8, 3, 6, 6)
    with pytest.warns(DefaultSkipWarning, match=r"leaves out weighted layers of type ScaledConv \(1 layer"):
        q = PtqQuantizer(model, [{"op_types": ["default"], "quant_types": ALL, "quant_bits": 8}])
    assert [w.name for w in q.get_modules_wrapper()] == ["0", "2"]  # not '4' (own forward)
    assert q.get_modules_wrapper()[1]._fn == "conv"
    q.calibrate([x[:4], x[4:]])
    path = tmp_path / "int8.onnx"
    q.export_model(tmp_path / "m.pt", onnx_path=path, input_shape=(1, 3, 6, 6))
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    graph = onnx.load(str(tmp_path / "opt.onnx")).graph
    consts = {i.name for i in graph.initializer}
    ops = [n.op_type for n in graph.node]
    assert ops.count("QLinearConv") == 2
    float_convs = [n for n in graph.node if n.op_type in ("Conv", "FusedConv") and n.input[1] in consts]
    assert len(float_convs) == 1  # ScaledConv, not selected
    with torch.no_grad():
        np.testing.assert_allclose(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0], model(x).numpy(),
                                   atol=1e-5)


class Residual(nn.Module):
    """x + fc(x) on [batch, tokens, features], fc without bias (Llama's o_proj / down_proj): the ONNX graph
    has MatMul -> Add(residual), no bias Add."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.fc(x))


def test_int8_onnx_output_grid_of_a_bias_free_linear_is_before_the_residual_add(tmp_path):
    torch.manual_seed(0)
    model = Residual().eval()
    x = torch.randn(16, 5, 8)
    q = PtqQuantizer(model, cfg(op_types=["Linear"])).calibrate([x[:8], x[8:]])
    path = tmp_path / "int8.onnx"
    q.export_model(tmp_path / "m.pt", onnx_path=path, dummy_input=x[:2])
    graph = onnx.load(str(path)).graph
    producer = {o: n for n in graph.node for o in n.output}
    # the residual Add reads fc's quantized (DequantizeLinear) output, not the raw MatMul
    add = next(n for n in graph.node if n.op_type == "Add")
    assert [producer[i].op_type for i in add.input if i in producer] == ["DequantizeLinear"]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = model(x).numpy()
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
