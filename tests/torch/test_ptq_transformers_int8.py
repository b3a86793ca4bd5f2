"""Transformers' Linear layers in the int8 ONNX graph (issue 27): static QDQ (QLinearMatMul / QGemm /
MatMulIntegerToFloat in onnxruntime) and ``activation='dynamic'`` (onnxruntime's ``quantize_dynamic``
equivalent: DynamicQuantizeMatMul), on tiny Hugging Face BERT and GPT-2 (HF Conv1D); Softmax / LayerNorm /
GELU stay float and are listed in ``quantizer.onnx_float_ops``."""

from __future__ import annotations

import collections
import copy
import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError
from compressor.torch import PtqQuantizer

pytestmark = pytest.mark.torch
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
tr = pytest.importorskip("transformers")

DYNAMIC = [{"op_types": ["Linear", "Conv1D"], "quant_types": ["input", "weight"], "quant_bits": 8}]
STATIC = [{"op_types": ["Linear", "Conv1D"], "quant_types": ["input", "weight", "output"], "quant_bits": 8}]


def bert() -> nn.Module:
    torch.manual_seed(0)
    return tr.BertForSequenceClassification(tr.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3)).eval()


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    model = tr.GPT2ForSequenceClassification(tr.GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2,
                                                           n_head=2, num_labels=3, pad_token_id=0))
    model.config.use_cache = False
    return model.eval()


def tokens(batch: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, 50, (batch, 12), generator=g),
            "attention_mask": torch.ones(batch, 12, dtype=torch.long)}


def run(make, cfg, tmp_path, **kwargs):
    model = make()
    float_model = copy.deepcopy(model)
    q = PtqQuantizer(model, cfg, dummy_input=tokens(2, 5), **kwargs)
    if kwargs.get("activation") != "dynamic":
        q.calibrate([tokens(4, 10 + i) for i in range(4)])
    path = os.path.join(tmp_path, "m.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.export_model(os.path.join(tmp_path, "m.pt"), onnx_path=path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = os.path.join(tmp_path, "opt.onnx")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    x = tokens(8, 77)
    got = sess.run(None, {i.name: x[i.name].numpy() for i in sess.get_inputs()})[0]
    with torch.no_grad():
        fake, ref = model(**x).logits.numpy(), float_model(**x).logits.numpy()
    ops = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    return q, ops, rel(got, fake), rel(got, ref)


def test_bert_static_integer_matmuls(tmp_path) -> None:
    q, ops, vs_fake, vs_float = run(bert, [dict(STATIC[0], op_types=["Linear"])], tmp_path)
    # q, k, v, attention output, FFN in, FFN out per layer: 12 MatMuls with an int8 weight, 11 of them with a
    # quantized output (QLinearMatMul), one with a float output (MatMulIntegerToFloat); pooler + classifier: QGemm
    assert (ops["QLinearMatMul"], ops["MatMulIntegerToFloat"], ops["QGemm"]) == (11, 1, 2)
    assert ops["MatMul"] + ops["FusedMatMul"] == 4  # attention's activation x activation products stay float
    assert ops["Softmax"] == 2 and ops["LayerNormalization"] == 5
    assert {"Softmax", "LayerNormalization", "Erf"} <= set(q.onnx_float_ops)
    assert vs_fake < 1e-3 and vs_float < 0.1


def test_bert_dynamic(tmp_path) -> None:
    q, ops, vs_fake, vs_float = run(bert, [dict(DYNAMIC[0], op_types=["Linear"])], tmp_path, activation="dynamic")
    # q/k/v read one input: one DynamicQuantizeLinear, three MatMulIntegerToFloat; the other 3 per layer +
    # pooler + classifier: DynamicQuantizeMatMul; no float MatMul with a weight left
    assert (ops["DynamicQuantizeMatMul"], ops["MatMulIntegerToFloat"], ops["DynamicQuantizeLinear"]) == (8, 6, 2)
    assert ops["MatMulInteger"] == 0 and ops["QLinearMatMul"] == 0
    assert {"Softmax": 2, "LayerNormalization": 5, "Erf": 2}.items() <= q.onnx_float_ops.items()
    assert all(v["input"] == "dynamic" for v in q.onnx_int8_summary.values())
    assert vs_fake < 1e-5 and vs_float < 0.05


def test_gpt2_conv1d_dynamic(tmp_path) -> None:
    q, ops, vs_fake, vs_float = run(gpt2, [dict(DYNAMIC[0], op_types=["Conv1D"])], tmp_path, activation="dynamic")
    # c_attn, c_proj, c_fc, mlp c_proj per layer (HF Conv1D); the score head (a Linear) is not selected
    assert ops["DynamicQuantizeMatMul"] == 8 and set(q.onnx_int8_summary) == {
        f"transformer.h.{i}.{n}" for i in range(2) for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert {"Softmax", "LayerNormalization", "Tanh"} <= set(q.onnx_float_ops)
    assert vs_fake < 1e-5 and vs_float < 0.05


def test_dynamic_needs_no_calibration_and_validates() -> None:
    q = PtqQuantizer(bert(), [dict(DYNAMIC[0], op_types=["Linear"])], activation="dynamic")
    assert q.calibrated
    w = q.get_modules_wrapper()[0].layer.weight
    torch.testing.assert_close(q.get_modules_wrapper()[0].weight_scale, w.detach().abs().amax(1) / 127)  # frozen
    model = bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="activation must be 'static' .* or 'dynamic'"):
        PtqQuantizer(model, DYNAMIC, activation="Dynamic")
    with pytest.raises(ConfigError, match=r"dynamic quantization takes \['input', 'weight'\]"):
        PtqQuantizer(model, [dict(STATIC[0], op_types=["Linear"])], activation="dynamic")
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="layer '0' is a Conv2d; dynamic quantization takes Linear"):
        PtqQuantizer(conv, [{"op_types": ["Conv2d"], "quant_types": ["input", "weight"],
                                    "quant_bits": 8}], activation="dynamic")
    assert not any("wrapper" in type(m).__name__.lower() for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
