"""Cross-backend parity of the one-shot compressors (issue 25): the same weights and the same calibration
batches give the same masks and the same integer codes on torch and Keras.

The twin models are residual MLP "decoders": ``x -> x + W2 relu(W1 x)`` blocks in a list, then a head. The
first block sees the calibration data itself, so its statistics are bit-identical on both backends and so
are its masks / codes (core computes them once, in float64). Later blocks see each framework's float32
forward of the compressed block before; their masks / codes may differ only where a value sits at a
rounding tie, which the test bounds."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import torch

import compressor.tf as ctf
import compressor.torch as cth

D, H, BLOCKS = 16, 32, 2
RNG = np.random.default_rng(3)
W = [(RNG.normal(size=(H, D)).astype(np.float32) / 4, RNG.normal(size=(D, H)).astype(np.float32) / 6)
     for _ in range(BLOCKS)]
HEAD = RNG.normal(size=(8, D)).astype(np.float32) / 4
MIX = RNG.normal(size=(D, D)).astype(np.float32)
BATCHES = [(RNG.normal(size=(4, 12, D)).astype(np.float32) @ MIX) for _ in range(4)]


class TorchBlock(torch.nn.Module):
    def __init__(self, w1, w2):
        super().__init__()
        self.fc1 = torch.nn.Linear(D, H, bias=False)
        self.fc2 = torch.nn.Linear(H, D, bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.from_numpy(w1))
            self.fc2.weight.copy_(torch.from_numpy(w2))

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([TorchBlock(*w) for w in W])
        self.head = torch.nn.Linear(D, 8, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.from_numpy(HEAD))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class KerasBlock(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.fc1 = keras.layers.Dense(H, use_bias=False, name="fc1")
        self.fc2 = keras.layers.Dense(D, use_bias=False, name="fc2")

    def call(self, x):
        return x + self.fc2(keras.ops.relu(self.fc1(x)))


class KerasNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.blocks = [KerasBlock(name=f"block_{i}") for i in range(BLOCKS)]
        self.head = keras.layers.Dense(8, use_bias=False, name="head")

    def call(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def twins():
    tm = TorchNet().eval()
    km = KerasNet()
    km(BATCHES[0])
    for b, (w1, w2) in zip(km.blocks, W):
        b.fc1.kernel.assign(w1.T)
        b.fc2.kernel.assign(w2.T)
    km.head.kernel.assign(HEAD.T)
    np.testing.assert_allclose(km(BATCHES[0]).numpy(), tm(torch.from_numpy(BATCHES[0])).detach().numpy(), atol=1e-5)
    return tm, km


def torch_weights(tm):
    return [(b.fc1.weight.detach().numpy().copy(), b.fc2.weight.detach().numpy().copy()) for b in tm.blocks]


def keras_weights(km):
    return [(b.fc1.kernel.numpy().T.copy(), b.fc2.kernel.numpy().T.copy()) for b in km.blocks]


def compare(tw, kw, exact_blocks=1, max_mismatch=0.005):
    for i, (t_pair, k_pair) in enumerate(zip(tw, kw)):
        for t, k in zip(t_pair, k_pair):
            if i < exact_blocks:
                np.testing.assert_array_equal(t == 0, k == 0)
                np.testing.assert_allclose(t, k, rtol=0, atol=1e-6)
            else:
                assert np.mean((t == 0) != (k == 0)) <= max_mismatch
                assert np.mean(np.abs(t - k) > 1e-4) <= max_mismatch


@pytest.mark.parametrize("config", [{"sparsity": 0.5}, {"sparse_pattern": "2:4"}], ids=["50pct", "2of4"])
@pytest.mark.parametrize("name", ["SparseGPTPruner", "WandaPruner"])
def test_one_shot_pruners_agree(name, config):
    tm, km = twins()
    cfg = [{**config, "op_types": ["default"]}]
    getattr(cth, name)(tm, cfg).calibrate([torch.from_numpy(b) for b in BATCHES], progress=False, forward_dtype="float64")
    getattr(ctf, name)(km, cfg).calibrate(BATCHES, progress=False, forward_dtype="float64")
    tw, kw = torch_weights(tm), keras_weights(km)
    compare(tw, kw)
    for t1, t2 in tw:
        assert np.mean(t1 == 0) == 0.5 and np.mean(t2 == 0) == 0.5


@pytest.mark.parametrize("name,extra", [("GptqQuantizer", {"act_order": True}), ("RtnQuantizer", {}),
                                        ("AwqQuantizer", {})])
def test_one_shot_quantizers_agree_code_for_code(name, extra):
    tm, km = twins()
    cfg = [{"quant_bits": 4, "group_size": 8, "op_types": ["default"], **extra}]
    tq = getattr(cth, name)(tm, cfg)
    kq = getattr(ctf, name)(km, cfg)
    data_t = [torch.from_numpy(b) for b in BATCHES]
    (tq.calibrate() if name == "RtnQuantizer" else tq.calibrate(data_t, progress=False, forward_dtype="float64"))
    (kq.calibrate() if name == "RtnQuantizer" else kq.calibrate(BATCHES, progress=False, forward_dtype="float64"))
    tw, kw = torch_weights(tm), keras_weights(km)
    compare(tw, kw, exact_blocks=BLOCKS if name == "RtnQuantizer" else 1)
    # the integer codes the wrappers keep, block 0 exactly
    t_codes = {w.name: cth.oneshot_codes(w).numpy() for w in tq.get_modules_wrapper()}
    k_codes = {w.name: ctf.oneshot_codes(w) for w in kq.get_modules_wrapper()}
    # and the form the wrappers keep (4 bits: two codes per byte) is the same bytes on both backends
    t_kept = {w.name: w.weight_codes.numpy() for w in tq.get_modules_wrapper()}
    k_kept = {w.name: w.weight_codes.numpy() for w in kq.get_modules_wrapper()}
    np.testing.assert_array_equal(t_kept["blocks.0.fc1"], k_kept["block_0/fc1"])
    assert sorted(t_codes) == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "head"]
    assert sorted(k_codes) == ["block_0/fc1", "block_0/fc2", "block_1/fc1", "block_1/fc2", "head"]
    np.testing.assert_array_equal(t_codes["blocks.0.fc1"], k_codes["block_0/fc1"])
    np.testing.assert_array_equal(t_codes["blocks.0.fc2"], k_codes["block_0/fc2"])


@pytest.mark.parametrize("name,extra", [("RtnQuantizer", {"quant_bits": 4, "group_size": 8}),
                                        ("RtnQuantizer", {"quant_bits": 8}),
                                        ("GptqQuantizer", {"quant_bits": 4, "group_size": 8, "quant_scheme": "affine"}),
                                        ("AwqQuantizer", {"quant_bits": 4, "group_size": 8})],
                         ids=["rtn-w4-g8", "rtn-w8", "gptq-w4-g8-affine", "awq-w4-g8"])
def test_torch_codes_give_the_keras_quantized_layer_of_the_keras_export(name, extra):
    """Issue 26: the torch quantizer's codes, written into Keras's own int4 / int8 / AWQ layer variables
    (:func:`compressor.tf.quantization.lowbit.keras_quantized_variables`), are the variables the Keras export writes."""
    from compressor.tf.quantization.lowbit import _plan_layer, keras_quantized_variables

    tm, km = twins()
    cfg = [{**extra, "op_types": ["default"]}]
    tq = getattr(cth, name)(tm, cfg)
    kq = getattr(ctf, name)(km, cfg)
    (tq.calibrate() if name == "RtnQuantizer" else tq.calibrate([torch.from_numpy(b) for b in BATCHES], progress=False, forward_dtype="float64"))
    (kq.calibrate() if name == "RtnQuantizer" else kq.calibrate(BATCHES, progress=False, forward_dtype="float64"))
    t_wrappers = {w.name: w for w in tq.get_modules_wrapper()}
    for kw in kq.get_modules_wrapper():
        if not kw.name.startswith("block_0/"):
            continue  # block 0 sees the same statistics on both backends: its codes are equal bit for bit
        tw = t_wrappers[kw.name.replace("block_", "blocks.").replace("/", ".")]
        awq = tw.awq_scales.numpy() if name == "AwqQuantizer" else None
        from_torch = keras_quantized_variables(kw.name, kw.layer, cth.oneshot_codes(tw).numpy(),
                                               tw.weight_group_scale.numpy(), tw.weight_group_zero_point.numpy(),
                                               extra.get("group_size", -1), extra["quant_bits"],
                                               symmetric=tw.weight_codes.dtype == torch.int8, awq_scales=awq)
        from_keras = _plan_layer(kw.name, kw, fast=False)
        assert from_torch.mode == from_keras.mode == {8: "int8", 4: "awq" if awq is not None else "int4"}[extra["quant_bits"]]
        assert sorted(from_torch.values) == sorted(from_keras.values)
        for key in from_keras.values:
            np.testing.assert_array_equal(from_torch.values[key], from_keras.values[key], err_msg=key)


class TorchGlu(torch.nn.Module):
    """``x + down(relu(gate(x)) * up(x))``: gate and up read the same input (one AWQ group)."""

    def __init__(self, wg, wu, wd):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(D, H, bias=False), torch.nn.Linear(D, H, bias=False)
        self.down = torch.nn.Linear(H, D, bias=False)
        with torch.no_grad():
            for lin, w in ((self.gate, wg), (self.up, wu), (self.down, wd)):
                lin.weight.copy_(torch.from_numpy(w))

    def forward(self, x):
        return x + self.down(torch.relu(self.gate(x)) * self.up(x))


class KerasGlu(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = keras.layers.Dense(H, use_bias=False, name="gate")
        self.up = keras.layers.Dense(H, use_bias=False, name="up")
        self.down = keras.layers.Dense(D, use_bias=False, name="down")

    def call(self, x):
        return x + self.down(keras.ops.relu(self.gate(x)) * self.up(x))


GLU = [(RNG.normal(size=(H, D)).astype(np.float32) / 4, RNG.normal(size=(H, D)).astype(np.float32) / 4,
        RNG.normal(size=(D, H)).astype(np.float32) / 6) for _ in range(BLOCKS)]


def test_awq_block_search_agrees_alpha_for_alpha_and_code_for_code():
    class TorchGluNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([TorchGlu(*w) for w in GLU])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    tm = TorchGluNet().eval()
    km = keras.Sequential([KerasGlu(name=f"glu_{i}") for i in range(BLOCKS)])
    km(BATCHES[0])
    for b, (wg, wu, wd) in zip(km.layers, GLU):
        b.gate.kernel.assign(wg.T)
        b.up.kernel.assign(wu.T)
        b.down.kernel.assign(wd.T)
    cfg = [{"quant_bits": 4, "group_size": 8, "op_types": ["default"]}]
    tq = cth.AwqQuantizer(tm, cfg).calibrate([torch.from_numpy(b) for b in BATCHES], progress=False, forward_dtype="float64")
    kq = ctf.AwqQuantizer(km, cfg).calibrate(BATCHES, progress=False, forward_dtype="float64")
    t_rows = [(r["layer"], r["alpha"], r.get("group")) for r in tq.oneshot_rows]
    k_rows = [(r["layer"], r["alpha"], r.get("group")) for r in kq.report()]
    assert [r[2] for r in t_rows] == ["blocks.0.gate", "blocks.0.gate", None, "blocks.1.gate",
                                       "blocks.1.gate", None]
    assert [r[2] for r in k_rows] == ["glu_0/gate", "glu_0/gate", None, "glu_1/gate", "glu_1/gate", None]
    assert [r[1] for r in t_rows] == [r[1] for r in k_rows]  # the same alpha everywhere
    t_codes = [cth.oneshot_codes(w).numpy() for w in tq.get_modules_wrapper()]
    k_codes = [ctf.oneshot_codes(w) for w in kq.get_modules_wrapper()]
    for t, k in zip(t_codes[:3], k_codes[:3]):  # block 0 sees the data itself: exactly equal codes
        np.testing.assert_array_equal(t, k)
    for t, k in zip(t_codes[3:], k_codes[3:]):
        assert np.mean(t != k) <= 0.005


class TorchMlpBlock(torch.nn.Module):
    """``h = x + mlp(rms(x))``, ``out = h + tanh(h)``: gate / up / down live in the sub-module ``mlp``, AWQ's parent
    of the gate / up group (the loss is mlp's output, not the block's)."""

    def __init__(self, wg, wu, wd):
        super().__init__()
        self.mlp = TorchGlu(wg, wu, wd)

    def forward(self, x):
        y = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-5)
        h = x + self.mlp(y) - y
        return h + torch.tanh(h)


class KerasMlpBlock(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.mlp = KerasGlu(name="mlp")

    def call(self, x):
        y = x * keras.ops.rsqrt(keras.ops.mean(x * x, axis=-1, keepdims=True) + 1e-5)
        h = x + self.mlp(y) - y
        return h + keras.ops.tanh(h)


@pytest.mark.parametrize("samples", [None, 6])
def test_awq_parent_module_search_agrees_alpha_for_alpha_and_code_for_code(samples):
    """samples=6: the grid is scored on sequences 0, 3, 6, 9, 12, 15 of the 16 (4 batches of 4), taken out of
    their batches on both backends (4 partial batches: the run counts below stay the same)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([TorchMlpBlock(*w) for w in GLU])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    tm = Net().eval()
    km = keras.Sequential([KerasMlpBlock(name=f"blk_{i}") for i in range(BLOCKS)])
    km(BATCHES[0])
    for b, (wg, wu, wd) in zip(km.layers, GLU):
        b.mlp.gate.kernel.assign(wg.T)
        b.mlp.up.kernel.assign(wu.T)
        b.mlp.down.kernel.assign(wd.T)
    runs = {"block": 0, "mlp": 0}
    for b in tm.blocks:
        b.register_forward_hook(lambda *a: runs.__setitem__("block", runs["block"] + 1))
        b.mlp.register_forward_hook(lambda *a: runs.__setitem__("mlp", runs["mlp"] + 1))
    cfg = [{"quant_bits": 4, "group_size": 8, "op_types": ["default"], "search_samples": samples}]
    tq = cth.AwqQuantizer(tm, cfg).calibrate([torch.from_numpy(b) for b in BATCHES], progress=False, forward_dtype="float64")
    kq = ctf.AwqQuantizer(km, cfg).calibrate(BATCHES, progress=False, forward_dtype="float64")
    t_rows = [(r["layer"], r["alpha"], r.get("group")) for r in tq.oneshot_rows]
    k_rows = [(r["layer"], r["alpha"], r.get("group")) for r in kq.report()]
    assert [r[2] for r in t_rows] == ["blocks.0.mlp.gate", "blocks.0.mlp.gate", None, "blocks.1.mlp.gate",
                                      "blocks.1.mlp.gate", None]
    assert [r[2] for r in k_rows] == ["blk_0/mlp/gate", "blk_0/mlp/gate", None, "blk_1/mlp/gate", "blk_1/mlp/gate",
                                      None]
    assert [r[1] for r in t_rows] == [r[1] for r in k_rows]
    # per block: observe (4 batches: the first runs to the end, the other 3 stop at the down projection's input,
    # before the block's and the mlp's forward hooks) + the shared-input probe (1) + record (4) [+ advance (4),
    # block 0]; the mlp also completes once per batch in each of those, then on its own: torch merges the 4
    # recorded calls into one (checked once: the merged call + the 4 separate ones), then 1 float reference + 20
    # alphas
    n = len(BATCHES)
    assert runs["block"] == BLOCKS * (1 + 1 + n) + n
    assert runs["mlp"] == runs["block"] + BLOCKS * ((1 + n) + 21)
    t_codes = [cth.oneshot_codes(w).numpy() for w in tq.get_modules_wrapper()]
    k_codes = [ctf.oneshot_codes(w) for w in kq.get_modules_wrapper()]
    for t, k in zip(t_codes[:3], k_codes[:3]):
        np.testing.assert_array_equal(t, k)
    for t, k in zip(t_codes[3:], k_codes[3:]):
        assert np.mean(t != k) <= 0.005
