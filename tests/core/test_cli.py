"""The ``compressor`` command line: list, check, report (on .npz, no framework needed), demo hook, exit codes."""

import importlib.util
import json
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import yaml

import compressor
from compressor.app.cli import main
from compressor.core import registry as R
from compressor.core.errors import ConfigError
from compressor.core.hookspecs import hookimpl

ROOT = __file__.rsplit("/tests/", 1)[0]

SEED_YAML = textwrap.dedent("""\
    tfAGPruner:
      config:
        -
            start_epoch: 0
            end_epoch: 16
            frequency: 2
            initial_sparsity: 0.05
            final_sparsity: 0.60
            support_type: default
        -
            prune: False
            start_epoch: 0
            end_epoch: 20
            frequency: 2
            initial_sparsity: 0.05
            final_sparsity: 0.60
            support_type: [Linear]
            support_op: [conv1, conv2]
""")


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ------------------------------------------------------------------------------------------------- list
def test_list_json_names_backends_and_plugin_algorithms(capsys, box):
    rc, out, err = run(capsys, "list", "--json")
    assert rc == 0 and err == ""
    data = json.loads(out)
    assert set(data["backends"]) >= {"torch", "tf", "box"}
    assert data["algorithms"]["box"] == {"pruners": ["BoxPruner"], "quantizers": []}
    assert data["plugins"]["box:BoxPruner"] == "box"


def test_list_text(capsys, box):
    rc, out, _ = run(capsys, "list")
    assert rc == 0
    assert "backend box: box models [installed]" in out.splitlines()
    assert "  pruners: BoxPruner (plugin box)" in out.splitlines()


# ------------------------------------------------------------------------------------------------ check
class BoxPruner:
    config_keys = ("sensitivity",)
    required_keys = ("sensitivity",)

    def __init__(self, model, config_list, optimizer=None):
        raise AssertionError("check must not build the algorithm")

    def validate_config(self, config_list):
        if len(config_list) > 2:
            raise ConfigError("BoxPruner takes at most 2 entries")


class BoxPlugin:
    @hookimpl
    def compressor_add_backends(self, registry):
        registry.add_backend("box", framework="json", description="box models")

    @hookimpl
    def compressor_add_algorithms(self, registry):
        registry.register("box", "BoxPruner", BoxPruner, kind="pruner")


@pytest.fixture
def box():
    plugin = BoxPlugin()
    compressor.register_plugin(plugin, name="box")
    yield plugin
    R.unregister_plugin(plugin)


def test_check_seed004_file_prints_normalised_yaml(capsys, tmp_path):
    path = write(tmp_path, "agp.yaml", SEED_YAML)
    rc, out, err = run(capsys, "check", path)
    assert rc == 0
    assert yaml.safe_load(out) == {"tfAGPruner": {"config": [
        {"start_epoch": 0, "end_epoch": 16, "frequency": 2, "initial_sparsity": 0.05, "final_sparsity": 0.6,
         "op_types": ["default"], "exclude": False},
        {"start_epoch": 0, "end_epoch": 20, "frequency": 2, "initial_sparsity": 0.05, "final_sparsity": 0.6,
         "exclude": True, "op_types": ["Linear"], "op_names": ["conv1", "conv2"]},
    ]}}
    # legacy keys are reported (as warnings, one line each), not refused
    lines = [line for line in err.splitlines() if "legacy key" in line]
    assert len(lines) == 2 and all(line.startswith("compressor: warning: section 'tfAGPruner': config_list[") for line in lines)
    assert "'support_type' -> 'op_types'" in lines[0]
    assert all(line.startswith("compressor: warning: ") for line in err.splitlines())


def test_check_bare_list(capsys, tmp_path):
    path = write(tmp_path, "c.yaml", "- {sparsity: 0.5, op_types: [Conv2d]}\n- {op_names: [fc], exclude: true}\n")
    rc, out, err = run(capsys, "check", path)
    assert (rc, err) == (0, "")
    assert yaml.safe_load(out) == [{"sparsity": 0.5, "op_types": ["Conv2d"], "exclude": False},
                                   {"op_names": ["fc"], "exclude": True}]


def test_check_bad_value_is_one_line_and_exit_2(capsys, tmp_path):
    path = write(tmp_path, "c.yaml", "- {sparsity: 1.5, op_types: [default]}\n")
    rc, out, err = run(capsys, "check", path)
    assert rc == 2 and out == ""
    assert err == (f"compressor: error: {path}: config_list[0]: 'sparsity' = 1.5 is invalid; "
                   f"allowed: a number with 0 <= sparsity < 1\n")


