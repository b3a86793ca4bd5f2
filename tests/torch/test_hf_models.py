"""Hugging Face models under the compressors (issue 17): ONNX export with real inputs and any output
structure, tied weights, save_pretrained / from_pretrained, resize_token_embeddings, GPT-2's Conv1D in
canonical layout, and nn.MultiheadAttention's directly-read out_proj. Tiny configs, random weights."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError, ConfigWarning, ModelError
from compressor.torch import (
    DoReFaQuantizer,
    L1FilterPruner,
    LevelPruner,
    LsqQuantizer,
    QAT_Quantizer,
    speedup_model,
)
from compressor.torch.onnx_io import model_inputs, tensor_leaves

tr = pytest.importorskip("transformers")  # a test dependency of the torch env
from transformers.pytorch_utils import Conv1D  # noqa: E402


def gpt2():
    torch.manual_seed(0)
    cfg = tr.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    return tr.GPT2LMHeadModel(cfg).eval()


def bert():
    torch.manual_seed(0)
    cfg = tr.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=3)
    return tr.BertForSequenceClassification(cfg).eval()


def tokens(batch, seq, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def ort_run(path, feeds):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    dims = [list(i.shape) for i in session.get_inputs()]
    return session.run(None, {n: feeds[n].numpy() for n in names}), dict(zip(names, dims))


# ------------------------------------------------------------------------------------------ 1. outputs
def test_tensor_leaves_of_every_output_structure():
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    assert [id(t) for t in tensor_leaves(a)] == [id(a)]
    assert [id(t) for t in tensor_leaves((a, [b, None], {"x": c, "s": "text"}))] == [id(a), id(b), id(c)]
    out = BaseModelOutputWithPooling(last_hidden_state=a, pooler_output=None, hidden_states=(b, c))
    assert [id(t) for t in tensor_leaves(out)] == [id(a), id(b), id(c)]  # None fields are not outputs
    assert tensor_leaves(None) == [] and tensor_leaves(3) == []


def test_model_inputs_forms_and_errors():
    x = torch.ones(2, 3)
    assert model_inputs(x) == ((x,), {})
    assert model_inputs((x, x))[0] == (x, x)
    assert model_inputs({"input_ids": x}) == ((), {"input_ids": x})
    args, kwargs = model_inputs(None, (4, 5))
    assert args[0].shape == (4, 5) and kwargs == {}
    with pytest.raises(ConfigError, match="dummy_input"):
        model_inputs(3)
    with pytest.raises(ConfigError, match="input_shape"):
        model_inputs()


def test_pruned_hf_resnet_exports_onnx_from_input_shape(tmp_path):
    torch.manual_seed(0)
    cfg = tr.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    model = tr.ResNetForImageClassification(cfg).eval()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    pruner.compress()
    # the output is an ImageClassifierOutputWithNoAttention, not a tensor
    quiet(pruner.export_model, tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx", input_shape=(1, 3, 32, 32))
    x = torch.randn(3, 3, 32, 32)
    (got,), dims = ort_run(tmp_path / "m.onnx", {"pixel_values": x})
    assert dims == {"pixel_values": ["batch", 3, 32, 32]}
    with torch.no_grad():
        want = model(pixel_values=x).logits
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ 2. real inputs
@pytest.mark.parametrize("make", [bert, gpt2], ids=["bert", "gpt2"])
def test_pruned_token_model_onnx_has_dynamic_batch_and_sequence(make, tmp_path):
    model = make()
    pruner = quiet(LevelPruner, model, [{"sparsity": 0.5, "op_types": ["default"]}])
    pruner.compress()
    use_cache = getattr(model.config, "use_cache", None)
    quiet(pruner.export_model, tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx", dummy_input=tokens(2, 7))
    assert getattr(model.config, "use_cache", None) == use_cache  # the export runs without the kv cache only
    other = tokens(3, 11, seed=2)  # another batch and sequence length
    outs, dims = ort_run(tmp_path / "m.onnx", other)
    assert dims == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
    assert len(outs) == 1
    torch.testing.assert_close(torch.from_numpy(outs[0]), logits(model, other), rtol=1e-4, atol=1e-5)


def test_quantizer_export_takes_a_dict_dummy_input(tmp_path):
    model = bert()
    q = DoReFaQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": ["default"]}])
    q.compress()
    quiet(q.export_model, tmp_path / "q.pt", onnx_path=tmp_path / "q.onnx", dummy_input=tokens(2, 7))
    other = tokens(1, 5, seed=3)
    (got,), dims = ort_run(tmp_path / "q.onnx", other)
    assert dims["input_ids"] == ["batch", "sequence"]  # weights as quantized constants: dynamic axes
    torch.testing.assert_close(torch.from_numpy(got), logits(model, other), rtol=1e-4, atol=1e-5)


class Noisy(nn.Module):
    """Its output is random: the ONNX check cannot pass."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) + torch.rand_like(self.fc(x))


