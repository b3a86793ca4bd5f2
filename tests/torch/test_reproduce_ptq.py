"""examples/reproduce_ptq.py --quick on the digits with PyTorch: PTQ int8 exported to QDQ ONNX and measured
in onnxruntime, next to onnxruntime's quantize_static on the same float model."""

from __future__ import annotations

import json

import pytest

from examples import reproduce_ptq

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
pytest.importorskip("sklearn")


def test_quick_digits_int8_onnx(tmp_path, capsys):
    out = tmp_path / "ptq.json"
    rc = reproduce_ptq.main(["--data", "digits", "--backend", "torch", "--quick", "--threads", "1",
                             "--no-progress", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ours-torch" in text and "anchor ort/minmax" in text
    r = json.loads(out.read_text())["results"]["torch"]
    f_err = 1 - r["float"]["acc"]
    assert f_err < 0.15  # the float CNN learned the digits
    assert abs(r["float"]["acc"] - r["float_sim_acc"]) <= 0.003  # the float ONNX predicts as the model
    for v in [f"ours/{o}" for o in reproduce_ptq.OBSERVERS] + ["ort/minmax", "ort/percentile"]:
        assert 1 - r[v]["acc"] <= f_err + 0.02, v  # quick mode is noisy: 2 pp
        assert r[v]["bytes"] <= 0.35 * r["float"]["bytes"], v
        assert "QuantizeLinear" in r[v]["ops"] and "DequantizeLinear" in r[v]["ops"], v
    for o in reproduce_ptq.OBSERVERS:
        # the artifact predicts as the quantizer's fake-quantized model, up to integer-kernel rounding
        assert abs(r[f"ours/{o}"]["acc"] - r[f"ours/{o}"]["sim_acc"]) <= 0.01
