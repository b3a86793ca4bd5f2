"""The compressed-tensors checkpoint format in numpy (compressor.core.compressed_tensors): bit packing,
the safetensors container, the reader's checks and the report's byte counts, on hand-built folders."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from compressor.app.cli import main
from compressor.core.compressed_tensors import (
    CheckpointError,
    bitmask_entries,
    checkpoint_report,
    is_24_sparse,
    load_compressed_tensors,
    naive_quantized_entries,
    pack_bitmask,
    pack_int32,
    pack_quantized_entries,
    pack_stored_int32,
    quant_args,
    read_safetensors,
    sparse24_entries,
    unpack_bitmask,
    unpack_int32,
    write_safetensors,
)
from compressor.core.errors import ModelError
from compressor.core.oneshot.codes import store_codes


def test_pack_int32_exact_words():
    # 4 bits: stored values code + 8 = [0, 15, 8, 9], nibble i at bits 4i..4i+3 of the row's first word
    packed = pack_int32(np.array([[-8, 7, 0, 1]], np.int8), 4)
    assert packed.dtype == np.int32 and packed.shape == (1, 1)
    assert int(packed[0, 0]) == 0 | 15 << 4 | 8 << 8 | 9 << 12
    # 3 bits straddle words: 11 codes = 33 bits -> 2 words; code 3 (stored 7) at bits 30..32
    codes = np.zeros((1, 11), np.int8)
    codes[0, 10] = 3
    words = pack_int32(codes, 3).view(np.uint32)
    base = sum(4 << (3 * i) for i in range(10))  # stored 4 (= 0 + 4) everywhere else
    assert words.shape == (1, 2)
    assert int(words[0, 0]) == (base | 7 << 30) & 0xFFFFFFFF and int(words[0, 1]) == 1
    with pytest.raises(ValueError, match="outside the signed 4-bit range"):
        pack_int32(np.array([[8]]), 4)


def test_codes_in_the_wrappers_layout_pack_to_the_same_words_without_unpacking():
    """The one-shot wrappers keep 4-bit codes two per byte; the checkpoint's int32 words are those bytes with each
    nibble's top bit flipped (code + 8), the odd last column's partner nibble zero, as pack_int32 pads."""
    stored = store_codes(np.array([[-8, 7, 0, 1, -1]], np.int8), 4)  # bytes 0x78, 0x10, 0x0F (odd last column)
    words = pack_stored_int32(stored, 4, 5).view(np.uint32)
    assert words.shape == (1, 1)
    assert int(words[0, 0]) == 0 | 15 << 4 | 8 << 8 | 9 << 12 | 7 << 16
    rng = np.random.default_rng(0)
    for bits in (2, 3, 4, 8):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        for cols in (1, 7, 8, 9, 64, 129):
            codes = rng.integers(lo, hi + 1, size=(5, cols)).astype(np.int8)
            got = pack_stored_int32(store_codes(codes, bits), bits, cols)
            np.testing.assert_array_equal(got, pack_int32(codes, bits))
    with pytest.raises(ValueError, match=r"kept as int8 \[rows, 3\]"):
        pack_stored_int32(np.zeros((2, 4), np.int8), 4, 5)
    ent = pack_quantized_entries("l", store_codes(codes, 8), np.ones((5, 1)), np.zeros((5, 1)), 8, True,
                                 stored_cols=129)
    np.testing.assert_array_equal(ent["l.weight_packed"], pack_int32(codes, 8))
    assert ent["l.weight_shape"].tolist() == [5, 129]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("cols", [1, 31, 32, 33, 100])
def test_pack_unpack_round_trip(bits, cols):
    rng = np.random.default_rng(bits * 100 + cols)
    c = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=(3, cols)).astype(np.int8)
    p = pack_int32(c, bits)
    assert p.shape == (3, -(-cols * bits // 32))
    np.testing.assert_array_equal(unpack_int32(p, bits, cols), c)


def test_bitmask_and_24():
    m = np.array([[1, 0, 0, 0, 0, 0, 0, 0, 1]], bool)
    assert pack_bitmask(m).tolist() == [[1, 1]]
    np.testing.assert_array_equal(unpack_bitmask(pack_bitmask(m), 9), m)
    w = np.array([[0.0, 2.0, 0.0, 3.0, 0.0, 0.0, 0.0, 5.0]], np.float32)
    assert is_24_sparse(w) and not is_24_sparse(np.ones((1, 8)))
    e = sparse24_entries("l", w)
    # a group with one non-zero keeps a zero at its lowest free position: [0(pos 4), 5(pos 7)]
    assert e["l.compressed"].tolist() == [[2.0, 3.0, 0.0, 5.0]]
    assert e["l.bitmask"].tolist() == [[0b10011010]] and e["l.shape"].shape == (2, 1)
    b = bitmask_entries("l", w)
    assert b["l.compressed"].tolist() == [2.0, 3.0, 5.0] and b["l.row_offsets"].tolist() == [0]


def test_safetensors_round_trip_and_size(tmp_path):
    t = {"b": np.arange(6, dtype=np.int32).reshape(2, 3), "a": np.ones(3, np.float32)}
    n = write_safetensors(tmp_path / "x.safetensors", t)
    assert n == os.path.getsize(tmp_path / "x.safetensors") and (n - 24 - 12) % 8 == 0
    back = read_safetensors(tmp_path / "x.safetensors")
    assert set(back) == {"a", "b"} and back["b"].dtype == np.int32
    np.testing.assert_array_equal(back["b"], t["b"])


def _checkpoint(folder, symmetric=True, sparse=False):
    """A hand-built checkpoint: layer 'q' 4-bit g4 [2, 8] (packed or naive), layer 's' sparse-bitmask [2, 8],
    'emb' float [4, 2]."""
    os.makedirs(folder, exist_ok=True)
    codes = np.array([[-7, 7, 0, 1, 2, 3, -1, -2], [1, 1, 1, 1, 0, 0, 0, 0]])
    scale = np.array([[0.5, 0.25], [1.0, 2.0]])
    if symmetric:
        entries = pack_quantized_entries("q", codes, scale, None, 4, True)
    else:
        entries = naive_quantized_entries("q", codes + 8, scale, np.array([[8, 9], [7, 8]]), 4, False)
    w = np.array([[0, 1.5, 0, 0, 0, 0, 0, 2], [0, 0, 0, 0, 0, 0, 0, 0]], np.float32)
    tensors = {**entries, "emb.weight": np.arange(8, dtype=np.float32).reshape(4, 2)}
    if sparse:
        tensors.update(bitmask_entries("s", w))
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized" if symmetric else "naive-quantized",
          "config_groups": {"group_0": {"targets": ["q"], "weights": quant_args(4, 4, symmetric),
                                        "format": "pack-quantized" if symmetric else "naive-quantized"}},
          "sparsity_config": {"format": "sparse-bitmask"} if sparse else {}}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"torch_dtype": "float32", "quantization_config": qc}, f)
    return codes, scale, w


def test_reader_and_report_exact(tmp_path):
    codes, scale, w = _checkpoint(tmp_path / "ck", sparse=True)
    out = load_compressed_tensors(tmp_path / "ck")
    assert set(out) == {"q.weight", "s.weight", "emb.weight"}
    np.testing.assert_array_equal(out["q.weight"], (codes * np.repeat(scale, 4, axis=1)).astype(np.float32))
    np.testing.assert_array_equal(out["s.weight"], w)
    rep = checkpoint_report(tmp_path / "ck")
    rows = {r["layer"]: r for r in rep["layers"]}
    # q: weight_packed 2x1 int32 (8) + weight_scale 2x2 f32 (16) + weight_shape 2 int64 (16) = 40 bytes
    assert rows["q.weight"] == {"layer": "q.weight", "format": "pack-quantized", "shape": [2, 8], "bits": 4,
                                "group_size": 4, "symmetric": True, "sparsity": 5 / 16, "bytes": 40,
                                "dense_bytes": 64}
    # s: 2 values f32 (8) + bitmask 2x1 (2) + row_offsets 2 int64 (16) + shape (16) = 42 bytes
    assert rows["s.weight"]["bytes"] == 42 and rows["s.weight"]["sparsity"] == 14 / 16
    assert rows["emb.weight"]["bytes"] == 32 and rows["emb.weight"]["format"] == "dense"
    assert rep["total"]["bytes"] == 40 + 42 + 32 and rep["total"]["dense_bytes"] == 64 + 64 + 32
    assert rep["total"]["files_bytes"] == os.path.getsize(tmp_path / "ck" / "model.safetensors")


def test_reader_asymmetric_naive(tmp_path):
    codes, scale, _ = _checkpoint(tmp_path / "ck", symmetric=False)
    zp = np.repeat(np.array([[8, 9], [7, 8]]) - 8, 4, axis=1)
    out = load_compressed_tensors(tmp_path / "ck")
    np.testing.assert_array_equal(out["q.weight"], ((codes - zp) * np.repeat(scale, 4, axis=1)).astype(np.float32))


def test_truncated_file_is_a_clear_error_and_unpack_leaves_target(tmp_path):
    _checkpoint(tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        load_compressed_tensors(tmp_path / "ck")
    assert issubclass(CheckpointError, ModelError)
    target = tmp_path / "out.npz"
    target.write_bytes(b"old")
    assert main(["unpack", str(tmp_path / "ck"), str(target)]) != 0
    assert target.read_bytes() == b"old"


def test_config_mismatch_and_unknown_format(tmp_path):
    _checkpoint(tmp_path / "ck")
    cfg_path = tmp_path / "ck" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 2
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"weight_scale is float32 \[2, 2\], expected a float \[2, 4\]"):
        load_compressed_tensors(tmp_path / "ck")
    cfg["quantization_config"]["format"] = "nvfp4-pack-quantized"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'nvfp4-pack-quantized' is not supported"):
        load_compressed_tensors(tmp_path / "ck")


def test_cli_report_and_unpack_on_folder(tmp_path, capsys):
    codes, scale, _ = _checkpoint(tmp_path / "ck")
    assert main(["report", str(tmp_path / "ck"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["layer"] for r in rep["layers"]] == ["emb.weight", "q.weight"] and rep["total"]["bytes"] == 72
    assert main(["unpack", str(tmp_path / "ck"), str(tmp_path / "w.safetensors")]) == 0
    back = read_safetensors(tmp_path / "w.safetensors")
    np.testing.assert_array_equal(back["q.weight"], (codes * np.repeat(scale, 4, axis=1)).astype(np.float32))


def test_bfloat16_bit_patterns_are_written_as_bf16(tmp_path):
    bits = np.array([[0x3F80, 0xC000]], np.uint16)  # bfloat16 1.0, -2.0
    write_safetensors(tmp_path / "m.safetensors", {"w": bits, "f": np.ones(2, np.float32)}, bf16={"w"})
    header = json.loads((tmp_path / "m.safetensors").read_bytes()[8:8 + int.from_bytes(
        (tmp_path / "m.safetensors").read_bytes()[:8], "little")])
    assert header["w"]["dtype"] == "BF16" and header["f"]["dtype"] == "F32"
    got = read_safetensors(tmp_path / "m.safetensors")["w"]
    np.testing.assert_array_equal(np.asarray(got, np.float32), [[1.0, -2.0]])
    with pytest.raises(ValueError, match="has dtype uint16"):  # uint16 not named as bf16 is no safetensors dtype here
        write_safetensors(tmp_path / "n.safetensors", {"w": bits})
