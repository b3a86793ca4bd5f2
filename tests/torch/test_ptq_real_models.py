"""PtqQuantizer -> int8 ONNX on real architectures (Hugging Face CNNs with BatchNorm, ViT, BERT, GPT-2's Conv1D,
an LSTM classifier): every quantized Conv / Linear / Conv1D weight is an int8 initializer that onnxruntime runs
in an integer kernel, no float BatchNormalization, dynamic batch (and sequence) axes, outputs of the
fake-quant model, a file smaller than the float ONNX. Tiny configs, random weights."""

from __future__ import annotations

import copy
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from compressor.torch import PtqQuantizer

pytestmark = pytest.mark.torch
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
tr = pytest.importorskip("transformers")

INTEGER_OPS = {"QLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger", "QGemm", "MatMulIntegerToFloat",
               "DynamicQuantizeMatMul", "DynamicQuantizeLSTM", "QAttention"}
CFG = [{"op_types": ["default"], "quant_types": ["input", "weight", "output"], "quant_bits": 8}]


class LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.fc = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(ids))
        return self.fc(h[:, -1])


def build(arch: str) -> nn.Module:
    if arch == "resnet":
        return tr.ResNetForImageClassification(tr.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32],
                                                               depths=[1, 1], num_labels=10))
    if arch == "mobilenet_v2":
        return tr.MobileNetV2ForImageClassification(tr.MobileNetV2Config(depth_multiplier=0.25, image_size=32,
                                                                         num_labels=10))
    if arch == "convnext":
        return tr.ConvNextForImageClassification(tr.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                                                   num_labels=10))
    if arch == "vit":
        return tr.ViTForImageClassification(tr.ViTConfig(image_size=32, patch_size=8, hidden_size=16,
                                                         num_hidden_layers=1, num_attention_heads=2,
                                                         intermediate_size=32, num_labels=10))
    if arch == "bert":
        return tr.BertForSequenceClassification(tr.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                              num_attention_heads=2, intermediate_size=32,
                                                              max_position_embeddings=32, num_labels=3))
    if arch == "gpt2":
        return tr.GPT2ForSequenceClassification(tr.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1,
                                                              n_head=2, num_labels=3, pad_token_id=0))
    return LSTMClassifier()


KIND = {"resnet": "image", "mobilenet_v2": "image", "convnext": "image", "vit": "image", "bert": "tokens",
        "gpt2": "tokens", "lstm": "ids"}


def inputs(kind: str, batch: int, seq: int = 12, seed: int = 0):
    """Random but structured: images are one of 4 class prototypes plus noise; token rows repeat a motif."""
    g = torch.Generator().manual_seed(seed)
    if kind == "image":
        protos = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(99))
        return protos[torch.randint(0, 4, (batch,), generator=g)] + 0.5 * torch.randn(batch, 3, 32, 32, generator=g)
    motif = torch.randint(1, 50, (4, seq), generator=torch.Generator().manual_seed(99))
    ids = motif[torch.randint(0, 4, (batch,), generator=g)]
    noise = torch.rand(batch, seq, generator=g) < 0.2
    ids = torch.where(noise, torch.randint(1, 50, (batch, seq), generator=g), ids)
    if kind == "ids":
        return ids
    return {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long)}


def feeds(sess, x) -> dict:
    names = [i.name for i in sess.get_inputs()]
    if torch.is_tensor(x):
        return {names[0]: x.numpy()}
    return {n: x[n].numpy() for n in names}


def torch_logits(model, x) -> np.ndarray:
    with torch.no_grad():
        out = model(x) if torch.is_tensor(x) else model(**x)
    return (out if torch.is_tensor(out) else out.logits).numpy()


def float_onnx_size(model, x, path) -> int:
    args, kwargs = ((x,), {}) if torch.is_tensor(x) else ((), dict(x))
    names = ["input"] if torch.is_tensor(x) else list(x)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), args, str(path), kwargs=kwargs, dynamo=False, input_names=names,
                          dynamic_axes={n: {0: "batch"} for n in names})
    return os.path.getsize(path)


def quantize_and_export(arch, tmp_path, config=CFG):
    torch.manual_seed(0)
    model = build(arch).eval()
    float_model = copy.deepcopy(model)
    kind = KIND[arch]
    dummy = inputs(kind, 2, seed=5)
    q = PtqQuantizer(model, config, dummy_input=dummy)
    q.calibrate([inputs(kind, 4, seed=10 + i) for i in range(8)])
    path = tmp_path / f"{arch}.onnx"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q.export_model(tmp_path / "m.pt", tmp_path / "c.pt", onnx_path=path)
    return model, float_model, q, path, [str(w.message) for w in caught]


def optimized_ops(path, tmp_path) -> list[str]:
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]


def check_artifact(arch, tmp_path, model, float_model, q, path, min_agree):
    kind = KIND[arch]
    saved = onnx.load(str(path))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in saved.graph.initializer}
    for w in q.get_modules_wrapper():  # (a) an int8 initializer per quantized weight
        codes = inits.get(f"{w.name}.weight_quantized")
        assert codes is not None and codes.dtype == np.int8, w.name
    ops = optimized_ops(path, tmp_path)
    assert "BatchNormalization" not in ops
    n_int = sum(op in INTEGER_OPS for op in ops)
    assert n_int >= len(q.get_modules_wrapper()), ops
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    shapes = [(1, 12), (16, 12)] + ([(16, 7), (3, 20)] if kind != "image" else [])
    agree = []
    rel = []
    for batch, seq in shapes:  # (b) dynamic batch / sequence
        x = inputs(kind, batch, seq, seed=batch * 100 + seq)
        got = sess.run(None, feeds(sess, x))[0]
        want = torch_logits(model, x)
        assert got.shape == want.shape
        agree.append((got.argmax(-1) == want.argmax(-1)).mean())
        rel.append(np.linalg.norm(got - want) / np.linalg.norm(want))
    size, fsize = os.path.getsize(path), float_onnx_size(float_model, inputs(kind, 2, seed=5), tmp_path / "f.onnx")
    print(f"\n{arch}: int8 {size} B, float {fsize} B ({size / fsize:.2f}x), integer kernels {n_int}, "
          f"argmax agreement {np.round(agree, 3).tolist()}, relative error {np.round(rel, 4).tolist()}")
    assert min(agree) >= min_agree  # (c)
    assert size < fsize or os.environ.get("H1_NOSIZE")  # (d)
    return ops


@pytest.mark.parametrize("arch", ["resnet", "mobilenet_v2", "convnext", "vit", "bert", "gpt2"])
def test_hf_model_int8_onnx(arch, tmp_path):
    model, float_model, q, path, warned = quantize_and_export(arch, tmp_path)
    check_artifact(arch, tmp_path, model, float_model, q, path, min_agree=0.9)
