"""Integer ONNX export of QAT_Quantizer: int8 weight initializers + QDQ activations that onnxruntime fuses
into QLinearConv / QGemm, dynamic batch, ~4x smaller than the float export, same predictions as the
fake-quant torch model."""

from __future__ import annotations

import copy
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from compressor.core.cpu import exact_onnx_weight_dtype
from compressor.torch import QAT_Quantizer

pytestmark = pytest.mark.torch
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

INTEGER_OPS = {"QLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger", "QGemm", "MatMulIntegerToFloat"}
FLOAT_COMPUTE = {"Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul", "NchwcConv"}


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.pool(self.relu(self.conv3(x)))
        return self.fc2(self.relu(self.fc1(self.flat(x))))


SIGNED_PER_CHANNEL = {"weight": ("int", "per_channel_symmetric"), "input": ("uint", "per_tensor_affine"),
                      "output": ("uint", "per_tensor_affine")}


def config(types, schemes=SIGNED_PER_CHANNEL):
    cfg = {"op_types": ["Conv2d", "Linear"], "quant_types": list(types), "quant_bits": 8}
    if schemes is not None:
        cfg["quant_dtype"] = {t: schemes[t][0] for t in types}
        cfg["quant_scheme"] = {t: schemes[t][1] for t in types}
    return [cfg]


def trained(types, schemes=SIGNED_PER_CHANNEL, steps=30):
    """A QAT model trained briefly on a synthetic task (so its logits have margins), in eval mode."""
    torch.manual_seed(0)
    model = CNN()
    float_model = copy.deepcopy(model)
    q = QAT_Quantizer(model, config(types, schemes))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    q.hook_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    proto = torch.randn(10, 3, 32, 32, generator=g)
    model.train()
    for _ in range(steps):
        y = torch.randint(0, 10, (32,), generator=g)
        x = proto[y] + 0.8 * torch.randn(32, 3, 32, 32, generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    return model, float_model, q


def float_onnx(model, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (torch.randn(1, 3, 32, 32),), str(path), dynamo=False, input_names=["input"],
                          dynamic_axes={"input": {0: "batch"}})
    return os.path.getsize(path)


def optimized_session(path, opt_path):
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(opt_path)
    so.intra_op_num_threads = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess, [n.op_type for n in onnx.load(str(opt_path)).graph.node]


CASES = {
    # every activation configured: all 5 layers become integer kernels
    "weight-input-output": (("weight", "input", "output"), SIGNED_PER_CHANNEL, 5),
    # outputs only: layers 2..5 inherit their input grid from the previous quantized output (through Relu,
    # MaxPool, Flatten); conv1 has no input scale and stays float (its weight is still stored as int8)
    "weight-output": (("weight", "output"), SIGNED_PER_CHANNEL, 4),
    # QAT's defaults: uint8 per-tensor affine weights and activations
    "defaults-uint8": (("weight", "input", "output"), None, 5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_int8_onnx_runs_integer_kernels(name, tmp_path):
    types, schemes, n_integer = CASES[name]
    model, float_model, q = trained(types, schemes)
    path = tmp_path / "int8.onnx"
    q.export_model(tmp_path / "m.pt", onnx_path=path, input_shape=(1, 3, 32, 32))
    assert model.training is False and all(not w.export_mode for w in q.get_modules_wrapper())

    # weights are stored as 8-bit integers (+ DequantizeLinear), per channel on the output axis
    saved = onnx.load(str(path))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in saved.graph.initializer}
    # symmetric weights: int8 codes, or the same codes + 128 as uint8 where u8s8 kernels saturate (core.cpu)
    want_dtype = np.dtype(exact_onnx_weight_dtype()) if schemes is not None else np.uint8
    for w in q.get_modules_wrapper():
        codes = inits[f"{w.name}.weight_quantized"]
        assert codes.dtype == want_dtype and codes.shape == tuple(w.weight.shape)
        assert not any(a.dtype == np.float32 and a.shape == codes.shape for a in inits.values())
    dq_axes = [a.i for n in saved.graph.node if n.op_type == "DequantizeLinear" and "weight" in n.input[0]
               for a in n.attribute if a.name == "axis"]
    assert dq_axes == ([0] * 5 if schemes is not None else [])
    assert os.path.getsize(path) <= 0.35 * float_onnx(float_model, tmp_path / "float.onnx")

    # onnxruntime's optimised graph: integer kernels, no float Conv/Gemm for the quantized layers
    sess, ops = optimized_session(path, tmp_path / "opt.onnx")
    assert sum(op in INTEGER_OPS for op in ops) == n_integer, ops
    assert sum(op in FLOAT_COMPUTE for op in ops) == 5 - n_integer, ops

    # dynamic batch; predictions of the fake-quant model
    name_in = sess.get_inputs()[0].name
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 3, 32, 32, generator=g)
    with torch.no_grad():
        want = model(x).numpy()
    got = np.concatenate([sess.run(None, {name_in: x[i:i + 32].numpy()})[0] for i in range(0, 256, 32)])
    one = sess.run(None, {name_in: x[:1].numpy()})[0]
    assert one.shape == (1, 10) and got.shape == (256, 10)
    np.testing.assert_allclose(one, got[:1], atol=1e-6)
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.99
    step = float(q.get_modules_wrapper()[-1].output_scale)  # fc2's output grid
    assert np.abs(got - want).max() <= 3 * step


def test_int8_onnx_bias_is_int32_on_the_product_scale(tmp_path):
    model, _, q = trained(("weight", "input", "output"), steps=3)
    path = tmp_path / "int8.onnx"
    q.export_model(tmp_path / "m.pt", onnx_path=path, input_shape=(2, 3, 32, 32))
    graph = onnx.load(str(path)).graph
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    for w in q.get_modules_wrapper():
        dq = next(n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] == f"{w.name}.bias_quantized")
        codes, scale = inits[dq.input[0]], inits[dq.input[1]]
        assert codes.dtype == np.int32 and inits[dq.input[2]].dtype == np.int32
        want = (w.input_scale * w.weight_scale).numpy()
        np.testing.assert_allclose(scale, want, rtol=1e-6)
        np.testing.assert_allclose(codes * scale, w.bias.detach().numpy(), atol=float(scale.max()))
    assert q.onnx_int8_summary["fc2"] == {"op": "Gemm", "output": True, "input": True, "bias": "int32",
                                          "weight": f"{exact_onnx_weight_dtype()} per-channel"}


