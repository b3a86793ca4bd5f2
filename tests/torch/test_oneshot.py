"""One-shot compressors on PyTorch (issue 25): WandaPruner, SparseGPTPruner, GptqQuantizer, RtnQuantizer,
AwqQuantizer on tiny Hugging Face causal LMs (random weights from configs), the block adapter, and the
calibration-data helper shared with PtqQuantizer."""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import compressor
from compressor.core import oneshot as os1
from compressor.core.errors import ConfigError, ModelError
from compressor.torch import (
    AwqQuantizer,
    GptqQuantizer,
    LevelPruner,
    PtqQuantizer,
    RtnQuantizer,
    SparseGPTPruner,
    WandaPruner,
)
from compressor.torch.calibration_data import calibration_batches
from compressor.torch.quantization.lowbit import oneshot_codes
from compressor.torch.sequential import TorchOneShotBackend
from compressor.torch.sequential.blocks import _Input, _merged_calls

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

VOCAB = 64


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0))


def opt():
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32))


#: family -> (builder, block paths, wrapped Linear / Conv1D layers per block)
FAMILIES = {
    "llama": (llama, ["model.layers.0", "model.layers.1"], 7),
    "qwen2": (qwen2, ["model.layers.0", "model.layers.1"], 7),
    "gpt2": (gpt2, ["transformer.h.0", "transformer.h.1"], 4),
    "opt": (opt, ["model.decoder.layers.0", "model.decoder.layers.1"], 6),
}
ALL = [{"op_types": ["default"]}]
_QKV = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj"}
SHARED = {"llama": {**_QKV, "mlp.up_proj": "mlp.gate_proj"}, "qwen2": {**_QKV, "mlp.up_proj": "mlp.gate_proj"},
          "gpt2": {}, "opt": _QKV}


def build(family, seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FAMILIES[family][0]().eval()


def batches(n=4, size=4, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (size, seq), generator=g) for _ in range(n)]


HELD = batches(1, 4, 16, seed=99)[0]


def make(cls, model, cfg, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DefaultSkipWarning (embeddings, norms)
        return cls(model, [{**cfg, "op_types": ["default"]}], **kw)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def same_state(model, before):
    now = model.state_dict()
    return all(torch.equal(before[k], now[k]) for k in before if k in now)


def logits_error(model, ref):
    with torch.no_grad():
        out = model(HELD).logits
    assert torch.isfinite(out).all()
    return float(((out - ref) ** 2).mean())


# ------------------------------------------------------------------------------------------------ blocks
@pytest.mark.parametrize("family", list(FAMILIES))
def test_blocks_are_found_without_naming_the_family_and_the_head_is_left_out(family):
    _, paths, per_block = FAMILIES[family]
    model = build(family)
    p = make(WandaPruner, model, {"sparsity": 0.5})
    names = [w.name for w in p.get_modules_wrapper()]
    assert len(names) == 2 * per_block
    assert not any("lm_head" in n for n in names)
    be = TorchOneShotBackend(p, None)
    assert [n for n, _ in be.blocks()] == paths
    assert [len(be.block_layers(b)) for _, b in be.blocks()] == [per_block, per_block]
    assert be.block_layers(None) == []
    block_class = type(be.blocks()[0][1]).__name__
    assert [n for n, _ in TorchOneShotBackend(p, [block_class]).blocks()] == paths
    # layers reading the very same hidden state share one accumulator (the first one called leads)
    name, block = be.blocks()[0]
    first = be.first_inputs([((batches(1)[0],), {"use_cache": False})])
    shared = {k[len(name) + 1:]: v[len(name) + 1:] for k, v in be.shared_inputs(block, first, be.block_layers(block)).items()}
    assert shared == SHARED[family]


def test_block_inputs_share_the_repeated_mask_and_rotary_tables_and_advance_in_place():
    """The first block's cached inputs keep ONE causal mask / rotary table for all batches (memory: one block's
    activations, not 1.5x), while hidden states and a padded batch's own mask stay per batch; advance() then
    replaces them by the block's outputs in place."""
    model = build("llama")
    model.config._attn_implementation = "eager"  # a float causal mask on every call (sdpa passes None)
    be = TorchOneShotBackend(make(WandaPruner, model, {"sparsity": 0.5}), None)
    ids = batches(3)
    pad = torch.ones(4, 16, dtype=torch.long)
    pad[0, :5] = 0
    with torch.no_grad():
        first = be.first_inputs([((ids[0],), {"use_cache": False}), ((ids[1],), {"use_cache": False}),
                                 ((ids[2],), {"use_cache": False, "attention_mask": pad})])
    k0, k1, k2 = (f.kwargs for f in first)
    assert torch.is_tensor(k0["attention_mask"]) and k0["attention_mask"].shape == (4, 1, 16, 16)
    assert k1["attention_mask"] is k0["attention_mask"]
    assert k1["position_embeddings"] is k0["position_embeddings"]
    assert k2["position_embeddings"] is k0["position_embeddings"]
    assert k2["attention_mask"] is not k0["attention_mask"]
    assert not torch.equal(k2["attention_mask"], k0["attention_mask"])
    hidden = [f.hidden() for f in first]
    assert hidden[0] is not hidden[1] and not torch.equal(hidden[0], hidden[1])
    # the next block's inputs: advance() overwrites the list in place with what run_block returns
    block = be.blocks()[0][1]
    with torch.no_grad():
        outs = be.run_block(block, first, None)
        same = be.advance(block, first)
    assert same is first and all(torch.equal(a.hidden(), b.hidden()) for a, b in zip(same, outs))
    assert same[1].kwargs["attention_mask"] is k0["attention_mask"]


def test_named_head_is_compressed_outside_the_blocks_and_a_model_without_blocks_is_one_pass():
    model = build("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["default"]},
                                    {"sparsity": 0.25, "op_names": ["lm_head"]}])
    out = io.StringIO()
    p.calibrate(batches(2), progress=out)
    assert [ln.split(":")[0] for ln in out.getvalue().splitlines()] == [
        "[sparsegpt] block 1/2 model.layers.0", "[sparsegpt] block 2/2 model.layers.1", "[sparsegpt] outside the blocks"]
    head = [r for r in p.oneshot_rows if r["layer"] == "lm_head"]
    assert head == [dict(head[0], block="", sparsity=0.25)]
    assert int((~model.lm_head.weight_mask).sum()) == 64 * 32 // 4

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    q = GptqQuantizer(mlp, [{"quant_bits": 4, "op_types": ["default"]}])
    assert TorchOneShotBackend(q, None).blocks() == []
    q.calibrate([torch.randn(5, 8) for _ in range(3)], progress=False)
    assert [r["block"] for r in q.oneshot_rows] == ["", ""]
    assert len(torch.unique(mlp[0].weight[0])) <= 15


