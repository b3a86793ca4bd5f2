"""Issue 29 (items 7-9) on the torch side: ``compressor report`` on crafted / fuzzed ONNX files raises ModelError
(no IndexError / ValueError), torch mask files that are missing or not ours get a ConfigError naming the
file, ``load_compressed`` refuses a file that does not fit the model from its header alone (before any
tensor is decoded), and the CLI answers hostile files with exit code 2 and one line. Torch ``.pt`` files: zip
bombs, pickles that allocate (``bytearray(n)``, quantized tensors) or run long, stride-0 views and legacy files
are refused before or right after ``torch.load`` (compressor.core.archives); ONNX: the size cap and external
data references. Fuzz: .pt and ONNX readers in a memory-capped subprocess."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
from torch import nn

from compressor.cli import main
from compressor.core.errors import CompressedFileError, ConfigError, ModelError
from compressor.report import read_masks, read_weights
from tests.core.test_hostile_files import FUZZ_CASES, bounded_work, craft, fuzz_in_subprocess, onnx_model

pytestmark = pytest.mark.torch

#: Python lines a reader may execute to refuse a file from its size, zip directory or first pickle opcodes
#: (no step per byte or per declared value; measured: 50 to 1,500)
LINES_TO_REFUSE = 10_000
_WARM: list[bool] = []  # a .pt file was read in this process (see refused_pt)


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


def test_onnx_size_cap_and_external_data_are_checked_before_loading(tmp_path):
    import onnx

    from compressor.report import ONNX_MAX_BYTES
    from tests.core.test_hostile_files import measured

    big = tmp_path / "big.onnx"
    with open(big, "wb") as f:  # sparse: takes no disk
        f.truncate(ONNX_MAX_BYTES + 1)
    (tmp_path / "warm.onnx").write_bytes(onnx_model().SerializeToString())
    read_weights(tmp_path / "warm.onnx")  # (the reader's first imports are not the big file's work)
    err, lines, peak = measured(read_weights, big)
    assert isinstance(err, ModelError) and "big.onnx" in str(err) and "more than the 2,147,483,648" in str(err)
    assert lines < LINES_TO_REFUSE and peak < 1 << 20
    # external data: the weights in a file beside the model, then references that escape it or repeat it
    model = onnx_model()
    path = tmp_path / "ext.onnx"
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.bin",
                    size_threshold=0)
    assert [n for n, _ in read_weights(path)[0]] == ["conv", "fc"]
    saved = onnx.load(path, load_external_data=False)

    def edit(fn) -> str:
        m = type(saved)()
        m.CopyFrom(saved)
        fn(m)
        out = tmp_path / "bad.onnx"
        out.write_bytes(m.SerializeToString())
        return str(out)

    def escape(m):
        for e in m.graph.initializer[0].external_data:
            if e.key == "location":
                e.value = "../outside.bin"

    def repeat(m):  # every tensor names the whole file: N x its bytes read from one file
        for init in m.graph.initializer:
            for e in init.external_data:
                if e.key == "offset":
                    e.value = "0"
                if e.key == "length":
                    e.value = str((tmp_path / "ext.bin").stat().st_size)

    (tmp_path.parent / "outside.bin").write_bytes(bytes(512))
    with pytest.raises(ModelError, match=r"bad\.onnx.*names external data '\.\./outside\.bin' outside the model's folder"):
        read_weights(edit(escape))
    with pytest.raises(ModelError, match=r"bad\.onnx.*tensors read [0-9,]+ bytes from the [0-9,]+-byte external data "
                                         r"file 'ext\.bin' \(overlapping regions\)"):
        read_weights(edit(repeat))


def test_fuzz_onnx_report_bounded():
    res = fuzz_in_subprocess("tests.core.test_hostile_files:fuzz_onnx", FUZZ_CASES, mem_mb=256)
    assert res["unexpected"] == [], res
    assert res["kinds"].get("ModelError", 0) > FUZZ_CASES // 3, res
    assert bounded_work(res), res


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
    from compressor.torch.cmpk import load_compressed, save_compressed

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
    from tests.core.test_hostile_files import zip_of

    keras_bomb = tmp_path / "bomb.keras"
    keras_bomb.write_bytes(zip_of([("config.json", b"{" + b" " * (16 << 20) + b"}"), ("model.weights.h5", b"")],
                                  deflated=("config.json",)))
    pt_bomb = tmp_path / "bomb.pt"
    pt_bomb.write_bytes(zip_of([("archive/data.pkl", b"\x80\x02}."), ("archive/data/0", bytes(16 << 20))],
                               deflated=("archive/data/0",)))
    runs = {
        "'config.json' inflates to 16,777,218 bytes": ["report", str(keras_bomb)],
        "'archive/data/0' inflates to 16,777,216 bytes": ["pack", str(pt_bomb), str(tmp_path / "out.cmpk")],
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
    assert not (tmp_path / "out.npz").exists() and not (tmp_path / "out.cmpk").exists()


# ---------------------------------------------------------------------------------------------- torch .pt files
def pt_entries(obj) -> dict[str, bytes]:
    """The zip entries torch.save writes for ``obj`` (names under 'archive/')."""
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as z:
        return {i.filename: z.read(i) for i in z.infolist()}


def pt_bytes(entries: dict[str, bytes], deflated: tuple[str, ...] = ()) -> bytes:
    """A zip of ``entries`` (stored, or deflated for the names in ``deflated``), as torch.load reads it."""
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data, zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED)
    return buf.getvalue()


def refused_pt(tmp_path, data: bytes, match: str) -> tuple[int, int]:
    """``read_weights`` of a crafted .pt: a ModelError naming the file and matching ``match``; (Python lines
    executed, peak bytes traced)."""
    from tests.core.test_hostile_files import measured

    if not _WARM:  # a valid file first: the counts are the crafted files' work, not the first read's imports
        torch.save({"fc.weight": torch.ones(2, 3), "fc.bias": torch.zeros(2)}, tmp_path / "warm.pt")
        with contextlib.suppress(ModelError):  # (refused while a test has lowered a cap: warmed later)
            read_weights(tmp_path / "warm.pt")
            _WARM.append(True)
    path = tmp_path / "crafted.pt"
    path.write_bytes(data)
    err, lines, peak = measured(read_weights, path)
    assert isinstance(err, ModelError) and "crafted.pt" in str(err), repr(err)
    assert __import__("re").search(match, str(err)), str(err)
    return lines, peak


def test_pt_zip_bomb_entry_is_refused_before_torch_inflates_it(tmp_path):
    import resource

    # a 1 GiB float32 storage whose zeros deflate to ~1 MB: torch.load would inflate all of it
    entries = pt_entries({"fc.weight": torch.zeros(2, 3)})
    pkl = entries["archive/data.pkl"]
    n = 1 << 28
    entries["archive/data.pkl"] = pkl.replace(b"K\x06t", b"J" + n.to_bytes(4, "little") + b"t", 1)
    entries["archive/data/0"] = bytes(64 << 20)  # written deflated: 64 MiB of zeros in ~64 KB
    data = pt_bytes(entries, deflated=("archive/data/0",))
    assert len(data) < 200_000
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lines, peak = refused_pt(tmp_path, data, r"archive/data/0' inflates to 67,108,864 bytes .*more than 100x "
                                             r"\(a zip bomb\)")
    assert lines < LINES_TO_REFUSE and peak < 4 * len(data) + (1 << 20)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 32 << 10  # KiB: nothing inflated
    # under the per-entry ratio (runs of 4 symbols deflate ~20x), but past what the file may inflate to
    runs = np.repeat(np.random.default_rng(0).integers(0, 4, 1 << 19, dtype=np.uint8), 16).tobytes()  # 8 MiB
    entries["archive/data/0"] = runs
    data = pt_bytes(entries, deflated=("archive/data/0",))
    assert 4 * len(data) + (1 << 20) < len(runs) < 100 * len(data)
    refused_pt(tmp_path, data, r"inflate to more than the [0-9,]+ bytes read from a file of")
    # a stored entry whose directory record claims more than it holds
    good = bytearray(pt_bytes(pt_entries({"w": torch.ones(4)})))
    cd = good.find(b"archive/data/0", good.find(b"PK\x01\x02")) - 46  # its central directory record
    assert good[cd:cd + 4] == b"PK\x01\x02"
    good[cd + 24:cd + 28] = (1 << 31).to_bytes(4, "little")  # its uncompressed size
    refused_pt(tmp_path, bytes(good), r"stored entry 'archive/data/0' claims 2,147,483,648 bytes but holds 16")


def test_pt_pickle_that_allocates_or_is_no_state_dict_is_refused(tmp_path, monkeypatch):
    from compressor.core import archives

    entries = pt_entries({"w": torch.ones(3)})
    # bytearray(2**40): allowed by weights_only, it would allocate 1 TiB from a 600-byte file
    entries["archive/data.pkl"] = b"\x80\x02}X\x01\x00\x00\x00wc__builtin__\nbytearray\n\x8a\x06\x00\x00\x00\x00\x00\x01\x85Rs."
    lines, peak = refused_pt(tmp_path, pt_bytes(entries), r"names builtins\.bytearray, which is not a dense tensor")
    assert lines < LINES_TO_REFUSE and peak < 1 << 20
    # a quantized tensor (torch allocates its declared size before checking it)
    entries["archive/data.pkl"] = b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_qtensor\n)Rs."
    refused_pt(tmp_path, pt_bytes(entries), r"_rebuild_qtensor")
    # a pickle of a million empty lists (~64 MB of Python objects and ~7 s of unpickling from 1 MB): the scan
    # stops at the budget (~15 lines per opcode scanned; torch's unpickler runs more per opcode it executes)
    entries["archive/data.pkl"] = b"\x80\x02}X\x01\x00\x00\x00w(" + b"]" * 1_000_000 + b"ls."
    lines, peak = refused_pt(tmp_path, pt_bytes(entries), r"more than 81,[0-9]{3} opcodes")
    assert lines < 25 * 82_000 and peak < 4 * 1_000_000 + (1 << 20), lines
    # too many entries (counted from the end record, before zipfile parses the directory)
    monkeypatch.setattr(archives, "TORCH_MAX_ENTRIES", 5)
    refused_pt(tmp_path, pt_bytes(pt_entries({"w": torch.ones(3)})), r"lists 7 entries, more than the 5 allowed")
    monkeypatch.undo()
    # views of one storage that together hold far more than the file (stride 0: torch allocates nothing)
    entries = pt_entries({f"v{i}": torch.zeros(1).expand(1 << 22) for i in range(20)})
    refused_pt(tmp_path, pt_bytes(entries), r"its tensors hold more than 67,[0-9,]+ bytes")
    # torch's legacy (non-zip) format, and a file that is nothing of torch's
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    refused_pt(tmp_path, path.read_bytes(), r"legacy format")
    refused_pt(tmp_path, b"hello" * 20, r"not a torch file")


def test_real_torch_files_still_read(tmp_path):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    optimizer = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4, 3, 3, 3)}},  # (as Adam's)
                 "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "amsgrad": False, "params": [0, 1]}]}
    cases = {"sd": model.state_dict(),
             "ckpt": {"state_dict": model.state_dict(), "optimizer": optimizer, "epoch": 3, "tags": {"a", "b"},
                      "blob": b"bytes", "c": 1j},
             "dtypes": {f"{d}.weight": torch.ones(2, 2, dtype=getattr(torch, d))
                        for d in ("float32", "bfloat16", "float16", "float8_e4m3fn")},
             "tied": {"emb.weight": (w := torch.randn(5, 3)), "head.weight": w, "part.weight": w[1:3]},
             "param": {"fc.weight": nn.Parameter(torch.ones(2, 2))}}
    for name, obj in cases.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        rows = read_weights(tmp_path / f"{name}.pt")[0]
        assert rows, name


def fuzz_pt(cases: int, limit) -> dict:
    """read_weights on mutated torch .pt files: raw truncations / flips, re-zipped pickles with flipped bytes or
    hostile integers, central-directory sizes and offsets changed, entries deflated."""
    import random
    import struct
    import tempfile

    from tests.core.test_hostile_files import fuzz_loop

    rng0 = np.random.default_rng(0)
    obj = {"conv.weight": torch.from_numpy(rng0.standard_normal((4, 3, 3, 3)).astype(np.float32)),
           "conv.bias": torch.zeros(4), "bn.num_batches_tracked": torch.tensor(7),
           "fc.weight": torch.ones(5, 16, dtype=torch.bfloat16), "fc.weight_mask": torch.ones(5, 16, dtype=torch.bool)}
    entries = pt_entries(obj)
    legit = pt_bytes(entries)
    path = os.path.join(tempfile.mkdtemp(), "fuzz.pt")
    hostile = [0, 1, 255, 1 << 16, 1 << 30, (1 << 31) - 1, -1, -(1 << 31)]

    def make(rng: random.Random) -> bytes:
        kind = rng.randrange(5)
        if kind == 0:
            return legit[:rng.randrange(len(legit))] if rng.random() < 0.8 else legit + bytes(rng.randrange(1, 64))
        if kind == 1:
            out = bytearray(legit)
            for _ in range(rng.randrange(1, 8)):
                out[rng.randrange(len(out))] = rng.randrange(256)
            return bytes(out)
        e = dict(entries)
        if kind == 2:  # the pickle: flipped bytes, or its integer arguments set to hostile values (valid CRC)
            pkl = bytearray(e["archive/data.pkl"])
            for _ in range(rng.randrange(1, 6)):
                if rng.random() < 0.5:
                    pkl[rng.randrange(len(pkl))] = rng.randrange(256)
                else:
                    at = [i for i, c in enumerate(pkl) if c == ord("J")]  # BININT: 4-byte signed int
                    i = rng.choice(at) if at else 0
                    pkl[i:i + 5] = b"J" + struct.pack("<i", rng.choice(hostile))
            e["archive/data.pkl"] = bytes(pkl)
            return pt_bytes(e)
        if kind == 3:  # a tensor's record replaced (shorter, longer, deflated zeros)
            name = rng.choice([n for n in e if "/data/" in n])
            e[name] = rng.choice([b"", e[name][:3], e[name] * 3, bytes(rng.choice([10, 1 << 16, 1 << 20]))])
            return pt_bytes(e, deflated=(name,) if rng.random() < 0.5 else ())
        out = bytearray(legit)  # central directory fields: sizes, offsets, name lengths, the entry count
        cds = [i for i in range(len(out) - 4) if out[i:i + 4] == b"PK\x01\x02"]
        for _ in range(rng.randrange(1, 4)):
            at = rng.choice(cds) + rng.choice([20, 24, 28, 42, 10])
            width = 2 if at - rng.choice(cds) in (28, 10) else 4
            out[at:at + width] = rng.randrange(1 << (8 * width)).to_bytes(width, "little")
        return bytes(out)

    def read(data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
        read_weights(path)

    read(legit)
    limit()
    return fuzz_loop(read, make, cases, (ModelError,), [legit])


def test_fuzz_pt_reader_bounded():
    res = fuzz_in_subprocess("tests.torch.test_hostile_files:fuzz_pt", FUZZ_CASES, mem_mb=256)
    assert res["unexpected"] == [], res
    assert res["kinds"].get("ModelError", 0) > FUZZ_CASES // 3, res
    assert bounded_work(res), res
