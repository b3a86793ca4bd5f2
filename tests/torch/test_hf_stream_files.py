"""compressor/torch/hf_stream.py: a checkpoint whose ``model.safetensors`` (or a shard) exists but is not a regular
file -- a FIFO (opening it would block), a folder, a link to ``/proc/self/mem`` (reads fail with an OSError) or a
dangling link -- is refused with a CheckpointError naming the file, before anything is read from it."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from compressor.core.compressed_tensors import CheckpointError

tr = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")
from compressor.torch.hf_stream import HfCheckpoint  # noqa: E402

pytestmark = pytest.mark.torch

NOT_REGULAR = ("the safetensors file is not a regular file (a directory, FIFO, socket or device); a checkpoint's "
               "files must be regular files")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_files")
    cfg = tr.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(cfg)
    model.save_pretrained(str(root / "single"), safe_serialization=True)
    model.save_pretrained(str(root / "sharded"), safe_serialization=True, max_shard_size="20KB")
    return root


def replaced(saved, tmp_path, name: str, file: str, how: str) -> str:
    folder = str(tmp_path / name)
    shutil.copytree(saved / name, folder)
    path = os.path.join(folder, file)
    os.remove(path)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "dir":
        os.mkdir(path)
    elif how == "mem":
        os.symlink("/proc/self/mem", path)
    else:
        os.symlink(os.path.join(folder, "gone"), path)
    return path


CASES = [("fifo", NOT_REGULAR), ("dir", NOT_REGULAR),
         ("mem", "truncated safetensors file (0 bytes, no header length)"),
         ("dangling", "cannot read the safetensors file (No such file or directory)")]


@pytest.mark.parametrize("how,message", CASES, ids=[c[0] for c in CASES])
def test_a_model_file_that_is_no_regular_file_is_refused_by_name(saved, tmp_path, how, message):
    if how == "fifo" and not hasattr(os, "mkfifo") or how == "mem" and not os.path.exists("/proc/self/mem"):
        pytest.skip("needs FIFOs / procfs")
    path = replaced(saved, tmp_path, "single", "model.safetensors", how)
    with pytest.raises(CheckpointError) as e:
        HfCheckpoint(os.path.dirname(path))
    assert str(e.value) == f"{path!r}: {message}"


@pytest.mark.parametrize("how,message", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_a_shard_that_is_no_regular_file_is_refused_by_name(saved, tmp_path, how, message):
    if how == "fifo" and not hasattr(os, "mkfifo"):
        pytest.skip("needs FIFOs")
    shards = sorted(n for n in os.listdir(saved / "sharded") if n.endswith(".safetensors"))
    assert len(shards) > 1
    path = replaced(saved, tmp_path, "sharded", shards[-1], how)
    with pytest.raises(CheckpointError) as e:
        HfCheckpoint(os.path.dirname(path))
    assert str(e.value) == f"{path!r}: {message}"