def test_a_layer_that_stops_sharing_its_leaders_input_is_an_error():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) + self.b(x if x.shape[0] != 3 else x.clone())

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for blk in self.layers:
                x = blk(x)
            return x

    torch.manual_seed(0)
    model = Net()
    p = GptqQuantizer(model, [{"quant_bits": 4, "op_types": ["default"]}])
    be = TorchOneShotBackend(p, None)
    assert be.shared_inputs(model.layers[0], be.first_inputs([((torch.randn(2, 4),), {})]),
                            be.block_layers(model.layers[0])) == {"layers.0.b": "layers.0.a"}
    p.calibrate([torch.randn(2, 4), torch.randn(2, 4)], progress=False)  # shared on every batch: fine
    other = Net()
    q = GptqQuantizer(other, [{"quant_bits": 4, "op_types": ["default"]}])
    before = state(other)
    with pytest.raises(ModelError, match=r"layer 'layers.0.b' read the same input as 'layers.0.a' on the first "
                                         r"calibration batch but not on a later one"):
        q.calibrate([torch.randn(2, 4), torch.randn(3, 4)], progress=False)
    assert same_state(other, before)


# ------------------------------------------------------------------------------------------------ methods
def _check_codes(wrapper, spec_bits, group_size):
    codes = oneshot_codes(wrapper).to(torch.float64)
    qmax = 2 ** (spec_bits - 1) - 1
    assert int(codes.min()) >= -qmax and int(codes.max()) <= qmax
    gidx = torch.arange(codes.shape[1]) // group_size
    deq = codes * wrapper.weight_group_scale.double()[:, gidx]
    if hasattr(wrapper, "awq_scales"):
        deq = deq / wrapper.awq_scales.double()[None, :]
    weight = wrapper.weight.double()
    if type(wrapper.layer).__name__ == "Conv1D":
        weight = weight.t()  # codes are kept in the canonical [out, in] layout
    torch.testing.assert_close(deq, weight, rtol=1e-6, atol=1e-6)
    assert bool(wrapper.oneshot_calibrated)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_method_compresses_every_family_exactly_as_configured(family):
    per_block = FAMILIES[family][2]
    calib = batches()
    for cls, cfg in [(WandaPruner, {"sparsity": 0.5}), (SparseGPTPruner, {"sparse_pattern": "2:4"})]:
        model = build(family)
        p = make(cls, model, cfg).calibrate(calib, progress=False)
        assert len(p.oneshot_rows) == 2 * per_block
        for w in p.get_modules_wrapper():
            keep = w.weight_mask if type(w.module).__name__ != "Conv1D" else w.weight_mask.t()
            assert torch.equal(w.weight == 0, ~w.weight_mask)  # exactly the pruned weights are zero
            if cls is WandaPruner:  # half of every output row
                assert (keep.sum(dim=1) == keep.shape[1] // 2).all(), w.name
            else:  # 2 of every 4 consecutive inputs
                assert (keep.reshape(keep.shape[0], -1, 4).sum(-1) == 2).all(), w.name
        assert p.report().total["sparsity"] == 0.5
    for cls in (GptqQuantizer, RtnQuantizer, AwqQuantizer):
        model = build(family)
        q = make(cls, model, {"quant_bits": 4, "group_size": 16})
        q.calibrate(None if cls is RtnQuantizer else calib, progress=False)
        assert {r["bits"] for r in q.oneshot_rows} == {4} and {r["group_size"] for r in q.oneshot_rows} == {16}
        for w in q.get_modules_wrapper():
            _check_codes(w, 4, 16)
        assert "group_size" in str(q.report())
        logits_error(model, 0.0)  # finite


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sparsegpt_beats_magnitude_and_gptq_beats_rtn_on_held_out_logits(family):
    ref_model = build(family)
    with torch.no_grad():
        ref = ref_model(HELD).logits
    calib = batches(8)
    err = {}
    for name, cls, cfg in [("sparsegpt", SparseGPTPruner, {"sparsity": 0.5}), ("magnitude", LevelPruner, {"sparsity": 0.5}),
                           ("gptq", GptqQuantizer, {"quant_bits": 3, "group_size": 16}),
                           ("rtn", RtnQuantizer, {"quant_bits": 3, "group_size": 16})]:
        model = build(family)
        if cls is LevelPruner:  # the same layers as the one-shot pruner: the decoder Linear / Conv1D layers
            names = [w.name for w in make(WandaPruner, build(family), {"sparsity": 0.5}).get_modules_wrapper()]
            LevelPruner(model, [{"sparsity": 0.5, "op_names": names}]).compress()
        else:
            make(cls, model, cfg).calibrate(calib, progress=False)
        err[name] = logits_error(model, ref)
    assert err["sparsegpt"] < err["magnitude"], err
    assert err["gptq"] < err["rtn"], err


def test_block_two_is_calibrated_on_the_outputs_of_the_compressed_block_one():
    model = build("llama")
    dense = build("llama")
    calib = batches(3)
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    target = model.model.layers[1].self_attn.q_proj  # the wrapper
    w_before = target.weight.detach().double().numpy().copy()
    value = model.model.layers[1].self_attn.v_proj  # reads the same hidden state (its rows are converted once)
    v_before = value.weight.detach().double().numpy().copy()
    seen = []
    h = target.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    p.calibrate(calib, progress=False, forward_dtype="model")  # the float32 passes (float64: the next test)
    h.remove()
    # block 1 (the last) ran on the first sequence of batch 0 (which layers share an input), then once observed;
    # no output pass
    assert len(seen) == 1 + len(calib) and torch.equal(seen[0], seen[1][:1])
    seen = seen[1:]

    def inputs_of(m):
        got = []
        layer = m.model.layers[1].self_attn.q_proj
        hh = layer.register_forward_pre_hook(lambda mod, a: got.append(a[0].detach().clone()))
        with torch.no_grad():
            for b in calib:
                m(b, use_cache=False)
        hh.remove()
        return got

    for a, b in zip(seen, inputs_of(model)):  # what the compressed model computes ...
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.allclose(seen[0], inputs_of(dense)[0], atol=1e-3)  # ... not what the dense one does
    acc = os1.GramAccumulator(32)
    for x in seen:
        acc.add(x.double().numpy())
    ref = os1.sparsegpt_prune(w_before, acc.gram, 0.5)
    np.testing.assert_array_equal(target.weight_mask.numpy(), ref.mask)
    np.testing.assert_array_equal(target.weight.detach().numpy(), ref.weight.astype(np.float32))
    np.testing.assert_array_equal(value.weight.detach().numpy(),
                                  os1.sparsegpt_prune(v_before, acc.gram, 0.5).weight.astype(np.float32))



def test_forward_dtype_float64_records_float64_inputs_of_the_compressed_blocks_and_leaves_the_model_float32():
    """'float64' (and 'auto' on CPU): block 1's layers see float64 inputs, equal to a float64 forward of the compressed
    model whose block 0 output is rounded to float32 (the activations are kept in the model's dtype between
    blocks); the model's own tensors stay float32, and the result differs from the float32 passes'."""
    calib = batches(3)
    model, same = build("llama"), build("llama")
    make(SparseGPTPruner, same, {"sparsity": 0.5}).calibrate(calib, progress=False, forward_dtype="model")
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    params = {n: t for n, t in model.named_parameters()}
    seen = []
    h = model.model.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    p.calibrate(calib, progress=False, forward_dtype="float64")
    h.remove()
    seen = [t for t in seen if t.dtype == torch.float64]
    assert len(seen) == len(calib)  # the observed pass ran in float64 (the sharing probe in float32)
    assert all(t.dtype == torch.float32 and params[n] is t for n, t in model.named_parameters())
    ref = copy.deepcopy(model).double()  # the compressed weights, in float64
    ref.model.layers[0].register_forward_hook(
        lambda m, a, out: out.float().double() if torch.is_tensor(out) else (out[0].float().double(), *out[1:]))
    got = []
    ref.model.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda m, a: got.append(a[0].detach().clone()))
    with torch.no_grad():
        for b in calib:
            ref(b, use_cache=False)
    for a, b in zip(seen, got):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # SparseGPT's weight updates follow the float64 statistics: not the float32 passes' weights bit for bit
    assert not torch.equal(model.model.layers[1].mlp.down_proj.weight, same.model.layers[1].mlp.down_proj.weight)


