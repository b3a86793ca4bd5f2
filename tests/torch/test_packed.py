"""Packed int4 / int8 weights on PyTorch's CPU kernels (issue 26): PackedLinear and pack_weights.

Tolerances (measured on tiny Llama / GPT-2, every layer type, GPTQ / RTN / AWQ, 4-bit g32 and 8-bit per channel):
with ``compute_dtype=torch.float32`` the packed layer's output is the fake-quant layer's to max|diff| <= 5e-7 *
max|y| (float32 rounding of the kernel's ``(q - 8) * s + zero`` and its summation order); in the default
bfloat16 to <= 7e-3 * max|y| (the input and the result rounded to bf16). The tests allow 2e-6 and 2e-2.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from compressor.core.errors import ModelError
from compressor.torch import (
    AwqQuantizer,
    GptqQuantizer,
    PackedLinear,
    PtqQuantizer,
    QAT_Quantizer,
    RtnQuantizer,
    SparseGPTPruner,
    pack_weights,
)
from compressor.torch.quantization.lowbit import _int4_kernel_source, oneshot_codes

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.torch]

F32_TOL, BF16_TOL = 2e-6, 2e-2
VOCAB = 64


def llama(seed=0, hidden=32, ffn=64):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)).eval()


def gpt2(seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)).eval()


def calib():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, 16), generator=g) for _ in range(2)]


HELD = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))


def quantize(model, cls, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = cls(model, [{**cfg, "op_types": ["default"]}])
        q.calibrate(None if cls is RtnQuantizer else calib(), progress=False)
    return q


def rel_err(y, ref):
    return float((y - ref).abs().max() / ref.abs().max())


def reference(codes, scale, zp, gs):
    gi = torch.arange(codes.shape[1]) // gs
    return (codes - zp[:, gi]).double() * scale[:, gi].double()


# ----------------------------------------------------------------------------------------------- one layer
@pytest.mark.parametrize("bits,gs,signed,n,k,kernel", [
    (4, 32, True, 32, 64, "int4"),      # symmetric full range [-8, 7], groups of 32
    (4, 64, False, 20, 128, "int4"),    # affine uint4, out padded 20 -> 32 for the kernel
    (4, None, True, 16, 96, "int4"),    # per channel: one scale repeated over 3 kernel groups of 32
    (3, 32, True, 16, 64, "int4"),      # 3-bit codes in int4 storage
    (4, None, True, 16, 40, "int8"),    # no int4 kernel group divides 40: int4 codes on the int8 kernel
    (8, None, True, 24, 40, "int8"),
    (8, None, False, 24, 40, "int8"),   # uint8 codes: v = c - 128 plus s * (128 - zp) * sum(x)
    (4, 16, True, 16, 64, "reference"),
    (8, 16, False, 8, 32, "reference"),
])
def test_codes_scales_and_zero_points_compute_as_dequantized_weights(bits, gs, signed, n, k, kernel):
    g = torch.Generator().manual_seed(bits * 100 + k)
    qmin, qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    codes = torch.randint(qmin, qmax + 1, (n, k), dtype=torch.int32, generator=g)
    groups = 1 if gs is None else -(-k // gs)
    scale = torch.rand(n, groups, generator=g) * 0.1 + 0.01
    zp = (torch.zeros(n, groups, dtype=torch.int32) if signed
          else torch.randint(0, 2**bits, (n, groups), dtype=torch.int32, generator=g))
    bias = torch.randn(n, generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = PackedLinear.from_codes(codes, scale, zp, bits, gs, bias=bias, signed=signed,
                                    compute_dtype=torch.float32, name="blk.fc")
    assert m.kernel == kernel
    msgs = [str(w.message) for w in caught]
    if kernel == "reference":  # the warning names the layer and why
        assert len(msgs) == 1 and "'blk.fc'" in msgs[0] and "reference path" in msgs[0]
        assert ("group sizes are (256, 128, 64, 32)" if bits == 4 else "one scale per output channel") in msgs[0]
    else:
        assert msgs == []
    assert torch.equal(m.codes(), codes)  # exact round trip through the kernel's layout
    w = reference(codes, scale, zp, k if gs is None else gs)
    assert torch.equal(m.dequantized_weight(torch.float64), w)
    x = torch.randn(2, 3, k, generator=g)
    y = m(x)
    assert y.shape == (2, 3, n)
    ref = x.double() @ w.T + bias.double()
    assert rel_err(y.double(), ref) < F32_TOL
    m.compute_dtype = torch.bfloat16
    m._set_codes(codes)
    assert rel_err(m(x).double(), ref) < BF16_TOL


def test_state_dict_is_the_portable_packed_form_and_reloads_into_a_fresh_module():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (32, 64), dtype=torch.int32, generator=g)
    scale, zp = torch.rand(32, 2, generator=g), torch.zeros(32, 2, dtype=torch.int32)
    m = PackedLinear.from_codes(codes, scale, zp, 4, 32, bias=torch.randn(32, generator=g), name="a")
    sd = m.state_dict()
    assert sorted(sd) == ["_extra_state", "bias", "qweight", "scale", "zero_point"]
    q = sd["qweight"]
    assert q.dtype == torch.uint8 and q.shape == (32, 32)  # two codes per byte
    assert torch.equal((q & 15).to(torch.int32) - 8, codes[:, 0::2]) and torch.equal((q >> 4).to(torch.int32) - 8,
                                                                                       codes[:, 1::2])
    fresh = PackedLinear(64, 32, 4, 32, signed=True)
    fresh.load_state_dict(sd)
    x = torch.randn(5, 64, generator=g)
    assert torch.equal(fresh(x), m(x)) and torch.equal(fresh.codes(), codes)
    wrong = PackedLinear(64, 32, 4, 64, signed=True)
    with pytest.raises(ValueError, match="format"):
        wrong.load_state_dict(sd)
    # resident: 0.5 byte per weight plus the kernel's bf16 scale/zero pairs and our float scales / int zero points
    assert m.resident_bytes() == 32 * 32 + 2 * 32 * 2 * 2 + 32 * 2 * 4 + 32 * 2 * 4 + 32 * 4


def test_the_kernel_layout_is_a_permutation_of_nibbles():
    src = _int4_kernel_source(32, 64)
    assert torch.equal(src.sort().values, torch.arange(32 * 64))


def test_torch_compile_gives_the_eager_outputs():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (32, 64), dtype=torch.int32, generator=g)
    m4 = PackedLinear.from_codes(codes, torch.rand(32, 2, generator=g), torch.randint(0, 16, (32, 2), generator=g,
                                 dtype=torch.int32), 4, 32, bias=torch.randn(32, generator=g), signed=False)
    m8 = PackedLinear.from_codes(torch.randint(0, 256, (16, 32), generator=g).to(torch.uint8),
                                 torch.rand(16, 1, generator=g), torch.full((16, 1), 100, dtype=torch.int32), 8, None)
    model = nn.Sequential(m4, nn.ReLU(), m8)
    x = torch.randn(3, 64, generator=g)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- pack_weights
@pytest.mark.parametrize("family,cls,cfg", [
    ("llama", GptqQuantizer, {"quant_bits": 4, "group_size": 32}),
    ("llama", AwqQuantizer, {"quant_bits": 4, "group_size": 32}),
    ("llama", RtnQuantizer, {"quant_bits": 8, "quant_scheme": "affine"}),
    ("gpt2", GptqQuantizer, {"quant_bits": 4, "group_size": 32, "quant_scheme": "affine"}),
    ("gpt2", AwqQuantizer, {"quant_bits": 4, "group_size": 32}),
])
def test_packed_model_equals_the_fake_quant_model_per_layer_and_in_logits(family, cls, cfg):
    model = llama() if family == "llama" else gpt2()
    q = quantize(model, cls, cfg)
    wrappers = {w.name: w for w in q.get_modules_wrapper()}
    inputs = {}
    hooks = [w.register_forward_pre_hook(lambda _m, a, n=n: inputs.__setitem__(n, a[0].detach()))
             for n, w in wrappers.items()]
    with torch.no_grad():
        ref_logits = model(HELD).logits
    for h in hooks:
        h.remove()
    ref = {n: w(inputs[n]).detach() for n, w in wrappers.items()}
    codes = {n: oneshot_codes(w) for n, w in wrappers.items()}
    assert pack_weights(model, compute_dtype=torch.float32) is model
    kernel = "int4" if cfg["quant_bits"] == 4 else "int8"
    for n in wrappers:
        m = model.get_submodule(n)
        assert isinstance(m, PackedLinear) and m.kernel == kernel, n
        assert m.source == ("Conv1D" if family == "gpt2" else "Linear")
        assert torch.equal(m.codes(), codes[n].to(torch.int32)), n
        assert (m.awq_scales is not None) == (cls is AwqQuantizer)
        assert rel_err(m(inputs[n]), ref[n]) < F32_TOL, n
    with torch.no_grad():
        assert rel_err(model(HELD).logits, ref_logits) < F32_TOL
    # state_dict round trip into a freshly packed model of the same config (other weights: another seed)
    fresh = (llama if family == "llama" else gpt2)(seed=5)
    quantize(fresh, cls, cfg)
    pack_weights(fresh, compute_dtype=torch.float32)
    with torch.no_grad():
        assert not torch.equal(fresh(HELD).logits, model(HELD).logits)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(HELD).logits, model(HELD).logits)


def test_default_bf16_compute_is_within_bf16_rounding():
    model = llama()
    quantize(model, GptqQuantizer, {"quant_bits": 4, "group_size": 32})
    with torch.no_grad():
        ref = model(HELD).logits
    pack_weights(model)
    assert {m.compute_dtype for m in model.modules() if isinstance(m, PackedLinear)} == {torch.bfloat16}
    with torch.no_grad():
        out = model(HELD).logits
    assert out.dtype == torch.float32 and 0 < rel_err(out, ref) < BF16_TOL


def test_uncalibrated_or_unsupported_wrappers_are_refused_before_anything_changes():
    model = llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        GptqQuantizer(model, [{"quant_bits": 4, "group_size": 32, "op_types": ["default"]}])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ModelError, match=r"'model.layers.0.self_attn.q_proj' has not been calibrated.*Nothing was changed"):
        pack_weights(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ModelError, match="no quantized layers"):
        pack_weights(llama())
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PtqQuantizer(net, [{"quant_types": ["input", "weight"], "quant_bits": 8, "op_types": ["Linear"]}]).calibrate(
            torch.randn(4, 8))
    with pytest.raises(ModelError, match=r"also quantizes \['input'\]: packed weights are weight-only"):
        pack_weights(net)


def test_weight_only_ptq_and_qat_pack_to_the_int8_kernel():
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    for cls in (PtqQuantizer, QAT_Quantizer):
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = cls(net, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Linear"]}])
            if cls is PtqQuantizer:
                q.calibrate(x)
        net.eval()
        with torch.no_grad():
            ref = net(x)
        scales = [w.weight_scale.clone() for w in q.get_modules_wrapper()]
        pack_weights(net, compute_dtype=torch.float32)
        assert [type(m).__name__ for m in net] == ["PackedLinear", "ReLU", "PackedLinear"]
        assert [m.kernel for m in (net[0], net[2])] == ["int8", "int8"]
        assert all(torch.equal(m.scale[:, 0], s.expand(m.out_features))  # QAT's default is one scale per tensor
                   for m, s in zip((net[0], net[2]), scales))
        c = net[0].codes()
        if cls is PtqQuantizer:  # per-channel symmetric int8 [-127, 127]: each row's largest weight hits 127
            assert net[0].signed and torch.equal(c.abs().amax(1), torch.full((16,), 127, dtype=torch.int32))
        else:  # QAT's default: per-tensor affine uint8
            assert not net[0].signed and int(c.min()) >= 0 and int(c.max()) <= 255
        with torch.no_grad():
            assert rel_err(net(x), ref) < F32_TOL, cls.__name__


def test_dynamic_int8_activations_run_the_int8_x_int8_kernel():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (48, 64), dtype=torch.int32, generator=g)
    scale, zp = torch.rand(48, 1, generator=g) * 0.01, torch.zeros(48, 1, dtype=torch.int32)
    bias = torch.randn(48, generator=g)
    m = PackedLinear.from_codes(codes, scale, zp, 8, None, bias=bias, activation="dynamic", name="fc")
    assert m.kernel == "int8-dynamic" and torch.equal(m.codes(), codes)
    x = torch.randn(4, 64, generator=g)
    ref = x.double() @ reference(codes, scale, zp, 64).T + bias.double()
    err = rel_err(m(x).double(), ref)
    assert 0 < err < 3e-2  # the activations are rounded to 7 bits per tensor
    fresh = PackedLinear(64, 48, 8, None, activation="dynamic")
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh(x), m(x))
    with pytest.raises(ValueError, match="'g': activation='dynamic' needs signed .* with 2 group"):
        PackedLinear(64, 48, 4, 32, activation="dynamic", name="g")
    model = llama()
    quantize(model, RtnQuantizer, {"quant_bits": 4, "group_size": 32})
    before = [type(m).__name__ for m in model.modules()]
    with pytest.raises(ValueError, match="activation='dynamic' needs signed"):
        pack_weights(model, activation="dynamic")
    assert [type(m).__name__ for m in model.modules()] == before  # refused before any layer was replaced


def test_a_pruned_then_quantized_model_packs_with_its_zeros():
    model = llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SparseGPTPruner(model, [{"sparse_pattern": "2:4", "op_types": ["default"]}]).calibrate(calib(), progress=False)
    q = quantize(model, GptqQuantizer, {"quant_bits": 4, "group_size": 32})
    masks = {w.name: w.module.weight_mask.clone() for w in q.get_modules_wrapper()}
    with torch.no_grad():
        ref = model(HELD).logits
    pack_weights(model, compute_dtype=torch.float32)
    assert not any(type(m).__name__.endswith("ModuleWrapper") for m in model.modules())
    for n, mask in masks.items():
        m = model.get_submodule(n)
        assert (m.codes()[~mask] == 0).all() and int((~mask).sum()) == mask.numel() // 2, n
    with torch.no_grad():
        assert rel_err(model(HELD).logits, ref) < F32_TOL
