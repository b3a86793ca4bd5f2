"""compressor/torch/hf_stream.py (issue 44): a Hugging Face checkpoint checked up front, its model built
without weights, and one submodule's weights loaded at a time, computing bit for bit what the same module of
``from_pretrained`` computes. Tiny Llama / GPT-2 / OPT models saved here, single-file and sharded, float32 and
bfloat16; every refused folder with its message."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from torch import nn

from compressor.core.compressed_tensors import CheckpointError, read_safetensors_header
from compressor.core.errors import ModelError

tr = pytest.importorskip("transformers")  # test dependencies of the torch env
pytest.importorskip("accelerate")
st = pytest.importorskip("safetensors.torch")
from compressor.torch.hf_stream import HfCheckpoint  # noqa: E402


def llama_config(tied: bool = False, layers: int = 3) -> object:
    return tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                          tie_word_embeddings=tied)


def gpt2_config() -> object:
    return tr.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                         eos_token_id=0)


def opt_config() -> object:
    return tr.OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                        max_position_embeddings=64, word_embed_proj_dim=64, bos_token_id=0, eos_token_id=0,
                        pad_token_id=1)


def save(folder, config, dtype: torch.dtype, sharded: bool) -> str:
    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # non-trivial norms, so loading them is tested
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(folder), safe_serialization=True, **({"max_shard_size": "50KB"} if sharded else {}))
    return str(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{name: saved checkpoint folder}, made once for the module (copied before any test alters one)."""
    root = tmp_path_factory.mktemp("hf_stream")
    made = {}
    for name, config, dtype, sharded in [
        ("llama-f32", llama_config(), torch.float32, False),
        ("llama-f32-sharded", llama_config(), torch.float32, True),
        ("llama-bf16", llama_config(), torch.bfloat16, False),
        ("llama-bf16-sharded", llama_config(), torch.bfloat16, True),
        ("llama-tied", llama_config(tied=True), torch.float32, False),
        ("llama-tied-bf16-sharded", llama_config(tied=True), torch.bfloat16, True),
        ("gpt2-sharded", gpt2_config(), torch.float32, True),
        ("opt-bf16", opt_config(), torch.bfloat16, False),
    ]:
        made[name] = save(root / name, config, dtype, sharded)
    return made


def copy_of(folders, name, tmp_path) -> str:
    dst = tmp_path / name
    shutil.copytree(folders[name], dst)
    return str(dst)


def reference(folder: str, dtype: torch.dtype) -> nn.Module:
    return tr.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def on_meta(module: nn.Module) -> bool:
    return all(p.device.type == "meta" for p in module.parameters())