@pytest.mark.parametrize("cls, cfg", [(SparseGPTPruner, {"sparsity": 0.5}),
                                      (GptqQuantizer, {"quant_bits": 4, "group_size": 16})])
def test_float64_pass_widens_one_wrapped_layer_at_a_time(cls, cfg):
    """The float64 passes copy a wrapped layer's tensors to float64 only while that layer runs: when a layer of
    block 1 returns, its own weight is float64 and every other wrapped layer's still float32 (the pruner's layer
    runs its own forward, the quantizer's wrapper computes with the weight itself: both covered); the probe run
    that finds shared inputs is float32 throughout."""
    from compressor.torch.modules import innermost_module

    model = build("llama")
    p = make(cls, model, cfg)
    block = model.model.layers[1]
    wrapped = {n: m for n, m in block.named_modules() if any(m is w for w in p.get_modules_wrapper())}
    assert sorted(wrapped) == ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj",
                               "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    seen: dict[str, set[tuple[str, ...]]] = {n: set() for n in wrapped}

    def record(name):
        def hook(module, args, out):
            seen[name].add(tuple(sorted(n for n, w in wrapped.items()
                                        if innermost_module(w)._parameters["weight"].dtype == torch.float64)))
        return hook
    handles = [w.register_forward_hook(record(n)) for n, w in wrapped.items()]
    p.calibrate(batches(2), progress=False, forward_dtype="auto")  # 'auto': float64 on CPU
    for h in handles:
        h.remove()
    assert seen == {n: {(), (n,)} for n in wrapped}
    assert all(t.dtype == torch.float32 for t in model.parameters())


