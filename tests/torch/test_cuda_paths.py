"""The user-facing paths on a CUDA model, each checked against the same run on the CPU: one-shot compression
(Wanda, SparseGPT, GPTQ, RTN, AWQ) of a Hugging Face Llama that lives on the GPU, calibration data held on
the GPU or the host, ``pack_weights`` of the result, PTQ calibration plus int8 ONNX export of a GPU model, and
structured speedup of a pruned GPU model. Skipped without a CUDA device (the CPU versions of every path are
tested elsewhere); run on a lent GPU machine."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from compressor.torch import (
    AwqQuantizer,
    GptqQuantizer,
    L1FilterPruner,
    PtqQuantizer,
    RtnQuantizer,
    SparseGPTPruner,
    WandaPruner,
    speedup_model,
)
from compressor.torch.quantization.lowbit import PackedLinear, oneshot_codes, pack_weights

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 64
ONESHOT = {
    "wanda": (WandaPruner, {"sparsity": 0.5}),
    "sparsegpt": (SparseGPTPruner, {"sparse_pattern": "2:4"}),
    "gptq": (GptqQuantizer, {"quant_bits": 4, "group_size": 16}),
    "rtn": (RtnQuantizer, {"quant_bits": 4, "group_size": 16}),
    "awq": (AwqQuantizer, {"quant_bits": 4, "group_size": 16}),
}


def llama(seed=0):
    pytest.importorskip("transformers")
    from tests.torch.test_packed import VOCAB as vocab
    from tests.torch.test_packed import llama as build

    assert vocab == VOCAB
    return build(seed, hidden=64, ffn=128)


def calib(on="cpu"):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, 32), generator=g).to(on) for _ in range(4)]


HELD = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(99))


def compress(name, model, data, forward_dtype="auto"):
    cls, cfg = ONESHOT[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = cls(model, [{**cfg, "op_types": ["default"]}])
    return c.calibrate(None if name == "rtn" else data, progress=False, forward_dtype=forward_dtype)


def on_device(model, kind):
    return all(t.device.type == kind for t in [*model.parameters(), *model.buffers()])


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("name", list(ONESHOT))
@pytest.mark.parametrize("data_on", ["cuda", "cpu"])
@pytest.mark.parametrize("forward_dtype", ["model", "float64"])  # 'auto' is 'model' on the GPU, 'float64' on CPU
def test_one_shot_on_a_cuda_model_gives_the_cpu_masks_and_codes(name, data_on, forward_dtype):
    cpu_model = llama()
    cpu = compress(name, cpu_model, calib(), forward_dtype)
    gpu_model = llama().cuda()
    gpu = compress(name, gpu_model, calib(data_on), forward_dtype)
    assert on_device(gpu_model, "cuda")
    wc = {w.name: w for w in cpu.get_modules_wrapper()}
    wg = {w.name: w for w in gpu.get_modules_wrapper()}
    assert sorted(wc) == sorted(wg) and len(wc) == 14
    for n, a in wc.items():
        b = wg[n]
        if hasattr(a, "weight_mask"):  # pruners: the same weights kept (float32 forward differences may flip
            # a near-tie in the calibration statistics: allow 1 in 200)
            assert b.weight_mask.device.type == "cuda"
            same = (a.weight_mask == b.weight_mask.cpu()).float().mean().item()
            assert same >= 0.995, (n, same)
            assert torch.equal(b.weight == 0, ~b.weight_mask), n
        else:  # weight-only quantizers: the same integer codes (RTN reads weights only: exactly)
            assert b.weight_codes.device.type == "cuda"
            same = (oneshot_codes(a) == oneshot_codes(b).cpu()).float().mean().item()
            assert (same == 1.0) if name == "rtn" else (same >= 0.995), (n, same)
    with torch.no_grad():
        want = cpu_model(HELD).logits
        got = gpu_model(HELD.cuda()).logits.cpu()
    assert rel_err(got, want) < (1e-5 if name == "rtn" else 2e-2), rel_err(got, want)
    assert "layer" in str(gpu.report()) or "name" in str(gpu.report())  # the report reads device tensors


@pytest.mark.parametrize("name", ["gptq", "awq"])
def test_pack_weights_on_cuda_runs_the_reference_path_and_equals_the_fake_quant_model(name):
    model = llama().cuda()
    compress(name, model, calib("cuda"))
    with torch.no_grad():
        ref = model(HELD.cuda()).logits
    pack_weights(model, compute_dtype=torch.float32)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 14 and all(m.kernel == "reference" for m in packed)
    assert on_device(model, "cuda")
    with torch.no_grad():
        assert rel_err(model(HELD.cuda()).logits, ref) < 1e-5


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(self.pool(torch.relu(self.conv2(x))).flatten(1))


def cnn():
    torch.manual_seed(0)
    return CNN().eval()


def test_ptq_calibrated_on_cuda_exports_the_int8_onnx_the_cpu_run_exports(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(16, 3, 8, 8, generator=g) for _ in range(4)]
    cfg = [{"op_types": ["Conv2d", "Linear"], "quant_types": ["weight", "input", "output"], "quant_bits": 8}]
    outs = {}
    for dev in ("cpu", "cuda"):
        model = cnn().to(dev)
        q = PtqQuantizer(model, copy.deepcopy(cfg))
        q.calibrate([x.to(dev) for x in data])
        assert on_device(model, dev)
        path = tmp_path / f"{dev}.onnx"
        q.export_model(tmp_path / f"{dev}.pt", onnx_path=path, input_shape=(1, 3, 8, 8))
        assert on_device(model, dev)  # export does not move the user's model
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        x = torch.randn(64, 3, 8, 8, generator=torch.Generator().manual_seed(4))
        outs[dev] = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        with torch.no_grad():
            fq = model(x.to(dev)).cpu().numpy()
        assert (outs[dev].argmax(1) == fq.argmax(1)).mean() >= 0.95
        outs[dev + "_scales"] = np.concatenate([v.cpu().double().flatten().numpy()
                                                for k, v in model.state_dict().items() if k.endswith("_scale")])
    assert outs["cpu_scales"].size > 8
    np.testing.assert_allclose(outs["cuda_scales"], outs["cpu_scales"], rtol=1e-5)
    assert (outs["cuda"].argmax(1) == outs["cpu"].argmax(1)).mean() >= 0.95


def test_speedup_of_a_pruned_cuda_model_keeps_it_on_cuda_with_the_masked_outputs():
    x = torch.randn(8, 3, 8, 8, device="cuda")
    shapes = {}
    for dev in ("cpu", "cuda"):
        model = cnn().to(dev)
        pruner = L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d"]}])
        pruner.compress()
        with torch.no_grad():
            masked = model(x.to(dev))
        small = speedup_model(pruner, x[:1].to(dev))
        assert on_device(small, dev)
        with torch.no_grad():
            torch.testing.assert_close(small(x.to(dev)), masked, rtol=1e-4, atol=1e-5)
        shapes[dev] = [tuple(p.shape) for p in small.parameters()]
    assert shapes["cuda"] == shapes["cpu"] and shapes["cpu"][0][0] == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kth_smallest_on_cuda_is_the_numpy_value(dtype):
    from compressor.torch.ops import ops

    g = torch.Generator().manual_seed(5)
    x = torch.randint(-50, 50, (64, 37), generator=g).to(dtype) / 7  # many ties
    flat = np.sort(x.numpy().reshape(-1))
    for k in (1, 2, 100, x.numel() // 2, x.numel() - 1, x.numel()):
        got = ops.kth_smallest(x.cuda(), k)
        assert got.device.type == "cuda" and got.dtype == dtype and float(got) == float(flat[k - 1]), k
