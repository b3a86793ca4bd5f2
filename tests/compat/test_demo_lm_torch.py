"""``compressor demo --lm --quick`` on PyTorch: every method's row is there, measured on the file it shipped
(packed int4 state_dict / exported state_dict + compressed file), reloaded into a fresh model."""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest
import torch

from compressor import unpack
from compressor.app import cli, demo_lm

pytest.importorskip("transformers")
pytestmark = pytest.mark.torch

LABELS = ["dense (float32)", "SparseGPT 50 %", "SparseGPT 2:4", "Wanda 50 %", "RTN w4 g32", "GPTQ w4 g32", "AWQ w4 g32"]
# the quick model: 1 decoder layer, width 64, FFN 128 -> [out, in] of its seven Linear layers
LINEARS = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 64), "self_attn.v_proj": (64, 64),
           "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
           "mlp.down_proj": (64, 128)}
#: packed (bfloat16 compute on the int4 kernel) vs fake-quant (float32) perplexity, relative
PACKED_RTOL = 1e-3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    save = tmp_path_factory.mktemp("lm")
    lines: list[str] = []
    (res,) = demo_lm.run_lm_demo(["torch"], quick=True, save_dir=str(save), out=lines.append)
    return res, "\n".join(lines), save / "torch"


def test_table_has_every_method(run):
    res, text, _ = run
    assert [r.label for r in res.rows] == LABELS
    assert re.search(r"method\s+perplexity\s+vs dense\s+weight size\s+decode ms/token\s+x dense", text)
    for label in LABELS:
        assert any(line.strip().startswith(label) for line in text.splitlines()), label
    assert "torch: " in text.splitlines()[-1] and "smaller model" in text.splitlines()[-1]


def test_perplexities_and_decode_times(run):
    res, _, _ = run
    for r in res.rows:
        assert math.isfinite(r.ppl) and 1.0 < r.ppl < 256.0, r
        assert r.decode_s is not None and 0 < r.decode_range[0] <= r.decode_s <= r.decode_range[1]
    # the shipped pruned model computes what the masked model computed
    for r in res.rows[1:4]:
        assert r.ppl == pytest.approx(r.ppl_model, rel=1e-6)
    # the packed int4 model (bfloat16 activations) computes what the fake-quant model computed
    for r in res.rows[4:]:
        assert r.ppl == pytest.approx(r.ppl_model, rel=PACKED_RTOL)


def test_sizes_are_the_saved_files(run):
    res, _, folder = run
    for r in res.rows:
        assert r.file_bytes == os.path.getsize(folder / r.file) > 0
    dense = torch.load(folder / "dense.pt", weights_only=True)
    assert dense["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    for key in ("rtn_w4", "gptq_w4", "awq_w4"):
        sd = torch.load(folder / f"{key}.pt", weights_only=True)
        for name, (n_out, n_in) in LINEARS.items():
            p = f"model.layers.0.{name}."
            assert f"{p}weight" not in sd
            assert sd[f"{p}qweight"].dtype == torch.uint8 and tuple(sd[f"{p}qweight"].shape) == (n_out, n_in // 2)
            assert tuple(sd[f"{p}scale"].shape) == (n_out, n_in // 32)  # group 32
        assert sd["lm_head.weight"].dtype == torch.float32  # left out
        assert res.row(key).file_bytes < res.dense.file_bytes


def test_pruned_files_hold_the_pattern(run):
    _, _, folder = run
    for key in ("sparsegpt50", "wanda50", "sparsegpt24"):
        weights = unpack(folder / f"{key}.cz")
        exported = torch.load(folder / f"{key}.pt", weights_only=True)
        for name, (n_out, n_in) in LINEARS.items():
            w = weights[f"model.layers.0.{name}.weight"]
            assert np.array_equal(w, exported[f"model.layers.0.{name}.weight"].numpy())
            if key == "sparsegpt24":
                assert ((w.reshape(n_out, n_in // 4, 4) == 0).sum(-1) >= 2).all()
            else:
                assert (w == 0).sum() == n_out * n_in // 2
        assert not (weights["lm_head.weight"] == 0).any()


def test_cli_dispatch_and_bad_input(capsys):
    assert cli.main(["demo", "--lm", "--methods", "gptq,nope", "--backend", "torch"]) == 2
    err = capsys.readouterr().err
    assert "compressor demo --lm: error: --methods" in err and "'nope'" in err and "gptq_w4" in err
    assert cli.main(["demo", "--lm", "--text-dir", "/nonexistent/text"]) == 2
    assert "--text-dir '/nonexistent/text' does not exist" in capsys.readouterr().err


def test_imports_stay_apart():
    from tests.core.test_imports import loaded_after

    assert loaded_after("import compressor.app.demo_lm") == set()
    assert loaded_after("import compressor.app.demo_lm_torch") == {"torch"}


def test_text_dir_corpus_split(tmp_path):
    for i in range(12):
        (tmp_path / f"f{i:02d}.txt").write_bytes(bytes([65 + i]) * (10 + i))
    (tmp_path / "skip.md").write_bytes(b"not text")
    c = demo_lm.load_corpus(str(tmp_path))
    assert c.held_out_files == ("f07.txt",) and len(c.train_files) == 11
    assert bytes(c.held_out) == b"H" * 17
    w = demo_lm.held_out_windows(c, seq=4, limit=3)
    assert w.tolist() == [[72] * 5] * 3
    std = demo_lm.load_corpus()  # Python's own standard library, every 10th file from index 7 held out
    names = sorted(std.train_files + std.held_out_files)
    assert std.held_out_files == tuple(n for i, n in enumerate(names) if i % 10 == 7)
    assert all(n.endswith(".py") for n in names)