def test_forward_dtype_bad_value_is_a_config_error_before_the_model_changes():
    model = build("llama")
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    before = state(model)
    for bad in ("fp64", None, torch.float64):
        with pytest.raises(ConfigError, match=r"forward_dtype must be one of \['auto', 'float64', 'model'\]"):
            p.calibrate(batches(2), progress=False, forward_dtype=bad)
        assert same_state(model, before) and not p.calibrated


def test_sparsegpt_2_4_then_gptq_w4_keeps_the_zeros():
    model = build("llama")
    calib = batches(3)
    make(SparseGPTPruner, model, {"sparse_pattern": "2:4"}).calibrate(calib, progress=False)
    q = make(GptqQuantizer, model, {"quant_bits": 4, "group_size": 16}).calibrate(calib, progress=False)
    for w in q.get_modules_wrapper():
        inner = w.module
        assert type(inner).__name__ == "PrunerModuleWrapper"
        pruned = ~inner.weight_mask
        assert int(pruned.sum()) == pruned.numel() // 2
        assert (w.weight[pruned] == 0).all() and (oneshot_codes(w)[pruned] == 0).all()
        assert ((w.weight != 0).reshape(w.weight.shape[0], -1, 4).sum(-1) <= 2).all()
        _check_codes(w, 4, 16)
    with torch.no_grad():
        assert torch.isfinite(model(HELD).logits).all()


def test_one_shot_pruners_keep_no_float_copy_of_the_masks():
    model = build("llama")
    p = make(SparseGPTPruner, model, {"sparsity": 0.5}).calibrate(batches(2), progress=False)
    ws = list(p.get_modules_wrapper())
    assert ws and all(w.multiplier_cache is False for w in ws)
    assert all(w._mul_cache == [None, None] for w in ws)  # nothing cached by calibrate's masking
    # a fine-tune afterwards still keeps the pruned weights at zero (masked from the bool mask)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p.hook_optimizer(opt)  # the pruner re-masks after every step
    model(HELD).logits.float().pow(2).mean().backward()
    opt.step()
    for w in ws:
        assert (w.weight[~w.weight_mask] == 0).all()
        assert w._mul_cache == [None, None]