def shards(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


# ------------------------------------------------------------------------------------------------ what it reads
def test_the_checkpoint_is_described_from_its_headers(folders):
    ck = HfCheckpoint(folders["llama-bf16-sharded"])
    assert len(ck.files) == len(shards(ck.path)) > 2
    assert ck.dtype == torch.bfloat16 and type(ck.config).__name__ == "LlamaConfig"
    ref = reference(ck.path, torch.bfloat16).state_dict()
    assert set(ck.tensors) == set(ref)  # untied: lm_head.weight is in the files
    name = "model.layers.1.mlp.up_proj.weight"
    path, dt, shape = ck.tensors[name]
    assert os.path.dirname(path) == ck.path and dt == "BF16" and shape == (128, 64)
    assert ck.nbytes == sum(2 * v.numel() for v in ref.values())
    assert HfCheckpoint(folders["llama-f32"]).dtype == torch.float32
    assert "30 tensors in 1 file(s)" in repr(HfCheckpoint(folders["llama-f32"]))


@pytest.mark.parametrize("name", ["llama-bf16-sharded", "llama-tied", "gpt2-sharded", "opt-bf16"])
def test_the_skeleton_has_meta_parameters_and_real_buffers(folders, name):
    ck = HfCheckpoint(folders[name])
    model = ck.skeleton()
    ref = reference(ck.path, ck.dtype)
    assert on_meta(model) and not model.training
    assert {p.dtype for p in model.parameters()} == {ck.dtype}
    assert set(model.state_dict()) == set(ref.state_dict())
    ref_buffers = dict(ref.named_buffers())
    assert set(dict(model.named_buffers())) == set(ref_buffers)
    for key, buf in model.named_buffers():  # rotary inv_freq: computed, not read; equal to from_pretrained's
        assert buf.device.type == "cpu" and buf.dtype == ref_buffers[key].dtype
        assert torch.equal(buf, ref_buffers[key]), key
    tied = ck.config.tie_word_embeddings
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied


# ----------------------------------------------------------------------------------------------------- loading
def layer_inputs(ref: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    hidden = torch.randn(2, 7, 64).to(dtype)
    positions = torch.arange(7).expand(2, 7)
    return hidden, ref.model.rotary_emb(hidden, positions)


def run_layer(layer: nn.Module, hidden: torch.Tensor, rope) -> torch.Tensor:
    with torch.no_grad():
        out = layer(hidden, position_embeddings=rope)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", ["llama-f32", "llama-f32-sharded", "llama-bf16", "llama-bf16-sharded"])
def test_a_loaded_block_computes_what_from_pretrained_computes(folders, name):
    ck = HfCheckpoint(folders[name])
    model = ck.skeleton()
    ref = reference(ck.path, ck.dtype)
    ck.load(model.model.layers[1], "model.layers.1.")
    block = model.model.layers[1]
    assert all(p.device.type == "cpu" and p.dtype == ck.dtype for p in block.parameters())
    for key, value in block.state_dict().items():
        assert torch.equal(value, ref.state_dict()[f"model.layers.1.{key}"]), key
    assert on_meta(model.model.layers[0]) and on_meta(model.model.layers[2]) and on_meta(model.model.embed_tokens)
    hidden, rope = layer_inputs(ref, ck.dtype)
    ours, theirs = run_layer(block, hidden, rope), run_layer(ref.model.layers[1], hidden, rope)
    assert ours.dtype == ck.dtype and torch.equal(ours, theirs)
    # the skeleton's own rotary embedding gives the same cos / sin
    for a, b in zip(model.model.rotary_emb(hidden, torch.arange(7).expand(2, 7)), rope):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["llama-bf16-sharded", "llama-tied", "llama-tied-bf16-sharded"])
def test_embedding_final_norm_and_head(folders, name):
    ck = HfCheckpoint(folders[name])
    model = ck.skeleton()
    ref = reference(ck.path, ck.dtype)
    for module, prefix in [(model.model.embed_tokens, "model.embed_tokens."), (model.model.norm, "model.norm."),
                           (model.lm_head, "lm_head.")]:
        ck.load(module, prefix)
    assert all(on_meta(layer) for layer in model.model.layers)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    hidden = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3)).to(ck.dtype)
    with torch.no_grad():
        assert torch.equal(model.model.embed_tokens(ids), ref.model.embed_tokens(ids))
        assert torch.equal(model.lm_head(model.model.norm(hidden)), ref.lm_head(ref.model.norm(hidden)))


def test_tied_head_is_read_from_the_embedding_and_stays_tied(folders):
    ck = HfCheckpoint(folders["llama-tied-bf16-sharded"])
    assert "lm_head.weight" not in ck.tensors
    model = ck.skeleton()
    ref = reference(ck.path, ck.dtype)
    ck.load(model.lm_head, "lm_head.")  # the head alone: its weight is the embedding's tensor
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu"
    assert torch.equal(model.lm_head.weight, ref.model.embed_tokens.weight)
    assert torch.equal(ck.read("lm_head.weight"), ref.model.embed_tokens.weight)
    ck.release(model.model.embed_tokens)  # released through the other name: both go
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.device.type == "meta"
    ck.load(model.model.embed_tokens, "model.embed_tokens.")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)


