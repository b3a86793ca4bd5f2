"""transformers 5's fused 3-D routed experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])
in the one-shot methods: each expert's slice of each parameter is a layer, calibrated on the tokens routed to it
(compressor/torch/sequential/expert_banks.py), written back into the 3-D parameter, and exported so that
``from_pretrained`` gives the in-memory logits."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compressor.core import oneshot as os1
from compressor.core.oneshot.observe import observers
from compressor.torch import AwqQuantizer, GptqQuantizer, SparseGPTPruner, WandaPruner
from compressor.torch.sequential import TorchOneShotBackend
from compressor.torch.sequential import expert_banks as fx
from compressor.torch.sequential.blocks import find_experts

pytestmark = [pytest.mark.torch]
transformers = pytest.importorskip("transformers")
from transformers.integrations import use_experts_implementation  # noqa: E402

H, I, E, VOCAB = 32, 48, 4, 64  # noqa: E741  (I: the experts' intermediate width, as transformers names it)


def mixtral(seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_local_experts=E, num_experts_per_tok=2)).eval()


def ids(n=4, seed=0):
    return torch.randint(0, VOCAB, (n, 16), generator=torch.Generator().manual_seed(seed))


def make(cls, model, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(model, [{**cfg, "op_types": ["default"]}])


def calibrate(comp, data, **kw):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        comp.calibrate(data, progress=False, **kw)
    return [str(w.message) for w in got]


def logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out


def rel(a, b):
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------- a hand-written bank stored [E, in, out] (GPT-OSS)
class _Cfg:
    _experts_implementation = "eager"


@use_experts_implementation(is_transposed=True)
class TBank(nn.Module):
    """Experts stored transposed: ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H] (``x @ W[e]``)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 16, 2 * 24) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(E, 24, 16) * 0.3)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel():
                g, u = (hidden_states[tok] @ self.gate_up_proj[e]).chunk(2, dim=-1)
                y = (self.act_fn(g) * u) @ self.down_proj[e]
                out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out


class TMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, E)
        self.experts = TBank(_Cfg())

    def forward(self, h):
        flat = h.reshape(-1, 16)
        w, idx = torch.topk(torch.softmax(self.router(flat), -1), 2, dim=-1)
        return self.experts(flat, idx, w / w.sum(-1, keepdim=True)).reshape(h.shape)


class TLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = nn.Linear(16, 16)
        self.moe = TMoE()

    def forward(self, h):
        h = h + self.attn(self.norm(h))
        return h + self.moe(self.norm(h))


class TNet(nn.Module):
    def __init__(self, dead=()):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList([TLayer() for _ in range(2)])
        self.lm_head = nn.Linear(16, VOCAB, bias=False)
        with torch.no_grad():
            for ly in self.layers:
                for e in dead:
                    ly.moe.router.bias[e] = -1e4

    def forward(self, x):
        h = self.embed(x)
        for ly in self.layers:
            h = ly(h)
        return self.lm_head(h)


