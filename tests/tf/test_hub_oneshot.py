"""compressor.tf.oneshot: a keras-hub preset compressed disk to disk one decoder block at a time (the backbone built
without weights, each block read from model.weights.h5 and released), equal to the in-memory Keras one-shot on
the same model and data, written as a preset of Keras's own quantized layers that keras-hub loads in a process
without compressor, resumable after a kill, and refusing bad input before anything is written.

The presets are tiny keras-hub models with random weights saved by ``save_to_preset``: a Llama 3 causal LM with a
byte-pair tokenizer and its preprocessor (hidden 128, so ``group_size: 128`` groups the MLP's down projection),
and a Gemma backbone (tied embeddings, another block class)."""

from __future__ import annotations

import filecmp
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")
pytest.importorskip("h5py")
tf = pytest.importorskip("tensorflow")

from compressor.app.cli import main as cli_main  # noqa: E402
from compressor.core.compressed_tensors import CheckpointError  # noqa: E402
from compressor.core.errors import ConfigError  # noqa: E402
from compressor.tf import AwqQuantizer, GptqQuantizer, SparseGPTPruner, hub_oneshot, to_keras_quantized  # noqa: E402
from compressor.tf.hub_stream import HubPreset  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

VOCAB, HIDDEN, N, LEN, BATCH = 256, 128, 8, 16, 4
GPTQ = [{"GptqQuantizer": [{"quant_bits": 4, "group_size": 128, "op_types": ["default"]}]}]
AWQ = [{"AwqQuantizer": [{"quant_bits": 4, "group_size": 128, "op_types": ["default"]}]}]
SPARSEGPT = [{"SparseGPTPruner": [{"sparsity": 0.5, "op_types": ["default"]}]}]
CLASSES = {"GptqQuantizer": GptqQuantizer, "AwqQuantizer": AwqQuantizer, "SparseGPTPruner": SparseGPTPruner}
TEXT = ("the quick brown fox jumps over the lazy dog while a bad cab grabs a crab and a faded decade ends "
        "in a haze of jazz and gaze ") * 8


def _tokenizer():
    vocab = {t: i for i, t in enumerate(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                          "<|end_header_id|>", "<|eot_id|>"])}
    for c in "abcdefghijklmnopqrstuvwxyzĠ":
        vocab[c] = len(vocab)
    merges = ["a b", "Ġ a", "t h", "th e"]
    for m in merges:
        vocab[m.replace(" ", "")] = len(vocab)
    return keras_hub.models.Llama3Tokenizer(vocabulary=vocab, merges=merges)


def _llama(path, layers=2, dtype=None, shard=None):
    keras.utils.set_random_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backbone = keras_hub.models.Llama3Backbone(vocabulary_size=VOCAB, num_layers=layers, num_query_heads=4,
                                                   num_key_value_heads=2, hidden_dim=HIDDEN,
                                                   intermediate_dim=2 * HIDDEN, dtype=dtype)
        pre = keras_hub.models.Llama3CausalLMPreprocessor(tokenizer=_tokenizer(), sequence_length=LEN)
        lm = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=pre)
        if shard is None:
            lm.save_to_preset(str(path))
        else:
            lm.save_to_preset(str(path), max_shard_size=shard)
    return path


def _gemma(path):
    keras.utils.set_random_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1,
                                       hidden_dim=HIDDEN, intermediate_dim=2 * HIDDEN, head_dim=64
                                       ).save_to_preset(str(path))
    return path


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    """The Llama preset, calibration text, the token windows core cuts from it with the preset's tokenizer (as a
    .npy array), and the streamed GPTQ w4 g128 preset from them, with what was watched during that run: each
    block's view of the others when it was read, the TensorFlow variables alive after each block."""
    root = tmp_path_factory.mktemp("presets")
    src = _llama(root / "llama")
    (root / "text.txt").write_text(TEXT)
    from compressor.core.token_data import token_windows

    stream = np.asarray(keras_hub.tokenizers.Tokenizer.from_preset(str(src))(TEXT)).reshape(-1)
    ids = token_windows(stream, num_samples=N, seq_len=LEN, source="text")
    np.save(root / "ids.npy", ids)
    loads, alive = [], []
    real_load = hub_oneshot._PresetIO.load_block

    def watching(self, block):
        loads.append([HubPreset.loaded(b) for b in self.blocks])  # every block's variables holding a value
        return real_load(self, block)

    def census(line):
        gc.collect()
        alive.append(sum(int(np.prod(o.shape)) * o.dtype.size for o in gc.get_objects()
                         if isinstance(o, tf.Variable) and not hasattr(o, "_value")))
    hub_oneshot._PresetIO.load_block = watching
    try:
        summary = _run(src, root / "gptq", GPTQ, root / "ids.npy", progress=census)
    finally:
        hub_oneshot._PresetIO.load_block = real_load
    return {"root": root, "llama": src, "ids": root / "ids.npy", "tokens": ids, "text": root / "text.txt",
            "gptq": root / "gptq", "summary": summary, "loads": loads, "alive": alive}