def test_export_before_any_forward_is_refused(tmp_path):
    torch.manual_seed(0)
    model = CNN()
    q = QAT_Quantizer(model, config(("weight", "input", "output")))
    with pytest.raises(ValueError, match=r"conv1\.input.*forward.*load_calibration_config"):
        q.export_model(tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx", input_shape=(1, 3, 32, 32))
    assert list(tmp_path.iterdir()) == []


def test_format_selection(tmp_path):
    torch.manual_seed(0)
    model = CNN()
    cfg = config(("weight", "output"))
    cfg[0]["quant_bits"] = {"weight": 4, "output": 8}
    q = QAT_Quantizer(model, cfg)
    model.train()
    model(torch.randn(4, 3, 32, 32))
    model.eval()
    with pytest.raises(ValueError, match="onnx_format='int8'.*8-bit"):
        q.export_model(tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx", input_shape=(1, 3, 32, 32),
                       onnx_format="int8")
    assert not (tmp_path / "m.onnx").exists()
    # 'auto' falls back to the fake-quant QDQ form (float weights) for grids narrower than 8 bits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.export_model(tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx", input_shape=(1, 3, 32, 32), dynamo=False)
    dtypes = {i.data_type for i in onnx.load(str(tmp_path / "m.onnx")).graph.initializer}
    assert onnx.TensorProto.INT8 not in dtypes
    with pytest.raises(ValueError, match="onnx_format"):
        q.export_model(tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx", input_shape=(1, 3, 32, 32),
                       onnx_format="int4")