def test_export_writes_the_compressed_weights_loadable_into_the_original_class(tmp_path):
    model = build("gpt2")
    q = make(AwqQuantizer, model, {"quant_bits": 4, "group_size": 16}).calibrate(batches(2), progress=False)
    with torch.no_grad():
        want = model(HELD).logits
    q.export_model(str(tmp_path / "m.pt"))
    fresh = build("gpt2", seed=5)
    fresh.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(fresh(HELD).logits, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ data
def test_calibration_data_in_every_form_gives_the_same_masks():
    ids = batches(1, 4, 16)[0]
    ones = torch.ones_like(ids)
    enc = transformers.BatchEncoding({"input_ids": ids, "attention_mask": ones})
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    forms = {"tensor": ids, "list": [ids[:2], ids[2:]], "tuple": (ids, ones), "dict": {"input_ids": ids},
             "batch_encoding": enc, "dataloader": loader, "dicts": [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]}
    masks = {}
    for name, data in forms.items():
        model = build("llama")
        p = make(WandaPruner, model, {"sparsity": 0.5}).calibrate(data, progress=False)
        masks[name] = [w.weight_mask.clone() for w in p.get_modules_wrapper()]
    for name, m in masks.items():  # the same tokens in one or two batches: the same masks
        assert all(torch.equal(a, b) for a, b in zip(m, masks["tensor"])), name


def test_num_samples_counts_sequences_and_cuts_the_last_batch():
    data = [torch.zeros(3, 5, dtype=torch.long), {"input_ids": torch.zeros(3, 5, dtype=torch.long),
                                                  "attention_mask": torch.ones(3, 5, dtype=torch.long)}]
    got = list(calibration_batches(data, "t", num_samples=4))
    assert [(i, [tuple(a.shape) for a in args], {k: tuple(v.shape) for k, v in kw.items()}) for i, args, kw in got] == [
        (0, [(3, 5)], {}), (1, [], {"input_ids": (1, 5), "attention_mask": (1, 5)})]
    assert len(list(calibration_batches(data, "t", num_samples=3))) == 1
    model = build("llama")
    p = make(WandaPruner, model, {"sparsity": 0.5})
    be = TorchOneShotBackend(p, None)
    first = be.first_inputs([((), {"input_ids": torch.zeros(2, 6, dtype=torch.long),
                                   "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2])})])
    rows = []
    be.run_block(be.blocks()[0][1], first, {"model.layers.0.mlp.down_proj": lambda x: rows.append(x.shape)})
    assert rows == [(10, 64)]  # 12 tokens, 2 of them padding: left out of the statistics


def test_bad_data_is_refused_before_any_weight_changes():
    model = build("llama")
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    before = state(model)
    emb = torch.randn(2, 8, 32)
    emb[1, 3, 0] = float("nan")
    cases = [(None, ConfigError, "no calibration data"), ([], ConfigError, "yielded no batch"),
             ([batches(1)[0], {"inputs_embeds": emb}], ConfigError, r"batch 1 \(inputs_embeds\) contains NaN or inf"),
             ([{"input_ids": torch.full((2, 8), VOCAB + 5)}], ModelError, r"calibration batch 0 .*failed in the model"),
             (["text"], ModelError, "batch 0 is a str"), (3, ConfigError, "calibration data must be")]
    for data, err, msg in cases:
        with pytest.raises(err, match=msg):
            p.calibrate(data, progress=False)
        assert same_state(model, before)
    with pytest.raises(ConfigError, match="num_samples must be a positive int"):
        p.calibrate(batches(1), num_samples=0)
    assert same_state(model, before) and not p.calibrated


def test_awq_parent_calls_are_merged_only_where_they_differ_in_the_hidden_state_alone():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, hidden_states, bias=None, scale=1.0):
            return self.lin(hidden_states) * scale + (0 if bias is None else bias)

    torch.manual_seed(0)
    mod = Parent()
    shared = torch.randn(1, 3, 4)  # a batch-1 tensor every call shares (a causal mask, a rotary table)
    calls = [_Input((), {"hidden_states": torch.randn(2, 3, 4), "bias": shared, "scale": 2.0}, ("kw", "hidden_states"),
                    None) for _ in range(5)]
    with torch.no_grad():
        want = torch.cat([mod(**c.kwargs) for c in calls])
    merged = _merged_calls(mod, list(calls))
    assert len(merged) == 1 and merged[0].kwargs["hidden_states"].shape == (10, 3, 4)
    with torch.no_grad():
        assert torch.allclose(mod(**merged[0].kwargs), want, rtol=0, atol=1e-6)
    # a per-call tensor argument, a different plain value, or a batch-sized tensor: not merged there
    own = [_Input((), {**c.kwargs, "bias": torch.randn(1, 3, 4)}, c.where, None) for c in calls[:2]]
    assert len(_merged_calls(mod, own)) == 2
    scaled = [calls[0], _Input((), {**calls[1].kwargs, "scale": 3.0}, calls[1].where, None)]
    assert len(_merged_calls(mod, scaled)) == 2
    per_row = torch.randn(2, 3, 4)
    rows = [_Input((), {**c.kwargs, "bias": per_row}, c.where, None) for c in calls[:2]]
    assert len(_merged_calls(mod, rows)) == 2
    # a module whose output depends on the batch as a whole (batch mean): the check keeps the calls apart
    class BatchMean(nn.Module):
        def forward(self, hidden_states, bias=None, scale=1.0):
            return hidden_states - hidden_states.mean(dim=0, keepdim=True)

    assert len(_merged_calls(BatchMean(), list(calls))) == 5


def test_inputs_embeds_batches_are_not_overwritten_by_the_in_place_advance():
    """The block inputs are updated in place block after block; a Llama hands inputs_embeds straight to its
    first block, so the caller's tensors must be copied, not overwritten (and give the same result)."""
    model = build("llama")
    with torch.no_grad():
        embs = [model.get_input_embeddings()(b) for b in batches(2)]
    given = [e.clone() for e in embs]
    p = make(SparseGPTPruner, model, {"sparsity": 0.5}).calibrate([{"inputs_embeds": e} for e in embs], progress=False)
    assert all(torch.equal(e, g) for e, g in zip(embs, given))
    ref = make(SparseGPTPruner, build("llama"), {"sparsity": 0.5}).calibrate(batches(2), progress=False)
    for a, b in zip(p.get_modules_wrapper(), ref.get_modules_wrapper()):
        assert torch.equal(a.weight_mask, b.weight_mask), a.name


def test_ptq_takes_dicts_batch_encodings_and_refuses_nan():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp

        def forward(self, x=None):
            return self.net(x)

    model = Kw()
    cfg = [{"quant_types": ["weight", "input"], "quant_bits": 8, "op_types": ["default"]}]
    q = PtqQuantizer(model, cfg, fuse_relu=False, share_ranges=False)
    with pytest.raises(ConfigError, match="contains NaN or inf"):
        q.calibrate([{"x": torch.full((2, 4), float("nan"))}])
    assert not q.calibrated
    q.calibrate(transformers.BatchEncoding({"x": torch.randn(6, 4)}), num_samples=5)
    assert q.calibrated and q.calibration_batches == 1


# ------------------------------------------------------------------------------------------------ config errors
def test_config_and_model_errors_name_what_is_wrong_before_the_model_changes():
    model = build("llama")
    before = state(model)
    types = {type(m) for m in model.modules()}
    cases = [
        (lambda: SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d"]}]), ConfigError,
         r"selects no layer of the model. Layer types in the model: \[.*'Linear'"),
        (lambda: SparseGPTPruner(model, [{"sparsity": 0.5, "op_names": ["lm_head"], "op_types": ["Embedding"]}]),
         ConfigError, "selects no layer"),
        (lambda: WandaPruner(model, [{"sparsity": 0.5, "op_types": ["default"], "damp": 0.1}]), ConfigError,
         r"unknown key 'damp'.*WandaPruner accepts"),
        (lambda: SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["default"], "damp": 1.5}]), ConfigError,
         r"'damp' = 1.5 is invalid"),
        (lambda: WandaPruner(model, [{"op_types": ["default"]}]), ConfigError, r"needs key\(s\) \['sparsity'\]"),
        (lambda: GptqQuantizer(model, [{"quant_bits": 16, "op_types": ["default"]}]), ConfigError,
         "quant_bits 2..8, got 16"),
        (lambda: GptqQuantizer(model, [{"quant_bits": 4, "quant_scheme": "per_tensor", "op_types": ["default"]}]),
         ConfigError, r"'quant_scheme' = 'per_tensor' is invalid"),
        (lambda: GptqQuantizer(model, [{"quant_bits": 4, "quant_types": ["input"], "op_types": ["default"]}]),
         ConfigError, r"quantizes weights only: quant_types must be \['weight'\].*got \['input'\]"),
        (lambda: SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], sequential_targets=["GPT2Block"]),
         ModelError, r"sequential_targets \['GPT2Block'\] name no module class.*LlamaDecoderLayer"),
        (lambda: SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], sequential_targets=[3]),
         ConfigError, "sequential_targets must be None or a non-empty list"),
        (lambda: SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["Embedding"]}]), ConfigError,
         r"'model.embed_tokens' \(Embedding\) is not a Linear layer"),
        (lambda: AwqQuantizer(model, [{"quant_bits": 4, "apply_clip": "yes", "op_types": ["default"]}]), ConfigError,
         r"'apply_clip' = 'yes' is invalid.*True or False"),
        (lambda: GptqQuantizer(model, [{"quant_bits": 4, "apply_clip": True, "op_types": ["default"]}]), ConfigError,
         r"unknown key 'apply_clip'"),
    ]
    for build_it, err, msg in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(err, match=msg):
                build_it()
        assert same_state(model, before) and {type(m) for m in model.modules()} == types


