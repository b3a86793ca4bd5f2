"""Issue 23 (items 5-8) on torch: dependency-aware filter pruning with op_types ['default'] (convolutions
and Linear) chooses only channels speedup can remove, on Hugging Face models and an LSTM classifier;
element-wise ops with scalar operands pass channels; sped-up HF models reload with from_pretrained;
MACs of recurrent layers and attention matmuls."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compressor.torch as cth
from compressor.core.errors import ConfigWarning, ModelError
from compressor.torch.speedup import count_flops_params, speedup_report

tr = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch


class Pointwise(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.a, self.b, self.f = nn.Linear(4, 6), nn.Linear(6, 2), f

    def forward(self, x):
        return self.b(self.f(self.a(x)))


def _prune(model, x, types=("default",), keep=()):
    config = [{"sparsity": 0.5, "op_types": list(types)}] + ([{"exclude": True, "op_names": list(keep)}] if keep else [])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        p = cth.L1FilterPruner(model, config, dependency_aware=True, dummy_input=x)
        p.compress()
    return p, [str(w.message) for w in rec if issubclass(w.category, ConfigWarning)]


def _out(m, x):
    r = m(**x) if isinstance(x, dict) else m(x)
    return r.logits if hasattr(r, "logits") else r


@pytest.mark.parametrize("f", [lambda x: x * 0.5, lambda x: 0.5 * x, lambda x: torch.pow(x, 3.0), lambda x: x ** 2,
                               lambda x: x / 6, torch.tanh, torch.erf, lambda x: torch.clamp(x, -1, 6), F.relu6,
                               F.gelu, F.silu, lambda x: 0.5 * x * (1 + torch.tanh(0.8 * (x + 0.04 * x ** 3)))],
                         ids=["mul", "rmul", "pow", "square", "div", "tanh", "erf", "clamp", "relu6", "gelu", "silu",
                              "gelu_new"])
def test_zero_preserving_pointwise_ops_pass_channels(f):
    torch.manual_seed(0)
    m, x = Pointwise(f).eval(), torch.randn(3, 4)
    p, msgs = _prune(m, x)
    with torch.no_grad():
        ref = p.bound_model(x)
    small = cth.speedup_model(p, x)
    assert (small.a.out_features, small.b.in_features, small.b.out_features) == (3, 3, 2)
    assert torch.allclose(small(x), ref, atol=1e-5)
    # the classifier 'b' is selected by 'default' and left whole: its outputs are the model output
    assert any("b: 2 of 2 channels never pruned (2: they reach a model output" in msg for msg in msgs)


@pytest.mark.parametrize("f,op", [(lambda x: x + 3, "AddBackward0"), (torch.sigmoid, "SigmoidBackward0"),
                                  (lambda x: 1 - x, "RsubBackward1"), (torch.cos, "CosBackward0")])
def test_ops_that_make_zeros_nonzero_block_pruning_and_are_named_with_the_layer(f, op):
    m, x = Pointwise(f).eval(), torch.randn(3, 4)
    before = m.a.weight.detach().clone()
    p, msgs = _prune(m, x)
    assert any(f"a: 6 of 6 channels never pruned (6: op {op} (after layer 'a') does not keep zero channels zero"
               in msg for msg in msgs), msgs
    assert torch.equal(p.bound_model.a.module.weight.detach(), before)  # nothing pruned
    small = cth.speedup_model(p, x)  # strict: nothing to refuse
    assert small.a.out_features == 6


def test_unclassified_op_is_named_with_the_layers_it_blocks():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)

        def forward(self, x):
            return self.b(torch.cumsum(self.a(x), dim=-1))

    p, msgs = _prune(Odd().eval(), torch.randn(3, 4))
    assert any("a: 6 of 6 channels never pruned (6: they reach op CumsumBackward0 (after layer 'a'), which speedup "
               "cannot cut)" in msg for msg in msgs), msgs


# ---------------------------------------------------------------------------------- real models
def _resnet():
    return tr.ResNetForImageClassification(tr.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                           num_labels=3)), torch.randn(2, 3, 32, 32)


def _mobilenet():
    return tr.MobileNetV2ForImageClassification(tr.MobileNetV2Config(image_size=32, depth_multiplier=0.25,
                                                                     num_labels=3)), torch.randn(2, 3, 32, 32)


def _convnext():
    return tr.ConvNextForImageClassification(tr.ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                                                               num_labels=3, image_size=32)), torch.randn(2, 3, 32, 32)


def _vit():
    return tr.ViTForImageClassification(tr.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=3)), \
        torch.randn(2, 3, 16, 16)


def _bert():
    return tr.BertForSequenceClassification(tr.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=32,
                                                          max_position_embeddings=16, num_labels=3)), \
        {"input_ids": torch.randint(0, 50, (2, 8))}


def _gpt2():
    return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                            bos_token_id=0, eos_token_id=0)), \
        {"input_ids": torch.randint(0, 50, (2, 8))}


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm = nn.Embedding(50, 16), nn.LSTM(16, 16, batch_first=True)
        self.fc, self.head = nn.Linear(16, 12), nn.Linear(12, 3)

    def forward(self, x):
        y, _ = self.lstm(self.emb(x))
        return self.head(torch.relu(self.fc(y[:, -1])))


def _lstm():
    return LSTMClassifier(), torch.randint(0, 50, (2, 8))


#: per model: {layer: (out, in) after speedup} that must hold exactly
EXPECT = {
    "resnet": {"resnet.embedder.embedder.convolution": (4, 3), "resnet.encoder.stages.0.layers.0.layer.0.convolution":
               (1, 4), "resnet.encoder.stages.1.layers.0.layer.2.convolution": (8, 2), "classifier.1": (3, 8)},
    "mobilenet": {"mobilenet_v2.conv_1x1.convolution": (640, 40), "classifier": (3, 640)},
    "convnext": {"convnext.encoder.stages.0.layers.0.pwconv1": (16, 8), "convnext.encoder.stages.1.layers.0.pwconv2":
                 (16, 32)},
    "vit": {"vit.layers.0.mlp.fc1": (16, 16), "vit.layers.0.mlp.fc2": (16, 16)},
    "bert": {"bert.encoder.layer.0.intermediate.dense": (16, 16), "bert.encoder.layer.0.output.dense": (16, 16),
             "bert.pooler.dense": (8, 16), "classifier": (3, 8)},
    "gpt2": {"transformer.h.0.mlp.c_fc": (64, 32), "transformer.h.0.mlp.c_proj": (32, 64)},
    "lstm": {"fc": (6, 16), "head": (3, 6)},
}
MODELS = {"resnet": _resnet, "mobilenet": _mobilenet, "convnext": _convnext, "vit": _vit, "bert": _bert,
          "gpt2": _gpt2, "lstm": _lstm}


def _sizes(module):
    if hasattr(module, "nf"):  # HF Conv1D, weight [in, out]
        return module.weight.shape[1], module.weight.shape[0]
    return module.weight.shape[0], module.weight.shape[1]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "mobilenet" else n for n in MODELS])
def test_default_dependency_aware_pruning_is_removed_exactly_by_strict_speedup(name):
    torch.manual_seed(0)
    model, x = MODELS[name]()
    model.eval()
    p, _ = _prune(model, x)
    wrapped = [w.name for w in p.get_modules_wrapper()]
    with torch.no_grad():
        ref = _out(p.bound_model, x)
    small = cth.speedup_model(p, x, strict=True)
    assert speedup_report(small).removed_classes > 0
    for layer, size in EXPECT[name].items():
        assert tuple(_sizes(small.get_submodule(layer))) == size, layer
    # every pruned channel is gone: no layer the pruner touched keeps a zero weight (random init has none)
    for layer in wrapped:
        assert not bool((small.get_submodule(layer).weight == 0).any()), layer
    with torch.no_grad():
        assert torch.allclose(_out(small, x), ref, atol=1e-5)


@pytest.mark.parametrize("make,types,keep,config", [
    (_resnet, ("default",), (), {"hidden_sizes": [4, 8], "embedding_size": 4}),
    (_gpt2, ("default",), (), {"n_inner": 64}),
    # BERT's pooler width is hidden_size in its config: a pruned pooler could not be reloaded (see below)
    (_bert, ("default",), ("bert.pooler.dense",), {"intermediate_size": 16}),
    (_vit, ("default", "ViTAttention"), (), {"intermediate_size": 16, "num_attention_heads": 1, "head_dim": 8}),
], ids=["resnet", "gpt2", "bert", "vit-heads"])
def test_sped_up_hf_model_reloads_with_from_pretrained(make, types, keep, config, tmp_path):
    torch.manual_seed(0)
    model, x = make()
    model.eval()
    p, _ = _prune(model, x, types, keep)
    small = cth.speedup_model(p, x)
    for key, value in config.items():
        assert getattr(small.config, key) == value, key
    small.save_pretrained(tmp_path)
    again = type(small).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(_out(again, x), _out(small, x))
    assert model.config.to_dict() != small.config.to_dict()  # the original model's config is untouched


@pytest.mark.parametrize("make,types,match", [
    (_convnext, ("default",), r"ConvNextForImageClassification has layer widths its config cannot express "
                              r"\(convnext\.encoder\.stages\.0\.layers\.0\.pwconv1\.bias: \(16,\) \(the config gives \(32,\)\)"),
    (_bert, ("default", "BertSelfAttention"), r"BertForSequenceClassification has layer widths its config cannot express"),
    (_bert, ("default",), r"bert\.pooler\.dense\.bias: \(8,\) \(the config gives \(16,\)\)"),
], ids=["convnext", "bert-heads", "bert-pooler"])
def test_widths_the_config_cannot_express_refuse_save_pretrained(make, types, match, tmp_path):
    torch.manual_seed(0)
    model, x = make()
    model.eval()
    p, _ = _prune(model, x, types)
    small = cth.speedup_model(p, x)
    with pytest.raises(ModelError, match=match):
        small.save_pretrained(tmp_path)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------- MACs
class _Recurrent(nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0]


class _Matmul(nn.Module):
    def __init__(self, sdpa=False):
        super().__init__()
        self.q, self.sdpa = nn.Linear(8, 8), sdpa

    def forward(self, x):
        q = self.q(x)
        if self.sdpa:
            q = q.view(2, 5, 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q)
        return (q @ q.transpose(1, 2)).softmax(-1) @ q


class _MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.m(x, x, x)[0]


@pytest.mark.parametrize("model,x,macs", [
    # LSTM: T * 4 * H * (in + H) = 5 * 4 * 6 * (8 + 6)
    (_Recurrent(nn.LSTM(8, 6, batch_first=True)), torch.randn(2, 5, 8), 5 * 4 * 6 * (8 + 6)),
    # GRU, 2 layers, bidirectional, time-major: T * dirs * 3 * H * ((in or 2H) + H)
    (_Recurrent(nn.GRU(4, 3, num_layers=2, bidirectional=True)), torch.randn(7, 2, 4),
     7 * (2 * 3 * 3 * (4 + 3) + 2 * 3 * 3 * (6 + 3))),
    (_Recurrent(nn.RNN(4, 3, batch_first=True)), torch.randn(2, 6, 4), 6 * 3 * (4 + 3)),
    # Linear L*E*E, Q @ K^T L*L*E, attn @ V L*L*E
    (_Matmul(), torch.randn(2, 5, 8), 5 * 64 + 2 * 5 * 5 * 8),
    (_Matmul(sdpa=True), torch.randn(2, 5, 8), 5 * 64 + 2 * 5 * 5 * 8),
    # in-projections 3*L*E*E, out-projection L*E*E, two matmuls 2*L*S*E
    (_MHA(), torch.randn(2, 5, 8), 4 * 5 * 64 + 2 * 5 * 5 * 8),
], ids=["lstm", "gru", "rnn", "matmul", "sdpa", "mha"])
def test_macs_of_recurrent_layers_and_attention_matmuls(model, x, macs):
    assert count_flops_params(model.eval(), x)[0] == macs


def test_hf_attention_matmuls_are_counted_per_sample():
    model, x = _gpt2()
    macs = count_flops_params(model.eval(), x)[0]
    # GPT-2, 1 layer, T = 8, E = 32: c_attn 3E^2, c_proj E^2, MLP 8E^2 per token, lm_head E*V, attention 2*T*T*E
    assert macs == 8 * (3 * 32 * 32 + 32 * 32 + 8 * 32 * 32 + 32 * 50) + 2 * 8 * 8 * 32