def test_check_reports_every_bad_section(capsys, tmp_path):
    path = write(tmp_path, "c.yaml", "A:\n  config: [{sparsty: 0.5, op_types: [default]}]\n"
                                     "B:\n  config: [{sparsity: 0.5}]\n")
    rc, _, err = run(capsys, "check", path)
    assert rc == 2
    lines = err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"compressor: error: {path}: section 'A': config_list[0]: unknown key 'sparsty' "
                               f"(did you mean 'sparsity'?)")
    assert lines[1] == f"compressor: error: {path}: section 'B': config_list[0]: names no layers; give 'op_types' " \
                       f"(e.g. ['default'], ['Conv2d']) and/or 'op_names' (e.g. ['conv1'])"


def test_check_with_algorithm_uses_its_keys(capsys, tmp_path, box):
    ok = write(tmp_path, "ok.yaml", "- {sensitivity: 1.5, op_types: [default]}\n")
    assert run(capsys, "check", ok, "--algorithm", "BoxPruner")[0] == 0
    missing = write(tmp_path, "missing.yaml", "- {op_types: [default]}\n")
    rc, _, err = run(capsys, "check", missing, "--algorithm", "BoxPruner")
    assert rc == 2
    assert err.strip().endswith("config_list[0]: BoxPruner needs key(s) ['sensitivity'] in every non-excluded entry")
    # the algorithm's own cross-entry check runs too (no model needed)
    three = write(tmp_path, "three.yaml", "- {sensitivity: 1.0, op_types: [default]}\n" * 3)
    rc, _, err = run(capsys, "check", three, "--algorithm", "BoxPruner")
    assert rc == 2 and err.strip().endswith("BoxPruner takes at most 2 entries")


def test_check_section_named_after_algorithm_uses_its_keys(capsys, tmp_path, box):
    path = write(tmp_path, "c.yaml", "BoxPruner:\n  config: [{op_types: [default]}]\n")
    rc, _, err = run(capsys, "check", path)
    assert rc == 2 and "BoxPruner needs key(s) ['sensitivity']" in err
    # without an algorithm, keys of any algorithm are accepted
    generic = write(tmp_path, "g.yaml", "my_settings:\n  config: [{sensitivity: 2.0, op_types: [default]}]\n")
    assert run(capsys, "check", generic)[0] == 0


def test_check_unknown_algorithm_did_you_mean(capsys, tmp_path, box):
    path = write(tmp_path, "c.yaml", "- {sparsity: 0.5, op_types: [default]}\n")
    rc, _, err = run(capsys, "check", path, "--algorithm", "BoxPrunr")
    assert rc == 2 and "no algorithm 'BoxPrunr' (did you mean 'BoxPruner'?)" in err


@pytest.mark.parametrize(("content", "message"), [
    (None, "config file '{p}' does not exist"),
    ("a: [unclosed\n", "config file '{p}' is not valid YAML"),
    ("42\n", "config file '{p}' must hold a list of dicts or a mapping"),
])
def test_check_bad_files(capsys, tmp_path, content, message):
    p = str(tmp_path / "c.yaml") if content is None else write(tmp_path, "c.yaml", content)
    rc, out, err = run(capsys, "check", p)
    assert rc == 2 and out == ""
    assert err.startswith("compressor: error: " + message.format(p=p))
    assert err.count("\n") == 1