# ------------------------------------------------------------------------------------------------ layout, tasks
def test_slices_are_tasks_in_the_canonical_layout_of_either_storage():
    """Mixtral stores [E, out, in] (F.linear), the transposed bank [E, in, out]: each slice's task has the
    input width of its product, its canonical view is [out, in] and writes land in the 3-D parameter."""
    for model, bank_path, widths in [(mixtral(), "model.layers.0.mlp.experts", {"gate_up_proj": (2 * I, H),
                                                                               "down_proj": (H, I)}),
                                     (TNet(), "layers.0.moe.experts", {"gate_up_proj": (48, 16),
                                                                       "down_proj": (16, 24)})]:
        p = make(SparseGPTPruner, model, {"sparsity": 0.5})
        tasks = [t for t in fx.fused_tasks(p, model, find_experts(model)) if t.name.startswith(bank_path + ".")]
        assert [t.name for t in tasks] == [f"{bank_path}.{e}.{n}" for n in ("gate_up_proj", "down_proj")
                                           for e in range(E)]
        bank = model.get_submodule(bank_path)
        for t in tasks:
            s = t.handle
            out_f, in_f = widths[s.param]
            assert t.in_features == in_f and s.read().shape == (out_f, in_f)
            stored = getattr(bank, s.param)[s.expert]
            expect = stored.t() if bank.is_transposed else stored
            np.testing.assert_array_equal(s.read(), expect.detach().double().numpy())
        s = tasks[1].handle
        s.assign(np.full(s.read().shape, 3.0))
        assert bool((getattr(bank, s.param)[1] == 3.0).all()) and not bool((getattr(bank, s.param)[0] == 3.0).any())


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
def test_the_per_expert_loop_computes_what_the_bank_computes(impl):
    bank = mixtral().model.layers[0].mlp.experts
    bank.config._experts_implementation = impl
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(20, H, generator=g), torch.rand(20, 2, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(20)])
    with torch.no_grad():
        ref = bank(x, idx, w)
        got = fx.expert_loop(bank, lambda *a: None)(x, idx, w)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ statistics
def _routed(model, data):
    """Per expert of block 0's bank (dense model): the rows routed to it and their ``act(gate) * up``."""
    bank = model.model.layers[0].mlp.experts
    got = []
    h = bank.register_forward_hook(lambda m, a, o: got.append((a[0].detach(), a[1].detach())))
    try:
        logits(model, data)
    finally:
        h.remove()
    (x, idx), = got
    out = {}
    with torch.no_grad():
        for e in range(E):
            xe = x[torch.where(idx == e)[0]]
            g, u = F.linear(xe, bank.gate_up_proj[e]).chunk(2, dim=-1)
            out[e] = (xe.double().numpy(), (bank.act_fn(g) * u).double().numpy())
    return out


