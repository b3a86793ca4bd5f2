"""compressor/torch/calibration_data.py: a calibration batch holding 0 sequences (or sequences of 0 tokens) is a
ConfigError naming the batch, its input and its shape, raised before the model is touched, for the one-shot
compressors and post-training quantization alike (the model used to fail inside with a RuntimeError)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError
from compressor.torch import PtqQuantizer, SparseGPTPruner
from compressor.torch.calibration_data import calibration_batches

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

HINT = ("give a few hundred sequences as a tensor, a tuple of positional inputs, a dict of keyword inputs (Hugging "
        "Face BatchEncoding), or a DataLoader / list / iterable of those")
EMPTY = torch.zeros(0, 8, dtype=torch.long)
GOOD = torch.ones(2, 8, dtype=torch.long)


def test_the_stream_refuses_an_empty_batch_where_it_is_reached():
    cases = [
        (EMPTY, "batch 0 (input 0) is empty (shape (0, 8))"),
        ({"input_ids": EMPTY, "attention_mask": EMPTY}, "batch 0 (input_ids) is empty (shape (0, 8))"),
        ([GOOD, EMPTY], "batch 1 (input 0) is empty (shape (0, 8))"),
        (torch.zeros(2, 0, dtype=torch.long), "batch 0 (input 0) is empty (shape (2, 0))"),
        ((GOOD, torch.zeros(2, 0)), "batch 0 (input 1) is empty (shape (2, 0))"),
    ]
    for data, msg in cases:
        with pytest.raises(ConfigError) as e:
            list(calibration_batches(data, "t"))
        assert str(e.value) == f"t: calibration {msg}; {HINT}"
    got = list(calibration_batches([GOOD, GOOD], "t"))  # unchanged for real batches
    assert [(i, tuple(a[0].shape)) for i, a, _ in got] == [(0, (2, 8)), (1, (2, 8))]
    scalar = list(calibration_batches({"input_ids": GOOD, "scale": torch.tensor(2.0)}, "t"))  # 0-d: not a batch axis
    assert [sorted(k) for _, _, k in scalar] == [["input_ids", "scale"]]


def _llama():
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return tr.LlamaForCausalLM(cfg).eval()


def test_one_shot_calibrate_refuses_zero_sequences_before_any_weight_changes():
    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    for data, msg in [(EMPTY, "batch 0 (input 0) is empty (shape (0, 8))"),
                      ({"input_ids": EMPTY}, "batch 0 (input_ids) is empty (shape (0, 8))"),
                      ([GOOD, EMPTY], "batch 1 (input 0) is empty (shape (0, 8))")]:
        with pytest.raises(ConfigError) as e:
            p.calibrate(data, progress=False)
        assert str(e.value) == f"SparseGPTPruner.calibrate: calibration {msg}; {HINT}"
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)
        assert not p.calibrated


def test_ptq_calibrate_refuses_zero_sequences():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    q = PtqQuantizer(model, [{"op_types": ["Linear"], "quant_types": ["weight", "output"], "quant_bits": 8}])
    with pytest.raises(ConfigError, match=r"^PtqQuantizer\.calibrate: calibration batch 0 \(input 0\) is empty "
                                          r"\(shape \(0, 4\)\); "):
        q.calibrate(torch.zeros(0, 4))
    assert not q.calibrated
    q.calibrate(torch.randn(5, 4))
    assert q.calibrated
