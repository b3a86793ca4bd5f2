"""Built-in quantizers on hand-built weights: exact scales, zero points, values and gradients; training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from compressor.core import NumpyOps
from compressor.core import quant as cq
from compressor.torch import BNNQuantizer, DoReFaQuantizer, LsqQuantizer, NaiveQuantizer, QAT_Quantizer
from compressor.torch.quantization.fakequant import fake_quant

from ._cuda import batch_and_step, no_host_sync

NP = NumpyOps()


def linear_with(weight) -> nn.Sequential:
    w = torch.tensor(weight, dtype=torch.float32)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return nn.Sequential(lin)


def qat(model, bits=8, types=("weight",), **extra):
    cfg = [{"quant_types": list(types), "quant_bits": bits, "op_types": ["default"], **extra}]
    return QAT_Quantizer(model, cfg)


# ---------------------------------------------------------------------------------- QAT exact values
def test_qat_uint_affine_scale_zero_point():
    model = linear_with([[1, 2], [3, 5]])
    w = qat(model).get_modules_wrapper()[0]
    model(torch.ones(1, 2))
    torch.testing.assert_close(w.weight_scale, torch.tensor(5 / 255))
    assert w.weight_zero_point.item() == 0


def test_qat_zero_point_rounds_half_to_even():
    # qmin - rmin / scale = 0 + 1 / (6/255) = 42.5 -> 42 (round half to even, as numpy/torch/tf round)
    model = linear_with([[-1, 2], [3, 5]])
    w = qat(model).get_modules_wrapper()[0]
    model(torch.ones(1, 2))
    torch.testing.assert_close(w.weight_scale, torch.tensor(6 / 255))
    assert w.weight_zero_point.item() == 42


def test_qat_dequantized_weight_values():
    model = linear_with([[1.1287, 2.3456], [3.7814, 5.9723]])
    qat(model)
    out = model(torch.eye(2))  # rows of eye pick the columns of W_q
    expected = torch.tensor([[1.1242, 2.3421], [3.7707, 5.9723]])
    torch.testing.assert_close(out.T, expected, atol=1e-4, rtol=0)


W18 = torch.arange(1, 19, dtype=torch.float32).view(2, 1, 3, 3)


@pytest.mark.parametrize("dtype, scheme, scale, zp", [
    ("int", "per_channel_symmetric", [9 / 127, 18 / 127], [0, 0]),
    ("uint", "per_tensor_affine", 18 / 255, 0),
    ("int", "per_tensor_symmetric", 18 / 127, 0),
    ("uint", "per_channel_affine", [9 / 255, 18 / 255], [0, 0]),
    ("uint", "per_tensor_symmetric", 18 / 127.5, 127),
    ("uint", "per_channel_symmetric", [9 / 127.5, 18 / 127.5], [127, 127]),
    ("int", "per_tensor_affine", 18 / 254, -127),
    ("int", "per_channel_affine", [9 / 254, 18 / 254], [-127, -127]),
])
def test_qat_dtype_scheme_table(dtype, scheme, scale, zp):
    conv = nn.Conv2d(1, 2, 3)
    with torch.no_grad():
        conv.weight.copy_(W18)
    model = nn.Sequential(conv)
    q = qat(model, quant_dtype=dtype, quant_scheme=scheme)
    w = q.get_modules_wrapper()[0]
    model(torch.randn(1, 1, 3, 3))
    torch.testing.assert_close(w.weight_scale, torch.tensor(scale))
    torch.testing.assert_close(w.weight_zero_point, torch.tensor(zp, dtype=torch.float32))
    # the forward uses core's fake quantization of the weight; the fused kernel multiplies by 1/scale, so a
    # value exactly on a rounding tie (9 / (18/127) = 63.5) may land on either neighbour
    qmin, qmax = cq.quant_range(8, dtype)
    s = np.asarray(scale, dtype=np.float64).reshape(-1, 1, 1, 1)
    z = np.asarray(zp, dtype=np.float64).reshape(-1, 1, 1, 1)
    w64 = W18.double().numpy()
    core = cq.fake_quantize(NP, w64, s, z, qmin, qmax)
    ours = q.export_weight(w)[0].double().numpy()
    tie = np.isclose(np.abs(w64 / s + z) % 1.0, 0.5)
    assert np.all(np.isclose(ours, core, atol=1e-5) | (tie & np.isclose(np.abs(ours - core), s, rtol=1e-4)))
    assert np.isclose(ours, core, atol=1e-5).sum() >= 16


def test_fused_kernel_matches_core_fake_quantize_including_ties():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 3.5, 300.0, -300.0])
    for zp in (0.0, 1.0, 3.0):
        s, z = torch.tensor(1.0), torch.tensor(zp)
        core = cq.fake_quantize(NP, x.numpy(), 1.0, zp, -128, 127)
        assert np.array_equal(fake_quant(x, s, z, -128, 127).numpy(), core)
        assert np.array_equal(fake_quant(x.view(2, 4), s.expand(2), z.expand(2), -128, 127, axis=0).view(-1).numpy(), core)


def test_32bit_uint_falls_back_to_core_with_clipped_ste():
    x = torch.tensor([-1.0, 0.25, 2.0], requires_grad=True)
    y = fake_quant(x, torch.tensor(0.5), torch.tensor(0.0), 0, 2**32 - 1)
    assert torch.equal(y, torch.tensor([0.0, 0.0, 2.0]))  # 0.25/0.5 = 0.5 -> 0 (half to even); -1 clipped
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 1.0]))


def test_qat_activation_ema_first_observation_then_decay():
    model = linear_with([[1.0]])
    w = qat(model, types=("output",)).get_modules_wrapper()[0]
    model(torch.tensor([[-1.0], [2.0]]))
    assert (w.tracked_min_output.item(), w.tracked_max_output.item()) == (-1.0, 2.0)
    model(torch.tensor([[0.0], [4.0]]))
    torch.testing.assert_close(w.tracked_min_output, torch.tensor(-0.99))
    torch.testing.assert_close(w.tracked_max_output, torch.tensor(2.02))
    torch.testing.assert_close(w.output_scale, torch.tensor((2.02 + 0.99) / 255))


def test_qat_eval_uses_stored_params_and_clips_gradient_outside_range():
    model = linear_with([[1.0]])
    w = qat(model, types=("output",)).get_modules_wrapper()[0]
    model(torch.tensor([[0.0], [2.55]]))  # range [0, 2.55] -> scale 0.01, zp 0
    model.eval()
    x = torch.tensor([[1.234], [5.0], [-1.0]], requires_grad=True)
    y = model(x)
    assert (w.tracked_min_output.item(), w.tracked_max_output.item()) == (0.0, pytest.approx(2.55))
    torch.testing.assert_close(y, torch.tensor([[1.23], [2.55], [0.0]]))
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[1.0], [0.0], [0.0]]))  # clipped STE


def test_qat_eval_before_any_observation_passes_activations_through():
    model = linear_with([[1.0]])
    qat(model, types=("output",))
    model.eval()
    x = torch.tensor([[1.2345]])
    assert torch.equal(model(x), x)


# ---------------------------------------------------------------------------------- other quantizers
def test_naive_rounds_with_running_max_scale():
    model = linear_with([[1.0, -2.54], [0.039, 0.5]])
    q = NaiveQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Linear"]}])
    w = q.get_modules_wrapper()[0]
    out = model(torch.eye(2)).T
    torch.testing.assert_close(w.weight_scale, torch.tensor(0.02))
    # 0.039 / 0.02 = 1.95 -> 2 (NNI's truncation would give 1)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.54], [0.04, 0.5]]), atol=1e-6, rtol=0)
    with torch.no_grad():
        w.weight.mul_(0.5)  # smaller weights: the running max keeps the scale
    model(torch.eye(2))
    torch.testing.assert_close(w.weight_scale, torch.tensor(0.02))


def test_dorefa_values_and_paper_gradient():
    weight = [[0.1, -0.7, 0.3], [1.5, -0.05, 0.0]]
    model = linear_with(weight)
    DoReFaQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 2, "op_types": ["Linear"]}])
    out = model(torch.eye(3)).T
    expected = cq.dorefa_weight(NP, np.asarray(weight, dtype=np.float32), 2)
    np.testing.assert_allclose(out.detach().numpy(), expected, atol=1e-6)
    out.sum().backward()
    grad = model[0].module.weight.grad
    # gradient flows through tanh (STE on the rounding only): not the identity of a plain STE
    t = torch.tensor(weight, requires_grad=True)
    tt = torch.tanh(t)
    (2 * (tt / (2 * tt.abs().max()) + 0.5) - 1).sum().backward()
    torch.testing.assert_close(grad, t.grad)


def test_bnn_sign_and_hardtanh_gradient():
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.diag(torch.tensor([0.3, -0.2, 0.0, 2.0])))
    q = BNNQuantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 1, "op_types": ["Linear"]}])
    x = torch.tensor([[0.5, 0.5, 0.5, 0.5]], requires_grad=True)
    y = model(x)
    # sign(W): diag(1, -1, 1 (sign(0) = +1), 1) with +1 off the diagonal (zeros) -> W_b @ x
    wb = torch.where(model[0].module.weight < 0, -1.0, 1.0)
    pre = x.detach() @ wb.T
    assert torch.equal(y, torch.where(pre < 0, -1.0, 1.0))
    y.sum().backward()
    keep = (pre.abs() <= 1).float()  # hard-tanh STE on the output
    torch.testing.assert_close(x.grad, keep @ wb)
    assert q.get_modules_wrapper()[0].weight.grad is not None


def test_bnn_output_gradient_zero_where_abs_above_one():
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
    BNNQuantizer(model, [{"quant_types": ["output"], "quant_bits": 1, "op_types": ["Linear"]}])
    x = torch.tensor([[0.5, -2.0, 1.0, 3.0]], requires_grad=True)
    y = model(x)
    assert torch.equal(y, torch.tensor([[1.0, -1.0, 1.0, 1.0]]))
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))


def test_lsq_scales_are_parameters_in_the_optimizer_with_paper_gradient():
    model = linear_with([[0.5, -1.0], [0.25, 2.0]])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    q = LsqQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": ["Linear"]}], opt)
    w = q.get_modules_wrapper()[0]
    s = w.weight_scale
    assert isinstance(s, nn.Parameter) and any(s is p for g in opt.param_groups for p in g["params"])
    assert any(s is p for p in model.parameters())
    qmax = 7
    torch.testing.assert_close(s.detach(), torch.tensor(2 * 0.9375 / qmax**0.5))  # 2 mean|w| / sqrt(qmax)
    out = model(torch.eye(2)).T
    wt = w.weight.detach()
    v = wt / s.detach()
    torch.testing.assert_close(out, torch.round(torch.clamp(v, -8, 7)) * s.detach())
    out.sum().backward()
    # d/ds of round(clip(v)) * s: round(v) - v inside the range, qmin/qmax outside; times g = 1/sqrt(N qmax)
    inside = (v >= -8) & (v <= 7)
    ds = torch.where(inside, torch.round(v) - v, torch.clamp(v, -8, 7)).sum() / (4 * qmax) ** 0.5
    torch.testing.assert_close(s.grad, ds)
    before = s.detach().clone()
    opt.step()
    assert not torch.equal(s.detach(), before)


# ---------------------------------------------------------------------------------- training
def tiny_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


CASES = {
    "qat": (QAT_Quantizer, {"quant_types": ["weight", "input", "output"], "quant_bits": 8}),
    "qat4-per-channel": (QAT_Quantizer, {"quant_types": ["weight", "output"], "quant_bits": 4,
                                         "quant_dtype": {"weight": "int", "output": "uint"},
                                         "quant_scheme": {"weight": "per_channel_symmetric",
                                                          "output": "per_tensor_affine"}}),
    "naive": (NaiveQuantizer, {"quant_types": ["weight"], "quant_bits": 8}),
    "dorefa": (DoReFaQuantizer, {"quant_types": ["weight"], "quant_bits": 4}),
    "bnn": (BNNQuantizer, {"quant_types": ["weight"], "quant_bits": 1}),
    "lsq": (LsqQuantizer, {"quant_types": ["weight", "input", "output"], "quant_bits": 8}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_training_lowers_loss_and_gradients_reach_float_weights(name):
    cls, cfg = CASES[name]
    model = tiny_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    q = cls(model, [{**cfg, "op_types": ["default"]}], opt)
    model = q.compress()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 1, 8, 8, generator=g)
    y = torch.randint(0, 5, (16,), generator=g)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        for w in q.get_modules_wrapper():
            assert w.weight.grad is not None and w.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert q.steps == 12


def test_embedding_and_transposed_conv_quantize_on_their_channel_axes():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.up = nn.ConvTranspose2d(4, 3, 2, stride=2)

        def forward(self, idx):
            return self.up(self.emb(idx)[:, :, None, None])

    torch.manual_seed(0)
    model = M()
    cfg = [{"quant_types": ["weight", "output"], "quant_bits": 4, "quant_dtype": "int", "op_types": ["ConvTranspose2d"],
            "quant_scheme": {"weight": "per_channel_symmetric", "output": "per_channel_affine"}},
           {"quant_types": ["weight"], "quant_bits": 4, "op_types": ["Embedding"]}]
    q = QAT_Quantizer(model, cfg)
    emb, up = q.get_modules_wrapper()
    out = model(torch.tensor([1, 2, 3]))
    # ConvTranspose2d weight is [in, out, kh, kw]: one scale per OUTPUT channel (axis 1), max|w| / 7
    expected = up.weight.detach().abs().amax(dim=(0, 2, 3)) / 7
    torch.testing.assert_close(up.weight_scale, expected)
    assert up.output_scale.shape == (3,) and out.shape == (3, 3, 2, 2)
    out.sum().backward()
    assert emb.weight.grad.abs().sum() > 0 and up.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("shape, axis", [((3, 4, 5), None), ((3, 4, 5), 0), ((3, 4, 5), 1), ((6, 4), -1)])
def test_one_pass_observation_equals_core_minmax(shape, axis):
    from compressor.torch.quantization.fakequant import observe_minmax

    x = torch.randn(*shape)
    lo, hi = observe_minmax(x, axis)
    clo, chi = cq.minmax(NP, x.numpy(), axis)
    assert np.array_equal(lo.numpy(), clo) and np.array_equal(hi.numpy(), chi)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_training_step_has_no_host_sync(name):
    cls, cfg = CASES[name]
    model = tiny_cnn().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cls(model, [{**cfg, "op_types": ["default"]}], opt)
    x, step = batch_and_step(model, opt)
    step()  # allocations, lazy init
    with no_host_sync():
        for _ in range(2):
            step()
        model.eval()
        with torch.no_grad():
            model(x)
    for w in model.modules():
        for b in w.buffers():
            assert b.device.type == "cuda"