def test_failed_onnx_check_leaves_no_file(tmp_path):
    model = Noisy()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    pruner.compress()
    with pytest.raises(RuntimeError, match="ONNX export check failed"):
        quiet(pruner.export_model, tmp_path / "m.pt", tmp_path / "mask.pt", onnx_path=tmp_path / "m.onnx",
              dummy_input=torch.randn(2, 4))
    assert os.listdir(tmp_path) == []  # no model, mask, ONNX or temporary file
    with pytest.raises(ConfigError, match="dummy_input must be"):
        pruner.export_model(tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx", dummy_input="x")
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------ 3. tied weights
def test_default_leaves_the_tied_lm_head_alone_and_export_reloads_exactly(tmp_path):
    model = gpt2()
    wte = model.transformer.wte.weight.detach().clone()
    with pytest.warns(ConfigWarning, match=r"'lm_head': its weight is the same Parameter as \['transformer.wte.weight'\]"):
        q = DoReFaQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}])
    q.compress()
    names = [layer.name for layer, _ in q.get_modules_to_compress()]
    assert "lm_head" not in names and len(names) == 4 and q.tied_weights == {}
    x = tokens(2, 7)
    want = logits(model, x)
    q.export_model(tmp_path / "q.pt")
    fresh = gpt2()
    fresh.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    assert torch.equal(fresh.transformer.wte.weight, wte)  # the embedding is not quantized
    assert torch.equal(logits(fresh, x), want)  # was 6.16 apart: lm_head quantized, wte float


def test_tied_weight_selected_everywhere_is_quantized_once_for_both_users(tmp_path):
    model = gpt2()
    config = [{"quant_types": ["weight"], "quant_bits": 8, "op_names": ["transformer.wte", "lm_head"]}]
    with pytest.warns(ConfigWarning, match="compressed once"):
        q = DoReFaQuantizer(model, config)
    q.compress()
    assert q.tied_weights == {"transformer.wte.weight": ["transformer.wte.weight", "lm_head.weight"]}
    x = tokens(2, 7)
    want = logits(model, x)
    q.export_model(tmp_path / "q.pt")
    state = torch.load(tmp_path / "q.pt", weights_only=True)
    assert torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])
    assert not torch.equal(state["lm_head.weight"], gpt2().lm_head.weight)
    fresh = gpt2()
    fresh.load_state_dict(state)
    assert torch.equal(logits(fresh, x), want)


def test_tied_weight_pruned_once_through_its_first_user(tmp_path):
    model = gpt2()
    with pytest.warns(ConfigWarning, match="compressed once"):
        p = LevelPruner(model, [{"sparsity": 0.5, "op_names": ["transformer.wte", "lm_head"]}])
    p.compress()
    assert [layer.name for layer, _ in p.get_modules_to_compress()] == ["transformer.wte"]
    assert model.lm_head.weight is model.transformer.wte.module.weight  # still one Parameter
    assert int((model.lm_head.weight == 0).sum()) == 50 * 32 // 2
    x = tokens(2, 7)
    p.export_model(tmp_path / "p.pt")
    fresh = gpt2()
    fresh.load_state_dict(torch.load(tmp_path / "p.pt", weights_only=True))
    assert torch.equal(logits(fresh, x), logits(model, x))


def test_tied_weight_named_without_its_other_user_is_refused():
    model = gpt2()
    with pytest.raises(ConfigError, match=r"'lm_head' is selected by name.*\['transformer.wte'\]"):
        LevelPruner(model, [{"sparsity": 0.5, "op_names": ["lm_head"]}])
    with pytest.raises(ConfigError, match="different config entries"):
        LevelPruner(model, [{"sparsity": 0.5, "op_names": ["lm_head"]}, {"sparsity": 0.3, "op_names": ["transformer.wte"]}])
    with pytest.raises(ConfigError, match="learns parameters per layer"):
        quiet(LsqQuantizer, model, [{"quant_types": ["weight"], "quant_bits": 8,
                                     "op_names": ["transformer.wte", "lm_head"]}])
    assert type(model.lm_head) is nn.Linear and type(model.transformer.wte) is nn.Embedding  # untouched


