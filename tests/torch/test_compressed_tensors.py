"""export_model(hf_path=DIR): compressed-tensors checkpoints of one-shot compressed Hugging Face models
(issue 26), reloaded with ``AutoModelForCausalLM.from_pretrained`` (compressed-tensors installed) or with
the numpy reader, compared with the compressed model's logits; and the refusals, before anything is written."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch

from compressor.core.compressed_tensors import (
    checkpoint_report,
    load_compressed_tensors,
    read_safetensors,
    unpack_int32,
)
from compressor.core.errors import ConfigError, ModelError
from compressor.torch import AwqQuantizer, GptqQuantizer, QAT_Quantizer, RtnQuantizer, SparseGPTPruner
from compressor.torch.quantization.lowbit import oneshot_codes

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB = 64
TOL = 1e-5  # float32 rounding of (code - zp) * scale computed in another order


def _build(family):
    torch.manual_seed(0)
    t = transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "llama":
            m = t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=64))
        elif family == "qwen2":
            m = t.Qwen2ForCausalLM(t.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=64))
        elif family == "opt":
            m = t.OPTForCausalLM(t.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                             num_attention_heads=4, max_position_embeddings=64,
                                             word_embed_proj_dim=32))
        else:
            m = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                                               bos_token_id=0, eos_token_id=0))
    return m.eval()


def _batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, 16), generator=g) for _ in range(n)]


IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _reload(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _qconfig(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("quantization_config")


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_gptq_int4_pack_quantized_loads_with_same_logits(tmp_path, family):
    model = _build(family)
    q = GptqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
    q.calibrate(_batches())
    ref = _logits(model)
    out = tmp_path / "ckpt"
    assert q.export_model(None, hf_path=str(out)) is None
    qc = _qconfig(out)
    assert qc["format"] == "pack-quantized" and qc["quant_method"] == "compressed-tensors"
    (group,) = qc["config_groups"].values()
    assert group["weights"]["num_bits"] == 4 and group["weights"]["group_size"] == 16
    assert group["weights"]["symmetric"] is True and group["weights"]["strategy"] == "group"
    names = sorted(w.name for w in q.get_modules_wrapper())
    assert group["targets"] == names
    tensors = read_safetensors(out / "model.safetensors")
    first = names[0]
    wrapper = dict(model.named_modules())[first]
    n_out, n_in = oneshot_codes(wrapper).shape
    assert tensors[f"{first}.weight_packed"].shape == (n_out, n_in * 4 // 32)
    assert f"{first}.weight" not in tensors and f"{first}.weight_zero_point" not in tensors
    # our narrow symmetric codes [-7, 7] are stored unchanged in compressed-tensors' signed int4
    codes = unpack_int32(tensors[f"{first}.weight_packed"], 4, n_in)
    np.testing.assert_array_equal(codes, oneshot_codes(wrapper).numpy())
    assert codes.min() >= -7 and codes.max() <= 7
    diff = (_logits(_reload(out)) - ref).abs().max().item()
    assert diff < TOL
    # the numpy reader gives the same float weights
    plain = _build(family)
    missing = plain.load_state_dict({k: torch.from_numpy(v) for k, v in load_compressed_tensors(out).items()},
                                    strict=False).missing_keys
    assert missing in ([], ["lm_head.weight"])  # a tied head is stored once
    plain.tie_weights()
    assert (_logits(plain) - ref).abs().max().item() < TOL


def test_rtn_affine_is_naive_quantized_and_loads(tmp_path):
    model = _build("llama")
    q = RtnQuantizer(model, [{"quant_bits": 4, "group_size": 16, "quant_scheme": "affine", "op_types": ["default"]}])
    q.calibrate()
    ref = _logits(model)
    q.export_model(None, hf_path=str(tmp_path / "ck"))
    qc = _qconfig(tmp_path / "ck")
    assert qc["format"] == "naive-quantized"
    assert next(iter(qc["config_groups"].values()))["weights"]["symmetric"] is False
    t = read_safetensors(tmp_path / "ck" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    w = dict(model.named_modules())[name]
    assert t[f"{name}.weight"].dtype == np.int8 and t[f"{name}.weight_zero_point"].dtype == np.int8
    np.testing.assert_array_equal(t[f"{name}.weight"], oneshot_codes(w).numpy().astype(np.int16) - 8)
    np.testing.assert_array_equal(t[f"{name}.weight_zero_point"], w.weight_group_zero_point.numpy() - 8)
    assert (_logits(_reload(tmp_path / "ck")) - ref).abs().max().item() < TOL


def test_awq_with_one_scale_per_input_group_packs_every_layer(tmp_path):
    """The default block search gives q / k / v one shared ``s`` (they read one norm): every 1/s folds
    exactly (q/k/v and fc1 into their norms, out_proj into v_proj's rows, fc2 into fc1's rows)."""
    import warnings

    model = _build("opt")
    q = AwqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
    q.calibrate(_batches())
    ref = _logits(model)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        q.export_model(None, hf_path=str(tmp_path / "ck"))
    assert not [r for r in rec if "written as float weights" in str(r.message)]
    p = "model.decoder.layers.0."
    (group,) = _qconfig(tmp_path / "ck")["config_groups"].values()
    assert group["targets"] == [p + n for n in ("fc1", "fc2", "self_attn.k_proj", "self_attn.out_proj",
                                                "self_attn.q_proj", "self_attn.v_proj")]
    assert (_logits(_reload(tmp_path / "ck")) - ref).abs().max().item() < TOL


def test_awq_folds_exactly_where_it_can(tmp_path):
    model = _build("opt")  # per-layer search: q / k / v get three different s
    q = AwqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"], "awq_search": "layer"}])
    q.calibrate(_batches())
    ref = _logits(model)
    with pytest.warns(UserWarning, match="written as float weights") as rec:
        q.export_model(None, hf_path=str(tmp_path / "ck"))
    msg = " ".join(str(r.message) for r in rec)
    p = "model.decoder.layers.0."
    # q/k/v read one norm with three different s: the norm takes k_proj's (the first of the widest), q and v
    # are written in float with k's s in their columns
    for name in ("self_attn.q_proj", "self_attn.v_proj"):
        assert f"'{p}{name}'" in msg
    assert f"took the 1/s of '{p}self_attn.k_proj', another reader (different s)" in msg  # the reason, once
    assert f"'{p}self_attn.k_proj'" not in msg.split(" (AWQ")[0]  # (named only in the reason)
    (group,) = _qconfig(tmp_path / "ck")["config_groups"].values()
    # fc1: 1/s in final_layer_norm; out_proj: in v_proj's rows; fc2: in fc1's rows (ReLU is positively homogeneous)
    assert group["targets"] == [p + "fc1", p + "fc2", p + "self_attn.k_proj", p + "self_attn.out_proj"]
    t = read_safetensors(tmp_path / "ck" / "model.safetensors")
    s = dict(model.named_modules())[p + "fc1"].awq_scales.double().numpy()
    gamma = dict(model.named_modules())[p + "final_layer_norm"].weight.detach().double().numpy()
    np.testing.assert_allclose(t[p + "final_layer_norm.weight"], gamma / s, rtol=1e-6)
    assert (_logits(_reload(tmp_path / "ck")) - ref).abs().max().item() < TOL


def test_awq_fold_check_falls_back_to_float(tmp_path, monkeypatch):
    import compressor.torch.hf_checkpoint as hc

    model = _build("llama")
    q = AwqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
    q.calibrate(_batches())
    ref = _logits(model)
    monkeypatch.setattr(hc, "_fold_error", lambda model, folder: (1.0, 1e-4))  # as if a fold were wrong
    with pytest.warns(UserWarning, match=r"changed this model's logits by 1 \(> 0.0001\), so none is used"):
        q.export_model(None, hf_path=str(tmp_path / "ck"))
    assert _qconfig(tmp_path / "ck") is None  # every AWQ layer in float
    assert (_logits(_reload(tmp_path / "ck")) - ref).abs().max().item() < TOL


def test_gpt2_conv1d_is_written_float_with_a_warning(tmp_path):
    model = _build("gpt2")
    q = RtnQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
    q.calibrate()
    ref = _logits(model)
    with pytest.warns(UserWarning, match=r"'transformer.h.0.attn.c_attn' \(Conv1D: not a Linear"):
        q.export_model(None, hf_path=str(tmp_path / "ck"))
    assert _qconfig(tmp_path / "ck") is None  # nothing packed: a plain float checkpoint
    assert (_logits(_reload(tmp_path / "ck")) - ref).abs().max().item() < TOL


def test_sparse_24_and_bitmask_formats_exact_bytes(tmp_path):
    model = _build("llama")
    p = SparseGPTPruner(model, [{"sparse_pattern": "2:4", "op_types": ["default"]}])
    p.calibrate(_batches())
    ref = _logits(model)
    with pytest.warns(UserWarning, match="compressed-tensors 0.15\\+ .* no longer reads"):
        p.export_model(None, hf_path=str(tmp_path / "s24"), hf_sparse_format="2:4")
    qc = _qconfig(tmp_path / "s24")
    assert qc["sparsity_config"]["format"] == "sparse-24-bitmask" and qc["config_groups"] == {}
    rows = {r["layer"]: r for r in checkpoint_report(tmp_path / "s24")["layers"]}
    q = rows["model.layers.0.self_attn.q_proj.weight"]
    # [32, 32]: 32 x 16 float32 values (2048) + 32 x 4 bitmask bytes (128) + shape 2 x int64 (16)
    assert q["format"] == "sparse-24-bitmask" and q["bytes"] == 2192 and q["dense_bytes"] == 4096
    assert q["sparsity"] == 0.5
    plain = _build("llama")
    plain.load_state_dict({k: torch.from_numpy(v) for k, v in load_compressed_tensors(tmp_path / "s24").items()})
    assert (_logits(plain) - ref).abs().max().item() == 0.0
    p.export_model(None, hf_path=str(tmp_path / "bm"), hf_sparse_format="bitmask")
    p.export_model(None, hf_path=str(tmp_path / "dense"))
    sizes = {k: os.path.getsize(tmp_path / k / "model.safetensors") for k in ("s24", "bm", "dense")}
    assert sizes["s24"] < sizes["bm"] < sizes["dense"]
    assert _qconfig(tmp_path / "dense") is None
    assert (_logits(_reload(tmp_path / "dense")) - ref).abs().max().item() == 0.0


def test_sparsegpt_then_gptq_composed(tmp_path):
    model = _build("qwen2")
    SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}]).calibrate(_batches())
    q = GptqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
    q.calibrate(_batches())
    ref = _logits(model)
    q.export_model(None, hf_path=str(tmp_path / "ck"))
    rows = checkpoint_report(tmp_path / "ck")["layers"]
    packed = [r for r in rows if r["format"] == "pack-quantized"]
    assert len(packed) == 7 and all(r["sparsity"] >= 0.5 for r in packed)
    assert (_logits(_reload(tmp_path / "ck")) - ref).abs().max().item() < TOL


def test_refusals_write_nothing(tmp_path):
    model = _build("llama")
    q = GptqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
    with pytest.raises(ModelError, match="not calibrated yet"):
        q.export_model(None, hf_path=str(tmp_path / "a"))
    q.calibrate(_batches())
    f = tmp_path / "file"
    f.write_text("keep")
    with pytest.raises(ModelError, match="exists and is not a folder"):
        q.export_model(None, hf_path=str(f))
    assert f.read_text() == "keep"
    with pytest.raises(ConfigError, match="hf_sparse_format must be one of"):
        q.export_model(None, hf_path=str(tmp_path / "a"), hf_sparse_format="csr")
    assert sorted(os.listdir(tmp_path)) == ["file"]
    # an existing checkpoint folder: the export's files are replaced, a file it does not write stays (issue 45)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "stale.bin").write_text("x")
    q.export_model(None, hf_path=str(tmp_path / "ck"))
    assert sorted(os.listdir(tmp_path / "ck")) == ["config.json", "generation_config.json", "model.safetensors",
                                                   "stale.bin"]


def test_refusals_models_without_codes_or_groups(tmp_path):
    model = _build("llama")
    qat = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Linear"]}])
    with pytest.raises(ModelError, match="keeps no integer codes"):
        qat.export_model(None, hf_path=str(tmp_path / "x"))
    model = _build("llama")
    q = RtnQuantizer(model, [{"quant_bits": 4, "group_size": 24, "op_types": ["default"]}])
    q.calibrate()
    with pytest.raises(ModelError, match="group_size 24 does not divide its 32 input columns"):
        q.export_model(None, hf_path=str(tmp_path / "x"))
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    r = RtnQuantizer(plain, [{"quant_bits": 4, "op_types": ["Linear"]}])
    r.calibrate()
    with pytest.raises(ModelError, match="belongs to no model family with a checkpoint format"):
        r.export_model(None, hf_path=str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")


def test_24_format_refused_for_unstructured_sparsity(tmp_path):
    model = _build("llama")
    p = SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    p.calibrate(_batches())
    with pytest.raises(ModelError, match=r"hf_sparse_format='2:4' but layer 'model.layers.0.self_attn.q_proj' is not 2:4"):
        p.export_model(None, hf_path=str(tmp_path / "ck"), hf_sparse_format="2:4")
    assert not os.path.exists(tmp_path / "ck")
    p.export_model(None, hf_path=str(tmp_path / "ck"), hf_sparse_format="auto")
    assert _qconfig(tmp_path / "ck")["sparsity_config"]["format"] == "sparse-bitmask"
    rep = checkpoint_report(tmp_path / "ck")
    assert all(r["sparsity"] == 0.5 for r in rep["layers"] if r["format"] == "sparse-bitmask")
    assert len([r for r in rep["layers"] if r["format"] == "sparse-bitmask"]) == 7


@pytest.mark.parametrize("bits,group_size,scheme,fmt,strategy", [
    (8, None, "symmetric", "pack-quantized", "channel"), (3, 16, "symmetric", "pack-quantized", "group"),
    (8, None, "affine", "naive-quantized", "channel")])
def test_other_bit_widths_reload(tmp_path, bits, group_size, scheme, fmt, strategy):
    model = _build("qwen2")
    q = RtnQuantizer(model, [{"quant_bits": bits, "group_size": group_size, "quant_scheme": scheme,
                              "op_types": ["default"]}])
    q.calibrate()
    ref = _logits(model)
    q.export_model(None, hf_path=str(tmp_path / "ck"))
    qc = _qconfig(tmp_path / "ck")
    (group,) = qc["config_groups"].values()
    assert qc["format"] == fmt and group["weights"]["num_bits"] == bits and group["weights"]["strategy"] == strategy
    t = read_safetensors(tmp_path / "ck" / "model.safetensors")
    name = "model.layers.0.mlp.up_proj"  # [64, 32]
    assert t[f"{name}.weight_scale"].shape == (64, 1 if group_size is None else 32 // group_size)
    if fmt == "pack-quantized":
        assert t[f"{name}.weight_packed"].shape == (64, 32 * bits // 32)
    assert (_logits(_reload(tmp_path / "ck")) - ref).abs().max().item() < TOL


def test_export_into_a_checkpoint_folder_keeps_the_files_it_does_not_write(tmp_path):
    """hf_path over an existing checkpoint folder: tokenizer files, README, training arguments and sub-folders stay
    (as save_pretrained keeps them); the old weights, index and config are replaced."""
    model = _build("llama")
    q = RtnQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
    q.calibrate()
    out = tmp_path / "ck"
    out.mkdir()
    keep = {"tokenizer.json": '{"v": 1}', "README.md": "# my model", "training_args.bin": "args",
            "runs/events.out": "log"}
    for name, text in keep.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    for old in ("pytorch_model.bin", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                "config.json"):
        (out / old).write_text("old")
    q.export_model(None, hf_path=str(out))
    for name, text in keep.items():
        assert (out / name).read_text() == text, name
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "generation_config.json",
                                                      "model.safetensors", "runs", "tokenizer.json",
                                                      "training_args.bin"]
    assert _qconfig(out)["format"] == "pack-quantized"
