"""Mixture-of-experts models in the one-shot methods (PyTorch): the decoder layers are the blocks (not the expert
lists), each routed expert is calibrated on exactly the tokens its router sends to it, an expert the data never
reaches falls back (round to nearest / magnitude) with one warning, routers are found, and transformers 5's fused
3-D experts are named when they stay uncompressed."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compressor.core import oneshot as os1
from compressor.core.errors import ModelError
from compressor.core.oneshot import experts as core_experts
from compressor.core.oneshot.observe import observers
from compressor.torch import AwqQuantizer, GptqQuantizer, SparseGPTPruner, WandaPruner
from compressor.torch.quantization.lowbit import oneshot_codes
from compressor.torch.sequential import TorchOneShotBackend
from compressor.torch.sequential.blocks import find_experts, find_routers, float64_exempt, model_dtype_hooks

pytestmark = [pytest.mark.torch]

D, FF, VOCAB, EXPERTS, LAYERS = 16, 24, 128, 8, 3


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(D, FF, bias=False)
        self.up_proj = nn.Linear(D, FF, bias=False)
        self.down_proj = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-2 routing over an ``nn.ModuleList`` of experts; an expert that gets no token is not called."""

    def __init__(self, n=EXPERTS, k=2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(D, n)
        self.experts = nn.ModuleList([Expert() for _ in range(n)])

    def route(self, flat):
        w, idx = torch.topk(torch.softmax(self.router(flat), dim=-1), self.k, dim=-1)
        return w / w.sum(-1, keepdim=True), idx

    def forward(self, h):
        flat = h.reshape(-1, D)
        w, idx = self.route(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(idx == e)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * w[rows, slot, None])
        return out.reshape(h.shape)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.Linear(D, D)  # stands for the attention
        self.moe = MoE()

    def pre_moe(self, h):
        h = h + self.attn(self.norm1(h))
        return h, self.norm2(h)

    def forward(self, h):
        h, x = self.pre_moe(h)
        return h + self.moe(x)


class Net(nn.Module):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Layer() for _ in range(layers)])
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def build(seed=0, dead=()):
    """The MoE decoder; the experts in ``dead`` never win the routing (router bias -1e4)."""
    torch.manual_seed(seed)
    model = Net().eval()
    with torch.no_grad():
        for layer in model.layers:
            for e in dead:
                layer.moe.router.bias[e] = -1e4
    return model


def batches(n=4, size=4, seq=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (size, seq), generator=g) for _ in range(n)]


