"""Issue 43 (item 5): ONNX export after speedup and of recurrent models.

* a sped-up Hugging Face GPT-2 exports to int8 ONNX like the original (its inner modules kept the old config,
  so the export's use_cache=False did not reach them: "unsupported type: DynamicCache");
* every ONNX export path gives a dynamic batch axis (an LSTM classifier exported with batch 2 or 1 runs in
  onnxruntime with batch 16): the int8 form, the fake-quant form and the pruner's export;
* an LSTM left float in an int8 file is said at export, in one warning naming it.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import compressor.torch as cth

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.torch


def _session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _run(sess, feeds):
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: feeds[n].numpy() for n in names})[0]


def _sped_up_gpt2():
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                             bos_token_id=0, eos_token_id=0)).eval()
    x = {"input_ids": torch.randint(0, 50, (2, 8))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = cth.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], dependency_aware=True,
                               dummy_input=x)
        p.compress()
        small = cth.speedup_model(p, x)
    assert small.transformer.h[0].mlp.c_fc.weight.shape[1] == 64  # n_inner 128 -> 64
    # a short fine-tune of the smaller model (a few steps of next-token loss)
    opt = torch.optim.SGD(small.parameters(), lr=0.05)
    small.train()
    for _ in range(3):
        ids = torch.randint(0, 50, (4, 8))
        loss = small(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    small.eval()
    return small, x


@pytest.mark.parametrize("as_dict", [True, False], ids=["dict", "tensor"])
def test_sped_up_gpt2_exports_int8_onnx(as_dict, tmp_path):
    small, x = _sped_up_gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = cth.PtqQuantizer(small, [{"quant_types": ["weight", "input"], "quant_bits": 8,
                                      "op_types": ["Linear", "Conv1D"]}])
        q.compress()
        q.calibrate([{"input_ids": torch.randint(0, 50, (2, 8))} for _ in range(4)])
        dummy = x if as_dict else x["input_ids"]
        q.export_model(None, onnx_path=tmp_path / "g.onnx", dummy_input=dummy, onnx_format="int8")
    sess = _session(tmp_path / "g.onnx")
    assert sess.get_inputs()[0].shape == ["batch", "sequence"]
    ids = torch.randint(0, 50, (5, 6))  # another batch and length than the export's
    got = _run(sess, {sess.get_inputs()[0].name: ids})
    with torch.no_grad():
        want = small(input_ids=ids).logits.numpy()
    assert got.shape == want.shape
    # integer kernels requantize each activation (QuantizeLinear rounds half to even, the int32 bias is
    # rounded to s_in * s_w): up to one activation step per layer input. Measured: max |diff| = 4e-4 of the
    # logits' range; 1 % leaves room for other CPUs' kernels (u8s8 vs u8u8) while a float graph or a weight
    # off its grid is far outside it
    span = float(want.max() - want.min())
    assert np.abs(got - want).max() < 0.01 * span
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.999


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm = nn.Embedding(50, 16), nn.LSTM(16, 16, batch_first=True)
        self.fc, self.head = nn.Linear(16, 12), nn.Linear(12, 3)

    def forward(self, x):
        y, _ = self.lstm(self.emb(x))
        return self.head(torch.relu(self.fc(y[:, -1])))


def _quantized_lstm(config):
    torch.manual_seed(0)
    model = LSTMClassifier().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = cth.PtqQuantizer(model, config)
        q.compress()
        q.calibrate([torch.randint(0, 50, (2, 8)) for _ in range(3)])
    return model, q


LSTM_IN_CONFIG = [{"quant_types": ["weight", "input"], "quant_bits": 8, "op_types": ["Linear"]},
                  {"quant_types": ["weight"], "quant_bits": 8, "op_types": ["LSTM"]}]
LSTM_LEFT_OUT = [{"quant_types": ["weight", "input"], "quant_bits": 8, "op_types": ["Linear"]}]


@pytest.mark.parametrize("config,says", [(LSTM_IN_CONFIG, "'lstm' (LSTM: quantized weight values weight_ih_l0, "
                                                          "weight_hh_l0 stored as float"),
                                         (LSTM_LEFT_OUT, "'lstm' (LSTM: not in the config, float)")],
                         ids=["quantized", "left-out"])
def test_int8_lstm_classifier_batch_is_dynamic_and_float_lstm_is_said(config, says, tmp_path):
    model, q = _quantized_lstm(config)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        q.export_model(None, onnx_path=tmp_path / "l.onnx", dummy_input=torch.randint(0, 50, (2, 8)))
    float_notes = [str(w.message) for w in rec if "keeps" in str(w.message) and "in float" in str(w.message)]
    assert len(float_notes) == 1 and says in float_notes[0], float_notes
    assert q.onnx_int8_summary["fc"]["weight"].startswith(("int8", "uint8"))  # the int8 form, not fake-quant
    sess = _session(tmp_path / "l.onnx")
    x16 = torch.randint(0, 50, (16, 8))
    got = _run(sess, {sess.get_inputs()[0].name: x16})
    with torch.no_grad():
        want = model(x16).numpy()
    assert got.shape == (16, 3)
    np.testing.assert_allclose(got, want, atol=0.05 * float(np.abs(want).max()) + 1e-3)


def test_fake_quant_onnx_batch_is_dynamic(tmp_path):
    model, q = _quantized_lstm(LSTM_IN_CONFIG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.export_model(None, onnx_path=tmp_path / "f.onnx", dummy_input=torch.randint(0, 50, (2, 8)),
                       onnx_format="fake_quant")
    sess = _session(tmp_path / "f.onnx")
    ops = [n.op_type for n in __import__("onnx").load(str(tmp_path / "f.onnx")).graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    x16 = torch.randint(0, 50, (16, 8))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(tmp_path / "f.onnx"), so, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = model(x16).numpy()
    # the graph as written is the fake-quant model (QDQ = its rounding; ties aside)
    np.testing.assert_allclose(_run(sess, {sess.get_inputs()[0].name: x16}), want, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 2])
def test_pruner_onnx_batch_is_dynamic(batch, tmp_path):
    torch.manual_seed(0)
    model = LSTMClassifier().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = cth.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}])
        p.compress()
        p.export_model(tmp_path / "p.pt", onnx_path=tmp_path / "p.onnx", dummy_input=torch.randint(0, 50, (batch, 8)))
    sess = _session(tmp_path / "p.onnx")
    assert sess.get_inputs()[0].shape[0] == "batch"
    x16 = torch.randint(0, 50, (16, 8))
    with torch.no_grad():
        want = model(x16).numpy()
    np.testing.assert_allclose(_run(sess, {sess.get_inputs()[0].name: x16}), want, atol=1e-5)
