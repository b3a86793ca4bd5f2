"""Bloom's blocks take an ALiBi bias shaped ``[batch * heads, 1, keys]`` (the batch folded with the heads): a one-shot
run on whole batches cuts it together with the block input when it takes sequences out of a batch (the probe of
shared inputs, AWQ's search sequences), so a [4, 16] tensor, a list of [2, 16] batches and a list of single rows
give the same masks / codes (issue 43)."""

from __future__ import annotations

import warnings

import pytest
import torch

from compressor.torch import AwqQuantizer, GptqQuantizer, SparseGPTPruner, WandaPruner
from compressor.torch.quantization.lowbit import oneshot_codes
from compressor.torch.sequential.blocks import _Input

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB = 64
IDS = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
FORMS = {"tensor": IDS, "pairs": [IDS[:2], IDS[2:]], "rows": [IDS[i:i + 1] for i in range(4)]}
METHODS = {
    "gptq": (GptqQuantizer, {"quant_bits": 4, "group_size": 16}),
    "awq": (AwqQuantizer, {"quant_bits": 4, "group_size": 16}),
    "sparsegpt": (SparseGPTPruner, {"sparsity": 0.5}),
    "wanda": (WandaPruner, {"sparsity": 0.5}),
}


def _bloom():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
        return transformers.BloomForCausalLM(cfg).eval()


def _result(method, data):
    cls, cfg = METHODS[method]
    c = cls(_bloom(), [{**cfg, "op_types": ["default"]}]).calibrate(data, progress=False, forward_dtype="float64")
    wrappers = sorted(c.get_modules_wrapper(), key=lambda w: w.name)
    assert len(wrappers) == 8  # 4 Linear layers per block, 2 blocks
    if method in ("gptq", "awq"):
        return {w.name: oneshot_codes(w).clone() for w in wrappers}
    return {w.name: w.weight_mask.clone() for w in wrappers}


@pytest.mark.parametrize("method", list(METHODS))
def test_whole_batches_give_the_results_of_single_rows(method):
    ref = _result(method, FORMS["rows"])
    for form in ("tensor", "pairs"):
        got = _result(method, FORMS[form])
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.equal(got[name], ref[name]), (method, form, name)


def test_take_rows_cuts_a_batch_folded_with_heads_in_batch_major_runs():
    from compressor.torch.sequential import TorchOneShotBackend

    model = _bloom()
    q = GptqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
    backend = TorchOneShotBackend(q, None)
    h = torch.randn(3, 5, 8)
    folded = torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3 * 4, 1, 5)  # [batch * heads, 1, keys]
    table = torch.randn(6, 8)  # [positions, dim]: 2-D, first axis a multiple of the batch but no batch
    mask = torch.randn(3, 1, 5, 5)
    inp = _Input((h,), {"alibi": folded, "table": table, "attention_mask": mask, "cache_position": torch.arange(5)},
                 ("arg", 0), None)
    cut = backend.take_rows(inp, [2, 0])
    assert torch.equal(cut.args[0], h[[2, 0]])
    assert torch.equal(cut.kwargs["alibi"], folded.view(3, 4, 1, 5)[[2, 0]].reshape(8, 1, 5))
    assert cut.kwargs["table"] is table and cut.kwargs["cache_position"] is inp.kwargs["cache_position"]
    assert torch.equal(cut.kwargs["attention_mask"], mask[[2, 0]])
    with torch.no_grad():  # the block on the cut rows gives the rows of the block on the whole batch
        ids = IDS[:3]
        store = backend.first_inputs([((ids,), {"use_cache": False})])
        block = backend.blocks()[0][1]
        whole = block(*store[0].args, **store[0].kwargs)
        part = backend.take_rows(store[0], [1])
        alone = block(*part.args, **part.kwargs)
        whole, alone = (o[0] if isinstance(o, tuple) else o for o in (whole, alone))
        torch.testing.assert_close(alone, whole[1:2], rtol=1e-5, atol=1e-6)