def make(cls, model, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DefaultSkipWarning (embeddings, norms)
        return cls(model, [{**cfg, "op_types": ["default"]}])


def calibrate(comp, data, **kw):
    """``comp.calibrate`` and the warnings it gave (every one recorded)."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        comp.calibrate(data, progress=False, **kw)
    return [str(w.message) for w in got]


def expert_layers(model, layer=None):
    """``[(path, wrapper)]`` of the experts' layers (of one decoder layer, or of all)."""
    picked = range(len(model.layers)) if layer is None else [layer]
    return [(f"layers.{i}.moe.experts.{e}.{n}", getattr(ex, n)) for i in picked
            for e, ex in enumerate(model.layers[i].moe.experts) for n in ("gate_proj", "up_proj", "down_proj")]


def routed_rows(model, layer, ids_batches):
    """Per expert of ``layer``: the MoE input rows the router sends to it, one float32 array per batch (computed
    from the dense model, independently of the hooks)."""
    out = {e: [] for e in range(EXPERTS)}
    with torch.no_grad():
        for ids in ids_batches:
            h = model.embed(ids)
            for ly in model.layers[:layer]:
                h = ly(h)
            _, x = model.layers[layer].pre_moe(h)
            flat = x.reshape(-1, D)
            _, idx = model.layers[layer].moe.route(flat)
            for e in range(EXPERTS):
                rows = torch.where(idx == e)[0]
                if rows.numel():
                    out[e].append(flat[rows].numpy())
    return out


# ------------------------------------------------------------------------------------------------ 1. blocks
def test_the_blocks_are_the_decoder_layers_not_an_expert_list():
    model = build()
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    be = TorchOneShotBackend(p, None)
    assert [n for n, _ in be.blocks()] == ["layers.0", "layers.1", "layers.2"]
    # attention + 8 experts x 3 per block, nothing outside (the head and the routers are left out by default)
    assert [len(be.block_layers(b)) for _, b in be.blocks()] == [25, 25, 25]
    assert be.block_layers(None) == []
    sets = find_experts(model)
    assert [(s.parent, s.path, s.count, s.fused, s.routers, s.gates) for s in sets] == [
        (f"layers.{i}.moe", f"layers.{i}.moe.experts", EXPERTS, False, [f"layers.{i}.moe.router"], [])
        for i in range(LAYERS)]
    assert find_routers(model) == [f"layers.{i}.moe.router" for i in range(LAYERS)]
    # the routed experts' layers are marked for core's fallback, the others not
    marked = {t.name: core_experts.routed_expert(t) for _, b in be.blocks() for t in be.block_layers(b)}
    assert marked["layers.1.moe.experts.5.down_proj"] == "layers.1.moe.experts.5"
    assert marked["layers.1.attn"] is None and "layers.1.moe.router" not in marked
    assert sum(v is not None for v in marked.values()) == LAYERS * EXPERTS * 3


def test_a_lone_moe_layer_has_no_blocks_and_an_outer_list_wins_over_the_lists_in_its_members():
    torch.manual_seed(0)
    lone = MoE()  # its only list is the experts: no blocks, the model is observed in one pass
    p = make(GptqQuantizer, lone, {"quant_bits": 4, "group_size": 8})
    assert TorchOneShotBackend(p, None).blocks() == []
    x = [torch.randn(2, 6, D, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    assert calibrate(p, x) == []
    assert len(p.oneshot_rows) == 3 * EXPERTS and {r["block"] for r in p.oneshot_rows} == {""}  # not the router

    class Stage(nn.Module):  # two stages of three chained layers, no router: the stages are the blocks
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(3)])

        def forward(self, h):
            for ly in self.layers:
                h = ly(h)
            return h

    class Staged(nn.Module):
        def __init__(self):
            super().__init__()
            self.stages = nn.ModuleList([Stage(), Stage()])

        def forward(self, h):
            for s in self.stages:
                h = s(h)
            return h

    q = make(GptqQuantizer, Staged(), {"quant_bits": 4, "group_size": 8})
    assert [n for n, _ in TorchOneShotBackend(q, None).blocks()] == ["stages.0", "stages.1"]


def test_an_expert_list_is_never_chained_and_no_expert_comes_out_zero():
    model = build()
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    assert calibrate(p, batches()) == []
    assert len(p.oneshot_rows) == 3 * 25
    for name, w in expert_layers(model):
        keep = w.weight_mask
        assert torch.equal(w.weight == 0, ~keep), name  # exactly the pruned weights are zero
        assert int(keep.sum()) == keep.numel() // 2, name
    with torch.no_grad():
        assert torch.isfinite(model(batches(1)[0])).all()


# ------------------------------------------------------------------------------------------------ 2. per expert
def test_each_experts_statistics_are_those_of_the_tokens_routed_to_it():
    """Block 0's observing pass: each expert layer's Gram matrix (SparseGPT / GPTQ) is exactly X_e^T X_e of the
    rows the router sent to expert e (accumulated batch by batch, as the hooks hand them over), its count the
    number of those rows; Wanda / AWQ's channel sums likewise; the down projection sees as many rows."""
    model = build()
    calib = batches()
    ref = routed_rows(model, 0, calib)
    for cls, cfg, gram in [(SparseGPTPruner, {"sparsity": 0.5}, True), (WandaPruner, {"sparsity": 0.5}, False)]:
        p = make(cls, build(), cfg)
        be = TorchOneShotBackend(p, None)
        name, block = be.blocks()[0]
        inputs = be.first_inputs([((b,), {}) for b in calib])
        tasks = be.block_layers(block)
        accs, observe = observers(p.method_class(), tasks, be.shared_inputs(block, inputs, tasks))
        with torch.no_grad():
            be.run_block(block, inputs, observe)
        seen = 0
        for e in range(EXPERTS):
            acc = accs[f"{name}.moe.experts.{e}.up_proj"]
            assert accs[f"{name}.moe.experts.{e}.gate_proj"] is acc  # gate / up read one tensor: one accumulator
            expect = os1.GramAccumulator(D, gram=gram)
            for rows in ref[e]:
                expect.add(rows)
            assert acc.count == expect.count == sum(len(r) for r in ref[e]) > 0
            np.testing.assert_array_equal(acc.abs_sum, expect.abs_sum)
            np.testing.assert_array_equal(acc.sq_sum, expect.sq_sum)
            x = np.concatenate(ref[e]).astype(np.float64)
            if gram:
                np.testing.assert_array_equal(acc.gram, expect.gram)
                np.testing.assert_allclose(acc.gram, x.T @ x, rtol=1e-5, atol=1e-5)
            assert accs[f"{name}.moe.experts.{e}.down_proj"].count == acc.count
            seen += acc.count
        assert seen == 2 * sum(b.numel() for b in calib)  # top-2: every token went to two experts


def test_sparsegpt_prunes_every_expert_from_its_own_hessian():
    model = build()
    before = {n: w.weight.detach().double().numpy().copy() for n, w in expert_layers(model, 0)}
    calib = batches()
    ref = routed_rows(model, 0, calib)
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    assert calibrate(p, calib) == []
    for e in range(EXPERTS):
        acc = os1.GramAccumulator(D)
        for rows in ref[e]:
            acc.add(rows)
        for proj in ("gate_proj", "up_proj"):
            name = f"layers.0.moe.experts.{e}.{proj}"
            r = os1.sparsegpt_prune(before[name], acc.gram, 0.5)
            w = dict(expert_layers(model, 0))[name]
            np.testing.assert_array_equal(w.weight_mask.numpy(), r.mask)
            np.testing.assert_array_equal(w.weight.detach().numpy(), r.weight.astype(np.float32))


@pytest.mark.parametrize("cls,cfg,fallback", [
    (SparseGPTPruner, {"sparsity": 0.5}, "magnitude"),
    (WandaPruner, {"sparse_pattern": "2:4"}, "magnitude"),
    (GptqQuantizer, {"quant_bits": 4, "group_size": 8}, "rtn"),
    (AwqQuantizer, {"quant_bits": 4, "group_size": 8}, "rtn"),
])
def test_an_expert_without_tokens_falls_back_with_one_warning(cls, cfg, fallback):
    """Experts 6 and 7 of every layer never win the routing: their layers get round to nearest / magnitude pruning
    (the exact result of the fallback), the rows say so with the token count, ONE warning lists them; the other
    experts are compressed from their statistics, none is zero."""
    model = build(dead=(6, 7))
    before = {n: w.weight.detach().double().numpy().copy() for n, w in expert_layers(model)}
    c = make(cls, model, cfg)
    got = calibrate(c, batches())
    dead = [f"layers.{i}.moe.experts.{e}" for i in range(LAYERS) for e in (6, 7)]
    how = "magnitude pruning" if fallback == "magnitude" else "round to nearest"
    assert got == [f"{c.method_class.name}: 6 routed expert(s) saw no calibration token and were compressed without "
                   f"statistics ({how}, 18 layer(s)): " + ", ".join(f"{d} (0 tokens)" for d in dead)
                   + "; more (or more varied) calibration data reaches them"]
    rows = {r["layer"]: r for r in c.oneshot_rows}
    assert len(rows) == 3 * 25
    for name, w in expert_layers(model):
        expert = name.rsplit(".", 1)[0]
        row = rows[name]
        if expert in dead:
            assert (row["fallback"], row["tokens"], row["expert"]) == (fallback, 0, expert)
        else:
            assert "fallback" not in row
        if fallback == "magnitude":
            keep = w.weight_mask.numpy()
            assert keep.sum() == keep.size // 2
            if expert in dead:
                np.testing.assert_array_equal(keep, os1.wanda_mask(before[name], np.ones(keep.shape[1]),
                                                                    cfg.get("sparsity"), cfg.get("sparse_pattern")))
        else:
            assert bool(w.oneshot_calibrated)
            codes = oneshot_codes(w).to(torch.float64)
            assert codes.abs().sum() > 0
            if expert in dead:
                q = os1.rtn_quantize(before[name], w.quant_spec)
                np.testing.assert_array_equal(codes.numpy(), q.codes)
                np.testing.assert_array_equal(w.weight.detach().numpy(), q.dequantized.astype(np.float32))
                if cls is AwqQuantizer:
                    np.testing.assert_array_equal(w.awq_scales.numpy(), np.ones(w.awq_scales.shape[0]))
        assert w.weight.abs().sum() > 0, name


def test_a_layer_outside_the_experts_that_sees_nothing_is_still_an_error():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):
            return self.a(x)

    p = make(GptqQuantizer, Unused(), {"quant_bits": 4, "group_size": 8})
    with pytest.raises(ModelError, match="layer 'b' saw no input"):
        p.calibrate([torch.randn(3, D)], progress=False)


