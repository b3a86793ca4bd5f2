"""Issue 43 (item 10): AWQ export_model(hf_path=...) on Gemma-2, Gemma-3 (text) and BERT writes a checkpoint with a
quantization_config that transformers reloads to the in-memory logits. Gemma's RMSNorm scales by ``1 + weight``
(its fold is ``(1 + w) / s - 1``); BERT's LayerNorm outputs are also the residual (no fold there: those layers are
written float, said with that reason in one warning)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from compressor.torch import AwqQuantizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::FutureWarning")]

V = 64


def _build(family):
    t = transformers
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "gemma2":
            return t.Gemma2ForCausalLM(t.Gemma2Config(**common, num_key_value_heads=2, head_dim=8,
                                                      sliding_window=16)).eval()
        if family == "gemma3":
            return t.Gemma3ForCausalLM(t.Gemma3TextConfig(**common, num_key_value_heads=2, head_dim=8,
                                                          sliding_window=16)).eval()
        return t.BertForMaskedLM(t.BertConfig(**common)).eval()


#: per family: layers that must be packed (in the first block), and the reason named for those left float
PACKED = {
    "gemma2": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj"],
    "gemma3": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj"],
    "bert": ["attention.output.dense"],
}
PREFIX = {"gemma2": "model.layers.0.", "gemma3": "model.layers.0.", "bert": "bert.encoder.layer.0."}


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "bert"])
def test_awq_checkpoint_has_quantization_config_and_reloads(family, tmp_path):
    model = _build(family)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = AwqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
        q.calibrate([torch.randint(0, V, (4, 16), generator=g) for _ in range(2)])
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        q.export_model(None, hf_path=str(tmp_path / "ck"))
    notes = [str(r.message) for r in rec if "hf_path" in str(r.message)]
    assert len(notes) <= 1  # what is float, and why, in one warning
    with open(os.path.join(tmp_path / "ck", "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    assert qc is not None
    targets = {t for group in qc["config_groups"].values() for t in group["targets"]}
    assert {PREFIX[family] + n for n in PACKED[family]} <= targets
    if notes:
        assert "so none is used" not in notes[0]  # the folds held: no fallback to an all-float checkpoint
    if family == "bert":  # the real reason for q / k / v, not a generic one
        assert "'bert.embeddings.LayerNorm') is also read outside its layers (a residual add)" in notes[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
        again = auto.from_pretrained(tmp_path / "ck").eval()
    with torch.no_grad():
        got = again(input_ids=ids).logits
    # float32 rounding of the folds and of (code - zp) * scale in another order (measured: ~2e-7 abs, 6e-7 of
    # the largest logit)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
