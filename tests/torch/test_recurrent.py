"""Recurrent, embedding and attention layers under torch pruners and quantizers: one slot per weight
matrix (compressor.torch.slots), exact floor(n * s) per matrix, masks that hold through training,
quantized matrices in the forward, export / reload / mask files, and clear refusals."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError
from compressor.core.matching import DefaultSkipWarning
from compressor.torch import (
    AGPPruner,
    DoReFaQuantizer,
    L1FilterPruner,
    LevelPruner,
    LsqQuantizer,
    QAT_Quantizer,
)
from compressor.torch.pruning.export import apply_compression_results
from compressor.torch.slots import SlottedLayer

pytestmark = pytest.mark.filterwarnings("ignore:.*match no layer:compressor.core.errors.ConfigWarning")
TYPES = ["Embedding", "LSTM", "GRU", "RNN", "MultiheadAttention", "LSTMCell", "GRUCell", "RNNCell"]


class Text(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.lstm = nn.LSTM(8, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.mha = nn.MultiheadAttention(12, 3, batch_first=True)
        self.gru = nn.GRU(12, 4, batch_first=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.emb(x)
        h, _ = self.lstm(h)
        h, _ = self.mha(h, h, h, need_weights=False)
        h, _ = self.gru(h)
        return self.fc(h[:, -1])


def model(seed=0):
    torch.manual_seed(seed)
    return Text()


def tokens(n=4, t=5, seed=1):
    return torch.randint(0, 30, (n, t), generator=torch.Generator().manual_seed(seed))


def train(m, opt, steps=3):
    x = tokens(8)
    for _ in range(steps):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    return opt


def test_every_matrix_is_its_own_slot_with_exact_counts():
    m = model()
    p = LevelPruner(m, [{"sparsity": 0.3, "op_types": TYPES}])
    p.compress()
    names = [w.name for w in p.get_modules_wrapper()]
    lstm = [f"lstm.weight_{k}_l{i}{r}" for i in range(2) for r in ("", "_reverse") for k in ("ih", "hh")]
    assert names == ["emb", *lstm, "mha.q_proj", "mha.k_proj", "mha.v_proj", "mha.out_proj", "gru.weight_ih_l0",
                     "gru.weight_hh_l0"]
    for w in p.get_modules_wrapper():
        n = w.weight.numel()
        assert int((~w.weight_mask).sum()) == math.floor(n * 0.3), w.name
        assert int((w.weight == 0).sum()) == math.floor(n * 0.3), w.name  # masked in place
    assert isinstance(m.lstm, SlottedLayer) and m.lstm.module.weight_ih_l1_reverse.shape == (24, 12)
    # the q / k / v slots are the row blocks of in_proj_weight, pruned in place there
    blocks = m.mha.module.in_proj_weight.detach().split(12)
    for block, w in zip(blocks, p.get_modules_wrapper()[9:12]):
        assert torch.equal(block == 0, ~w.weight_mask)
    # magnitude: every kept weight of a matrix is at least as large as every pruned one
    w = p.get_modules_wrapper()[1]
    orig = model().lstm.weight_ih_l0.detach().abs()
    assert orig[w.weight_mask].min() >= orig[~w.weight_mask].max()


def test_separate_projections_projection_size_and_cells():
    torch.manual_seed(0)
    m = nn.ModuleDict({
        "attn": nn.MultiheadAttention(8, 2, kdim=5, vdim=6),
        "lstm": nn.LSTM(4, 6, proj_size=3),
        "cell": nn.LSTMCell(4, 5), "gcell": nn.GRUCell(4, 5), "rcell": nn.RNNCell(4, 5),
    })
    p = LevelPruner(m, [{"sparsity": 0.5, "op_types": TYPES}])
    p.compress()
    shapes = {w.name: tuple(w.weight.shape) for w in p.get_modules_wrapper()}
    assert shapes == {
        "attn.q_proj": (8, 8), "attn.k_proj": (8, 5), "attn.v_proj": (8, 6), "attn.out_proj": (8, 8),
        "lstm.weight_ih_l0": (24, 4), "lstm.weight_hh_l0": (24, 3), "lstm.weight_hr_l0": (3, 6),
        "cell.weight_ih": (20, 4), "cell.weight_hh": (20, 5), "gcell.weight_ih": (15, 4),
        "gcell.weight_hh": (15, 5), "rcell.weight_ih": (5, 4), "rcell.weight_hh": (5, 5)}
    assert int((m["attn"].module.k_proj_weight == 0).sum()) == 20
    h, c = m["cell"](torch.randn(2, 4))  # the container calls the cell as before
    assert h.shape == (2, 5) and m["cell"].hidden_size == 5  # attributes read through


def test_masks_hold_through_training_and_agp_is_monotone():
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    p = AGPPruner(m, [{"initial_sparsity": 0.0, "final_sparsity": 0.6, "start_epoch": 0, "end_epoch": 2,
                       "frequency": 1, "op_types": ["LSTM", "MultiheadAttention"]}], opt, pruning_algorithm="level")
    p.compress()
    before = None
    for epoch in range(3):
        p.update_epoch(epoch)
        x = tokens(8, seed=epoch)
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
        masks = [w.weight_mask.clone() for w in p.get_modules_wrapper()]
        for w in p.get_modules_wrapper():
            assert torch.equal(w.weight == 0, ~w.weight_mask) or bool((w.weight[~w.weight_mask] == 0).all())
        if before is not None:
            assert all(bool((~b <= ~a).all()) for a, b in zip(masks, before))  # pruned stay pruned
        before = masks
    for w in p.get_modules_wrapper():
        assert int((~w.weight_mask).sum()) == math.floor(w.weight.numel() * 0.6)


def test_pruned_export_reloads_into_the_original_class_and_mask_file_applies(tmp_path):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    p = LevelPruner(m, [{"sparsity": 0.5, "op_types": TYPES}], opt)
    p.compress()
    train(m, opt)
    m.eval()
    p.export_model(str(tmp_path / "m.pt"), str(tmp_path / "masks.pt"))
    fresh = model(seed=5).eval()
    fresh.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))  # original keys
    x = tokens()
    with torch.no_grad():
        assert torch.equal(fresh(x), m(x))
    masks = torch.load(tmp_path / "masks.pt", weights_only=True)
    assert sorted(masks) == ["emb", "gru", "lstm", "mha", "mha.out_proj"]
    assert set(masks["mha"]) == {"in_proj_weight"} and masks["mha"]["in_proj_weight"].shape == (36, 12)
    other = model(seed=7)
    apply_compression_results(other, str(tmp_path / "masks.pt"))
    assert torch.equal(other.mha.in_proj_weight == 0, ~masks["mha"]["in_proj_weight"])
    assert torch.equal(other.lstm.weight_hh_l1 == 0, ~masks["lstm"]["weight_hh_l1"])
    # and onto a wrapped model: the slots' wrappers take the masks
    wrapped = model(seed=8)
    p2 = LevelPruner(wrapped, [{"sparsity": 0.1, "op_types": TYPES}])
    p2.compress()
    apply_compression_results(wrapped, str(tmp_path / "masks.pt"))
    got = {w.name: w.weight_mask for w in p2.get_modules_wrapper()}
    assert torch.equal(got["mha.out_proj"], masks["mha.out_proj"]["weight"])
    assert torch.equal(got["lstm.weight_ih_l0"], masks["lstm"]["weight_ih_l0"])


def test_wrapped_state_dict_round_trip_and_unwrap():
    m = model()
    p = LevelPruner(m, [{"sparsity": 0.4, "op_types": ["LSTM", "MultiheadAttention"]}])
    p.compress()
    state = copy.deepcopy(m.state_dict())
    assert "lstm.module.weight_ih_l0" in state and "mha.slots.q_proj.weight_mask" in state
    other = model(seed=3)
    p2 = LevelPruner(other, [{"sparsity": 0.4, "op_types": ["LSTM", "MultiheadAttention"]}])
    other.load_state_dict(state)
    x = tokens()
    with torch.no_grad():
        assert torch.equal(other(x), m(x))
    p2._unwrap_model()
    assert type(other.lstm) is nn.LSTM and type(other.mha) is nn.MultiheadAttention
    p2._wrap_model()
    assert isinstance(other.lstm, SlottedLayer)


@pytest.mark.parametrize("cls, config", [
    (QAT_Quantizer, {}),
    (DoReFaQuantizer, {}),
    (LsqQuantizer, {}),
])
def test_quantizers_quantize_every_matrix_and_export_reloads(cls, config, tmp_path):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    q = cls(m, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": TYPES, **config}], opt)
    q.compress()
    names = [w.name for w in q.get_modules_wrapper()]
    assert "lstm.weight_hh_l1_reverse" in names and "mha.v_proj" in names and "emb" in names
    train(m, opt, steps=2)
    m.eval()
    x = tokens()
    with torch.no_grad():
        out = m(x)
    q.export_model(str(tmp_path / "q.pt"), str(tmp_path / "calib.pt"))
    state = torch.load(tmp_path / "q.pt", weights_only=True)
    for key in ("lstm.weight_ih_l0", "mha.in_proj_weight", "gru.weight_hh_l0", "emb.weight"):
        assert len(torch.unique(state[key])) <= 16 * (3 if key == "mha.in_proj_weight" else 1), key  # 4 bits
    fresh = model(seed=9).eval()
    fresh.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), out, rtol=1e-5, atol=1e-6)
    calib = torch.load(tmp_path / "calib.pt", weights_only=True)
    assert set(calib) == set(names)


def test_pruner_and_quantizer_on_the_same_lstm(tmp_path):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    p = LevelPruner(m, [{"sparsity": 0.5, "op_types": ["LSTM"]}], opt)
    p.compress()
    q = QAT_Quantizer(m, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["LSTM"]}], opt)
    q.compress()
    container = m.lstm
    assert isinstance(container, SlottedLayer)  # one container, both kinds inside
    assert type(container.slots["weight_ih_l0"]).__name__ == "QuantizerModuleWrapper"
    assert type(container.slots["weight_ih_l0"].module).__name__ == "PrunerModuleWrapper"
    train(m, opt)
    for w in p.get_modules_wrapper():
        assert bool((w.weight[~w.weight_mask] == 0).all())
    q._unwrap_model()
    assert m.lstm is container and type(container.slots["weight_ih_l0"]).__name__ == "PrunerModuleWrapper"
    q._wrap_model()
    assert type(container.slots["weight_ih_l0"]).__name__ == "QuantizerModuleWrapper"


@pytest.mark.parametrize("make, config, match", [
    (lambda m: QAT_Quantizer, {"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["LSTM"]},
     r"layer 'lstm' \(LSTM\): quant_types \['weight', 'output'\] is not supported"),
    (lambda m: QAT_Quantizer, {"quant_types": ["input"], "quant_bits": 8, "op_types": ["Embedding"]},
     "token indices"),
    (lambda m: QAT_Quantizer, {"quant_types": ["weight"], "quant_bits": 8, "op_types": ["GRU"],
                               "quant_scheme": "per_channel_symmetric", "quant_dtype": "int"}, "per_tensor"),
    (lambda m: L1FilterPruner, {"sparsity": 0.5, "op_types": ["LSTM"]}, r"'lstm.weight_ih_l0' \(LSTM\) is not supported"),
])
def test_refusals_leave_the_model_untouched(make, config, match):
    m = model()
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(ConfigError, match=match):
        make(m)(m, [config])
    assert type(m.lstm) is nn.LSTM and type(m.gru) is nn.GRU and type(m.emb) is nn.Embedding
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


def test_default_says_what_it_leaves_out():
    m = model()
    counts = {n: sum(p.numel() for p in getattr(m, n).parameters()) for n in ("emb", "lstm", "mha", "gru", "fc")}
    total = sum(counts.values())
    with pytest.warns(DefaultSkipWarning) as rec:
        p = LevelPruner(m, [{"sparsity": 0.5, "op_types": ["default"]}])
    assert [w.name for w in p.get_modules_wrapper()] == ["fc"]
    msg = str(rec[0].message)
    for name, kind in (("lstm", "LSTM"), ("mha", "MultiheadAttention"), ("gru", "GRU"), ("emb", "Embedding")):
        assert f"{kind} (1 layer, {counts[name] / total:.1%} of the parameters)" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error", DefaultSkipWarning)
        LevelPruner(model(), [{"sparsity": 0.5, "op_types": ["default", *TYPES]}])