def test_argument_errors_are_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "compressor: error: the following arguments are required: COMMAND (see 'compressor --help')\n"
    with pytest.raises(SystemExit) as e:
        main(["check", "x.yaml", "--backend", "jax"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


# ----------------------------------------------------------------------------------------------- report
@pytest.fixture
def npz_model(tmp_path):
    grid = np.array([-1.0, -1 / 3, 1 / 3, 1.0], dtype=np.float32)  # a 2-bit grid, no zero level
    fc2 = grid[np.arange(64) % 4].reshape(8, 8)
    fc1 = np.array([[0, 0, 1, 2], [0, 3, 0, 4]], dtype=np.float32)
    path = tmp_path / "model.npz"
    np.savez(path, fc1=fc1, fc2=fc2, steps=np.array([3]))  # the int array is not a layer
    return str(path)


def test_report_npz_json(capsys, npz_model, tmp_path):
    masks = tmp_path / "masks.npz"
    m = np.ones((2, 4), bool)
    m[0, :2] = m[1, 0] = m[1, 2] = m[1, 3] = False
    np.savez(masks, fc1=m, **{"fc1:bias": np.ones(2, bool)})
    rc, out, err = run(capsys, "report", npz_model, "--masks", str(masks), "--json")
    assert (rc, err) == (0, "")
    rows = {r["layer"]: r for r in json.loads(out)}
    assert rows["fc1"] == {"layer": "fc1", "shape": [2, 4], "params": 8, "zeros": 4, "sparsity": 0.5,
                           "masked": 0.625, "distinct": 4, "bits": 32, "bits_source": "dtype", "dtype": "float32"}
    assert rows["fc2"] == {"layer": "fc2", "shape": [8, 8], "params": 64, "zeros": 0, "sparsity": 0.0,
                           "masked": None, "distinct": 4, "bits": 2, "bits_source": "distinct values", "dtype": "float32"}
    assert set(rows) == {"fc1", "fc2"}


def test_report_table(capsys, npz_model):
    rc, out, _ = run(capsys, "report", npz_model)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["layer", "shape", "params", "zeros", "sparsity", "masked", "bits"]
    assert lines[2].split() == ["fc1", "2x4", "8", "4", "50.00%", "-", "32", "(float32)"]
    assert lines[3].split() == ["fc2", "8x8", "64", "0", "0.00%", "-", "~2"]
    assert lines[5].split() == ["total", "72", "4", "5.56%", "-"]
    assert lines[6].startswith("~ bits estimated from the number of distinct values")


def test_report_bad_inputs_exit_2(capsys, npz_model, tmp_path):
    masks = tmp_path / "masks.npz"
    np.savez(masks, nope=np.ones(3, bool))
    rc, _, err = run(capsys, "report", npz_model, "--masks", str(masks))
    assert rc == 2 and err == ("compressor: error: mask file names layers the model does not have: ['nope']; "
                               "model layers: ['fc1', 'fc2']\n")
    bad = write(tmp_path, "model.bin", "x")
    rc, _, err = run(capsys, "report", bad)
    assert rc == 2 and "unsupported model file type '.bin'" in err and "(.onnx)" in err
    bad = write(tmp_path, "model.onnx", "x")
    rc, _, err = run(capsys, "report", bad)  # onnx missing (core env): which extra; present: not an ONNX file
    assert rc == 2 and ("as an ONNX model" in err or "needs onnx" in err), err
    rc, _, err = run(capsys, "report", str(tmp_path / "missing.npz"))
    assert rc == 2 and "does not exist" in err
    junk = write(tmp_path, "junk.npz", "not a zip")
    rc, _, err = run(capsys, "report", junk)
    assert rc == 2 and err.startswith(f"compressor: error: cannot read '{junk}' as a .npz archive") and err.count("\n") == 1


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="the message for a missing torch")
def test_report_torch_file_without_torch(capsys, tmp_path):
    p = write(tmp_path, "model.pt", "x")
    rc, _, err = run(capsys, "report", p)
    assert rc == 2 and "needs torch (pip install 'compressor[torch]')" in err


def test_report_plot(capsys, npz_model, tmp_path):
    png = tmp_path / "sparsity.png"
    rc, out, err = run(capsys, "report", npz_model, "--plot", str(png))
    if importlib.util.find_spec("matplotlib") is None:
        assert rc == 2 and "--plot needs matplotlib" in err and not png.exists()
    else:
        assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert out.splitlines()[-1] == f"plot written to {png}"


# ------------------------------------------------------------------------------------------------- demo
def test_demo_forwards_all_arguments(capsys, monkeypatch):
    seen = []
    fake = types.ModuleType("compressor.app.demo")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "compressor.app.demo", fake)
    assert main(["demo", "--epochs", "2", "--backend", "tf"]) == 0
    assert seen == [["--epochs", "2", "--backend", "tf"]]


def test_demo_placeholder_without_demo_module(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "compressor.app.demo", None)  # import fails as if the module were absent
    rc, out, _ = run(capsys, "demo")
    assert rc == 0 and out.startswith("compressor demo: the training demo arrives with the examples")


# ------------------------------------------------------------------------------------------- subprocess
def test_module_entry_point_exit_codes(tmp_path):
    bad = write(tmp_path, "c.yaml", "- {sparsity: -1, op_types: [default]}\n")
    env = {"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "compressor", "check", bad], capture_output=True, text=True,
                         env=env, timeout=1800)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [f"compressor: error: {bad}: config_list[0]: 'sparsity' = -1 is invalid; "
                                       f"allowed: a number with 0 <= sparsity < 1"]
    ok = subprocess.run([sys.executable, "-m", "compressor", "list"], capture_output=True, text=True, env=env,
                        timeout=1800)
    assert ok.returncode == 0 and "backend torch:" in ok.stdout
