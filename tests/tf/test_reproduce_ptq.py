"""examples/reproduce_ptq.py --quick on the digits with Keras 3: PTQ int8 exported as full-integer TFLite
and measured in the TFLite interpreter, next to the TFLite converter's own PTQ on the same float model."""

from __future__ import annotations

import json

import pytest

from examples import reproduce_ptq

pytest.importorskip("sklearn")


def test_quick_digits_int8_tflite(tmp_path, capsys):
    out = tmp_path / "ptq.json"
    rc = reproduce_ptq.main(["--data", "digits", "--backend", "tf", "--quick", "--threads", "1",
                             "--no-progress", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ours-tf" in text and "anchor tflite" in text
    r = json.loads(out.read_text())["results"]["tf"]
    f_err = 1 - r["float"]["acc"]
    assert f_err < 0.15  # the float CNN learned the digits
    assert abs(r["float"]["acc"] - r["float_sim_acc"]) <= 0.003  # the float TFLite predicts as the model
    for v in [f"ours/{o}" for o in reproduce_ptq.OBSERVERS] + ["tflite"]:
        assert 1 - r[v]["acc"] <= f_err + 0.02, v  # quick mode is noisy: 2 pp
        assert r[v]["bytes"] <= 0.35 * r["float"]["bytes"], v
        assert r[v]["full_integer"], v
