"""Issue 16 on torch: wrappers read through to the layer, the seeds' clock for user calc_mask, torch.compile
and bf16 autocast, atomic exports, saving with a quantizer attached, slimming that keeps every layer."""

from __future__ import annotations

import copy
import io
import os

import numpy as np
import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError
from compressor.torch import LevelPruner, LsqQuantizer, QAT_Quantizer, SlimPruner

X = torch.randn(8, 1, 6, 6, generator=torch.Generator().manual_seed(0))


def small(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, stride=2, padding=1, dilation=1), nn.ReLU(), nn.Flatten(), nn.Linear(36, 3))


def train(model, optimizer, steps, x=X):
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def level_keep(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Independent reference: the floor(n * s) smallest |w| pruned (ties: lower index first)."""
    flat = w.detach().abs().flatten()
    k = int(flat.numel() * sparsity)
    order = torch.sort(flat, stable=True).indices
    keep = torch.ones_like(flat, dtype=torch.bool)
    keep[order[:k]] = False
    return keep.view_as(w)


def fake_quant_uint8(w: torch.Tensor) -> torch.Tensor:
    """Independent reference of per-tensor affine uint8 fake quantization (range includes 0)."""
    w = w.detach()
    rmin, rmax = torch.clamp(w.min(), max=0.0), torch.clamp(w.max(), min=0.0)
    scale = (rmax - rmin) * torch.tensor(1 / 255, dtype=torch.float32)  # float32 scale, as the quantizer keeps
    zp = int(torch.clamp(torch.round(-rmin.double() / scale.double()), 0, 255))
    return torch.fake_quantize_per_tensor_affine(w, float(scale), zp, 0, 255)


# ---------------------------------------------------------------- 1. wrappers read through to the layer
def test_wrappers_read_through_to_the_wrapped_layer():
    model = small()
    conv, fc = model[0], model[3]
    keys_before = set(model.state_dict())
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d", "Linear"]}])
    pruner.compress()
    quantizer = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2d"]}])
    quantizer.compress()
    qw, pw = model[0], model[3]
    assert (qw.stride, qw.kernel_size, qw.dilation, qw.padding, qw.out_channels) == ((2, 2), (3, 3), (1, 1), (1, 1), 4)
    assert (pw.in_features, pw.out_features) == (36, 3)
    assert pw.weight is fc.weight and qw.weight is conv.weight
    assert qw._conv_forward.__self__ is conv  # private methods too (model code calls them)
    assert not hasattr(qw, "no_such_attribute") and not hasattr(qw, "__no_such_dunder__")
    with pytest.raises(AttributeError, match="no_such_attribute"):
        _ = pw.no_such_attribute
    # state_dict names are the wrapped ones, as before: '<layer>.module.weight' plus the wrappers' buffers
    keys = set(model.state_dict())
    assert {"0.module.module.weight", "0.module.weight_mask", "3.module.weight", "3.weight_mask",
            "0.weight_scale"} <= keys
    assert not keys & keys_before - {"0.weight", "0.bias", "3.weight", "3.bias"}
    # pickling keeps working (no infinite __getattr__ recursion while unpickling)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert isinstance(torch.load(buf, weights_only=False)[0].module.stride, tuple)
    assert copy.deepcopy(model)[3].in_features == 36


def _hf_mobilenet():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MobileNetV2Config(image_size=32, depth_multiplier=0.25, num_labels=3,
                                         classifier_dropout_prob=0.0)
    torch.manual_seed(0)
    # training mode (batch statistics in BN, no dropout): fresh running statistics would shrink the
    # activations to ~1e-9 at the logits, where any two models look alike
    return transformers.MobileNetV2ForImageClassification(cfg).train()


def test_hf_mobilenetv2_runs_under_a_pruner_and_a_quantizer(tmp_path):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    model = _hf_mobilenet()
    dense = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    with torch.no_grad():  # the expected pruned model, masked by hand
        for m in reference.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.mul_(level_keep(m.weight, 0.5))
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d", "Linear"]}])
    pruner.compress()  # HF code reads conv.stride / kernel_size / dilation of the wrapped convs
    with torch.no_grad():
        got, want, base = model(x).logits, reference(x).logits, dense(x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (got - base).abs().max() > 1e-3  # the pruning is visible in the output
    pruner.export_model(tmp_path / "m.pt")
    fresh = _hf_mobilenet()
    fresh.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x).logits, got, rtol=1e-5, atol=1e-6)

    model = _hf_mobilenet()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for m in reference.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.copy_(fake_quant_uint8(m.weight))
    QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2d"]}]).compress()
    with torch.no_grad():
        got, want = model(x).logits, reference(x).logits
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    assert (got - base).abs().max() > 1e-4


# ---------------------------------------------------------------- 3. the seeds' clock
class CountingLevelPruner(LevelPruner):
    """A user's subclass of a built-in one-shot pruner: its calc_mask must run at every optimizer step."""

    calls = 0

    def calc_mask(self, wrapper, wrapper_idx=None):
        type(self).calls += 1
        super().calc_mask(wrapper, wrapper_idx)
        return {"weight_mask": wrapper.weight.detach().abs() > 0.05}  # recomputed from the current weights


def test_overridden_calc_mask_runs_at_every_optimizer_step(monkeypatch):
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    CountingLevelPruner.calls = 0
    pruner = CountingLevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}], opt)
    pruner.compress()
    assert CountingLevelPruner.calls == 1  # compress(): once for the one wrapper
    train(model, opt, 3)
    assert CountingLevelPruner.calls == 1 + 3
    w = pruner.get_modules_wrapper()[0]
    assert torch.equal(w.weight_mask, w.module.weight.detach().abs() > 0.05)  # the last step's mask is in place

    # the built-ins keep their fast path: no mask computation after the first
    from compressor.torch.pruning.level import LevelPrunerMasker

    count = {"n": 0}
    original = LevelPrunerMasker.calc_mask

    def counting(self, *a, **k):
        count["n"] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(LevelPrunerMasker, "calc_mask", counting)
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}], opt).compress()
    train(model, opt, 3)
    assert count["n"] == 1


