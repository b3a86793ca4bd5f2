"""compressor.torch.oneshot: a Hugging Face checkpoint compressed disk to disk one decoder block at a time, equal to
the in-memory calibrate + export_model(hf_path=) checkpoint, resumable after a kill, loaded by transformers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("accelerate")

from compressor.core.compressed_tensors import read_safetensors  # noqa: E402
from compressor.core.errors import ConfigError  # noqa: E402
from compressor.torch import hf_oneshot  # noqa: E402
from compressor.torch.hf_oneshot import oneshot  # noqa: E402

GPTQ = [{"GptqQuantizer": [{"quant_bits": 4, "group_size": 32, "op_types": ["Linear"]},
                           {"op_names": ["lm_head"], "exclude": True}]}]
AWQ = [{"AwqQuantizer": [{"quant_bits": 4, "group_size": 32, "op_types": ["Linear"]},
                         {"op_names": ["lm_head"], "exclude": True}]}]
SPARSEGPT = [{"SparseGPTPruner": [{"sparsity": 0.5, "op_types": ["Linear"]}, {"op_names": ["lm_head"], "exclude": True}]}]


def llama(tmp_path, layers=3, dtype=torch.float32, shard="40KB"):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    src = tmp_path / "src"
    model.save_pretrained(src, safe_serialization=True, max_shard_size=shard)
    (src / "tokenizer_config.json").write_text("{}")  # copied to the output as it is
    return src


def tokens(tmp_path, n=8, length=32):
    ids = np.random.default_rng(1).integers(0, 128, size=(n, length))
    path = tmp_path / "ids.npy"
    np.save(path, ids)
    return path, torch.from_numpy(ids)


def tensors_of(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(read_safetensors(os.path.join(folder, f)))
    return out


def in_memory(src, stage, ids, batch_size, out, dtype=None):
    from compressor.torch import AwqQuantizer, GptqQuantizer, SparseGPTPruner

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()
    (name, config), = stage[0].items()
    cls = {"GptqQuantizer": GptqQuantizer, "SparseGPTPruner": SparseGPTPruner, "AwqQuantizer": AwqQuantizer}[name]
    comp = cls(model, config)
    comp.calibrate(list(ids.split(batch_size)), progress=False, forward_dtype="model")
    comp.export_model(str(out / "m.pt"), hf_path=str(out / "ref")) if name != "SparseGPTPruner" else \
        comp.export_model(str(out / "m.pt"), str(out / "mask.pt"), hf_path=str(out / "ref"))
    return model, out / "ref"


@pytest.mark.parametrize("recipe", [GPTQ, SPARSEGPT, AWQ], ids=["gptq", "sparsegpt", "awq"])
def test_streamed_checkpoint_equals_the_in_memory_one_and_loads_in_transformers(tmp_path, recipe):
    src = llama(tmp_path)
    path, ids = tokens(tmp_path)
    loads = []
    real_load = hf_oneshot._Checkpoint.load_block

    def counting(self, block):
        resident = [b for b in self.model.model.layers if next(b.parameters()).device.type != "meta"]
        loads.append(len(resident))
        return real_load(self, block)
    hf_oneshot._Checkpoint.load_block = counting
    try:
        summary = oneshot(src, tmp_path / "out", recipe, str(path), num_samples=8, seq_len=32, batch_size=4,
                          progress=False)
    finally:
        hf_oneshot._Checkpoint.load_block = real_load
    assert loads == [0, 0, 0]  # no other block in memory when a block is read
    assert summary["blocks"] == 3 and summary["bytes_out"] > 0
    model, ref = in_memory(src, recipe, ids, 4, tmp_path)
    got, want = tensors_of(tmp_path / "out"), tensors_of(ref)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg.get("quantization_config") == json.loads((ref / "config.json").read_text()).get("quantization_config")
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == "{}"
    assert not (tmp_path / "out.partial").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        a = loaded(ids[:2]).logits
        b = model(ids[:2]).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_bfloat16_checkpoint_streams_in_bfloat16_to_the_in_memory_tensors(tmp_path):
    src = llama(tmp_path, dtype=torch.bfloat16)
    path, ids = tokens(tmp_path)
    oneshot(src, tmp_path / "out", GPTQ, str(path), num_samples=8, seq_len=32, batch_size=4, progress=False)
    _, ref = in_memory(src, GPTQ, ids, 4, tmp_path, dtype=torch.bfloat16)
    got, want = tensors_of(tmp_path / "out"), tensors_of(ref)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    header = json.loads(open(tmp_path / "out" / "model.safetensors.index.json").read())
    norm = header["weight_map"]["model.norm.weight"]
    raw = (tmp_path / "out" / norm).read_bytes()
    meta = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert meta["model.norm.weight"]["dtype"] == "BF16"  # the float tensors stay in the checkpoint's dtype


def test_a_run_killed_after_any_block_continues_to_the_same_checkpoint(tmp_path):
    src = llama(tmp_path)
    path, _ = tokens(tmp_path)
    oneshot(src, tmp_path / "ref", GPTQ, str(path), num_samples=8, seq_len=32, batch_size=4, progress=False)
    want = tensors_of(tmp_path / "ref")
    real_save = hf_oneshot._Checkpoint.save_block
    for kill_block in range(3):
        calls = []

        def dying(self, block, p, kill_block=kill_block, calls=calls):
            calls.append(p)
            if len(calls) == kill_block + 1:
                raise KeyboardInterrupt  # stands for the kill: the run stops here, the run folder stays
            return real_save(self, block, p)
        hf_oneshot._Checkpoint.save_block = dying
        out = tmp_path / f"out{kill_block}"
        try:
            with pytest.raises(KeyboardInterrupt):
                oneshot(src, out, GPTQ, str(path), num_samples=8, seq_len=32, batch_size=4, progress=False)
        finally:
            hf_oneshot._Checkpoint.save_block = real_save
        assert not out.exists() and (tmp_path / f"out{kill_block}.partial").exists()
        state = json.loads((tmp_path / f"out{kill_block}.partial" / "state" / "state.json").read_text())
        assert state["done"] == kill_block
        lines = []
        oneshot(src, out, GPTQ, str(path), num_samples=8, seq_len=32, batch_size=4, progress=lines.append)
        assert len(lines) == 3 - kill_block  # only the unfinished blocks are run again
        got = tensors_of(out)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    src = llama(tmp_path, layers=2)
    path, _ = tokens(tmp_path)
    with pytest.raises(ConfigError, match="is inside SRC_DIR"):
        oneshot(src, src / "out", GPTQ, str(path), num_samples=8, seq_len=32)
    (tmp_path / "exists").mkdir()
    with pytest.raises(ConfigError, match="exists; give a new folder"):
        oneshot(src, tmp_path / "exists", GPTQ, str(path), num_samples=8, seq_len=32)
    with pytest.raises(ConfigError, match="LevelPruner"):
        oneshot(src, tmp_path / "o1", [{"LevelPruner": [{"sparsity": 0.5, "op_types": ["default"]}]}], str(path),
                num_samples=8, seq_len=32)
    with pytest.raises(ConfigError, match="layers outside the decoder blocks"):
        oneshot(src, tmp_path / "o2", [{"GptqQuantizer": [{"quant_bits": 4, "op_types": ["Linear"]},
                                                           {"quant_bits": 4, "op_names": ["lm_head"]}]}],
                str(path), num_samples=8, seq_len=32, progress=False)
    with pytest.raises(ConfigError, match=r"stage 0 \(GptqQuantizer\): config_list\[1\]: op_names \['lm_haed'\] match no layer"):
        oneshot(src, tmp_path / "o5", [{"GptqQuantizer": [{"quant_bits": 4, "op_types": ["Linear"]},
                                                          {"op_names": ["lm_haed"], "exclude": True}]}],
                str(path), num_samples=8, seq_len=32)
    real = hf_oneshot.shutil.disk_usage
    hf_oneshot.shutil.disk_usage = lambda p: real(p)._replace(free=1000)
    try:
        with pytest.raises(ConfigError, match=r"0\.00 GiB free beside OUT_DIR, the run needs about"):
            oneshot(src, tmp_path / "o3", GPTQ, str(path), num_samples=8, seq_len=32)
    finally:
        hf_oneshot.shutil.disk_usage = real
    with pytest.raises(ConfigError, match="does not exist"):
        oneshot(src, tmp_path / "no" / "o4", GPTQ, str(path), num_samples=8, seq_len=32)
    assert sorted(os.listdir(tmp_path)) == ["exists", "ids.npy", "src"]  # nothing made beside the refused outputs


def test_the_command_line_runs_the_same_compression(tmp_path, capsys):
    from compressor.app.cli import main

    src = llama(tmp_path, layers=2)
    path, _ = tokens(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("- GptqQuantizer: [{quant_bits: 4, group_size: 32, op_types: [Linear]}, "
                      "{op_names: [lm_head], exclude: true}]\n")
    argv = [str(src), str(tmp_path / "out"), "--recipe", str(recipe), "--data", str(path), "--num-samples", "8",
            "--seq-len", "32", "--batch-size", "4"]
    assert main(["oneshot", *argv]) == 0
    out = capsys.readouterr()
    assert "2 blocks, 14 layers compressed" in out.out and "block 2/2 model.layers.1: 7 layer(s), 8 samples" in out.err
    assert "model.layers.1.mlp.down_proj" in out.out and "error" in out.out.splitlines()[0]  # the per-layer table
    oneshot(src, tmp_path / "api", GPTQ, str(path), num_samples=8, seq_len=32, batch_size=4, progress=False)
    got, want = tensors_of(tmp_path / "out"), tensors_of(tmp_path / "api")
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    assert main(["oneshot", *argv]) == 2  # OUT_DIR exists now
    assert "exists; give a new folder" in capsys.readouterr().err
    assert main(["oneshot", str(src), str(tmp_path / "o3"), "--recipe", str(tmp_path / "nope.yaml"), "--data",
                 str(path)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["oneshot", *argv[:1], str(tmp_path / "o4"), *argv[2:], "--workers", "3"]) == 2
    assert "3 processes need at least 3 calibration batches, there are 2" in capsys.readouterr().err
    assert main(["oneshot", *argv[:1], str(tmp_path / "o5"), *argv[2:], "--workers", "2", "--threads", "1"]) == 0
    got = tensors_of(tmp_path / "o5")
    assert sorted(got) == sorted(want)


def test_a_two_stage_recipe_prunes_then_quantizes_each_block(tmp_path):
    """SparseGPT 2:4 then GPTQ w4 on each block in turn: the packed codes keep the 2:4 zeros (GPTQ respects the
    pruner's mask), the config says both, transformers loads the checkpoint."""
    src = llama(tmp_path, layers=2)
    path, ids = tokens(tmp_path)
    recipe = [{"SparseGPTPruner": [{"sparse_pattern": "2:4", "op_types": ["Linear"]},
                                   {"op_names": ["lm_head"], "exclude": True}]}, GPTQ[0]]
    summary = oneshot(src, tmp_path / "out", recipe, str(path), num_samples=8, seq_len=32, batch_size=4,
                      progress=False)
    assert [r["method"] for r in summary["rows"]] == ["sparsegpt"] * 7 + ["gptq"] * 7 + ["sparsegpt"] * 7 + ["gptq"] * 7
    from compressor.core.compressed_tensors import load_compressed_tensors

    weights = load_compressed_tensors(str(tmp_path / "out"))  # the packed layers decoded to float
    linear = [k for k in weights if k.startswith("model.layers.") and "proj.weight" in k]
    assert len(linear) == 14
    for k in linear:
        w = weights[k].reshape(weights[k].shape[0], -1, 4)
        assert int((w != 0).sum(-1).max()) <= 2, k  # 2:4 after quantization too
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized" and len(cfg["config_groups"]["group_0"]["targets"]) == 14
    with torch.no_grad():
        assert torch.isfinite(loaded(ids[:1]).logits).all()


KILLER = r"""
import os, signal, sys
import compressor.core.oneshot.stream as stream
import compressor.torch.hf_oneshot as h

kill_at, count = int(sys.argv[1]), [0]

def step():
    count[0] += 1
    if count[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

def wrap(owner, name):
    real = getattr(owner, name)
    def patched(*a, **k):
        step()
        return real(*a, **k)
    setattr(owner, name, patched)

wrap(stream.RunStore, "mark_done")
wrap(h, "_save")
wrap(h, "write_safetensors")
wrap(h.os, "replace")
wrap(h.shutil, "rmtree")
recipe = [{"GptqQuantizer": [{"quant_bits": 4, "group_size": 32, "op_types": ["Linear"]},
                             {"op_names": ["lm_head"], "exclude": True}]}]
h.oneshot(sys.argv[2], sys.argv[3], recipe, sys.argv[4], num_samples=8, seq_len=32, batch_size=4, progress=False)
print("steps", count[0])
"""


def test_sigkill_before_any_file_operation_resumes_to_the_same_checkpoint(tmp_path):
    """SIGKILL (no handler runs) just before each file operation of a run (state, block states, recorded inputs,
    shards, renames): OUT_DIR is absent or complete, and the same call afterwards writes the same checkpoint."""
    import subprocess
    import sys

    src = llama(tmp_path, layers=2)
    path, _ = tokens(tmp_path)
    (tmp_path / "killer.py").write_text(KILLER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(p) for p in (os.getcwd(),)] + sys.path)}

    def run(kill_at, out):
        return subprocess.run([sys.executable, str(tmp_path / "killer.py"), str(kill_at), str(src), str(out), str(path)],
                              capture_output=True, text=True, env=env, timeout=1800)
    full = run(0, tmp_path / "ref")
    assert full.returncode == 0, full.stderr[-2000:]
    total = int(full.stdout.split()[-1])
    assert total >= 10
    want = tensors_of(tmp_path / "ref")
    for k in range(1, total + 1):
        out = tmp_path / f"out{k}"
        killed = run(k, out)
        assert killed.returncode == -9, (k, killed.stderr[-2000:])
        assert not out.exists() or sorted(tensors_of(out)) == sorted(want)  # never a half-written OUT_DIR
        if not out.exists():
            oneshot(src, out, GPTQ, str(path), num_samples=8, seq_len=32, batch_size=4, progress=False)
        got = tensors_of(out)
        assert sorted(got) == sorted(want), k
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"kill {k}: {key}")
        if (tmp_path / f"out{k}.partial").exists():  # killed after OUT_DIR's rename: the next call clears it
            with pytest.raises(ConfigError, match="exists"):
                oneshot(src, out, GPTQ, str(path), num_samples=8, seq_len=32, batch_size=4, progress=False)
        assert not (tmp_path / f"out{k}.partial").exists()


def test_layers_the_checkpoint_cannot_pack_are_named_in_a_warning(tmp_path):
    """GPT-2's Conv1D layers are quantized but written as float weights (compressed-tensors packs Linear only): the
    call says so, as the in-memory export does, and the config claims no quantization."""
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    torch.manual_seed(0)
    src = tmp_path / "src"
    transformers.AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(src)
    path, _ = tokens(tmp_path)
    recipe = [{"GptqQuantizer": [{"quant_bits": 4, "group_size": 32, "op_types": ["default"]},
                                 {"op_names": ["lm_head"], "exclude": True}]}]
    with pytest.warns(UserWarning, match=r"written as float weights \(not packed\): 'transformer.h.0.attn.c_attn' "
                                         r"\(Conv1D: not a Linear"):
        summary = oneshot(src, tmp_path / "out", recipe, str(path), num_samples=8, seq_len=32, batch_size=4,
                          progress=False)
    assert len(summary["dense_notes"]) == 8 and summary["bytes_out"] >= summary["bytes_in"]
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