# ------------------------------------------------------------------------------------------------ 3. routers

def test_routers_stay_float_by_default_and_are_compressed_when_named():
    model = build()
    routers = {f"layers.{i}.moe.router": model.layers[i].moe.router.weight.detach().clone() for i in range(LAYERS)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}])
    assert not set(routers) & {w.name for w in p.get_modules_wrapper()}
    assert calibrate(p, batches()) == []
    for i in range(LAYERS):
        assert torch.equal(model.layers[i].moe.router.weight, routers[f"layers.{i}.moe.router"])
    named = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = SparseGPTPruner(named, [{"sparsity": 0.5, "op_types": ["Linear"]},
                                    {"sparsity": 0.5, "op_names": ["layers.1.moe.router"]}])
    assert calibrate(q, batches()) == []
    assert int((named.layers[1].moe.router.weight == 0).sum()) == D * EXPERTS // 2
    assert torch.equal(named.layers[0].moe.router.weight, routers["layers.0.moe.router"])


# ------------------------------------------------------------------------------------------------ 4. fused experts
def _hf_moe(family):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "mixtral":
            return transformers.MixtralForCausalLM(transformers.MixtralConfig(
                num_local_experts=4, num_experts_per_tok=2, **common)).eval()
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=48,
            **common)).eval()