# ---------------------------------------------------------------- 5. torch.compile and bf16 autocast
def test_torch_compile_after_compress_trains_and_masks_hold():
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d", "Linear"]}], opt)
    pruner.compress()
    masks = [w.weight_mask.clone() for w in pruner.get_modules_wrapper()]
    before = [w.weight.detach().clone() for w in pruner.get_modules_wrapper()]
    compiled = torch.compile(model)
    train(compiled, opt, 3)
    for w, m, b in zip(pruner.get_modules_wrapper(), masks, before):
        assert torch.equal(w.weight_mask, m)
        assert int((~m).sum()) == w.weight.numel() // 2
        assert torch.count_nonzero(w.weight.detach()[~m]) == 0  # exactly 0 after momentum steps
        assert not torch.equal(w.weight.detach()[m], b[m])  # trained
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), model(X))


def test_bf16_autocast_through_pruned_and_qat_layers():
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d", "Linear"]}], opt)
    pruner.compress()
    quantizer = QAT_Quantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 8,
                                       "op_types": ["Conv2d", "Linear"]}], opt)
    quantizer.compress()
    for _ in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(X)
        assert out.dtype == torch.bfloat16
        out.float().square().mean().backward()
        grads = [w.weight.grad for w in pruner.get_modules_wrapper()]
        assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
        opt.step()
    for w in pruner.get_modules_wrapper():
        assert torch.count_nonzero(w.weight.detach()[~w.weight_mask]) == 0
    assert all(bool(w.output_observed) for w in quantizer.get_modules_wrapper())


# ---------------------------------------------------------------- 7. atomic exports
def _listing(path):
    return sorted(p.name for p in path.iterdir())