# ------------------------------------------------------------------------------------------ 4. save_pretrained
def test_save_pretrained_of_a_pruned_and_quantized_bert_reloads_equal(tmp_path):
    model = bert()
    LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}]).compress()
    QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}]).compress()
    model.eval()
    x = tokens(2, 7)
    want = logits(model, x)
    quiet(model.save_pretrained, tmp_path)
    reloaded = quiet(tr.BertForSequenceClassification.from_pretrained, tmp_path).eval()
    assert torch.equal(logits(reloaded, x), want)
    assert not any("module" in k or "mask" in k or "scale" in k for k in reloaded.state_dict())
    assert "weight_mask" in "".join(model.state_dict())  # the live model keeps its wrappers
    dense = reloaded.bert.encoder.layer[0].intermediate.dense.weight
    assert int((dense == 0).sum()) == 32 * 16 // 2


def test_save_pretrained_keeps_a_pruned_tie_and_warns_about_activation_quantization(tmp_path):
    model = gpt2()
    quiet(LevelPruner, model, [{"sparsity": 0.5, "op_names": ["transformer.wte", "lm_head"]}]).compress()
    x = tokens(2, 7)
    want = logits(model, x)
    quiet(model.save_pretrained, tmp_path / "p")
    reloaded = quiet(tr.GPT2LMHeadModel.from_pretrained, tmp_path / "p").eval()
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    assert torch.equal(logits(reloaded, x), want)

    other = bert()
    QAT_Quantizer(other, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["default"]}]).compress()
    with pytest.warns(UserWarning, match="input/output quantization"):
        other.save_pretrained(tmp_path / "q")


def test_resize_token_embeddings_works_unless_the_embedding_is_compressed():
    model = gpt2()
    quiet(LevelPruner, model, [{"sparsity": 0.5, "op_types": ["default"]}]).compress()  # lm_head left out (tie)
    x = tokens(2, 7)
    want = logits(model, x)
    quiet(model.resize_token_embeddings, 60)
    assert model.lm_head.weight.shape == (60, 32) and model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(logits(model, x)[..., :50], want)

    tied = gpt2()
    quiet(LevelPruner, tied, [{"sparsity": 0.5, "op_names": ["transformer.wte", "lm_head"]}]).compress()
    with pytest.raises(ModelError, match=r"resize_token_embeddings: \['transformer.wte'\] are compressed"):
        tied.resize_token_embeddings(60)
    assert tied.lm_head.weight.shape == (50, 32)


# ------------------------------------------------------------------------------------------ 5. HF Conv1D
class Pair(nn.Module):
    """Two projections, as HF Conv1D ([in, out] weights) or as the equivalent nn.Linear."""

    def __init__(self, linear: bool):
        super().__init__()
        self.a = nn.Linear(8, 12) if linear else Conv1D(12, 8)
        self.b = nn.Linear(12, 4) if linear else Conv1D(4, 12)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def conv1d_and_linear():
    torch.manual_seed(0)
    conv, lin = Pair(False), Pair(True)
    with torch.no_grad():
        for n in ("a", "b"):
            getattr(lin, n).weight.copy_(getattr(conv, n).weight.t())
            getattr(lin, n).bias.copy_(getattr(conv, n).bias)
    return conv, lin


def test_conv1d_per_channel_scales_are_on_output_features():
    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(96, 32))  # 32 -> 96
    cfg = [{"quant_types": ["weight", "input", "output"], "quant_bits": 8, "op_types": ["default"],
            "quant_scheme": "per_channel_symmetric"}]
    q = QAT_Quantizer(model, cfg)
    q.compress()
    model(torch.randn(4, 5, 32))
    w = q.get_modules_wrapper()[0]
    assert w.weight_scale.shape == (96,) and w.input_scale.shape == (32,) and w.output_scale.shape == (96,)
    lin = nn.Sequential(nn.Linear(32, 96))
    with torch.no_grad():
        lin[0].weight.copy_(model[0].module.weight.t())
        lin[0].bias.copy_(model[0].module.bias)
    q2 = QAT_Quantizer(lin, cfg)
    q2.compress()
    lin(torch.randn(4, 5, 32))
    assert torch.equal(w.weight_scale, q2.get_modules_wrapper()[0].weight_scale)


