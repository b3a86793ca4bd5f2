"""Fused routed experts (transformers 5's ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I]) in
the compressed-tensors export: packed / sparse per expert in transformers' own on-disk layout (what save_pretrained
writes: Mixtral ``block_sparse_moe.experts.E.w1/w2/w3``, Qwen2-MoE ``mlp.experts.E.gate_proj/up_proj/down_proj``),
which ``from_pretrained`` dequantizes and merges back into the fused parameters; and the streamed run reading a
checkpoint in that layout (compressor/torch/sequential/expert_banks.py ``checkpoint_layout``, hf_checkpoint.py
``_expert_plan``, hf_stream.py)."""

from __future__ import annotations

import glob
import json
import os
import warnings

import numpy as np
import pytest
import torch

from compressor.core.compressed_tensors import load_compressed_tensors, read_safetensors, write_safetensors
from compressor.torch import GptqQuantizer, SparseGPTPruner
from compressor.torch.sequential.expert_banks import checkpoint_layout, fuse_pieces

pytestmark = [pytest.mark.torch]
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

H, INTER, E, VOCAB = 32, 48, 4, 64


def mixtral(seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_local_experts=E, num_experts_per_tok=2)).eval()


def qwen2_moe(seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, moe_intermediate_size=16,
            shared_expert_intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, num_experts=E, num_experts_per_tok=2)).eval()


FAMILIES = {"mixtral": (mixtral, "model.layers.{l}.block_sparse_moe.experts.{e}.w1"),
            "qwen2_moe": (qwen2_moe, "model.layers.{l}.mlp.experts.{e}.gate_proj")}
GPTQ = {"quant_bits": 4, "group_size": 16}


def ids(n=4, seed=0):
    return torch.randint(0, VOCAB, (n, 16), generator=torch.Generator().manual_seed(seed))