def test_failed_pruner_export_leaves_nothing_and_keeps_old_files(tmp_path, monkeypatch):
    model = small()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d", "Linear"]}])
    pruner.compress()
    (tmp_path / "model.pt").write_bytes(b"previous export")

    def broken(*args, **kwargs):
        raise RuntimeError("converter failed")

    monkeypatch.setattr(torch.onnx, "export", broken)
    with pytest.raises(RuntimeError, match="converter failed"):
        pruner.export_model(tmp_path / "model.pt", tmp_path / "mask.pt", tmp_path / "model.onnx", input_shape=(1, 1, 6, 6))
    assert _listing(tmp_path) == ["model.pt"]
    assert (tmp_path / "model.pt").read_bytes() == b"previous export"
    monkeypatch.undo()
    pruner.export_model(tmp_path / "model.pt", tmp_path / "mask.pt")
    assert _listing(tmp_path) == ["mask.pt", "model.pt"]
    assert set(torch.load(tmp_path / "model.pt", weights_only=True)) == {"0.weight", "0.bias", "3.weight", "3.bias"}


def test_failed_quantizer_export_leaves_nothing(tmp_path, monkeypatch):
    model = small()
    quantizer = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2d", "Linear"]}])
    quantizer.compress()
    (tmp_path / "calib.pt").write_bytes(b"old")

    def broken(*args, **kwargs):
        raise RuntimeError("converter failed")

    monkeypatch.setattr(torch.onnx, "export", broken)
    for fmt in ("fake_quant", "int8"):
        with pytest.raises(RuntimeError, match="converter failed"):
            quantizer.export_model(tmp_path / "q.pt", tmp_path / "calib.pt", tmp_path / "q.onnx",
                                   input_shape=(1, 1, 6, 6), onnx_format=fmt)
        assert _listing(tmp_path) == ["calib.pt"] and (tmp_path / "calib.pt").read_bytes() == b"old"
    model.train()
    assert model.training  # the model's mode is restored after the failure


# ---------------------------------------------------------------- 8. torch.save / state_dict with a quantizer
def test_state_dict_with_a_quantizer_reloads_into_the_same_setup(tmp_path):
    x = torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(3))
    for Q, cfg in ((QAT_Quantizer, {"quant_types": ["weight", "output"], "quant_bits": 8}),
                   (LsqQuantizer, {"quant_types": ["weight", "output"], "quant_bits": 4})):
        cfg = [{**cfg, "op_types": ["Conv2d", "Linear"]}]
        model = small()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        Q(model, cfg, opt).compress()
        train(model, opt, 3)  # activation ranges / learned step sizes move
        model.eval()
        with torch.no_grad():
            want = model(x)
        torch.save(model.state_dict(), tmp_path / "sd.pt")
        fresh = small(seed=1)  # other weights: everything must come from the file
        Q(fresh, cfg).compress()
        fresh.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
        fresh.eval()
        with torch.no_grad():
            torch.testing.assert_close(fresh(x), want, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="Missing key"):  # wrapped keys: not the plain model's
            small().load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
        # the whole pickled model loads, but its forward refuses: the quantizer is not pickled
        torch.save(model, tmp_path / "whole.pt")
        loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
        with pytest.raises(RuntimeError, match=r"without its quantizer; export it with quantizer.export_model"):
            loaded(x)


# ---------------------------------------------------------------- 9. slimming keeps every layer
def conv_bn_stack(widths=(4, 8, 16)) -> nn.Sequential:
    torch.manual_seed(0)
    layers, c = [], 1
    for w in widths:
        layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU()]
        c = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 2))


def test_slim_on_fresh_batchnorms_keeps_every_layer_and_warns():
    model = conv_bn_stack()
    with pytest.warns(RuntimeWarning, match="25 channel scores tie at the global threshold and 14 of them"):
        pruner = SlimPruner(model, [{"sparsity": 0.5, "op_types": ["BatchNorm2d"]}])
        pruner.compress()
    masks = [w.weight_mask for w in pruner.get_modules_wrapper()]
    # floor(28 * 0.5) = 14, spread over the tied channels: half of every layer (each keeps its channel 0)
    assert [int(m.sum()) for m in masks] == [2, 4, 8]
    assert [torch.nonzero(~m).flatten().tolist() for m in masks] == [[1, 2], [1, 2, 3, 4], list(range(1, 9))]
    model.eval()
    out = model(torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(2)))
    assert (out - out[0]).abs().max() > 0  # not disconnected: the output depends on the input


