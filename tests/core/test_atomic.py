"""Issue 29: one export = one transaction (core.atomic): all targets move into place or none, old files stay
byte-identical, no temporary is left, errors name the target."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from compressor.app.cli import main
from compressor.core import atomic, npz
from compressor.core.atomic import atomic_path, atomic_paths, temp_path_for
from compressor.core.cmpk import pack
from compressor.core.errors import ConfigError
from compressor.core.npz import save_npz


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _listing(path):
    return sorted(p.name for p in path.iterdir())


def test_a_later_target_that_is_a_directory_changes_nothing(tmp_path):
    a, d = tmp_path / "model.pt", tmp_path / "model.onnx"
    a.write_bytes(b"old model")
    d.mkdir()
    with pytest.raises(IsADirectoryError) as info, atomic_paths(a, d) as (ta, td):
        _write(ta, b"new model")
        _write(td, b"onnx")
    assert info.value.filename == str(d)  # the target, not the temporary
    assert a.read_bytes() == b"old model" and d.is_dir()
    assert _listing(tmp_path) == ["model.onnx", "model.pt"]


def test_a_directory_cannot_replace_a_file(tmp_path):
    a, saved = tmp_path / "model.keras", tmp_path / "saved"
    a.write_bytes(b"old")
    saved.write_bytes(b"a file where the SavedModel folder goes")
    with pytest.raises(NotADirectoryError) as info, atomic_paths(a, saved) as (ta, ts):
        _write(ta, b"new")
        os.mkdir(ts)
        _write(os.path.join(ts, "saved_model.pb"), b"pb")
    assert info.value.filename == str(saved)
    assert a.read_bytes() == b"old" and saved.read_bytes() == b"a file where the SavedModel folder goes"
    assert _listing(tmp_path) == ["model.keras", "saved"]


def test_a_move_failing_half_way_puts_every_old_file_back(tmp_path, monkeypatch):
    a, b, c, d = (tmp_path / n for n in ("a.pt", "b.pt", "c.onnx", "saved"))
    a.write_bytes(b"old a")
    d.mkdir()
    (d / "old.pb").write_bytes(b"old d")
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(os.path.basename(dst))
        if os.path.basename(dst) == "c.onnx":  # the third move: ENOSPC
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError, match="No space left"), atomic_paths(a, d, b, c) as (ta, td, tb, tc):
        _write(ta, b"new a")
        os.mkdir(td)
        _write(os.path.join(td, "new.pb"), b"new d")
        _write(tb, b"new b")
        _write(tc, b"new c")
    monkeypatch.undo()
    assert "c.onnx" in calls
    assert a.read_bytes() == b"old a"  # moved in, then put back
    assert _listing(d) == ["old.pb"]  # the swapped folder is back
    assert _listing(tmp_path) == ["a.pt", "saved"]  # b.pt (new) removed again, no temporary, no backup


def test_overwrite_keeps_the_mode_and_writes_through_a_symlink(tmp_path):
    real = tmp_path / "real.pt"
    real.write_bytes(b"old")
    os.chmod(real, 0o600)
    link = tmp_path / "link.pt"
    link.symlink_to(real)
    with atomic_path(link) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path)
        _write(tmp, b"new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() == b"new"
    assert oct(os.stat(real).st_mode & 0o777) == "0o600"
    assert _listing(tmp_path) == ["link.pt", "real.pt"]


def test_a_250_character_name_works_and_keeps_its_extension(tmp_path):
    name = "m" * 244 + ".keras"  # 250 bytes: the file system takes it, so must the export
    tmp = temp_path_for(tmp_path / name)
    assert len(os.path.basename(tmp)) == 255 and tmp.endswith("m.keras")
    with atomic_path(tmp_path / name) as t:
        _write(t, b"x")
    assert _listing(tmp_path) == [name]
    nested = temp_path_for(temp_path_for(tmp_path / name))  # a temporary of a temporary (tf PTQ export)
    assert len(os.path.basename(nested)) == 255 and nested.endswith(".keras")


def test_the_same_file_twice_is_refused_before_writing(tmp_path):
    a = tmp_path / "model.pt"
    a.write_bytes(b"old")
    (tmp_path / "alias.pt").symlink_to(a)
    os.link(a, tmp_path / "hard.pt")
    for other in (a, tmp_path / "sub" / ".." / "model.pt", tmp_path / "alias.pt", tmp_path / "hard.pt"):
        with pytest.raises(ConfigError, match=r"model_path and mask_path are the same file"):
            with atomic_paths(a, None, other, names=("model_path", "onnx_path", "mask_path")):
                raise AssertionError("the body must not run")
    assert a.read_bytes() == b"old" and not (tmp_path / "sub").exists()


def test_write_errors_name_the_target(tmp_path):
    a, b = tmp_path / "model.pt", tmp_path / "masks.pt"
    a.write_bytes(b"old")
    with pytest.raises(OSError) as info, atomic_paths(a, b) as (ta, tb):
        _write(ta, b"new")
        raise OSError(errno.ENOSPC, "No space left on device", tb)
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, str(b))
    assert ".tmp-" not in str(info.value)
    # a writer that wraps the system error (torch: RuntimeError "enforce fail at inline_container.cc" whose
    # context is the OSError of the file object, which names no file): the temporary written last is named
    with pytest.raises(OSError) as info, atomic_paths(a, b) as (ta, tb):
        _write(ta, b"new")
        _write(tb, b"partial")
        try:
            raise OSError(errno.EFBIG, "File too large")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    assert (info.value.errno, info.value.filename) == (errno.EFBIG, str(b))
    assert "inline_container" not in str(info.value)
    assert a.read_bytes() == b"old" and _listing(tmp_path) == ["model.pt"]
    # an error about a file that is not ours (an input read in the body) passes unchanged
    with pytest.raises(FileNotFoundError) as info, atomic_paths(a):
        open(tmp_path / "missing.bin", "rb")
    assert info.value.filename == str(tmp_path / "missing.bin")


# ---------------------------------------------------------------- .npz names and the CLI's output paths
SAVEZ_NAMES = {"file": np.arange(3, dtype=np.float32), "allow_pickle": np.ones((2, 2), bool),
               "args": np.array([7], np.int64), "kwds": np.zeros(0, np.float16), "layer/0.weight": np.eye(2)}


def test_save_npz_keeps_names_np_savez_takes_as_its_own_arguments(tmp_path):
    save_npz(tmp_path / "m.npz", SAVEZ_NAMES)
    with np.load(tmp_path / "m.npz", allow_pickle=False) as data:
        assert sorted(data.files) == sorted(SAVEZ_NAMES)
        for k, v in SAVEZ_NAMES.items():
            assert data[k].dtype == v.dtype and np.array_equal(data[k], v)
    with pytest.raises(ValueError, match="pickle"):
        save_npz(tmp_path / "o.npz", {"o": np.array([object()], dtype=object)})


def test_cli_unpack_to_npz_round_trips_every_name(tmp_path, capsys):
    pack(SAVEZ_NAMES, tmp_path / "m.cmpk")
    assert main(["unpack", str(tmp_path / "m.cmpk"), str(tmp_path / "out.npz")]) == 0
    with np.load(tmp_path / "out.npz", allow_pickle=False) as data:
        assert sorted(data.files) == sorted(SAVEZ_NAMES)
        assert all(np.array_equal(data[k], v) for k, v in SAVEZ_NAMES.items())
    assert "5 tensors" in capsys.readouterr().out


def test_cli_output_path_problems_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    pack({"w": np.ones(4, np.float32)}, tmp_path / "m.cmpk")
    (tmp_path / "dir.npz").mkdir()
    assert main(["unpack", str(tmp_path / "m.cmpk"), str(tmp_path / "dir.npz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compressor: error: [Errno 21]") and str(tmp_path / "dir.npz") in err
    assert "Traceback" not in err and ".tmp-" not in err and err.count("\n") == 1
    long_name = "w" * 236 + ".npz"  # 240 characters: a valid name
    assert main(["unpack", str(tmp_path / "m.cmpk"), str(tmp_path / long_name)]) == 0
    assert (tmp_path / long_name).is_file()
    too_long = "w" * 300 + ".npz"
    assert main(["unpack", str(tmp_path / "m.cmpk"), str(tmp_path / too_long)]) == 2
    assert "File name too long" in capsys.readouterr().err

    def read_only(path, arrays):
        raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))

    monkeypatch.setattr(npz, "save_npz", read_only)
    assert main(["unpack", str(tmp_path / "m.cmpk"), str(tmp_path / "ro.npz")]) == 2
    err = capsys.readouterr().err
    assert err == f"compressor: error: [Errno 30] Read-only file system: '{tmp_path / 'ro.npz'}'\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["dir.npz", long_name, "m.cmpk"])