@pytest.mark.parametrize("pruner, config", [
    (L1FilterPruner, {"sparsity": 0.5, "op_types": ["Conv1D", "Linear"], "op_names": ["a"]}),
    (LevelPruner, {"sparsity": 0.3, "op_types": ["Conv1D", "Linear"]}),
], ids=["filters", "level"])
def test_conv1d_masks_are_the_transposed_linear_masks(pruner, config):
    conv, lin = conv1d_and_linear()
    quiet(pruner, conv, [config]).compress()  # (one of the two op_types matches nothing in each model)
    quiet(pruner, lin, [config]).compress()
    for n in ("a", "b") if pruner is LevelPruner else ("a",):
        assert torch.equal(getattr(conv, n).weight_mask, getattr(lin, n).weight_mask.t())
    if pruner is L1FilterPruner:  # 6 of 12 output features (columns of the [8, 12] weight) pruned
        assert conv.a.weight_mask.shape == (8, 12) and int(conv.a.weight_mask.all(0).sum()) == 6
        assert torch.equal(conv.a.bias_mask, conv.a.weight_mask.all(0))


def test_conv1d_neurons_pruned_and_sped_up():
    conv, _ = conv1d_and_linear()
    x = torch.randn(3, 5, 8)
    p = L1FilterPruner(conv, [{"sparsity": 0.5, "op_types": ["Conv1D"], "op_names": ["a"]}],
                       dependency_aware=True, dummy_input=x)
    p.compress()
    with torch.no_grad():
        want = conv(x)
    small = speedup_model(p, x)
    assert type(small.a) is Conv1D and small.a.weight.shape == (8, 6) and small.b.weight.shape == (6, 4)
    with torch.no_grad():
        torch.testing.assert_close(small(x), want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ 6. MHA out_proj
class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.att(x, x, x)[0]


def test_multihead_attention_out_proj_quantizer_is_refused_pruner_works():
    torch.manual_seed(0)
    model = Attention().eval()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match=r"'att.out_proj' cannot be quantized on its own: MultiheadAttention "
                                          r"reads.*op_names \['att'\]"):
        QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 2, "op_names": ["att.out_proj"]}])
    assert type(model.att.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        dense = model(x)
    pruned = copy.deepcopy(model)
    LevelPruner(pruned, [{"sparsity": 0.5, "op_names": ["att.out_proj"]}]).compress()  # masks in place: seen
    assert int((pruned.att.out_proj.weight == 0).sum()) == 32
    with torch.no_grad():
        assert not torch.equal(pruned(x), dense)
    # the advice of the error: quantize the attention module itself (out_proj included)
    q = quiet(QAT_Quantizer, model, [{"quant_types": ["weight"], "quant_bits": 2, "op_names": ["att"]}])
    q.compress()
    assert "att.out_proj" in [layer.name for layer, _ in q.get_modules_to_compress()]
    model.eval()
    with torch.no_grad():
        assert not torch.equal(model(x), dense)


def test_save_pretrained_failing_half_way_keeps_the_old_checkpoint_loadable(tmp_path, monkeypatch):
    import errno

    import transformers.modeling_utils as mu

    model = bert()
    quiet(LevelPruner, model, [{"sparsity": 0.5, "op_types": ["default"]}]).compress()
    x = tokens(2, 7)
    old = logits(model, x)
    folder = tmp_path / "ckpt"
    quiet(model.save_pretrained, folder)
    (folder / "tokenizer.json").write_text("{}")  # saved beside it by the user: kept by every save
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with torch.no_grad():
        model.classifier.bias.add_(1.0)  # the next save differs
    real_save = mu.safe_save_file

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a safetensors file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mu, "safe_save_file", full_disk)
    with pytest.raises(OSError) as info:
        quiet(model.save_pretrained, folder)
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, str(folder))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # byte-identical, nothing added
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left
    reloaded = quiet(tr.BertForSequenceClassification.from_pretrained, folder).eval()
    assert torch.equal(logits(reloaded, x), old)
    monkeypatch.setattr(mu, "safe_save_file", real_save)
    quiet(model.save_pretrained, folder)
    assert (folder / "tokenizer.json").read_text() == "{}"
    reloaded = quiet(tr.BertForSequenceClassification.from_pretrained, folder).eval()
    assert torch.equal(logits(reloaded, x), logits(model, x)) and not torch.equal(logits(reloaded, x), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        quiet(model.save_pretrained, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"