def test_slim_max_layer_sparsity():
    model = conv_bn_stack()
    with pytest.warns(RuntimeWarning, match="pruned 7 channels instead of 14"):
        pruner = SlimPruner(model, [{"sparsity": 0.5, "op_types": ["BatchNorm2d"]}], max_layer_sparsity=0.25)
        pruner.compress()
    assert [int(w.weight_mask.sum()) for w in pruner.get_modules_wrapper()] == [3, 6, 12]
    from compressor.core.errors import ConfigError

    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match="max_layer_sparsity"):
        SlimPruner(conv_bn_stack(), [{"sparsity": 0.5, "op_types": ["BatchNorm2d"]}], max_layer_sparsity=1.0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_export_files_are_not_left_as_temporaries(tmp_path):
    model = small()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d"]}])
    pruner.compress()
    pruner.export_model(str(tmp_path / "sub" / "m.pt"))  # a missing folder is created
    assert _listing(tmp_path / "sub") == ["m.pt"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]
    np.testing.assert_array_equal(torch.load(tmp_path / "sub" / "m.pt", weights_only=True)["0.weight"].numpy(),
                                  model[0].weight.detach().numpy())


# ---------------------------------------------------------------- issue 29: one transaction per export
def _pruned_small():
    model = small()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d", "Linear"]}])
    pruner.compress()
    return pruner


def test_pruner_export_with_a_later_target_a_directory_changes_no_file(tmp_path):
    pruner = _pruned_small()
    (tmp_path / "model.pt").write_bytes(b"old model")
    (tmp_path / "mask.pt").write_bytes(b"old masks")
    (tmp_path / "model.cmpk").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        pruner.export_model(tmp_path / "model.pt", tmp_path / "mask.pt", compressed_path=tmp_path / "model.cmpk")
    assert info.value.filename == str(tmp_path / "model.cmpk")
    assert (tmp_path / "model.pt").read_bytes() == b"old model" and (tmp_path / "mask.pt").read_bytes() == b"old masks"
    assert _listing(tmp_path) == ["mask.pt", "model.cmpk", "model.pt"]


def test_quantizer_export_with_a_later_target_a_directory_changes_no_file(tmp_path):
    quantizer = QAT_Quantizer(small(), [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2d", "Linear"]}])
    quantizer.compress()
    (tmp_path / "q.pt").write_bytes(b"old model")
    (tmp_path / "calib.pt").mkdir()
    with pytest.raises(IsADirectoryError):
        quantizer.export_model(tmp_path / "q.pt", tmp_path / "calib.pt")
    assert (tmp_path / "q.pt").read_bytes() == b"old model" and _listing(tmp_path) == ["calib.pt", "q.pt"]


def test_export_to_the_same_file_twice_is_refused_before_writing(tmp_path):
    pruner = _pruned_small()
    (tmp_path / "model.pt").write_bytes(b"old model")
    (tmp_path / "alias.pt").symlink_to(tmp_path / "model.pt")
    for mask_path in (tmp_path / "model.pt", tmp_path / "alias.pt"):
        with pytest.raises(ConfigError, match="model_path and mask_path are the same file"):
            pruner.export_model(tmp_path / "model.pt", mask_path)
    quantizer = QAT_Quantizer(small(), [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2d"]}])
    quantizer.compress()
    with pytest.raises(ConfigError, match="model_path and calibration_path are the same file"):
        quantizer.export_model(tmp_path / "model.pt", str(tmp_path / "model.pt"))
    assert (tmp_path / "model.pt").read_bytes() == b"old model" and _listing(tmp_path) == ["alias.pt", "model.pt"]




def test_a_full_disk_is_an_oserror_naming_the_target_and_keeps_the_old_file(tmp_path):
    # the file-size limit makes write() fail half way (EFBIG), as a full disk does (ENOSPC): torch's writer
    # would report "[enforce fail at inline_container.cc]" with a temporary name
    import subprocess
    import sys

    script = f"""
import errno, os, resource, signal
import torch
from torch import nn
from compressor.torch import LevelPruner
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
pruner = LevelPruner(model, [{{"sparsity": 0.5, "op_types": ["Linear"]}}])
pruner.compress()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    pruner.export_model({str(tmp_path / 'model.pt')!r}, {str(tmp_path / 'mask.pt')!r})
except OSError as e:
    print(type(e).__name__, e.errno == errno.EFBIG, e.filename, str(e))
"""
    (tmp_path / "model.pt").write_bytes(b"old model")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split(" ")[:3] == ["OSError", "True", str(tmp_path / "model.pt")], out.stdout
    assert "inline_container" not in out.stdout and ".tmp-" not in out.stdout
    assert (tmp_path / "model.pt").read_bytes() == b"old model" and _listing(tmp_path) == ["model.pt"]


# ---------------------------------------------------------------- issue 29: speedup masks=, flag types
def _masked_reference(model, masks):
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, entry in masks.items():
            for pname, m in entry.items():
                getattr(ref.get_submodule(name), pname).mul_(torch.as_tensor(np.asarray(m), dtype=torch.float32))
    return ref


def test_speedup_masks_mixed_tensor_and_numpy_and_checked_before_any_change():
    from compressor.torch import speedup_model

    model = small()
    keep = torch.tensor([True, False, True, False])
    masks = {"0": {"weight": keep.view(4, 1, 1, 1).expand(4, 1, 3, 3).numpy().copy(), "bias": keep},
             "3": {"weight": np.ones((3, 36), np.int64)}}
    x = torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _masked_reference(model, masks).eval()(x)
    before = copy.deepcopy(model.state_dict())
    bad_cases = [({"0": {"weight": np.full((4, 1, 3, 3), 0.5, np.float32)}}, "values must be 0 / 1"),
                 ({"0": {"bias": keep}, "3": {"weight": [[1] * 36] * 3}}, "must be a torch tensor or a numpy array"),
                 ({"0": {"bias": keep}, "3": {"weight": np.ones((3, 35), bool)}}, r"mask 3.weight of shape \(3, 35\)"),
                 ({"0": {"bias": keep}, "3": {"weight": np.array([["1"] * 36] * 3)}}, "is not bool or numeric")]
    for bad, message in bad_cases:
        with pytest.raises(ConfigError, match=message):
            speedup_model(model, x, masks=bad)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the first layer too
    with pytest.raises(ConfigError, match="strict must be True or False, got 'no'"):
        speedup_model(model, x, masks=masks, strict="no")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    speedup_model(model, x, masks=masks)
    assert model[0].out_channels == 2 and model[3].in_features == 18
    torch.testing.assert_close(model.eval()(x), expected)


def test_wrong_type_flags_are_refused():
    from compressor.torch import PtqQuantizer

    model = small()
    before = copy.deepcopy(model)
    cfg = [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2d"]}]
    with pytest.raises(ConfigError, match="PtqQuantizer: bn_fold must be True or False, got 'no'"):
        PtqQuantizer(model, cfg, bn_fold="no")
    with pytest.raises(ConfigError, match="QAT_Quantizer: bn_fold must be True, False or None, got 0"):
        QAT_Quantizer(model, cfg, bn_fold=0)
    assert str(model) == str(before)  # not wrapped


def test_a_compressed_file_with_two_values_for_one_tied_tensor_is_refused(tmp_path):
    from compressor.core.cmpk import pack
    from compressor.core.errors import CompressedFileError
    from compressor.torch.cmpk import load_compressed

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    before = model.emb.weight.detach().clone()
    arrays = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    assert sorted(arrays) == ["emb.weight", "head.weight"]
    arrays["head.weight"][0, 0] += 1.0
    pack(arrays, tmp_path / "m.cmpk")
    with pytest.raises(CompressedFileError, match="'emb.weight' and 'head.weight' are one tied tensor"):
        load_compressed(model, tmp_path / "m.cmpk")
    assert torch.equal(model.emb.weight, before)
    arrays["head.weight"] = arrays["emb.weight"]
    pack(arrays, tmp_path / "m.cmpk")
    load_compressed(model, tmp_path / "m.cmpk")
    assert model.head.weight is model.emb.weight
