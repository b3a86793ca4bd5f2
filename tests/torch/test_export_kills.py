"""Every PyTorch export kind killed before each of its file-system operations (hard: the process dies; soft: an
interrupt the export handles): each target is the whole old or the whole new version, all targets of one export
the same after the next call into the folder, nothing of the export left (core.atomic's journal). And the
hf_path folder is part of the all-or-nothing export."""

from __future__ import annotations

import errno
import shutil
import warnings

import pytest
import torch
from torch import nn

from compressor.core import atomic
from compressor.torch import LevelPruner, QAT_Quantizer, RtnQuantizer
from compressor.torch.weight_sharing import WeightSharingQuantizer
from tests._fs_kills import Killed, check_every_kill, count_ops, counted, listing, tree

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ALL = [{"op_types": ["default"]}]
CHECKPOINT = {"README.md": b"# my model", "tokenizer.json": b'{"v": 1}', "config.json": b"old config",
              "model.safetensors": b"old weights"}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _llama():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)).eval()


def _reset(root, files=(), checkpoint=None):
    """The old versions: ``files`` (relative paths) hold b'old <name>', ``checkpoint`` a checkpoint folder with a
    README and tokenizer beside its weights; everything else in ``root`` goes."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    (root / "onnx").mkdir()
    (root / "notes.txt").write_bytes(b"the user's own file")
    for f in files:
        (root / f).write_bytes(b"old " + f.encode())
    if checkpoint is not None:
        (root / checkpoint).mkdir()
        for name, data in CHECKPOINT.items():
            (root / checkpoint / name).write_bytes(data)


def _run_all(tmp_path, export, targets, old_files=(), checkpoint=None):
    root = tmp_path / "out"
    out = check_every_kill(export, [str(root / t) for t in targets], [str(root), str(root / "onnx")],
                           lambda: _reset(root, old_files, checkpoint), exchange_variants=checkpoint is not None)
    assert out["old"] > 0 and out["new"] > 0, out
    return root


def test_pruner_export_model_mask_onnx_compressed(tmp_path):
    model = _net()
    p = LevelPruner(model, [{"sparsity": 0.5, **ALL[0]}])
    p.compress()
    root = tmp_path / "out"

    def export():
        p.export_model(str(root / "model.pt"), mask_path=str(root / "masks.pt"), onnx_path=str(root / "onnx" / "m.onnx"),
                       input_shape=(2, 8), dynamo=False, compressed_path=str(root / "model.cmpk"))

    _run_all(tmp_path, export, ["model.pt", "masks.pt", "onnx/m.onnx", "model.cmpk"], old_files=("model.pt", "onnx/m.onnx"))


def test_quantizer_export_model_calibration_onnx(tmp_path):
    model = _net()
    q = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": {"weight": 8}, **ALL[0]}])
    q.compress()
    model(torch.randn(4, 8))
    root = tmp_path / "out"

    def export():
        q.export_model(str(root / "model.pt"), calibration_path=str(root / "calib.pt"),
                       onnx_path=str(root / "onnx" / "q.onnx"), input_shape=(2, 8), dynamo=False)

    _run_all(tmp_path, export, ["model.pt", "calib.pt", "onnx/q.onnx"], old_files=("onnx/q.onnx", "calib.pt"))


def test_weight_sharing_export_model_compressed(tmp_path):
    q = WeightSharingQuantizer(_net(), [{"quant_types": ["weight"], "quant_bits": {"weight": 2}, **ALL[0]}])
    q.compress()
    root = tmp_path / "out"

    def export():
        q.export_model(str(root / "model.pt"), compressed_path=str(root / "onnx" / "model.cmpk"))

    _run_all(tmp_path, export, ["model.pt", "onnx/model.cmpk"], old_files=("model.pt",))


def test_oneshot_quantizer_hf_path_with_model_and_calibration_files(tmp_path):
    q = RtnQuantizer(_llama(), [{"quant_bits": 4, "group_size": 16, **ALL[0]}])
    q.calibrate(progress=False)
    root = tmp_path / "out"

    def export():
        q.export_model(str(root / "model.pt"), calibration_path=str(root / "onnx" / "calib.pt"), hf_path=str(root / "ck"))

    root = _run_all(tmp_path, export, ["model.pt", "onnx/calib.pt", "ck"], old_files=("model.pt",), checkpoint="ck")
    _reset(root, ("model.pt",), "ck")
    export()
    assert listing(root / "ck") == ["README.md", "config.json", "generation_config.json", "model.safetensors",
                                    "tokenizer.json"]
    assert listing(root) == ["ck", "model.pt", "notes.txt", "onnx"]


def test_pruner_hf_path_with_mask_file(tmp_path):
    model = _llama()
    p = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}])
    p.compress()
    root = tmp_path / "out"

    def export():
        p.export_model(None, mask_path=str(root / "masks.pt"), hf_path=str(root / "ck"), hf_sparse_format="bitmask")

    _run_all(tmp_path, export, ["masks.pt", "ck"], old_files=("masks.pt",), checkpoint="ck")


def test_save_pretrained_of_a_compressed_model(tmp_path):
    model = _llama()
    RtnQuantizer(model, [{"quant_bits": 4, "group_size": 16, **ALL[0]}]).calibrate(progress=False)
    root = tmp_path / "out"

    def export():
        model.save_pretrained(str(root / "ck"))

    _run_all(tmp_path, export, ["ck"], checkpoint="ck")


def test_hf_path_lands_only_with_the_other_artifacts(tmp_path, monkeypatch):
    """A failing compressed_path write leaves the checkpoint folder as it was (it was replaced first before)."""
    from compressor.torch import cmpk

    model = _llama()
    p = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}])
    p.compress()
    root = tmp_path / "out"
    _reset(root, checkpoint="ck")
    before = tree(root)

    def full(state, path):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(cmpk, "save_compressed", full)
    with pytest.raises(OSError, match="No space left") as info:
        p.export_model(str(root / "model.pt"), compressed_path=str(root / "model.cmpk"), hf_path=str(root / "ck"))
    assert info.value.filename == str(root / "model.cmpk")
    assert tree(root) == before
    monkeypatch.undo()
    p.export_model(str(root / "model.pt"), compressed_path=str(root / "model.cmpk"), hf_path=str(root / "ck"))
    assert listing(root) == ["ck", "model.cmpk", "model.pt", "notes.txt", "onnx"]
    assert (root / "ck" / "README.md").read_bytes() == CHECKPOINT["README.md"]
    assert (root / "ck" / "config.json").read_bytes() != CHECKPOINT["config.json"]


def test_the_next_export_repairs_a_killed_one(tmp_path):
    """Killed while the old checkpoint folder is renamed aside (systems without the one-step swap): the folder is
    absent; the next export into it puts the old one back first, keeps its README, and lands."""
    q = RtnQuantizer(_llama(), [{"quant_bits": 4, "group_size": 16, **ALL[0]}])
    q.calibrate(progress=False)
    root = tmp_path / "out"

    def export():
        q.export_model(None, hf_path=str(root / "ck"))

    _reset(root, checkpoint="ck")
    n = count_ops(export)
    for k in range(1, n + 1):
        _reset(root, checkpoint="ck")
        with counted(k, True, no_exchange=True), pytest.raises(Killed):
            export()
        if not (root / "ck").exists():
            break
    else:
        raise AssertionError("no kill left the folder absent")
    assert any(name.startswith(".txn-") for name in listing(root))
    export()
    assert listing(root) == ["ck", "notes.txt", "onnx"]
    assert (root / "ck" / "README.md").read_bytes() == CHECKPOINT["README.md"]
    assert not any(name.startswith(".") for name in listing(root / "ck"))
    atomic.recover(root / "ck")  # nothing left to do
    assert listing(root) == ["ck", "notes.txt", "onnx"]