def test_the_registry_picks_the_torch_classes():
    model = build("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = compressor.SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    assert type(p) is SparseGPTPruner
    for name in ("WandaPruner", "GptqQuantizer", "RtnQuantizer", "AwqQuantizer"):
        assert compressor.core.registry.registry().get("torch", name) is getattr(compressor.torch, name)


# ------------------------------------------------------------------------------------------------ AWQ search, rollback, range
def test_awq_block_search_gives_one_alpha_and_one_scale_vector_per_input_group():
    model = build("llama")
    q = make(AwqQuantizer, model, {"quant_bits": 4, "group_size": 16}).calibrate(batches(), progress=False)
    rows = {r["layer"]: r for r in q.oneshot_rows}
    ws = {w.name: w for w in q.get_modules_wrapper()}
    for b in ("model.layers.0", "model.layers.1"):
        groups = [[f"{b}.self_attn.{n}_proj" for n in "qkv"], [f"{b}.mlp.gate_proj", f"{b}.mlp.up_proj"]]
        for g in groups:
            assert {rows[n]["group"] for n in g} == {g[0]} and len({rows[n]["alpha"] for n in g}) == 1
            for n in g[1:]:
                assert torch.equal(ws[n].awq_scales, ws[g[0]].awq_scales)
        for n in (f"{b}.self_attn.o_proj", f"{b}.mlp.down_proj"):  # alone: their own output error
            assert "group" not in rows[n]
    for w in ws.values():
        _check_codes(w, 4, 16)
    lq = make(AwqQuantizer, build("llama"), {"quant_bits": 4, "group_size": 16, "awq_search": "layer"})
    lq.calibrate(batches(), progress=False)
    assert all("group" not in r for r in lq.oneshot_rows)
    with pytest.raises(ConfigError, match="awq_search"):
        make(AwqQuantizer, build("llama"), {"quant_bits": 4, "awq_search": "model"})
    for bad in (0, 1.5, "all"):
        with pytest.raises(ConfigError, match="search_samples"):
            make(AwqQuantizer, build("llama"), {"quant_bits": 4, "search_samples": bad})
    for bad in (1, 0, "Both", None):  # 1 / 0 are not True / False
        with pytest.raises(ConfigError, match=r"'duo_scaling'.*True, False or 'both'"):
            make(AwqQuantizer, build("llama"), {"quant_bits": 4, "duo_scaling": bad})
    both = make(AwqQuantizer, build("llama"), {"quant_bits": 4, "group_size": 16, "duo_scaling": "both", "n_grid": 4})
    both.calibrate(batches(), progress=False)
    # 'both' with n_grid 4: alpha in {0, 1}, each without then with duo scaling
    assert {(r["alpha"], r["duo"]) for r in both.oneshot_rows} <= {(0.0, False), (0.0, True), (1.0, False), (1.0, True)}
    assert "duo" in str(both.report()) and "alpha" in str(both.report())


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_awq_search_samples_are_sequences_taken_out_of_their_batches(family):
    """search_samples counts sequences: 3 of one batch of 8 (rows 0, 4, 7 of a 2-D token tensor) score the grid
    exactly as the same sequences do when every sequence is its own batch (the statistics use all 8)."""
    data = batches(1, 8, 16, seed=3)[0]
    cfg = {"quant_bits": 4, "group_size": 16, "search_samples": 3}
    one = make(AwqQuantizer, build(family), cfg).calibrate(data, progress=False)
    each = make(AwqQuantizer, build(family), cfg).calibrate([data[i:i + 1] for i in range(8)], progress=False)
    full = make(AwqQuantizer, build(family), {**cfg, "search_samples": None}).calibrate(data, progress=False)
    groups = [r for r in one.oneshot_rows if "group" in r]
    assert groups, "no group was searched on its parent module"
    by = {r["layer"]: r for r in each.oneshot_rows}
    for r in groups:
        assert r["alpha"] == by[r["layer"]]["alpha"]
        assert r["error"] == pytest.approx(by[r["layer"]]["error"], rel=1e-4)
    # fewer sequences, another loss: the error of the full search is a different number
    errs = {r["layer"]: r["error"] for r in full.oneshot_rows if "group" in r}
    assert any(abs(errs[r["layer"]] - r["error"]) > 1e-3 * errs[r["layer"]] for r in groups)


@pytest.mark.parametrize("cls,cfg,exc", [
    (SparseGPTPruner, {"sparsity": 0.5}, RuntimeError),
    (GptqQuantizer, {"quant_bits": 4, "group_size": 16}, KeyboardInterrupt),
    (AwqQuantizer, {"quant_bits": 4, "group_size": 16}, RuntimeError),
], ids=["sparsegpt", "gptq-interrupt", "awq"])
def test_calibrate_that_fails_in_block_two_leaves_every_weight_and_buffer_as_before(cls, cfg, exc):
    model = build("llama")
    p = make(cls, model, cfg)
    before = state(model)
    assert any("weight_mask" in k or "weight_codes" in k for k in before)  # wrapper buffers are in the state

    def boom(module, args, kwargs):
        raise exc("block 2 failed")

    handle = model.model.layers[1].register_forward_pre_hook(boom, with_kwargs=True)
    with pytest.raises(exc, match="block 2 failed"):
        p.calibrate(batches(), progress=False)
    handle.remove()
    assert same_state(model, before) and set(model.state_dict()) == set(before)
    assert not p.calibrated and p.oneshot_rows == []
    # and the compressor still works: the same result as on a fresh copy
    p.calibrate(batches(), progress=False)
    fresh = build("llama")
    make(cls, fresh, cfg).calibrate(batches(), progress=False)
    assert same_state(model, state(fresh))


def test_codes_of_4_bits_are_kept_two_per_byte_and_8_bits_one():
    for bits, per_byte in ((4, 2), (8, 1)):
        q = make(RtnQuantizer, build("llama"), {"quant_bits": bits, "group_size": 16}).calibrate()
        for w in q.get_modules_wrapper():
            n_out, n_in = w.weight.shape
            assert w.weight_codes.dtype == torch.int8 and tuple(w.weight_codes.shape) == (n_out, n_in // per_byte)
            codes = oneshot_codes(w)
            assert tuple(codes.shape) == (n_out, n_in) and codes.dtype == torch.int8
            gidx = torch.arange(n_in) // 16
            torch.testing.assert_close(codes.double() * w.weight_group_scale.double()[:, gidx], w.weight.double(),
                                       rtol=1e-6, atol=1e-6)
    # a state saved with one code per entry (before codes were packed) loads into the packed buffers
    q = make(RtnQuantizer, build("llama"), {"quant_bits": 4, "group_size": 16}).calibrate()
    want = {w.name: oneshot_codes(w) for w in q.get_modules_wrapper()}
    old = {k: want[k.removesuffix(".weight_codes")] if k.endswith(".weight_codes") else v
           for k, v in q.bound_model.state_dict().items()}
    assert sum(k.endswith(".weight_codes") for k in old) == len(want)
    fresh = make(RtnQuantizer, build("llama"), {"quant_bits": 4, "group_size": 16})
    fresh.bound_model.load_state_dict(old)
    for w in fresh.get_modules_wrapper():
        torch.testing.assert_close(oneshot_codes(w), want[w.name], rtol=0, atol=0)


def test_oneshot_codes_refuses_uncalibrated_and_other_wrappers():
    q = make(RtnQuantizer, build("llama"), {"quant_bits": 4, "group_size": 16})
    w = q.get_modules_wrapper()[0]
    with pytest.raises(ModelError, match="not calibrated yet"):
        oneshot_codes(w)
    p = PtqQuantizer(build("llama"), [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}])
    with pytest.raises(ModelError, match="holds no integer codes"):
        oneshot_codes(p.get_modules_wrapper()[0])


def test_quant_range_full_uses_the_signed_int4_grid():
    for rng_key, lo in (("full", -8), ("narrow", -7)):
        model = build("llama")
        q = make(RtnQuantizer, model, {"quant_bits": 4, "group_size": 16, "quant_range": rng_key}).calibrate()
        codes = torch.cat([oneshot_codes(w).flatten() for w in q.get_modules_wrapper()])
        assert int(codes.min()) == lo and int(codes.max()) == 7
        for w in q.get_modules_wrapper():
            gidx = torch.arange(oneshot_codes(w).shape[1]) // 16
            deq = oneshot_codes(w).double() * w.weight_group_scale.double()[:, gidx]
            torch.testing.assert_close(deq, w.weight.double(), rtol=1e-6, atol=1e-6)
            assert int(w.weight_group_zero_point.abs().max()) == 0
    g = make(GptqQuantizer, build("llama"), {"quant_bits": 4, "group_size": 16, "quant_range": "full"})
    g.calibrate(batches(), progress=False)
    codes = torch.cat([oneshot_codes(w).flatten() for w in g.get_modules_wrapper()])
    assert int(codes.min()) == -8 and int(codes.max()) == 7
    with pytest.raises(ConfigError, match="quant_range"):
        make(GptqQuantizer, build("llama"), {"quant_bits": 4, "quant_range": "wide"})


@pytest.mark.parametrize("family, last", [("llama", "mlp.down_proj"), ("gpt2", "mlp.c_proj"), ("opt", "fc2")])
def test_an_observing_call_ends_after_the_blocks_last_observed_input_with_the_same_result(family, last, monkeypatch):
    """The observing pass needs the layers' inputs, not the block's output: from its second call on, a block call
    stops once the last observed layer has handed over its input (its own product is never computed); the first
    call runs to the end and fixes the order. The compressed weights are bit for bit those of full calls."""
    import compressor.core.oneshot as seq

    n = 3
    model = build(family)
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    blocks = [model.get_submodule(b) for b in FAMILIES[family][1]]
    runs = {i: 0 for i in range(len(blocks))}
    handles = [b.get_submodule(last).register_forward_hook(
        lambda m, a, o, i=i: runs.__setitem__(i, runs[i] + 1)) for i, b in enumerate(blocks)]
    p.calibrate(batches(n), progress=False)
    for h in handles:
        h.remove()
    # block 0: the shared-input probe, the first observing call, n advancing calls; block 1 (the last): no advance
    assert runs == {0: 1 + 1 + n, 1: 1 + 1}

    full = build(family)
    monkeypatch.setattr(seq.ObserveCalls, "fired", lambda self, name: False)
    make(SparseGPTPruner, full, {"sparsity": 0.5}).calibrate(batches(n), progress=False)
    assert same_state(full, state(model))


def test_a_float64_pass_puts_the_blocks_own_tensors_back_when_a_call_fails_midway():
    """The float64 pass swaps the block's tensors outside the wrapped layers for float64 copies for the whole pass
    and a wrapped layer's while it runs: an exception in the middle of a call (here in the MLP, after the attention
    ran) leaves every parameter and buffer the very object it was, float32, in the module that held it."""
    model = build("llama")
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    held = {(id(m), n): t for m in model.modules() for d in (m._parameters, m._buffers) for n, t in d.items()
            if t is not None}
    mlp = model.model.layers[0].mlp
    calls = []

    def boom(module, args):
        calls.append(args[0].dtype)
        if len(calls) == 3:
            raise RuntimeError("MLP failed")
    handle = mlp.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="MLP failed"):
        p.calibrate(batches(), progress=False, forward_dtype="float64")
    handle.remove()
    assert calls[-1] == torch.float64  # it failed inside a float64 call
    now = {(id(m), n): t for m in model.modules() for d in (m._parameters, m._buffers) for n, t in d.items()
           if t is not None}
    assert now.keys() == held.keys() and all(now[k] is held[k] for k in held)
    assert all(t.dtype == torch.float32 for t in model.parameters())


def test_a_float64_pass_leaves_no_float64_tensor_for_the_garbage_collector():
    """The float64 copies of a pass (the workspace, the widened block tensors and call arguments) are freed when
    the pass ends, by reference counting: none is left in a reference cycle waiting for the collector (a
    recursive closure kept a pass's copies alive into the next blocks, +10-15 MiB on the 10x model)."""
    import gc

    model = build("llama")
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    def float64_tensors():
        return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.float64}

    gc.collect()
    gc.disable()
    try:
        before = float64_tensors()  # held by other tests' objects, if any: alive, so their ids stay theirs
        p.calibrate(batches(), progress=False, forward_dtype="float64")
        left = [t for i, t in float64_tensors().items() if i not in before]
    finally:
        gc.enable()
    assert left == []