@pytest.mark.parametrize("family,params,share", [
    ("mixtral", "gate_up_proj [4, 96, 32], down_proj [4, 32, 48]", 85),
    ("qwen2_moe", "gate_up_proj [4, 48, 32], down_proj [4, 32, 24]", 54),
])
def test_fused_3d_experts_are_found_and_named_when_they_stay_uncompressed(family, params, share):
    """transformers 5 stores the routed experts as 3-D parameters: they are found (with their router, and
    Qwen2-MoE's scalar shared-expert gate). transformers' banks are compressed slice by slice (test_moe_fused.py);
    a bank whose per-expert computation is unknown (here: the marks transformers' experts decorator sets, removed)
    stays as it is, and the run says so, and how much it holds."""
    model = _hf_moe(family)
    with torch.no_grad():
        plain = copy.deepcopy(model)
    assert calibrate(make(GptqQuantizer, plain, {"quant_bits": 4, "group_size": 16}),
                     [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))]) == []
    model.config._experts_implementation = "eager"
    for i in range(2):
        del model.model.layers[i].mlp.experts.has_gate
    sets = find_experts(model)
    assert [(s.path, s.count, s.fused, s.routers) for s in sets] == [
        (f"model.layers.{i}.mlp.experts", 4, True, [f"model.layers.{i}.mlp.gate"]) for i in range(2)]
    gates = [f"model.layers.{i}.mlp.shared_expert_gate" for i in range(2)] if family == "qwen2_moe" else []
    assert [g for s in sets for g in s.gates] == gates
    assert find_routers(model) == [p for i in range(2) for p in
                                   [f"model.layers.{i}.mlp.gate"] + gates[i:i + 1]]
    p = make(GptqQuantizer, model, {"quant_bits": 4, "group_size": 16})
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    got = calibrate(p, [ids])
    assert got == [f"one-shot calibration: the routed experts of 2 mixture-of-experts module(s) are fused 3-D "
                   f"parameters (model.layers.0.mlp.experts: {params} and 1 more like it; {share} % of the weights of "
                   f"the blocks) and are NOT compressed: the one-shot methods compress Linear layers (one 2-D weight "
                   f"each); only the model's Linear layers are"]
    assert not any(".experts." in r["layer"] for r in p.oneshot_rows)


def test_fused_experts_run_in_the_model_dtype_inside_a_float64_pass():
    """float64_exempt names the fused experts of a block; with model_dtype_hooks they take float64 inputs (their
    parameters kept float32: transformers' grouped-matmul kernel takes no float64 weights) and give float64
    outputs, the float32 computation's values exactly; eager experts (F.linear) alike."""
    model = _hf_moe("mixtral")
    (experts,) = float64_exempt(model.model.layers[0])
    assert experts is model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    x, idx, w = torch.randn(10, 32, generator=g), torch.randint(0, 4, (10, 2), generator=g), torch.rand(10, 2, generator=g)
    with torch.no_grad():
        with pytest.raises(RuntimeError):  # what a float64 pass that widens the expert weights meets
            copy.deepcopy(experts).double()(x.double(), idx, w.double())
        for impl in ("grouped_mm", "eager"):
            experts.config._experts_implementation = impl
            ref = experts(x, idx, w)
            handles = model_dtype_hooks(experts)
            try:
                out = experts(x.double(), idx, w.double())
            finally:
                for h in handles:
                    h.remove()
            assert out.dtype == torch.float64 and torch.equal(out, ref.double()), impl
        experts.config._experts_implementation = "eager"
        with pytest.raises(RuntimeError):  # eager F.linear of a float64 input and float32 weights, without hooks
            experts(x.double(), idx, w.double())


def test_a_float64_pass_over_fused_experts_does_not_crash():
    model = _hf_moe("mixtral")
    p = make(GptqQuantizer, model, {"quant_bits": 4, "group_size": 16})
    calibrate(p, [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))], forward_dtype="float64")
    assert len(p.oneshot_rows) == 8 + 2 * 2 * 4  # q/k/v/o and, per expert, its gate_up and down slices
