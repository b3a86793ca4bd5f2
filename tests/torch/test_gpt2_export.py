"""GPT-2's ``Conv1D`` layers in a compressed-tensors checkpoint (issue 43 item 4): transformers cannot reload them
packed (compressed-tensors quantizes nn.Linear / nn.Embedding modules only), so the export writes their compressed
values as float weights, says so once naming every such layer and why, and the checkpoint reloads with the
compressed model's logits through transformers and through our own reader."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from compressor.core.compressed_tensors import load_compressed_tensors, read_safetensors
from compressor.torch import GptqQuantizer, SparseGPTPruner
from compressor.torch.hf_checkpoint import CONV1D_REASON
from compressor.torch.quantization.lowbit import oneshot_codes

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB = 64
CONV1D = [f"transformer.h.{i}.{n}" for i in range(2) for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
CALIB = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))


def _gpt2():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg).eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _rel(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("method", ["gptq", "sparsegpt"])
def test_conv1d_layers_are_written_float_with_one_warning_and_reload_exactly(tmp_path, method):
    model = _gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "gptq":
            c = GptqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
        else:
            c = SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
        c.calibrate(CALIB, progress=False)
    assert sorted(w.name for w in c.get_modules_wrapper()) == sorted(CONV1D)
    ref = _logits(model)
    out = tmp_path / "ckpt"
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c.export_model(None, hf_path=str(out))
    said = [str(w.message) for w in got if "export_model(hf_path" in str(w.message)]
    if method == "gptq":
        assert len(said) == 1 and said[0].count(CONV1D_REASON) == 1
        assert all(f"{n!r} (Conv1D: not a Linear" in said[0] for n in CONV1D)
    else:
        assert said == []  # pruned float layers are float in any case (sparse_format 'dense')
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    stored = read_safetensors(out / "model.safetensors")
    for name in CONV1D:  # the compressed values, in Conv1D's own [in, out] layout
        wrapper = dict(model.named_modules())[name]
        assert stored[f"{name}.weight"].shape == tuple(wrapper.weight.shape)
        torch.testing.assert_close(torch.from_numpy(stored[f"{name}.weight"]), wrapper.weight.detach(), rtol=0, atol=0)
        if method == "gptq":  # and those are the codes times the scales
            codes = oneshot_codes(wrapper).double()
            deq = codes * wrapper.weight_group_scale.double()[:, torch.arange(codes.shape[1]) // 16]
            torch.testing.assert_close(deq.t(), wrapper.weight.double(), rtol=1e-6, atol=1e-7)
        else:
            assert int((wrapper.weight == 0).sum()) == wrapper.weight.numel() // 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert _rel(_logits(reloaded), ref) < 1e-5
    plain = _gpt2()  # our reader
    missing = plain.load_state_dict({k: torch.from_numpy(v) for k, v in load_compressed_tensors(out).items()},
                                    strict=False).missing_keys
    assert missing in ([], ["lm_head.weight"])
    plain.tie_weights()
    assert _rel(_logits(plain), ref) < 1e-5


def test_compressed_tensors_gives_conv1d_no_quantization_scheme():
    """The fact the float export rests on: applying a config that targets GPT-2's Conv1D layers by name gives them
    no scheme (so transformers would not read their packed tensors), while a Linear named beside them gets one. If
    a compressed-tensors release quantizes Conv1D, this fails and the export can pack them."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    model = _gpt2()
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}
    config = QuantizationConfig(config_groups={"group_0": {"targets": [*CONV1D, "lm_head"], "weights": weights}},
                                quantization_status="frozen")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_quantization_config(model, config)
    modules = dict(model.named_modules())
    assert getattr(modules["lm_head"], "quantization_scheme", None) is not None
    assert all(getattr(modules[n], "quantization_scheme", None) is None for n in CONV1D)
