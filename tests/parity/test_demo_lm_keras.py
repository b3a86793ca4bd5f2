"""``compressor demo --lm --quick`` on Keras: the same trained weights in the Keras port, every method's row
measured on the ``.keras`` file it shipped (Keras's own int4 layers for the quantizers), reloaded."""

from __future__ import annotations

import json
import math
import os
import re
import zipfile

import pytest

from compressor import unpack
from compressor.app import demo_lm

# in tests/parity (both frameworks): the demo trains its model with PyTorch + transformers, also for Keras
pytest.importorskip("transformers")

LABELS = ["dense (float32)", "SparseGPT 50 %", "SparseGPT 2:4", "Wanda 50 %", "RTN w4 g32", "GPTQ w4 g32", "AWQ w4 g32"]
# the quick model's seven projections (Keras paths layers_0/<name>) as [out, in]
LINEARS = {"q_proj": (64, 64), "k_proj": (64, 64), "v_proj": (64, 64), "o_proj": (64, 64), "gate_proj": (128, 64),
           "up_proj": (128, 64), "down_proj": (64, 128)}
#: Keras's int4 call vs the fake-quant kernel: the same integers, one more float32 rounding (relative)
KERAS_RTOL = 1e-4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    save = tmp_path_factory.mktemp("lm")
    lines: list[str] = []
    (res,) = demo_lm.run_lm_demo(["tf"], quick=True, save_dir=str(save), out=lines.append)
    return res, "\n".join(lines), save / "tf"


def test_table_and_artifacts(run):
    res, text, folder = run
    assert [r.label for r in res.rows] == LABELS
    assert re.search(r"method\s+perplexity\s+vs dense\s+weight size\s+decode ms/token\s+x dense", text)
    assert text.splitlines()[-1].strip().startswith("tf: ")
    for r in res.rows:
        assert math.isfinite(r.ppl) and 1.0 < r.ppl < 256.0, r
        assert r.decode_s is None  # not measured on Keras (said in the notes)
        assert r.file_bytes == os.path.getsize(folder / r.file) > 0
    for r in res.rows[1:]:  # shipped (reloaded .keras) vs the compressed model before shipping
        assert r.ppl == pytest.approx(r.ppl_model, rel=KERAS_RTOL if r.key.endswith("_w4") else 1e-6)
    # what the .keras files hold (the run measured them reloaded): Keras's int4 / AWQ layers, group 32, lm_head float
    modes = {"rtn_w4": "int4/32", "gptq_w4": "int4/32", "awq_w4": "awq/4/32"}
    for key, mode in modes.items():
        with zipfile.ZipFile(folder / f"{key}_tf.keras") as z:
            policies = json.loads(z.read("config.json"))["config"]["layer_policies"]
        assert {k: v["config"]["mode"] for k, v in policies.items()} == {f"layers_0/{n}": mode for n in LINEARS}
        assert res.row(key).file_bytes < res.dense.file_bytes


def test_pruned_files_hold_the_pattern(run):
    _, _, folder = run
    for key in ("sparsegpt50", "wanda50", "sparsegpt24"):
        weights = unpack(folder / f"{key}_tf.cz")
        for name, (n_out, n_in) in LINEARS.items():
            w = weights[f"layers_0/{name}/kernel"].T  # Keras [in, out] -> [out, in]
            if key == "sparsegpt24":
                assert ((w.reshape(n_out, n_in // 4, 4) == 0).sum(-1) >= 2).all()
            else:
                assert (w == 0).sum() == n_out * n_in // 2


def test_keras_harness_does_not_import_torch():
    from tests.core.test_imports import loaded_after

    assert "torch" not in loaded_after("import compressor.app.demo_lm_tf")
