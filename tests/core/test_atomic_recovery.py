"""An export killed at any point leaves each target whole (old or new), and the next call into the folder
finishes or undoes it (core.atomic's journal): killed before every file-system operation, hard (the process
dies: nothing more reaches the disk) and soft (an interrupt the export's own code handles)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
from pathlib import Path

import pytest

from compressor.core import atomic
from compressor.core.atomic import atomic_path, atomic_paths, recover, transaction
from compressor.core.errors import ConfigError
from tests._fs_kills import Killed, check_every_kill, counted, listing, tree


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _old_state(root):
    """Old versions: a file, a folder (a checkpoint), and a file in a second folder; nothing at the other
    targets."""
    import shutil

    for name in ("a", "b"):
        shutil.rmtree(root / name, ignore_errors=True)
    (root / "a").mkdir()
    (root / "b").mkdir()
    (root / "a" / "model.pt").write_bytes(b"old model")
    (root / "a" / "ckpt").mkdir()
    (root / "a" / "ckpt" / "config.json").write_bytes(b"old config")
    (root / "a" / "ckpt" / "README.md").write_bytes(b"old readme")
    (root / "b" / "model.onnx").write_bytes(b"old onnx")
    (root / "a" / "unrelated.txt").write_bytes(b"not ours")


def _export(root):
    a, b = root / "a", root / "b"

    def run():
        with atomic_paths(a / "model.pt", a / "ckpt", b / "model.onnx", b / "masks.pt") as (tm, tc, to, tk):
            _write(tm, b"new model")
            os.mkdir(tc)
            _write(os.path.join(tc, "config.json"), b"new config")
            _write(os.path.join(tc, "model.safetensors"), b"new weights")
            _write(to, b"new onnx")
            _write(tk, b"new masks")
    return run, [str(a / "model.pt"), str(a / "ckpt"), str(b / "model.onnx"), str(b / "masks.pt")], [str(a), str(b)]


def test_killed_before_every_operation_each_target_is_whole_and_all_agree(tmp_path):
    run, targets, folders = _export(tmp_path)
    out = check_every_kill(run, targets, folders, lambda: _old_state(tmp_path), exchange_variants=True)
    assert out["old"] > 0 and out["new"] > 0  # kills before and after the commit point were both tried
    _old_state(tmp_path)
    run()
    assert tree(tmp_path / "a" / "ckpt") == {"config.json": b"new config", "model.safetensors": b"new weights"}
    assert listing(tmp_path / "a") == ["ckpt", "model.pt", "unrelated.txt"]
    assert listing(tmp_path / "b") == ["masks.pt", "model.onnx"]


def test_the_next_export_into_the_folder_repairs_a_killed_one(tmp_path):
    _old_state(tmp_path)
    run, targets, _ = _export(tmp_path)
    ckpt = tmp_path / "a" / "ckpt"
    with counted(None, False) as state:
        run()
    n = state["n"]
    # find a kill that leaves the old folder renamed aside (the two-rename swap) and recover by exporting again
    for k in range(1, n + 1):
        _old_state(tmp_path)
        with counted(k, True, no_exchange=True):
            with pytest.raises(Killed):
                run()
        if not ckpt.exists():
            break
    else:
        raise AssertionError("no kill left the folder absent")
    assert any(n.startswith(".txn-") for n in listing(tmp_path / "a"))
    with atomic_path(tmp_path / "a" / "other.bin") as t:  # any export into that folder
        _write(t, b"other")
    assert tree(ckpt) == {"README.md": b"old readme", "config.json": b"old config"}
    assert tree(tmp_path / "b" / "model.onnx") == b"old onnx"  # the whole transaction, in both folders
    assert listing(tmp_path / "a") == ["ckpt", "model.pt", "other.bin", "unrelated.txt"]
    assert listing(tmp_path / "b") == ["model.onnx"]


def test_recovery_starting_in_the_second_folder_finds_the_journal(tmp_path):
    _old_state(tmp_path)
    run, targets, _ = _export(tmp_path)
    with counted(None, False) as state:
        run()
    _old_state(tmp_path)
    with counted(state["n"] - 4, True):  # in the final clean-up: committed, the kept old versions not yet gone
        with pytest.raises(Killed):
            run()
    assert any(n.endswith(".ref") for n in listing(tmp_path / "b"))
    recover(tmp_path / "b" / "model.onnx")
    assert tree(tmp_path / "b" / "model.onnx") == b"new onnx" and tree(tmp_path / "a" / "model.pt") == b"new model"
    assert listing(tmp_path / "a") == ["ckpt", "model.pt", "unrelated.txt"]
    assert listing(tmp_path / "b") == ["masks.pt", "model.onnx"]


def test_a_live_export_is_left_alone(tmp_path):
    """A transaction whose lock is held (another process exporting now) is not touched by a recovery."""
    target = tmp_path / "model.pt"
    target.write_bytes(b"old")
    with atomic_path(target) as t:
        _write(t, b"new")
        locks = [n for n in listing(tmp_path) if n.endswith(".lock")]
        assert len(locks) == 1
        journal = json.loads((tmp_path / locks[0].replace(".lock", ".json")).read_text())
        assert journal["state"] == "writing" and journal["entries"][0]["target"] == str(target)
        recover(target)  # our own, alive
        assert os.path.exists(t)
    assert target.read_bytes() == b"new" and listing(tmp_path) == ["model.pt"]
    # a lock held by someone else: a recovery skips it; once released, the next one cleans up
    (tmp_path / ".txn-0123abcd.lock").write_bytes(b"")
    (tmp_path / ".tmp-0123abcd-model.pt").write_bytes(b"half written")
    fd = os.open(tmp_path / ".txn-0123abcd.lock", os.O_RDWR)
    other = os.open(tmp_path / ".txn-0123abcd.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    recover(target)
    assert ".tmp-0123abcd-model.pt" in listing(tmp_path)
    os.close(fd)
    os.close(other)
    recover(target)
    assert listing(tmp_path) == ["model.pt"]


def test_targets_inside_one_another_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model_path .* is inside hf_path"):
        with atomic_paths(tmp_path / "ckpt", tmp_path / "ckpt" / "model.pt", names=("hf_path", "model_path")):
            raise AssertionError("the body must not run")
    with pytest.raises(ConfigError, match=r"model_path and path 1 are the same file"):
        with transaction():
            with atomic_paths(tmp_path / "m.pt", names=("model_path",)) as (t,):
                _write(t, b"x")
            with atomic_path(tmp_path / "m.pt"):
                raise AssertionError("the body must not run")
    assert listing(tmp_path) == []


def test_a_transaction_lands_all_its_blocks_or_none(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_bytes(b"old")
    with pytest.raises(RuntimeError, match="second artifact failed"):
        with transaction():
            with atomic_path(tmp_path / "ckpt") as t:
                os.mkdir(t)
                _write(os.path.join(t, "config.json"), b"new")
            assert tree(tmp_path / "ckpt") == {"config.json": b"old"}  # not yet: the transaction is open
            with atomic_path(tmp_path / "model.pt") as t:
                raise RuntimeError("second artifact failed")
    assert tree(tmp_path / "ckpt") == {"config.json": b"old"} and listing(tmp_path) == ["ckpt"]
    with transaction():
        with atomic_path(tmp_path / "ckpt") as t:
            os.mkdir(t)
            _write(os.path.join(t, "config.json"), b"new")
        with atomic_path(tmp_path / "model.pt") as t:
            _write(t, b"model")
    assert tree(tmp_path / "ckpt") == {"config.json": b"new"} and listing(tmp_path) == ["ckpt", "model.pt"]


def test_ctrl_c_while_the_targets_move_is_raised_once_they_all_moved(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    a.write_bytes(b"old a")
    b.write_bytes(b"old b")
    real = os.replace
    sent = []

    def replace(src, dst):
        if os.path.basename(dst) == "a.pt" and not sent:  # the first target's move: Ctrl-C now
            sent.append(dst)
            os.kill(os.getpid(), signal.SIGINT)
        return real(src, dst)

    atomic.os.replace = replace
    try:
        with pytest.raises(KeyboardInterrupt):
            with atomic_paths(a, b) as (ta, tb):
                _write(ta, b"new a")
                _write(tb, b"new b")
    finally:
        atomic.os.replace = real
    assert sent and a.read_bytes() == b"new a" and b.read_bytes() == b"new b"
    assert listing(tmp_path) == ["a.pt", "b.pt"]


def test_folders_an_export_created_go_again_when_it_is_rolled_back(tmp_path):
    import shutil

    target = tmp_path / "new" / "sub" / "model.pt"

    def reset():
        shutil.rmtree(tmp_path / "new", ignore_errors=True)

    def run():
        with atomic_path(target) as t:
            _write(t, b"model")

    out = check_every_kill(run, [str(target)], [str(tmp_path / "new" / "sub")], reset)
    assert out["old"] > 0 and out["new"] > 0
    reset()
    with counted(1, True), pytest.raises(Killed):  # killed creating the first folder
        run()
    recover(target)
    assert listing(tmp_path) == []


def test_a_reader_repairs_a_killed_export_before_it_reads(tmp_path):
    """Killed before each file-system operation of an export of a checkpoint folder and a .cmpk file (one
    transaction), then only READ: load_compressed_tensors and cmpk.unpack see the complete old or the complete
    new version, both the same one, and the folder holds nothing of the transaction afterwards."""
    import numpy as np

    from compressor.core import cmpk
    from compressor.core.compressed_tensors import load_compressed_tensors, write_safetensors

    ckpt, packed = tmp_path / "ckpt", tmp_path / "w.cmpk"
    old = {"layer.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}
    new = {"layer.weight": -np.arange(6, dtype=np.float32).reshape(2, 3)}

    def write(folder, file, tensors):
        os.mkdir(folder)
        (Path(folder) / "config.json").write_text('{"model_type": "llama"}')
        write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
        cmpk.pack(tensors, file)

    def export():
        with atomic_paths(ckpt, packed) as (tc, tp):
            write(tc, tp, new)

    def reset():
        import shutil

        shutil.rmtree(ckpt, ignore_errors=True)
        for n in os.listdir(tmp_path):
            p = tmp_path / n
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        ckpt.mkdir()
        (ckpt / "config.json").write_text('{"model_type": "llama"}')
        write_safetensors(str(ckpt / "model.safetensors"), old)
        cmpk.pack(old, packed)

    reset()
    with counted(None, False) as state:
        export()
    seen = set()
    for k in range(1, state["n"] + 1):
        reset()
        with counted(k, True, no_exchange=k % 2 == 0):
            with pytest.raises(Killed):
                export()
        got_ckpt = load_compressed_tensors(ckpt)["layer.weight"]
        got_file = cmpk.unpack(packed)["layer.weight"]
        version = "new" if np.array_equal(got_ckpt, new["layer.weight"]) else "old"
        np.testing.assert_array_equal(got_ckpt, {"old": old, "new": new}[version]["layer.weight"], err_msg=str(k))
        np.testing.assert_array_equal(got_file, {"old": old, "new": new}[version]["layer.weight"], err_msg=str(k))
        assert listing(tmp_path) == ["ckpt", "w.cmpk"], k
        assert listing(ckpt) == ["config.json", "model.safetensors"], k
        seen.add(version)
    assert seen == {"old", "new"}
