"""The Keras 3 port of HF ``LlamaForCausalLM`` (examples/llm_keras.py, issue 25): the same weights give the same
logits and perplexity as the HF model, the state dict round-trips, and SparseGPT on the port finds the decoder
blocks and chooses the masks torch's SparseGPT chooses on the HF model.

Tiny config (width 32, 2 layers, 4 heads over 2 key/value heads, FFN 64, vocabulary 64). HF's initialisation
(std 0.02) gives logits of about 0.3, too small for a 1e-4 comparison to mean anything, so the weights are
redrawn at unit scale (projections ``N(0, 1 / fan_in)``, embeddings ``N(0, 1)``, norm gains ``1 + N(0, 0.04)``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
keras = pytest.importorskip("keras")
transformers = pytest.importorskip("transformers")

import compressor.tf as ctf  # noqa: E402
import compressor.torch as cth  # noqa: E402
from examples.llm_keras import build_keras_llama, keras_state_dict, load_hf_weights, perplexity_keras  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.tf, pytest.mark.filterwarnings("ignore:.*leaves out weighted layers")]

CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
          "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
IDS = np.random.default_rng(0).integers(0, 64, (2, 16))
WINDOWS = np.random.default_rng(1).integers(0, 64, (8, 17))
CALIB = np.random.default_rng(2).integers(0, 64, (16, 16))


def hf_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CONFIG)
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / (1.0 if "embed" in name else p.shape[1] ** 0.5))
            else:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def twins():
    tm = hf_llama()
    sd = {k: v.detach().numpy().copy() for k, v in tm.state_dict().items()}
    km = load_hf_weights(build_keras_llama(CONFIG), sd)
    return tm, km, sd


def hf_logits(tm, ids):
    with torch.no_grad():
        return tm(input_ids=torch.from_numpy(ids)).logits.numpy()


def torch_perplexity(model, windows, batch=32):
    """What examples/llm_common.perplexity_torch computes: exp(mean float64 cross entropy) of every next token."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(windows[i:i + batch])
            logits = model(input_ids=x[:, :-1]).logits.double()
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                             x[:, 1:].reshape(-1), reduction="sum"))
            count += x[:, 1:].numel()
    return math.exp(total / count)


def test_logits_state_dict_and_perplexity_match_hf():
    tm, km, sd = twins()
    ref = hf_logits(tm, IDS)
    got = np.asarray(km(IDS))
    assert got.shape == (2, 16, 64) and got.dtype == np.float32
    assert np.abs(ref).max() > 2.0  # the comparison below is not vacuous
    assert np.abs(got - ref).max() < 1e-4
    # the last position attends to all 16 tokens; changing a later token leaves earlier logits alone (causal)
    later = IDS.copy()
    later[:, 10:] = (later[:, 10:] + 1) % 64
    np.testing.assert_array_equal(np.asarray(km(later))[:, :10], got[:, :10])
    back = keras_state_dict(km)
    assert sorted(back) == sorted(sd) and len(back) == 2 + 2 * 9 + 1
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k], err_msg=k)
    ppl_t, ppl_k = torch_perplexity(tm, WINDOWS), perplexity_keras(km, WINDOWS)
    assert 10 < ppl_t < 1000
    assert abs(ppl_t - ppl_k) < 1e-5


def test_bad_config_and_state_dict_are_refused_before_anything_changes():
    with pytest.raises(ValueError, match=r"tie_word_embeddings=True is not ported"):
        build_keras_llama({**CONFIG, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match=r"unknown keys \['hiden_size'\]"):
        build_keras_llama({**CONFIG, "hiden_size": 32})
    tm, km, sd = twins()
    before = keras_state_dict(km)
    bad = {k: (np.zeros_like(v) if "layers.0" in k else v) for k, v in sd.items() if k != "model.norm.weight"}
    bad["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"].T
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\].*model.layers.1.mlp.up_proj.weight: "
                                         r"\(32, 64\), expected \(64, 32\)"):
        load_hf_weights(km, bad)
    after = keras_state_dict(km)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_sparsegpt_on_the_port_chooses_torchs_masks():
    tm, km, _ = twins()
    cfg = [{"sparsity": 0.5, "op_types": ["default"]}]
    pt = cth.SparseGPTPruner(tm, cfg)
    pt.calibrate([torch.from_numpy(CALIB[i:i + 8]) for i in range(0, len(CALIB), 8)], progress=False, forward_dtype="float64")
    pk = ctf.SparseGPTPruner(km, cfg)
    pk.calibrate(CALIB, progress=False, forward_dtype="float64")
    assert pk.blocks == ["layers_0", "layers_1"]
    assert pk.excluded == ["lm_head"]
    assert sorted(w.name for w in pk.get_modules_wrapper()) == sorted(
        f"layers_{i}/{p.replace('.', '/')}" for i in range(2) for p in PROJ)
    t_sd = {k.replace(".module.", "."): v.detach().numpy() for k, v in tm.state_dict().items() if "mask" not in k}
    k_sd = keras_state_dict(km)
    np.testing.assert_array_equal(k_sd["lm_head.weight"], t_sd["lm_head.weight"])
    differ = total = 0
    for i in range(2):
        for p in PROJ:
            key = f"model.layers.{i}.{p}.weight"
            t, k = t_sd[key], k_sd[key]
            assert np.mean(k == 0) == 0.5, key
            if i == 0:  # block 0 sees the same inputs on both backends: the very same masks
                np.testing.assert_array_equal(t == 0, k == 0, err_msg=key)
                np.testing.assert_allclose(k, t, rtol=0, atol=1e-6, err_msg=key)
            else:
                differ += int(np.sum((t == 0) != (k == 0)))
                total += t.size
    # block 1 sees each framework's float32 forward of the pruned block 0 (measured: 0 of 9216 entries differ)
    assert total == 9216 and differ <= 0.005 * total
    assert np.abs(np.asarray(km(IDS)) - hf_logits(tm, IDS)).max() < 1e-4
