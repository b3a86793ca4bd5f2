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
    # q, k, v, attention output, FFN in, FFN out per layer: 12 MatMuls with an int8 weight, each followed by its
    # bias Add and then the output's QuantizeLinear, as the fake-quant model quantizes (onnxruntime has no integer
    # MatMul adding a bias: MatMulIntegerToFloat + Add); pooler + classifier (2-D): QGemm with the int32 bias
    assert (ops["QLinearMatMul"], ops["MatMulIntegerToFloat"], ops["QGemm"]) == (0, 12, 2)
    assert ops["MatMul"] + ops["FusedMatMul"] == 4  # attention's activation x activation products stay float
    assert ops["Softmax"] == 2 and ops["LayerNormalization"] == 5
    assert {"Softmax", "LayerNormalization", "Gelu"} <= set(q.onnx_float_ops)
    # opset 20: GELU is one Gelu node between DQ and Q, as in quantize_static's graph; at opset 17 it was
    # Div -> Erf -> Add -> Mul -> Mul reading x twice, which onnxruntime cannot fuse once its QDQ pass gives
    # each reader of a DequantizeLinear its own copy (5 float kernels per GELU, ~7 % of BERT's int8 run time)
    assert ops["Gelu"] == 2 and ops["Erf"] == 0
    assert vs_fake < 1e-3 and vs_float < 0.1


def test_bert_dynamic(tmp_path) -> None:
    q, ops, vs_fake, vs_float = run(bert, [dict(DYNAMIC[0], op_types=["Linear"])], tmp_path, activation="dynamic")
    # q/k/v read one input: one DynamicQuantizeLinear, three MatMulIntegerToFloat; the other 3 per layer +
    # pooler + classifier: DynamicQuantizeMatMul; no float MatMul with a weight left
    assert (ops["DynamicQuantizeMatMul"], ops["MatMulIntegerToFloat"], ops["DynamicQuantizeLinear"]) == (8, 6, 2)
    assert ops["MatMulInteger"] == 0 and ops["QLinearMatMul"] == 0
    assert {"Softmax": 2, "LayerNormalization": 5, "Gelu": 2}.items() <= q.onnx_float_ops.items()
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


def test_equal_biases_are_added_before_the_output_quantization(tmp_path) -> None:
    """The TorchScript exporter stores equal tensors once and reads the copies through ``Identity`` (the all-zero
    biases of a freshly initialised Hugging Face model; here two equal non-zero ones): each Linear's output is
    still quantized after its bias Add, as in the fake-quant model (it was quantized before the Add, with the
    bias added in float after the DequantizeLinear: 2 % off the fake-quant model here)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)).eval()
    with torch.no_grad():
        for m in (model[0], model[2]):
            m.bias.fill_(0.3)
    x = torch.randn(2, 5, 16)
    q = PtqQuantizer(model, [dict(STATIC[0], op_types=["Linear"])], dummy_input=x)
    q.calibrate([torch.randn(4, 5, 16) for _ in range(4)])
    path = os.path.join(tmp_path, "m.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.export_model(os.path.join(tmp_path, "m.pt"), onnx_path=path)
    graph = onnx.load(path).graph
    made = {o: n.op_type for n in graph.node for o in n.output}
    # each layer's output QuantizeLinear reads its bias Add; no Identity is left
    assert sorted(made.get(n.input[0]) for n in graph.node if n.op_type == "QuantizeLinear"
                  and made.get(n.input[0]) in ("Add", "MatMul")) == ["Add", "Add"]
    assert "Identity" not in made.values()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    xe = torch.randn(3, 5, 16)
    got = sess.run(None, {sess.get_inputs()[0].name: xe.numpy()})[0]
    with torch.no_grad():
        fake = model(xe).numpy()
    assert np.linalg.norm(got - fake) / np.linalg.norm(fake) < 1e-5


EMBEDDING = {"op_types": ["Embedding"], "quant_types": ["weight"], "quant_bits": 8}


@pytest.mark.parametrize("activation, scheme", [("static", None), ("dynamic", "per_tensor_symmetric")])
def test_bert_int8_embedding_tables(tmp_path, activation, scheme) -> None:
    """Word / position / token-type tables as int8 codes: rows are gathered as codes and only they are
    dequantized (per row: Gather of the rows' scales, Cast, Mul; per tensor: DequantizeLinear); the artifact
    computes what the fake-quant model computes, and the file loses 3 of the 4 bytes of each table entry."""
    linear = dict((STATIC if activation == "static" else DYNAMIC)[0], op_types=["Linear"])
    emb = dict(EMBEDDING, **({"quant_scheme": scheme} if scheme else {}))
    for d in ("with", "without"):
        (tmp_path / d).mkdir()
    q, ops, vs_fake, vs_float = run(bert, [linear, emb], tmp_path / "with", activation=activation)
    _, ops0, _, _ = run(bert, [linear], tmp_path / "without", activation=activation)
    sizes = [os.path.getsize(tmp_path / d / "m.onnx") for d in ("with", "without")]
    per_row = scheme is None
    tables = {"word_embeddings": (50, 32), "position_embeddings": (32, 32), "token_type_embeddings": (2, 32)}
    assert {n: q.onnx_int8_summary[f"bert.embeddings.{n}"]["weight"] for n in tables} == dict.fromkeys(
        tables, "int8 per-row" if per_row else "int8")
    graph = onnx.load(tmp_path / "with" / "m.onnx").graph
    floats = [tuple(i.dims) for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert not set(tables.values()) & set(floats)
    entries = sum(a * b for a, b in tables.values())  # 2688
    scales = 4 * sum(a for a, _ in tables.values()) if per_row else 0
    # (measured 6935 / 7550 bytes: the new nodes and their tensors cost a few hundred)
    assert sizes[1] - sizes[0] >= 0.85 * (3 * entries - scales)
    if per_row:
        assert (ops["Cast"] - ops0["Cast"], ops["Mul"] - ops0["Mul"], ops["Gather"] - ops0["Gather"]) == (3, 3, 3)
    else:
        assert ops["DequantizeLinear"] - ops0["DequantizeLinear"] == 3 and ops["Gather"] == ops0["Gather"]
    assert vs_fake < 1e-6 and vs_float < 0.05
