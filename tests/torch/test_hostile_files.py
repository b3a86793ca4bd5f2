"""Issue 29 (items 7-9) on the torch side: ``compressor report`` on crafted / fuzzed ONNX files raises ModelError
(no IndexError / ValueError), torch mask files that are missing or not ours get a ConfigError naming the
file, ``load_compressed`` refuses a file that does not fit the model from its header alone (before any
tensor is decoded), and the CLI answers hostile files with exit code 2 and one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from compressor.cli import main
from compressor.core.errors import CompressedFileError, ConfigError, ModelError
from compressor.report import read_masks, read_weights
from tests.core.test_hostile_files import FUZZ_CASES, craft, fuzz_in_subprocess, onnx_model

pytestmark = pytest.mark.torch


# ---------------------------------------------------------------------------------------------- ONNX
def test_onnx_reader_on_the_reference_graph(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(onnx_model().SerializeToString())
    rows = read_weights(path)[0]
    assert [(n, a.dtype.name, a.shape) for n, a in rows] == [("conv", "float32", (4, 3, 3, 3)), ("fc", "int32", (5, 16))]
    assert int((rows[1][1] == 0).sum()) == 16  # code == zero point (3) in the first row: zero weights


def onnx_variant(tmp_path, edit) -> str:
    model = onnx_model()
    edit(model)
    path = tmp_path / "bad.onnx"
    path.write_bytes(model.SerializeToString())
    return str(path)


def test_crafted_onnx_graphs_are_model_errors(tmp_path):
    def no_dq_inputs(m):
        del m.graph.node[2].input[:]

    def short_raw_data(m):
        m.graph.initializer[0].raw_data = m.graph.initializer[0].raw_data[:10]

    def zero_points_on_a_missing_axis(m):
        m.graph.node[2].attribute.add().CopyFrom(__import__("onnx").helper.make_attribute("axis", 7))
        zp = next(i for i in m.graph.initializer if i.name == "fc.zp")
        zp.CopyFrom(__import__("onnx").numpy_helper.from_array(np.full(5, 3, np.int8), "fc.zp"))

    def huge_dims(m):
        del m.graph.initializer[0].dims[:]
        m.graph.initializer[0].dims.extend([1 << 40, 1 << 40])

    for edit in (no_dq_inputs, short_raw_data, zero_points_on_a_missing_axis, huge_dims):
        with pytest.raises(ModelError, match=r"bad\.onnx.*not a valid ONNX model"):
            read_weights(onnx_variant(tmp_path, edit))
    (tmp_path / "junk.onnx").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelError, match=r"cannot read .*junk\.onnx\' as an ONNX model"):
        read_weights(tmp_path / "junk.onnx")


def test_fuzz_onnx_report_bounded():
    res = fuzz_in_subprocess("tests.core.test_hostile_files:fuzz_onnx", FUZZ_CASES, mem_mb=256)
    assert res["unexpected"] == [], res
    assert res["kinds"].get("ModelError", 0) > FUZZ_CASES // 3, res
    assert res["worst_s"] < 1.0, res


# ---------------------------------------------------------------------------------------------- mask files
def test_bad_torch_mask_files_are_config_errors(tmp_path):
    from compressor.torch.pruning.export import apply_compression_results
    from compressor.torch.speedup import speedup_model

    model = nn.Sequential(nn.Linear(4, 3))
    before = model[0].weight.detach().clone()
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    torch.save({"0": {"weight": torch.ones(3, 4, dtype=torch.bool)}, "obj": nn.Linear(1, 1)}, tmp_path / "pickled.pt")
    for load in (lambda p: apply_compression_results(model, p), lambda p: speedup_model(model, torch.zeros(1, 4), masks=p)):
        with pytest.raises(ConfigError, match=r"mask file .*missing\.pt.* does not exist"):
            load(tmp_path / "missing.pt")
        with pytest.raises(ConfigError, match=r"cannot read mask file .*garbage\.pt"):
            load(tmp_path / "garbage.pt")
        with pytest.raises(ConfigError, match=r"cannot read mask file .*pickled\.pt.*UnpicklingError"):
            load(tmp_path / "pickled.pt")
    assert torch.equal(model[0].weight, before)
    # the report's mask reader: .npz with pickled content, a .npz that is no zip
    np.save(tmp_path / "obj.npy", np.array([None], dtype=object), allow_pickle=True)
    import zipfile

    with zipfile.ZipFile(tmp_path / "obj.npz", "w") as z:
        z.write(tmp_path / "obj.npy", "fc.npy")
    with pytest.raises(ConfigError, match=r"obj\.npz.*'fc' holds Python objects"):
        read_masks(tmp_path / "obj.npz")
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(ConfigError, match=r"text\.npz\' as a \.npz archive \(the mask file is not a zip file"):
        read_masks(tmp_path / "text.npz")


def test_npz_member_declaring_more_than_it_holds_is_refused_before_allocating(tmp_path):
    import zipfile

    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float32))
    header["shape"] = (1 << 40,)
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    with zipfile.ZipFile(tmp_path / "big.npz", "w") as z:
        z.writestr("w.npy", buf.getvalue() + bytes(16))
    with pytest.raises(ModelError, match=r"'w' declares shape \(1099511627776,\)"):
        read_weights(tmp_path / "big.npz")


# ---------------------------------------------------------------------------------------------- load_compressed
def test_load_compressed_checks_names_and_shapes_before_decoding(tmp_path):
    from compressor.torch.packing import load_compressed, save_compressed

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    save_compressed(model.state_dict(), tmp_path / "ok.cmpk")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # every stream is garbage, and one shape is wrong: the shape is what is reported (nothing decoded)
    entries = [[k, "<f4", list(v.shape), "ap", [["h", 7, int(v.numel()) * 4]]] for k, v in before.items()]
    entries[0][2] = [4, 3]
    path = tmp_path / "bad.cmpk"
    path.write_bytes(craft({"v": 1, "t": entries}, bytes(7 * len(entries))))
    with pytest.raises(CompressedFileError, match=r"'0\.weight' has shape \(4, 3\), the model's is \(3, 4\)"):
        load_compressed(model, path)
    entries[0][2] = [3, 4]
    path.write_bytes(craft({"v": 1, "t": entries}, bytes(7 * len(entries))))
    with pytest.raises(CompressedFileError, match="huffman stream is corrupt"):  # fits: then decoded, and refused
        load_compressed(model, path)
    entries.append(["extra", "<f4", [1 << 30], "rp", [["n", 0, 0], ["n", 0, 0]]])
    path.write_bytes(craft({"v": 1, "t": entries}, bytes(7 * (len(entries) - 1))))
    with pytest.raises(CompressedFileError, match=r"unexpected keys \['extra'\]"):
        load_compressed(model, path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert load_compressed(model, tmp_path / "ok.cmpk") is model


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_on_hostile_files_exits_2_with_one_line(tmp_path, capsys):
    bomb = tmp_path / "bomb.cmpk"
    bomb.write_bytes(craft({"v": 1, "t": [["w", "<f4", [1 << 28], "rp", [["n", 0, 0], ["n", 0, 0]]]]}))
    deep = tmp_path / "deep.cmpk"
    deep.write_bytes(craft(text=b"[" * 100_000))
    onnx_bad = tmp_path / "bad.onnx"
    m = onnx_model()
    del m.graph.node[2].input[:]
    onnx_bad.write_bytes(m.SerializeToString())
    keras_bad = tmp_path / "m.keras"
    keras_bad.write_bytes(b"garbage")
    masks_bad = tmp_path / "masks.npz"
    masks_bad.write_bytes(b"garbage")
    good = tmp_path / "w.npz"
    np.savez(good, fc=np.ones((2, 2), np.float32))
    runs = {
        "its tensors hold 1,073,741,824 bytes": ["unpack", str(bomb), str(tmp_path / "out.npz")],
        "nested too deeply": ["unpack", str(deep), str(tmp_path / "out.npz")],
        "not a valid ONNX model": ["report", str(onnx_bad)],
        "not a .keras archive": ["report", str(keras_bad)],
        "masks.npz' as a .npz archive (the mask file is not a zip file": ["report", str(good), "--masks", str(masks_bad)],
    }
    for match, argv in runs.items():
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("compressor: error: ") and match in err, err
    assert not (tmp_path / "out.npz").exists()