def test_release_frees_and_a_reload_gives_the_same_values(folders):
    ck = HfCheckpoint(folders["llama-bf16-sharded"])
    model = ck.skeleton()
    block = model.model.layers[2]
    ck.load(block, "model.layers.2.")
    before = {k: v.clone() for k, v in block.state_dict().items()}
    ck.release(block)
    assert on_meta(block) and on_meta(model)
    assert {p.dtype for p in block.parameters()} == {torch.bfloat16}
    ck.release(block)  # twice: nothing to do
    ck.load(block, "model.layers.2.")
    after = block.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def leaves(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every module holding parameters of its own, with its state_dict prefix (what a streaming run loads)."""
    return [(m, f"{n}." if n else "") for n, m in model.named_modules() if list(m.parameters(recurse=False))]


@pytest.mark.parametrize("name", ["llama-bf16-sharded", "llama-tied-bf16-sharded", "gpt2-sharded", "opt-bf16"])
def test_the_model_loaded_piece_by_piece_equals_from_pretrained(folders, name):
    ck = HfCheckpoint(folders[name])
    model = ck.skeleton()
    ref = reference(ck.path, ck.dtype)
    for module, prefix in leaves(model):
        ck.load(module, prefix)
    assert all(p.device.type == "cpu" for p in model.parameters())
    ids = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    ck.release(model)
    assert on_meta(model)


def test_a_block_of_gpt2_loads_with_its_conv1d_layers(folders):
    ck = HfCheckpoint(folders["gpt2-sharded"])
    model = ck.skeleton()
    ref = reference(ck.path, ck.dtype)
    ck.load(model.transformer.h[1], "transformer.h.1.")
    assert on_meta(model.transformer.h[0]) and on_meta(model.transformer.wte)
    hidden = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = model.transformer.h[1](hidden), ref.transformer.h[1](hidden)
    ours, theirs = (x[0] if isinstance(x, tuple) else x for x in (ours, theirs))
    assert torch.equal(ours, theirs)


def test_read_gives_one_tensor_as_stored(folders):
    ck = HfCheckpoint(folders["llama-bf16-sharded"])
    ref = reference(ck.path, ck.dtype)
    norm = ck.read("model.layers.0.input_layernorm.weight")
    assert norm.dtype == torch.bfloat16 and torch.equal(norm, ref.model.layers[0].input_layernorm.weight)
    with pytest.raises(CheckpointError, match=re.escape(f"{ck.path!r}: no tensor 'model.nope' in the checkpoint")):
        ck.read("model.nope")


def test_load_with_a_wrong_prefix_fails(folders):
    ck = HfCheckpoint(folders["llama-f32"])
    model = ck.skeleton()
    with pytest.raises(ModelError, match=re.escape(
            f"{ck.path!r}: 'model.layers.9.self_attn.q_proj.weight' is not a tensor of the checkpoint (is "
            f"'model.layers.9.' the module's prefix in the model?)")):
        ck.load(model.model.layers[1], "model.layers.9.")
    assert on_meta(model)


def test_a_few_float32_tensors_in_a_bfloat16_checkpoint_load_as_bfloat16(folders, tmp_path):
    folder = copy_of(folders, "llama-bf16", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    tensors = st.load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].float()
    st.save_file(tensors, path, metadata={"format": "pt"})
    ck = HfCheckpoint(folder)
    assert ck.dtype == torch.bfloat16 and ck.tensors["model.norm.weight"][1] == "F32"
    model = ck.skeleton()
    ck.load(model.model.norm, "model.norm.")
    ref = reference(folder, torch.bfloat16)
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, ref.model.norm.weight)
    assert ck.read("model.norm.weight").dtype == torch.float32  # read: as stored


# ------------------------------------------------------------------------------------------ refused checkpoints
def fails(folder: str, message: str, build: bool = False) -> None:
    with pytest.raises(CheckpointError) as info:
        ck = HfCheckpoint(folder)
        if build:
            ck.skeleton()
    assert str(info.value) == message


def rewrite(path: str, change) -> None:
    """Rewrite one safetensors file with ``change(tensors)`` applied (tiny test files: read whole)."""
    tensors = st.load_file(path)
    change(tensors)
    st.save_file(tensors, path, metadata={"format": "pt"})


def edit_index(folder: str, change) -> str:
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    change(data["weight_map"])
    with open(index, "w") as f:
        json.dump(data, f)
    return index


def test_missing_folder_config_and_weights(folders, tmp_path):
    fails(str(tmp_path / "nowhere"), f"{str(tmp_path / 'nowhere')!r} is not a folder (a Hugging Face checkpoint is "
                                     f"a folder holding config.json and safetensors files)")
    folder = copy_of(folders, "llama-f32", tmp_path)
    os.remove(os.path.join(folder, "model.safetensors"))
    fails(folder, f"{folder!r}: neither model.safetensors nor model.safetensors.index.json (only safetensors "
                  f"checkpoints are read)")
    os.remove(os.path.join(folder, "config.json"))
    fails(folder, f"{folder!r}: no config.json (a Hugging Face checkpoint has one)")


def test_unreadable_config(folders, tmp_path):
    folder = copy_of(folders, "llama-f32", tmp_path)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": "no-such-model"}, f)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{os.path.join(folder, 'config.json')!r}: transformers {tr.__version__} cannot read it: ")):
        HfCheckpoint(folder)


def test_a_shard_the_index_names_is_missing(folders, tmp_path):
    folder = copy_of(folders, "llama-bf16-sharded", tmp_path)
    gone = shards(folder)[1]
    os.remove(os.path.join(folder, gone))
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        first = next(k for k, v in json.load(f)["weight_map"].items() if v == gone)
    fails(folder, f"{os.path.join(folder, 'model.safetensors.index.json')!r}: shard {gone!r} (holding {first!r} and "
                  f"more) is missing from {folder!r}")
    os.remove(os.path.join(folder, "model.safetensors.index.json"))
    fails(folder, f"{folder!r}: neither model.safetensors nor model.safetensors.index.json (only safetensors "
                  f"checkpoints are read)")


def test_a_truncated_shard(folders, tmp_path):
    folder = copy_of(folders, "llama-bf16-sharded", tmp_path)
    path = os.path.join(folder, shards(folder)[2])
    header, start = read_safetensors_header(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    end = header[last]["data_offsets"][1]
    with open(path, "r+b") as f:
        f.truncate(start + end - 10)
    fails(folder, f"{path!r}: truncated safetensors file: tensor {last!r} ends at byte {end} of the data, which "
                  f"has {end - 10}")


def test_a_tensor_in_two_shards(folders, tmp_path):
    folder = copy_of(folders, "llama-bf16-sharded", tmp_path)
    first, second = (os.path.join(folder, s) for s in shards(folder)[:2])
    name = sorted(st.load_file(first))[0]
    rewrite(second, lambda t: t.update({name: st.load_file(first)[name]}))
    fails(folder, f"{folder!r}: tensor {name!r} is in two shards: {first!r} and {second!r}")


def test_an_index_that_disagrees_with_its_shards(folders, tmp_path):
    folder = copy_of(folders, "llama-bf16-sharded", tmp_path)
    first, second = shards(folder)[:2]
    name = sorted(st.load_file(os.path.join(folder, first)))[0]
    index = edit_index(folder, lambda m: m.update({name: second}))
    fails(folder, f"{index!r}: tensor {name!r} is listed in {second!r} but is in {os.path.join(folder, first)!r}")
    index = edit_index(folder, lambda m: m.update({name: first, "model.layers.0.extra.weight": second}))
    fails(folder, f"{index!r}: tensor 'model.layers.0.extra.weight' is listed in {second!r}, which does not hold it")
    index = edit_index(folder, lambda m: (m.pop("model.layers.0.extra.weight"), m.pop(name)))
    fails(folder, f"{os.path.join(folder, first)!r}: tensor {name!r} is not in the index {index!r}")
    index = edit_index(folder, lambda m: m.update({name: "../elsewhere.safetensors"}))
    fails(folder, f"{index!r}: the index names files that are not .safetensors files inside the checkpoint folder: "
                  f"'../elsewhere.safetensors'")


@pytest.mark.parametrize("dtype,code", [(torch.float64, "F64"), (torch.int64, "I64")])
def test_an_unsupported_dtype(folders, tmp_path, dtype, code):
    folder = copy_of(folders, "llama-f32", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    rewrite(path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(dtype)}))
    fails(folder, f"{path!r}: tensor 'model.norm.weight' has dtype {code}; this reader takes F32, BF16 and F16 "
                  f"checkpoints")


def test_mixed_float_dtypes(folders, tmp_path):
    folder = copy_of(folders, "llama-bf16", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    rewrite(path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].half()}))
    fails(folder, f"{folder!r}: the checkpoint mixes BF16 and F16 tensors (e.g. 'lm_head.weight' and "
                  f"'model.norm.weight'); one dtype is needed")
    rewrite(path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].bfloat16(),
                                      "lm_head.weight": t["lm_head.weight"].float()}))
    fails(folder, f"{folder!r}: the checkpoint mixes BF16 and F32 tensors, and the F32 ones hold 6% of the "
                  f"elements (at most 5% are taken and loaded as BF16): 'lm_head.weight'")


def test_a_tensor_of_another_shape(folders, tmp_path):
    folder = copy_of(folders, "llama-bf16-sharded", tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    ck = HfCheckpoint(folder)
    path = ck.tensors[name][0]
    rewrite(path, lambda t: t.update({name: t[name][:120]}))
    fails(folder, f"{path!r}: tensor {name!r} has shape [120, 64], the model built from config.json expects "
                  f"[128, 64]", build=True)


def test_tensors_the_model_lacks_or_the_files_lack(folders, tmp_path):
    folder = copy_of(folders, "llama-f32", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    rewrite(path, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    fails(folder, f"{folder!r} does not match the LlamaForCausalLM its config.json describes; tensors the model "
                  f"does not have: 'model.layers.0.extra.weight'", build=True)
    rewrite(path, lambda t: (t.pop("model.layers.0.extra.weight"), t.pop("lm_head.weight"),
                             t.pop("model.layers.2.mlp.up_proj.weight")))
    fails(folder, f"{folder!r} does not match the LlamaForCausalLM its config.json describes; model tensors "
                  f"absent from the files: 'model.layers.2.mlp.up_proj.weight', 'lm_head.weight'", build=True)


def test_old_per_layer_rotary_buffers_are_skipped_as_from_pretrained_does(folders, tmp_path):
    folder = copy_of(folders, "llama-f32", tmp_path)
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    rewrite(os.path.join(folder, "model.safetensors"), lambda t: t.update({name: torch.ones(8)}))
    ck = HfCheckpoint(folder)
    model = ck.skeleton()
    assert ck.unused == (name,)
    ck.load(model.model.layers[0], "model.layers.0.")
    assert not on_meta(model.model.layers[0])
