"""``compressor report`` on inputs that used to crash it: a checkpoint whose tensors are all empty (no float
weights to compare with), names that are not valid Unicode (a lone surrogate: printed escaped), and a large
.tflite file (memory-mapped, never read whole: the work and memory of refusing one do not grow with it)."""

from __future__ import annotations

import json
import os
import struct
import tracemalloc

import numpy as np
import pytest

from compressor.app.cli import main
from compressor.app.report import format_sizes, format_table, layer_stats, read_weights
from compressor.core.compressed_tensors import checkpoint_report, format_checkpoint_report, write_safetensors
from compressor.core.errors import ModelError


def _folder(path, tensors):
    os.makedirs(path)
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"torch_dtype": "float32"}, f)
    return str(path)


def test_checkpoint_of_empty_tensors_reports_no_ratio(tmp_path, capsys):
    folder = _folder(tmp_path / "ck", {"a.weight": np.zeros((0, 3), np.float32), "b": np.zeros(0, np.int8)})
    rep = checkpoint_report(folder)
    assert rep["total"] == {"bytes": 0, "dense_bytes": 0, "files_bytes": os.path.getsize(
        os.path.join(folder, "model.safetensors")), "ratio": None}
    assert rep["layers"] == [{"layer": "a.weight", "format": "dense", "shape": [0, 3], "bits": None, "group_size": None,
                              "symmetric": None, "sparsity": 0.0, "bytes": 0, "dense_bytes": 0}]
    assert main(["report", folder]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == (f"total: 0 bytes of tensors vs 0 as a float checkpoint (no float weights); files "
                                    f"{rep['total']['files_bytes']:,} bytes")
    assert main(["report", folder, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["ratio"] is None


def test_a_lone_surrogate_in_a_tensor_name_is_printed_escaped(tmp_path, capsys):
    name = "blk\ud800.weight"  # safetensors headers are JSON: "\ud800" parses to a lone surrogate
    folder = _folder(tmp_path / "ck", {name: np.ones((2, 3), np.float32)})
    rep = checkpoint_report(folder)
    assert [r["layer"] for r in rep["layers"]] == [name]
    text = format_checkpoint_report(rep)
    assert text.encode("utf-8").decode("utf-8") == text  # printable on a UTF-8 terminal
    assert text.splitlines()[1].startswith("blk\\ud800.weight ")
    assert main(["report", folder]) == 0
    assert "blk\\ud800.weight" in capsys.readouterr().out
    assert main(["report", folder, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"][0]["layer"] == name  # JSON escapes it itself
    # the table of the other model files: the same escape
    rows = layer_stats([(name, np.array([[0.0, 1.0]], np.float32))])
    table = format_table(rows)
    assert table.encode("utf-8") and table.splitlines()[2].split()[0] == "blk\\ud800.weight"
    sizes = format_sizes([{"path": "m\udcff.pt", "bytes": 10, "ratio": 1.0}])
    assert sizes == "file  m\\udcff.pt  10 bytes  1.000x m\\udcff.pt"


def tiny_tflite() -> bytes:
    """The smallest TFLite flatbuffer the reader walks: a Model whose one SubGraph has no tensors or operators."""
    out = bytearray(struct.pack("<I", 20) + b"TFL3")          # root table at 20, file identifier
    out += struct.pack("<HHHHH", 10, 8, 0, 0, 4) + b"\0\0"    # 8: Model vtable (fields 0..2: subgraphs at +4)
    out += struct.pack("<iI", 20 - 8, 4)                      # 20: Model (vtable 8 back), subgraphs vector at 28
    out += struct.pack("<II", 1, 8)                           # 28: one subgraph, at 32 + 8 = 40
    out += struct.pack("<HH", 4, 4)                           # 36: SubGraph vtable (no fields)
    out += struct.pack("<i", 40 - 36)                         # 40: SubGraph
    return bytes(out)


def test_tflite_is_memory_mapped_not_read(tmp_path):
    small, big = tmp_path / "small.tflite", tmp_path / "big.tflite"
    small.write_bytes(tiny_tflite())
    big.write_bytes(tiny_tflite() + bytes(16 << 20))  # 16 MiB after the flatbuffer (large models keep buffers there)
    peaks = []
    for path in (small, big):
        with pytest.raises(ModelError):  # warm: imports
            read_weights(path)
        tracemalloc.start()
        with pytest.raises(ModelError, match=r"holds no layer weights"):
            read_weights(path)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < peaks[0] + 4096 and peaks[1] < 1 << 20, peaks  # reading it whole would take 16 MiB


def test_max_bytes_on_the_command_line_caps_and_raises_the_decoded_size(tmp_path, capsys):
    """``--max-bytes`` (report and unpack, checkpoint folders and .cmpk files): below what the weights decode to,
    one line naming the size and exit 2 with nothing written; at or above it the command runs."""
    from compressor.core.cmpk import pack

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    write_safetensors(str(ckpt / "model.safetensors"), {"layer.weight": np.ones((64, 64), np.float32)})
    pack({"w": np.ones((64, 64), np.float32)}, tmp_path / "w.cmpk")
    need = 64 * 64 * 4
    for cmd in (["report", str(ckpt)], ["unpack", str(ckpt), str(tmp_path / "o1.npz")],
                ["unpack", str(tmp_path / "w.cmpk"), str(tmp_path / "o2.npz")]):
        assert main([*cmd, "--max-bytes", str(need - 1)]) == 2
        err = capsys.readouterr().err
        assert f"{need:,}" in err and err.count("\n") == 1, err
        assert not (tmp_path / "o1.npz").exists() and not (tmp_path / "o2.npz").exists()
        assert main([*cmd, "--max-bytes", "16K"]) == 0
        capsys.readouterr()
        for out in ("o1.npz", "o2.npz"):
            (tmp_path / out).unlink(missing_ok=True)
    with pytest.raises(SystemExit) as e:  # argparse's own usage error
        main(["report", str(ckpt), "--max-bytes", "lots"])
    assert e.value.code == 2 and "a size in bytes" in capsys.readouterr().err