def _data(ids):
    ids = np.asarray(ids, dtype="int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}


def _in_memory(src, recipe, ids, backbone_only=False, dtype=None):
    """The in-memory Keras one-shot on the preset: calibrate on the same batches, then the layers Keras runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {} if dtype is None else {"dtype": dtype}
        model = (keras_hub.models.Backbone if backbone_only else keras_hub.models.CausalLM).from_preset(str(src),
                                                                                                        **kwargs)
        backbone = model if backbone_only else model.backbone
        (name, config), = recipe[0].items()
        comp = CLASSES[name](backbone, config)
        comp.calibrate([_data(ids[i:i + BATCH]) for i in range(0, len(ids), BATCH)], forward_dtype="model",
                       progress=False)
        if name == "SparseGPTPruner":
            comp.strip()
        else:
            to_keras_quantized(comp)
    return model, backbone


def _weights(backbone):
    return {v.path: np.asarray(v.numpy()) for v in backbone.weights}


def _run(src, out, recipe, data, **kw):
    kw = {"num_samples": N, "seq_len": LEN, "batch_size": BATCH, "progress": False, **kw}
    return hub_oneshot.oneshot(src, out, recipe, str(data), **kw)


RELOAD = textwrap.dedent("""
    import json, sys
    sys.modules["compressor"] = None  # keras-hub alone: importing compressor fails here
    import numpy as np
    import keras_hub
    ids = np.load(sys.argv[1]).astype("int32")
    out = {}
    for name in sys.argv[2:]:
        lm = keras_hub.models.CausalLM.from_preset(name)
        modes = sorted({str(l.quantization_mode) for l in lm.backbone._flatten_layers() if l.quantization_mode})
        logits = np.asarray(lm({"token_ids": ids, "padding_mask": np.ones_like(ids)}))
        np.save(name + ".logits.npy", logits)
        out[name] = modes
    print(json.dumps(out))
""")


def _written(out):
    """The backbone a written preset describes, with its weights file read by Keras's own loader."""
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backbone = keras.saving.deserialize_keras_object(cfg)
    backbone.load_weights(os.path.join(out, "model.weights.h5"))
    return backbone


def _assert_same_weights(got, want, what):
    want, have = _weights(want), _weights(got)
    assert sorted(want) == sorted(have), what
    for k in want:
        np.testing.assert_array_equal(have[k], want[k], err_msg=f"{what}: {k}")


def test_streamed_presets_equal_the_in_memory_one_shot_and_load_in_keras_hub_alone(presets, tmp_path):
    """GPTQ w4 g128, SparseGPT 50 % and AWQ w4 g128: every variable of the written backbone (Keras's int4 / AWQ
    layers' codes, scales, zero points, g_idx, AWQ scales; the pruned float kernels) equals the in-memory Keras
    one-shot's after to_keras_quantized, no other block holds weights when a block is read, and the presets load
    with keras-hub alone (a fresh process where importing compressor fails) and give the compressed model's
    logits."""
    src, ids = presets["llama"], presets["tokens"]
    assert presets["summary"]["blocks"] == 2 and len(presets["summary"]["rows"]) == 14
    assert presets["loads"] == [[0, 0], [0, 0]]  # no block holds its weights when the next one is read
    outs, refs = [], {}
    for name, recipe in (("gptq", GPTQ), ("sparsegpt", SPARSEGPT), ("awq", AWQ)):
        out = presets["gptq"] if name == "gptq" else tmp_path / name
        if name != "gptq":
            _run(src, out, recipe, presets["ids"])
        model, backbone = _in_memory(src, recipe, ids)
        _assert_same_weights(_written(out), backbone, name)
        refs[str(out)] = np.asarray(model(_data(ids[:2])))
        outs.append(str(out))
        assert sorted(os.listdir(out)) == sorted(os.listdir(src))  # tokenizer, preprocessor, assets copied
        assert filecmp.cmp(out / "tokenizer.json", src / "tokenizer.json", shallow=False)
        assert not os.path.exists(f"{out}.partial")
    np.save(tmp_path / "ids2.npy", ids[:2])
    proc = subprocess.run([sys.executable, "-c", RELOAD, str(tmp_path / "ids2.npy"), *outs], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    modes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert modes == {outs[0]: ["int4"], outs[1]: [], outs[2]: ["awq"]}
    for out in outs:
        np.testing.assert_allclose(np.load(out + ".logits.npy"), refs[out], rtol=1e-5, atol=1e-5, err_msg=out)


def test_each_block_gives_its_memory_back(presets):
    """After each block only the layers outside the blocks hold TensorFlow variables (the token embedding, its
    reverse, the final norm) and the compressor's step counter: the block's weights, its Keras int4 layers and
    the quantizer's codes and scales are all gone."""
    preset = HubPreset(presets["llama"])
    outside = sum(int(np.prod(s)) * 4 for n, (_, s, _) in preset.datasets.items()
                  if not n.startswith("layers/llama_transformer_decoder"))
    assert presets["alive"] == [outside + 8] * 2  # + the int64 step counter


def test_a_stopped_run_continues_at_the_unfinished_block_to_the_same_bytes(presets, tmp_path):
    """Stopped before block 1's file is written, the same call runs block 1 only and writes a preset whose every
    file equals an uninterrupted run's, byte for byte (HDF5 times are not recorded, layer names come from the
    source)."""
    src = presets["llama"]
    real_save = hub_oneshot._PresetIO.save_block
    calls = []

    def stopping(self, block, p):
        calls.append(p)
        if len(calls) == 2:
            raise KeyboardInterrupt  # stands for the kill: the run stops here, the run folder stays
        return real_save(self, block, p)
    hub_oneshot._PresetIO.save_block = stopping
    out = tmp_path / "out"
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(src, out, GPTQ, presets["ids"])
    finally:
        hub_oneshot._PresetIO.save_block = real_save
    assert not out.exists()
    assert json.loads((tmp_path / "out.partial" / "state" / "state.json").read_text())["done"] == 1
    lines = []
    _run(src, out, GPTQ, presets["ids"], progress=lines.append)
    assert len(lines) == 1 and lines[0].startswith("block 2/2 transformer_layer_1")
    _same_files(out, presets["gptq"])


def _same_files(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for f in names:
        if os.path.isfile(os.path.join(a, f)):
            assert filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False), f


KILLER = r"""
import os, signal, sys
import compressor.core.oneshot.stream as stream
import compressor.tf.hub_oneshot as h

name, nth = sys.argv[1].split(":")
seen = {}

def wrap(owner, attr):
    real = getattr(owner, attr)
    def patched(*a, **k):
        seen[attr] = seen.get(attr, 0) + 1
        if attr == name and seen[attr] == int(nth):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    setattr(owner, attr, patched)

wrap(stream.RunStore, "mark_done")
wrap(h, "_save_pickle")
wrap(h._PresetIO, "save_block")
wrap(h, "_write_json")
wrap(h.os, "replace")
wrap(h.shutil, "rmtree")
recipe = [{"GptqQuantizer": [{"quant_bits": 4, "group_size": 128, "op_types": ["default"]}]}]
h.oneshot(sys.argv[2], sys.argv[3], recipe, sys.argv[4], num_samples=8, seq_len=16, batch_size=4, progress=False)
"""


#: where the killed runs die: before block 0 is marked done (its file written), before block 1's recorded inputs
#: are written, while the output's JSON files are written, after OUT_DIR's rename (before the run folder goes)
KILLS = ["mark_done:2", "_save_pickle:1", "_write_json:1", "rmtree:1"]


def test_sigkill_in_each_phase_resumes_to_the_same_preset(presets, tmp_path):
    """SIGKILL (no handler runs) in each phase of a run: OUT_DIR is absent or whole, and the same call afterwards
    writes the uninterrupted run's preset, byte for byte; a run folder left after the rename is removed."""
    src = presets["llama"]
    (tmp_path / "killer.py").write_text(KILLER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    for i, kill in enumerate(KILLS):
        out = tmp_path / f"out{i}"
        killed = subprocess.run([sys.executable, str(tmp_path / "killer.py"), kill, str(src), str(out),
                                 str(presets["ids"])], capture_output=True, text=True, env=env, timeout=600)
        assert killed.returncode == -9, (kill, killed.stderr[-3000:])
        assert out.exists() == (kill == "rmtree:1"), kill  # never a half-written OUT_DIR
        if not out.exists():
            assert (tmp_path / f"out{i}.partial" / "state" / "state.json").exists()
            _run(src, out, GPTQ, presets["ids"])
        else:  # killed after OUT_DIR's rename: the next call clears the run folder
            with pytest.raises(ConfigError, match="exists"):
                _run(src, out, GPTQ, presets["ids"])
        _same_files(out, presets["gptq"])
        assert not (tmp_path / f"out{i}.partial").exists(), kill


def test_text_is_tokenized_with_the_presets_own_tokenizer(presets, tmp_path):
    """Text data goes through the preset's keras-hub tokenizer (no special tokens), cut into windows as core cuts
    any token stream: the same preset as from those windows given as an array."""
    assert presets["tokens"].max() < 40  # the tiny vocabulary's ids
    _run(presets["llama"], tmp_path / "text", GPTQ, presets["text"])
    _same_files(tmp_path / "text", presets["gptq"])


def test_a_sharded_bfloat16_preset_streams_in_bfloat16(presets, tmp_path):
    """A preset over max_shard_size (model.weights.json + shards) in bfloat16: read shard by shard, computed in
    bfloat16, equal to the in-memory run in bfloat16; the float layers stay bfloat16 in the output."""
    src = _llama(tmp_path / "src", dtype="bfloat16", shard=0.0002)
    assert os.path.isfile(src / "model.weights.json") and not os.path.isfile(src / "model.weights.h5")
    assert len([f for f in os.listdir(src) if f.endswith(".weights.h5")]) > 2
    _run(src, tmp_path / "out", GPTQ, presets["ids"])
    _, backbone = _in_memory(src, GPTQ, presets["tokens"], dtype="bfloat16")
    _assert_same_weights(_written(tmp_path / "out"), backbone, "bfloat16")
    import h5py

    with h5py.File(tmp_path / "out" / "model.weights.h5") as f:
        assert f["layers/llama_layer_norm/vars/0"].attrs["dtype"] == "bfloat16"


def test_gemma_streams_to_the_in_memory_result(tmp_path, presets):
    """Another family (Gemma: tied embeddings, its own decoder block class), a backbone-only preset, and another
    Keras layout: GPTQ w8 g64 codes in Keras's GPTQ layers (one byte a code, scales and zero points per group)."""
    src = _gemma(tmp_path / "gemma")
    recipe = [{"GptqQuantizer": [{"quant_bits": 8, "group_size": 64, "op_types": ["default"]}]}]
    _run(src, tmp_path / "out", recipe, presets["ids"])
    _, backbone = _in_memory(src, recipe, presets["tokens"], backbone_only=True)
    got = _written(tmp_path / "out")
    assert {str(layer.quantization_mode) for layer in got._flatten_layers() if layer.quantization_mode} == {"gptq"}
    _assert_same_weights(got, backbone, "gemma")


def test_bad_input_is_refused_before_anything_is_written(presets, tmp_path):
    src = presets["llama"]
    ids = presets["ids"]
    with pytest.raises(ConfigError, match="is inside SRC_DIR"):
        _run(src, src / "out", GPTQ, ids)
    (tmp_path / "exists").mkdir()
    with pytest.raises(ConfigError, match="exists; give a new folder"):
        _run(src, tmp_path / "exists", GPTQ, ids)
    with pytest.raises(ConfigError, match=r"stage 0 \(GptqQuantizer\): config_list\[1\]: op_names \['no_such'\] "
                                          r"match no layer.*named like \['transformer_layer_0/"):
        _run(src, tmp_path / "o1", [{"GptqQuantizer": [{"quant_bits": 4, "op_types": ["default"]},
                                                       {"op_names": ["no_such"], "exclude": True}]}], ids)
    with pytest.raises(ConfigError, match="no 'lm_head' layer"):
        _run(src, tmp_path / "o1", [{"GptqQuantizer": [{"quant_bits": 4, "op_types": ["default"]},
                                                       {"op_names": ["lm_head"], "exclude": True}]}], ids)
    with pytest.raises(ConfigError, match="8-bit AWQ codes have no stock Keras layer"):
        _run(src, tmp_path / "o1", [{"AwqQuantizer": [{"quant_bits": 8, "op_types": ["default"]}]}], ids)
    with pytest.raises(ConfigError, match=r"stage 0 \(RtnQuantizer\): layer 'transformer_layer_0/self_attention/query': "
                                          r"8-bit symmetric codes per output channel go into Keras's int8 layers"):
        _run(src, tmp_path / "o1", [{"RtnQuantizer": [{"quant_bits": 8, "op_types": ["default"]}]}], ids)
    (tmp_path / "ids.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"\.pt token file is read by the torch backend"):
        _run(src, tmp_path / "o1", GPTQ, tmp_path / "ids.pt")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(src, no_weights)
    os.remove(no_weights / "model.weights.h5")
    with pytest.raises(CheckpointError, match="neither model.weights.h5 nor model.weights.json"):
        _run(no_weights, tmp_path / "o1", GPTQ, ids)
    truncated = tmp_path / "truncated"
    shutil.copytree(src, truncated)
    with open(truncated / "model.weights.h5", "r+b") as f:
        f.truncate(4096)
    with pytest.raises(CheckpointError, match="not a readable HDF5 weights file"):
        _run(truncated, tmp_path / "o1", GPTQ, ids)
    other = tmp_path / "other"  # weights of another shape than config.json says
    shutil.copytree(src, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["config"]["intermediate_dim"] = 3 * HIDDEN
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has shape \[128, 256\], the model built from config.json expects "
                                              r"\[128, 384\]"):
        _run(other, tmp_path / "o1", GPTQ, ids)
    backbone_only = tmp_path / "backbone_only"  # no tokenizer: text cannot be read
    shutil.copytree(src, backbone_only, ignore=shutil.ignore_patterns("tokenizer.json"))
    with pytest.raises(ConfigError, match="text data needs the checkpoint's tokenizer"):
        _run(backbone_only, tmp_path / "o1", GPTQ, presets["text"])
    np.save(tmp_path / "big.npy", np.full((N, LEN), VOCAB))
    with pytest.raises(ConfigError, match="token id 256 at row 0, column 0 is outside the vocabulary"):
        _run(src, tmp_path / "o1", GPTQ, tmp_path / "big.npy")
    assert sorted(os.listdir(tmp_path)) == ["backbone_only", "big.npy", "exists", "ids.pt", "no_weights", "other",
                                            "truncated"]  # nothing made beside the refused outputs
    assert sorted(os.listdir(src)) == sorted(os.listdir(presets["root"] / "llama"))


def test_the_command_line_streams_a_keras_hub_preset(presets, tmp_path, capsys):
    src = presets["llama"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("- GptqQuantizer: [{quant_bits: 4, group_size: 128, op_types: [default]}]\n")
    argv = [str(src), str(tmp_path / "out"), "--recipe", str(recipe), "--data", str(presets["ids"]),
            "--num-samples", str(N), "--seq-len", str(LEN), "--batch-size", str(BATCH)]
    assert cli_main(["oneshot", *argv]) == 0
    out = capsys.readouterr()
    assert "2 blocks, 14 layers compressed" in out.out
    assert "block 2/2 transformer_layer_1: 7 layer(s), 8 samples" in out.err
    assert "transformer_layer_1/feedforward_output_dense" in out.out  # the per-layer table
    _same_files(tmp_path / "out", presets["gptq"])
    assert cli_main(["oneshot", *argv[:1], str(tmp_path / "o2"), *argv[2:], "--sparse-format", "bitmask"]) == 2
    assert "--sparse-format" in capsys.readouterr().err
