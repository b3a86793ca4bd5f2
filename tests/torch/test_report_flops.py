"""MACs / params in the pruner report and in ``compressor report --flops`` (torch): dense vs. after a
speedup computed on a copy. The tiny model: Conv2d(3,4,3) -> BN -> ReLU -> Conv2d(4,2,1) on 1x3x8x8.

Dense: conv1 4*27 MACs at 6x6 = 3888, conv2 2*4 at 6x6 = 288 -> 4176 MACs; params 112 + 8 + 10 = 130.
Half of conv1's filters pruned (dependency-aware: BN masked too): 1944 + 144 = 2088 MACs; 56 + 4 + 6 = 66.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch
from torch import nn

import compressor.app.report as file_report
from compressor.app.cli import main
from compressor.core.errors import ConfigError
from compressor.torch import L1FilterPruner
from compressor.torch.pruning.report import sparsity_report

X = torch.randn(1, 3, 8, 8)
EXPECTED = {"macs_dense": 4176, "params_dense": 130, "macs_after": 2088, "params_after": 66,
            "macs_ratio": 0.5, "params_ratio": 66 / 130}


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(conv1=nn.Conv2d(3, 4, 3), bn=nn.BatchNorm2d(4), relu=nn.ReLU(),
                                     conv2=nn.Conv2d(4, 2, 1)))


def pruned():
    model = tiny()
    pruner = L1FilterPruner(model, [{"sparsity": 0.5, "op_names": ["conv1"]}], dependency_aware=True, dummy_input=X)
    pruner.compress()
    return model, pruner


def test_report_with_dummy_input_has_exact_macs_and_params():
    model, pruner = pruned()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rep = pruner.report(dummy_input=X)
    assert {k: rep.flops[k] for k in EXPECTED} == pytest.approx(EXPECTED)
    text = str(rep)
    assert "dense          params 130           MACs/sample 4,176" in text
    assert "after speedup  params  66 (50.77%)  MACs/sample 2,088 (50.00%)" in text
    # the user's model is untouched: still wrapped, same shapes and values
    assert type(model.conv1).__name__ == "PrunerModuleWrapper" and model.conv1.module.out_channels == 4
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    # without dummy_input: no MACs (as before)
    assert sparsity_report(pruner).flops is None and "MACs" not in str(sparsity_report(pruner))


def test_pruner_report_function_dispatches():
    _, pruner = pruned()
    rep = file_report.pruner_report(pruner, X)
    assert (rep.flops["macs_after"], rep.flops["params_after"]) == (2088, 66)
    with pytest.raises(ConfigError, match="dummy_input"):
        file_report.pruner_report(pruner)


@pytest.fixture()
def model_fn(tmp_path, monkeypatch):
    """A module ``tiny_cli_model_torch`` with ``build()`` in the working directory."""
    (tmp_path / "tiny_cli_model_torch.py").write_text(textwrap.dedent("""
        from collections import OrderedDict
        from torch import nn

        def build():
            return nn.Sequential(OrderedDict(conv1=nn.Conv2d(3, 4, 3), bn=nn.BatchNorm2d(4), relu=nn.ReLU(),
                                             conv2=nn.Conv2d(4, 2, 1)))
    """))
    monkeypatch.chdir(tmp_path)
    yield "tiny_cli_model_torch:build"
    sys.modules.pop("tiny_cli_model_torch", None)


def test_cli_report_flops_on_export_and_on_wrapped_state_dict(capsys, tmp_path, model_fn):
    model, pruner = pruned()
    pruner.export_model(str(tmp_path / "m.pt"), str(tmp_path / "masks.pt"))
    rc = main(["report", str(tmp_path / "m.pt"), "--masks", str(tmp_path / "masks.pt"), "--model-fn", model_fn,
               "--input-shape", "1,3,8,8", "--json"])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    data = json.loads(out)
    assert {k: data["flops"][k] for k in EXPECTED} == pytest.approx(EXPECTED)
    assert {r["layer"] for r in data["layers"]} == {"conv1", "bn", "conv2"}
    # a wrapped model's state_dict carries its masks; table output
    torch.save(model.state_dict(), tmp_path / "wrapped.pt")
    rc = main(["report", str(tmp_path / "wrapped.pt"), "--model-fn", model_fn, "--input-shape", "1x3x8x8"])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    assert "after speedup  params  66 (50.77%)  MACs/sample 2,088 (50.00%)" in out


def test_cli_report_flops_needs_model_fn_and_shape(capsys, tmp_path, model_fn):
    _, pruner = pruned()
    pruner.export_model(str(tmp_path / "m.pt"))
    assert main(["report", str(tmp_path / "m.pt"), "--flops"]) == 2
    err = capsys.readouterr().err
    assert "--model-fn" in err and "--input-shape" in err and len(err.strip().splitlines()) == 1
    assert main(["report", str(tmp_path / "m.pt"), "--model-fn", model_fn, "--input-shape", "1,a"]) == 2
    assert "--input-shape" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "m.pt"), "--model-fn", "nope_module:x", "--input-shape", "1,3,8,8"]) == 2
    assert "nope_module" in capsys.readouterr().err


def test_grouped_query_attention_macs_on_a_batch_1_input():
    """HF Llama with 4 query heads sharing 2 key/value heads (scaled_dot_product_attention with
    enable_gqa): the trace used to fail broadcasting [1, 4] with [1, 2] heads. Per token and layer:
    q 32*32 + k 32*16 + v 32*16 + o 32*32 + gate/up/down 3*32*64 = 9216 MACs; attention 4 heads * 16 * (8 + 8)
    per query position; the score head 32*10 per token; 16 tokens, 2 layers."""
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tr.LlamaForSequenceClassification(tr.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, num_labels=10, use_cache=False)).eval()
    from compressor.torch import count_flops_params

    macs, params, _ = count_flops_params(model, torch.randint(1, 64, (1, 16)))
    assert macs == 2 * 16 * 9216 + 2 * 16 * 4 * 16 * (8 + 8) + 16 * 32 * 10
    assert params == sum(p.numel() for p in model.parameters())
