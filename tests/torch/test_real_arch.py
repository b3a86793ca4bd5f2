"""Real architectures under the compressors (issue 16): Hugging Face ResNet, MobileNetV2, ViT, BERT and
GPT-2 from tiny configs (random weights, no downloads) and a torch LSTM + attention text model. Per
architecture a pruner and a quantizer, with ``'default'`` and with the embedding / recurrent /
attention types: one training step, export, reload into a FRESH instance of the model class, same
outputs. Also: what ``'default'`` says it leaves out."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from compressor.core.matching import DefaultSkipWarning
from compressor.torch import LevelPruner, QAT_Quantizer

tr = pytest.importorskip("transformers")  # a test dependency of the torch env

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' config notes


def hf_resnet():
    return tr.ResNetForImageClassification(tr.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3))


def hf_mobilenet_v2():
    return tr.MobileNetV2ForImageClassification(tr.MobileNetV2Config(
        num_channels=3, image_size=32, depth_multiplier=0.25, min_depth=4, num_labels=3))


def hf_vit():
    return tr.ViTForImageClassification(tr.ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=3))


def hf_bert():
    return tr.BertForSequenceClassification(tr.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3))


def hf_gpt2():
    return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                            bos_token_id=0, eos_token_id=0))


class LstmAttention(nn.Module):
    """Embedding -> bidirectional LSTM -> self-attention -> GRU -> classifier."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 8, bidirectional=True, batch_first=True)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.gru = nn.GRU(16, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, input_ids):
        h, _ = self.lstm(self.emb(input_ids))
        h, _ = self.attn(h, h, h, need_weights=False)
        h, _ = self.gru(h)
        return self.fc(h[:, -1])


def images(size):
    return {"pixel_values": torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))}


def token_ids():
    return {"input_ids": torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))}


ARCHS = {
    "resnet": (hf_resnet, lambda: images(32)),
    "mobilenet_v2": (hf_mobilenet_v2, lambda: images(32)),
    "vit": (hf_vit, lambda: images(16)),
    "bert": (hf_bert, token_ids),
    "gpt2": (hf_gpt2, token_ids),
    "lstm_attention": (LstmAttention, token_ids),
}
EXTRA = {"bert": ["Embedding"], "gpt2": ["Embedding"], "lstm_attention": ["Embedding", "LSTM", "GRU", "MultiheadAttention"]}
CASES = [(arch, kind, extra) for arch in ARCHS for kind in ("pruner", "quantizer")
         for extra in ((False, True) if arch in EXTRA else (False,))]


def build(arch, seed):
    torch.manual_seed(seed)
    return ARCHS[arch][0]()


def logits(model, inputs):
    out = model(**inputs)
    return out if torch.is_tensor(out) else out.logits


@pytest.mark.parametrize("arch, kind, extra", CASES,
                         ids=[f"{a}-{k}-{'extra' if e else 'default'}" for a, k, e in CASES])
def test_train_export_reload(arch, kind, extra, tmp_path):
    types = ["default", *EXTRA.get(arch, [])] if extra else ["default"]
    model = build(arch, 0)
    inputs = ARCHS[arch][1]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DefaultSkipWarning)
        if kind == "pruner":
            comp = LevelPruner(model, [{"sparsity": 0.5, "op_types": types}], opt)
        else:
            comp = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": types}], opt)
    comp.compress()
    wrapped = {w.type for w in comp.get_modules_wrapper()}
    if extra:
        assert set(EXTRA[arch]) <= wrapped  # the extra types really are compressed
    model.train()
    opt.zero_grad()
    logits(model, inputs).float().pow(2).mean().backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        expected = logits(model, inputs)
    assert torch.isfinite(expected).all()
    if kind == "pruner":
        for w in comp.get_modules_wrapper():  # exact per matrix, held through the step
            n = w.weight.numel()
            assert int((~w.weight_mask).sum()) == math.floor(n * 0.5), w.name
            assert not w.weight.detach()[~w.weight_mask].any(), w.name
    comp.export_model(str(tmp_path / "model.pt"))
    fresh = build(arch, 1).eval()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    with torch.no_grad():
        torch.testing.assert_close(logits(fresh, inputs), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch, expected", [("resnet", None), ("vit", None), ("bert", "Embedding"),
                                            ("gpt2", "Embedding"), ("lstm_attention", "LSTM")])
def test_default_names_what_it_leaves_out(arch, expected):
    model = build(arch, 0)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    notes = [str(w.message) for w in rec if issubclass(w.category, DefaultSkipWarning)]
    if expected is None:
        assert notes == []  # convolutions, linears and norms only: nothing to say
    else:
        assert len(notes) == 1 and f"{expected} (" in notes[0]