def test_each_slice_gets_the_gram_matrix_of_its_own_routed_tokens():
    model = mixtral()
    data = ids()
    ref = _routed(model, data)
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    be = TorchOneShotBackend(p, None)
    name, block = be.blocks()[0]
    inputs = be.first_inputs([((data,), {})])
    tasks = be.block_layers(block)
    accs, observe = observers(p.method_class(), tasks, be.shared_inputs(block, inputs, tasks))
    with torch.no_grad():
        be.run_block(block, inputs, observe)
    assert "forward" not in block.mlp.experts.__dict__  # the bank's own forward is back
    total = 0
    for e in range(E):
        x, act = ref[e]
        gu, down = accs[f"{name}.mlp.experts.{e}.gate_up_proj"], accs[f"{name}.mlp.experts.{e}.down_proj"]
        assert gu is not down and gu.count == down.count == len(x) > 0
        np.testing.assert_allclose(gu.gram, x.T @ x, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(down.gram, act.T @ act, rtol=1e-4, atol=1e-6)
        total += gu.count
    assert total == 2 * data.numel()  # top-2


def test_padded_tokens_are_left_out_of_the_expert_statistics():
    model = mixtral()
    data = ids(2)
    mask = torch.ones_like(data)
    mask[1, 10:] = 0
    p = make(WandaPruner, model, {"sparsity": 0.5})
    be = TorchOneShotBackend(p, None)
    name, block = be.blocks()[0]
    inputs = be.first_inputs([((), {"input_ids": data, "attention_mask": mask})])
    tasks = be.block_layers(block)
    accs, observe = observers(p.method_class(), tasks, be.shared_inputs(block, inputs, tasks))
    with torch.no_grad():
        be.run_block(block, inputs, observe)
    assert sum(accs[f"{name}.mlp.experts.{e}.gate_up_proj"].count for e in range(E)) == 2 * int(mask.sum())


# ------------------------------------------------------------------------------------------------ exact results
def test_sparsegpt_50_percent_exact_per_slice_from_its_own_hessian():
    model = mixtral()
    bank = model.model.layers[0].mlp.experts
    before = {n: getattr(bank, n).detach().double().numpy().copy() for n in ("gate_up_proj", "down_proj")}
    data = ids()
    ref = _routed(model, data)
    dense = logits(model, data)
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    assert calibrate(p, [data]) == []
    rows = {r["layer"]: r for r in p.oneshot_rows}
    assert len(rows) == 2 * (4 + 2 * E)  # q/k/v/o + 2 slices per expert, per layer; the routers stay float
    for i in range(2):
        b = model.model.layers[i].mlp.experts
        for n in ("gate_up_proj", "down_proj"):
            for e in range(E):
                w = getattr(b, n)[e]
                assert int((w == 0).sum()) == w.numel() // 2, (i, n, e)
                assert rows[f"model.layers.{i}.mlp.experts.{e}.{n}"]["sparsity"] == 0.5
                got = fx.fused_results(b)[f"model.layers.{i}.mlp.experts.{e}.{n}"]
                assert torch.equal(torch.from_numpy(got.mask), w != 0)
    for e in range(E):
        x = ref[e][0]
        r = os1.sparsegpt_prune(before["gate_up_proj"][e], x.T.astype(np.float32).astype(np.float64)
                                @ x.astype(np.float32).astype(np.float64), 0.5)
        np.testing.assert_array_equal((bank.gate_up_proj[e] != 0).numpy(), r.mask)
    out = logits(model, data)
    assert torch.isfinite(out).all() and rel(out, dense) < 0.25


def test_wanda_2_4_groups_are_valid_in_every_slice():
    model = mixtral()
    p = make(WandaPruner, model, {"sparse_pattern": "2:4"})
    assert calibrate(p, [ids()]) == []
    for ly in model.model.layers:
        for n in ("gate_up_proj", "down_proj"):
            w = getattr(ly.mlp.experts, n)
            zeros = (w == 0).reshape(E, w.shape[1], -1, 4).sum(-1)
            assert bool((zeros == 2).all()), n


@pytest.mark.parametrize("cls", [GptqQuantizer, AwqQuantizer])
def test_quantized_slices_hold_their_grid_values(cls):
    model = mixtral()
    data = ids()
    dense = logits(model, data)
    q = make(cls, model, {"quant_bits": 4, "group_size": 16})
    assert calibrate(q, [data]) == []
    for ly in model.model.layers:
        bank = ly.mlp.experts
        got = fx.fused_results(bank)
        assert len(got) == 2 * E
        for name, r in got.items():
            s = fx.FusedSlice(bank, name.rsplit(".", 2)[0], name.rsplit(".", 1)[1], int(name.rsplit(".", 2)[1]))
            qw = r.quantized
            assert qw.spec.bits == 4 and qw.group_size == 16
            assert qw.codes.min() >= -7 and qw.codes.max() <= 7  # the symmetric narrow range
            assert qw.dequantized is None  # not kept: the slice holds it
            g = qw.group_index()
            deq = (qw.codes.astype(np.float64) - qw.zero_point[:, g]) * qw.scale[:, g]
            if r.scales is not None:  # AWQ: the slice computes Q(W s) / s
                deq = deq / r.scales[None, :]
            np.testing.assert_allclose(s.read(), deq, rtol=1e-6, atol=1e-7)
    out = logits(model, data)
    assert torch.isfinite(out).all() and rel(out, dense) < 0.1


# ------------------------------------------------------------------------------------------------ fallback
@pytest.mark.parametrize("cls,cfg,how", [(SparseGPTPruner, {"sparsity": 0.5}, "magnitude pruning"),
                                         (GptqQuantizer, {"quant_bits": 4, "group_size": 8}, "round to nearest")])
def test_an_expert_without_tokens_falls_back_with_one_warning(cls, cfg, how):
    model = TNet(dead=(3,))
    before = {i: model.layers[i].moe.experts.down_proj[3].detach().t().double().numpy().copy() for i in range(2)}
    c = make(cls, model, cfg)
    got = calibrate(c, [ids()])
    assert got == [f"{c.method_class.name}: 2 routed expert(s) saw no calibration token and were compressed without "
                   f"statistics ({how}, 4 layer(s)): layers.0.moe.experts.3 (0 tokens), layers.1.moe.experts.3 "
                   f"(0 tokens); more (or more varied) calibration data reaches them"]
    rows = {r["layer"]: r for r in c.oneshot_rows}
    for i in range(2):
        r = rows[f"layers.{i}.moe.experts.3.down_proj"]
        assert r["tokens"] == 0 and r["expert"] == f"layers.{i}.moe.experts.3"
        assert "fallback" not in rows[f"layers.{i}.moe.experts.0.down_proj"]
        w = model.layers[i].moe.experts.down_proj[3].detach().t().double().numpy()
        if cls is GptqQuantizer:
            task = os1.LayerTask("x", c.config_list[0], 24)
            np.testing.assert_allclose(w, os1.rtn_quantize(before[i], task.quant_spec("GptqQuantizer")).dequantized,
                                       rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(w != 0, os1.wanda_mask(before[i], np.ones(24), 0.5, None))


# ------------------------------------------------------------------------------------------------ clean-up
def test_an_interrupted_pass_puts_the_banks_forward_and_weights_back():
    model = TNet()
    bank = model.layers[0].moe.experts
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def boom(m, a):
        calls.append(1)
        if "forward" in bank.__dict__:  # the observing pass: the per-expert loop is in place
            raise KeyboardInterrupt

    h = model.layers[0].moe.router.register_forward_pre_hook(boom)
    p = make(GptqQuantizer, model, {"quant_bits": 4, "group_size": 8})
    with pytest.raises(KeyboardInterrupt):
        p.calibrate([ids()], progress=False)
    h.remove()
    assert calls and "forward" not in bank.__dict__
    for k, v in model.state_dict().items():
        if k in before:
            assert torch.equal(v, before[k]), k


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("cls,cfg", [(GptqQuantizer, {"quant_bits": 4, "group_size": 16}),
                                     (SparseGPTPruner, {"sparsity": 0.5})])
def test_the_compressed_tensors_checkpoint_reloads_with_the_in_memory_logits(tmp_path, cls, cfg):
    pytest.importorskip("compressed_tensors")
    model = mixtral()
    data = ids()
    c = make(cls, model, cfg)
    calibrate(c, [data])
    ref = logits(model, data)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        c.export_model(None, hf_path=str(tmp_path / "ck"))
    # quantized experts are packed per expert (tests/torch/test_moe_export.py), pruned ones are plain floats as
    # pruned Linear layers are: neither is a float-layer note
    assert not [str(w.message) for w in got if "fused 3-D routed experts" in str(w.message)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ck"), dtype=torch.float32).eval()
    # packed: float32 rounding of code * scale in the loader's dequantization
    torch.testing.assert_close(back.model.layers[1].mlp.experts.down_proj, model.model.layers[1].mlp.experts.down_proj,
                               rtol=1e-6, atol=1e-7)
    assert rel(logits(back, data), ref) <= 1e-5


def test_the_streamed_run_compresses_a_checkpoint_with_fused_names_as_in_memory(tmp_path):
    """compressor.torch.oneshot on a checkpoint that stores the fused names (as export_model writes them): the same
    expert slices as calibrate() in memory. (A checkpoint in Mixtral's per-expert layout, which save_pretrained
    writes: tests/torch/test_moe_export.py.)"""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import save_file

    from compressor.torch import oneshot

    model = mixtral()
    src = tmp_path / "src"
    model.config.save_pretrained(src)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    data = np.random.default_rng(1).integers(0, VOCAB, size=(8, 16))
    np.save(tmp_path / "ids.npy", data)
    stage = [{"quant_bits": 4, "group_size": 16, "op_types": ["Linear"]}, {"op_names": ["lm_head"], "exclude": True}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oneshot(src, tmp_path / "out", [{"GptqQuantizer": stage}], str(tmp_path / "ids.npy"), num_samples=8,
                seq_len=16, batch_size=4, progress=False)
        GptqQuantizer(model, stage).calibrate(list(torch.from_numpy(data).split(4)), progress=False)
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    for i in range(2):  # packed per expert: float32 rounding of code * scale in the loader's dequantization
        for n in ("gate_up_proj", "down_proj"):
            torch.testing.assert_close(getattr(back.model.layers[i].mlp.experts, n),
                                       getattr(model.model.layers[i].mlp.experts, n), rtol=1e-6, atol=1e-7)
    x = torch.from_numpy(data[:2])
    assert rel(logits(back, x), logits(model, x)) <= 1e-5


# ------------------------------------------------------------------------------------------------ pack_weights
def test_pack_weights_packs_every_expert_of_a_fused_bank():
    """After GPTQ w4 g16 on every Linear and every expert slice, pack_weights replaces each bank by a PackedExperts
    of one PackedLinear per expert and projection holding the slices' codes: float32 compute gives the fake-quant
    model's logits to float32 rounding, bfloat16 within bf16 rounding, and the packed bank's weights take 1/4 of
    their float32 bytes plus the scales."""
    from compressor.torch.quantization.lowbit import PackedExperts, PackedLinear, pack_weights

    data = ids()
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = mixtral()
        q = make(GptqQuantizer, model, {"quant_bits": 4, "group_size": 16})
        calibrate(q, data)
        ref = logits(model, data)
        bank = model.model.layers[0].mlp.experts
        dense_bytes = sum(p.numel() * 4 for p in (bank.gate_up_proj, bank.down_proj))
        want = {e: fx.fused_results(bank)[f"model.layers.0.mlp.experts.{e}.down_proj"].quantized.codes for e in range(E)}
        pack_weights(model, compute_dtype=dtype)
        packed = model.model.layers[0].mlp.experts
        assert isinstance(packed, PackedExperts) and len(packed.up) == len(packed.down) == E
        assert all(isinstance(m, PackedLinear) and m.bits == 4 for m in [*packed.up, *packed.down])
        assert (packed.up[0].out_features, packed.up[0].in_features) == (2 * I, H)
        assert (packed.down[0].out_features, packed.down[0].in_features) == (H, I)
        for e in range(E):  # the codes the run settled on, as the kernel stores them
            np.testing.assert_array_equal(fx_codes(packed.down[e]), want[e].astype(np.int64))
        packed_bytes = sum(b.numel() * b.element_size() for m in [*packed.up, *packed.down]
                           for b in (m._wq,))
        assert packed_bytes <= dense_bytes // 8 + 1024
        outs[dtype] = (logits(model, data), ref)
    got, ref = outs[torch.float32]
    assert rel(got, ref) < 1e-5
    got, ref = outs[torch.bfloat16]
    assert rel(got.float(), ref) < 2e-2


def fx_codes(m):
    """A PackedLinear's codes [out, in] (signed), read back from its state dict."""
    sd = m.state_dict()
    packed = sd["qweight"].to(torch.int64)
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)[:, : m.in_features]
    return (codes - 8).numpy() if m.signed else codes.numpy()


def test_pack_weights_refuses_a_bank_quantized_in_part_and_changes_nothing():
    from compressor.torch.quantization.lowbit import pack_weights

    model = mixtral()
    q = GptqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_names": ["model.layers.0.mlp.experts.gate_up_proj",
                                                                               "model.layers.1.self_attn.q_proj"]}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.calibrate(ids(), progress=False)
    before = {n: type(m) for n, m in model.named_modules()}
    from compressor.core.errors import ModelError

    with pytest.raises(ModelError, match=r"'model.layers.0.mlp.experts' \(fused experts: 4 of 8 expert slices"):
        pack_weights(model)
    assert {n: type(m) for n, m in model.named_modules()} == before