def compress(cls, model, cfg, data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = cls(model, [{**cfg, "op_types": ["default"]}])
        c.calibrate([data], progress=False)
    return c


def export(c, path, **kw):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c.export_model(None, hf_path=str(path), **kw)
    return [str(w.message) for w in got if "written as float weights" in str(w.message)]


def reload(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def rel(a, b):
    return float((a - b).norm() / b.norm())


def tensors(folder):
    out = {}
    for f in sorted(glob.glob(os.path.join(str(folder), "*.safetensors"))):
        out.update({k: np.array(v) for k, v in read_safetensors(f).items()})
    return out


def fused_params(model):
    return {k: v.detach() for k, v in model.state_dict().items() if ".experts." in k and k.endswith("_proj")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gptq_experts_are_packed_per_expert_and_reload_with_the_in_memory_logits(tmp_path, family):
    build, piece = FAMILIES[family]
    model, data = build(), ids()
    c = compress(GptqQuantizer, model, GPTQ, data)
    ref = logits(model, data)
    notes = export(c, tmp_path / "ck")
    assert not any("routed experts" in n for n in notes), notes
    stored = tensors(tmp_path / "ck")
    assert not any(k.endswith(("gate_up_proj", "down_proj")) and ".experts." in k for k in stored)
    for layer in range(2):
        for e in range(E):
            name = piece.format(l=layer, e=e)
            assert stored[f"{name}.weight_packed"].dtype == np.int32 and f"{name}.weight" not in stored
            assert tuple(stored[f"{name}.weight_shape"]) == (16 if family == "qwen2_moe" else INTER, H)
    qc = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]
    groups = [g for g in qc["config_groups"].values() if any("experts" in t for t in g["targets"])]
    assert len(groups) == 1 and all(t.startswith("re:") for t in groups[0]["targets"])
    assert groups[0]["weights"]["group_size"] == 16 and groups[0]["weights"]["num_bits"] == 4
    # transformers dequantizes each expert's pieces and merges them into the fused parameters
    back = reload(tmp_path / "ck")
    assert rel(logits(back, data), ref) <= 1e-5
    want = fused_params(model)
    for k, v in fused_params(back).items():
        torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-7)  # float32 rounding of code * scale
    # our reader decodes the same pieces; stacked back they are the in-memory parameters
    decoded = fuse_pieces(load_compressed_tensors(str(tmp_path / "ck")), checkpoint_layout(model)[0])
    for k, v in want.items():
        np.testing.assert_allclose(decoded[k], v.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sparsegpt_experts_dense_reload_exactly_and_bitmask_round_trips_in_our_reader(tmp_path, family):
    build, piece = FAMILIES[family]
    model, data = build(), ids()
    c = compress(SparseGPTPruner, model, {"sparsity": 0.5}, data)
    ref, want = logits(model, data), fused_params(model)
    assert not export(c, tmp_path / "dense")  # pruned experts, like pruned Linear layers, are plain floats
    back = reload(tmp_path / "dense")
    assert rel(logits(back, data), ref) <= 1e-5
    for k, v in fused_params(back).items():
        assert torch.equal(v, want[k]), k
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c.export_model(None, hf_path=str(tmp_path / "bitmask"), hf_sparse_format="bitmask")
    stored = tensors(tmp_path / "bitmask")
    name = piece.format(l=1, e=2)
    assert {f"{name}.bitmask", f"{name}.compressed", f"{name}.shape"} <= set(stored)
    sc = json.loads((tmp_path / "bitmask" / "config.json").read_text())["quantization_config"]["sparsity_config"]
    assert sc["format"] == "sparse-bitmask" and name in sc["targets"]
    decoded = fuse_pieces(load_compressed_tensors(str(tmp_path / "bitmask")), checkpoint_layout(model)[0])
    for k, v in want.items():
        assert np.array_equal(decoded[k], v.numpy()), k


def test_asymmetric_experts_stay_dense_with_the_reason_and_still_reload(tmp_path):
    model, data = mixtral(), ids()
    c = compress(GptqQuantizer, model, {**GPTQ, "quant_scheme": "affine"}, data)
    ref = logits(model, data)
    notes = export(c, tmp_path / "ck")
    assert len(notes) == 1 and "model.layers.0.mlp.experts.{down_proj,gate_up_proj} (fused 3-D routed experts, " \
        "4 slices quantized each: asymmetric codes" in notes[0]
    stored = tensors(tmp_path / "ck")
    assert "model.layers.1.mlp.experts.gate_up_proj" in stored
    assert not any(k.endswith("weight_packed") and ".experts." in k for k in stored)
    assert rel(logits(reload(tmp_path / "ck"), data), ref) <= 1e-5


def test_pinned_transformers_drops_float_per_expert_pieces_in_a_quantized_checkpoint(tmp_path):
    """Why float experts of a checkpoint with a quantization_config keep their fused names: transformers (5.24 with
    compressed-tensors 0.20) runs its dequantizing merge on every per-expert converter of such a checkpoint, and
    float ``.weight`` pieces come out of it empty (a loading error). Should a later version load them, they could be
    written per expert too: this test then fails and says so."""
    model, data = mixtral(), ids()
    c = compress(GptqQuantizer, model, GPTQ, data)
    export(c, tmp_path / "ck")
    stored = tensors(tmp_path / "ck")
    layout = checkpoint_layout(model)[0]
    for p in layout["model.layers.1.mlp.experts.down_proj"]:  # one parameter's pieces as float weights
        for leaf in ("weight_packed", "weight_scale", "weight_shape"):
            stored.pop(f"{p.name}.{leaf}")
        stored[f"{p.name}.weight"] = model.model.layers[1].mlp.experts.down_proj[p.expert][p.rows].detach().numpy()
    write_safetensors(str(tmp_path / "ck" / "model.safetensors"), stored, {"format": "pt"})
    try:
        back = reload(tmp_path / "ck")
    except RuntimeError as e:
        assert "conversion" in str(e).lower()
        return
    loaded = torch.equal(back.model.layers[1].mlp.experts.down_proj, model.model.layers[1].mlp.experts.down_proj)
    assert not loaded, ("transformers now loads float per-expert pieces in a quantized checkpoint: float experts "
                        "could be written in the per-expert layout too (hf_checkpoint._expert_plan)")


@pytest.mark.parametrize("scheme", ["symmetric", "affine"])
def test_streamed_run_reads_save_pretrained_layout_and_writes_what_the_in_memory_export_does(tmp_path, scheme):
    """compressor.torch.oneshot on Mixtral as save_pretrained writes it (per-expert w1/w2/w3 under
    block_sparse_moe, the router renamed too): the experts stacked into the fused parameters; the written tensors and
    config are the in-memory calibrate + export_model(hf_path) ones bit for bit, with the same float-layer warning
    (affine: the experts stored dense, for the same reason)."""
    from compressor.torch import oneshot

    model = mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "src")
    on_disk = set(read_safetensors(str(tmp_path / "src" / "model.safetensors")))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in on_disk
    assert "model.layers.0.block_sparse_moe.gate.weight" in on_disk
    data = np.random.default_rng(1).integers(0, VOCAB, size=(8, 16))
    stage = [{**GPTQ, "quant_scheme": scheme, "op_types": ["Linear"]}, {"op_names": ["lm_head"], "exclude": True}]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        oneshot(tmp_path / "src", tmp_path / "out", [{"GptqQuantizer": stage}], data, num_samples=8, seq_len=16,
                batch_size=4, progress=False)
    streamed = [str(w.message).split(": ", 1)[1] for w in got if "written as float weights" in str(w.message)]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c = GptqQuantizer(model, stage)
        c.calibrate(list(torch.from_numpy(data).split(4)), progress=False)
        c.export_model(None, hf_path=str(tmp_path / "mem"))
    in_memory = [str(w.message).split(": ", 1)[1] for w in got if "written as float weights" in str(w.message)]
    assert streamed == in_memory
    a, b = tensors(tmp_path / "out"), tensors(tmp_path / "mem")
    assert set(a) == set(b)
    assert [k for k in a if not np.array_equal(a[k], b[k])] == []
    if scheme == "affine":
        assert len(in_memory) == 1 and "asymmetric codes" in in_memory[0]
        assert "model.layers.1.mlp.experts.gate_up_proj" in a
    else:
        assert in_memory == [] and "model.layers.1.block_sparse_moe.experts.2.w3.weight_packed" in a
    qa = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    qb = json.loads((tmp_path / "mem" / "config.json").read_text())["quantization_config"]
    assert qa == qb
    x = torch.from_numpy(data[:2])
    assert rel(logits(reload(tmp_path / "out"), x), logits(model, x)) <= 1e-5
