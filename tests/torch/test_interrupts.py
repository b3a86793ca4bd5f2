"""Ctrl-C at every step of an in-place change leaves the model as it was (every parameter and buffer bit-identical,
dtypes included, the same Parameter objects, no hook left) or finished: one-shot ``calibrate`` (its float64 pass
swaps each layer's tensors for float64 copies and back), ``speedup_model`` and a second Ctrl-C while the change
is being undone. The interrupt is a real SIGINT sent after the n-th traced line (tests/_sigint.py), for every n."""

from __future__ import annotations

import copy
import os
import signal
import warnings

import pytest
import torch
from torch import nn

import compressor
from compressor.torch import GptqQuantizer, SparseGPTPruner
from compressor.torch.sequential import TorchOneShotBackend
from compressor.torch.speedup import speedup_model
from tests._sigint import count_lines, run_interrupted

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

ROOT = os.path.dirname(compressor.__file__)
DATA = [torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))]
#: where calibrate changes the model, or records / undoes a change: every line of these functions
CHANGES = {"widen", "narrow", "call", "_calling", "_remove_hooks", "before", "rollback", "commit_layer", "write",
           "set_weight", "restore", "snapshot", "_oneshot_write", "first_inputs", "shared_inputs", "run_block",
           "advance", "run_model", "set_mark", "set_masks", "apply_masks", "run_sequential", "calibrate"}
CALIBRATE = {os.path.join(ROOT, p): CHANGES for p in (
    "torch/sequential/backend.py", "torch/sequential/mixin.py", "core/oneshot/memory.py", "core/oneshot/steps.py",
    "core/oneshot/driver.py", "torch/quantization/oneshot.py", "torch/pruning/oneshot.py", "torch/pruning/wrapper.py")}


def _llama():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32)).eval()


LAYERS = ["model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]


@pytest.fixture(autouse=True)
def one_thread():
    """Hundreds of tiny runs: one intra-op thread (several spin-waiting on a busy machine made each 100x slower).
    After each test, torch's grad mode must be on as before: an interrupt landing inside ``no_grad``'s own exit
    left it off for every later test of the session."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    assert torch.is_grad_enabled(), "an interrupted run left torch's grad mode off"


def _snapshot(model):
    """Everything an interrupted change could leave behind: each tensor's bytes and dtype, which object holds
    it, the hooks and training flags of every module."""
    tensors = {k: (v.dtype, v.detach().clone(), id(v)) for k, v in model.state_dict(keep_vars=True).items()}
    modules = {n: (type(m), m.training, len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    return tensors, modules


def _same(a, b):
    (ta, ma), (tb, mb) = a, b
    return (ma == mb and ta.keys() == tb.keys()
            and all(x[0] == y[0] and x[2] == y[2] and torch.equal(x[1], y[1]) for x, y in zip(ta.values(), tb.values())))


def _structure(snapshot):
    return {n: (t, pre, post) for n, (t, _, pre, post) in snapshot[1].items()}


def _quantizer(model, pruned=False):
    if pruned:
        SparseGPTPruner(model, [{"sparsity": 0.5, "op_names": LAYERS}]).calibrate(DATA, progress=False)
    return GptqQuantizer(model, [{"quant_bits": 4, "group_size": 8, "op_names": LAYERS}])


def _calibrate(q):
    q.calibrate(DATA, progress=False, forward_dtype="float64")


def _every_interrupt(pruned, stride=1):
    model = _llama()
    q = _quantizer(model, pruned)
    before = _snapshot(model)
    fresh = _llama()
    _calibrate(_quantizer(fresh, pruned))
    finished = _snapshot(fresh)
    n = count_lines(lambda: _calibrate(_quantizer(_llama(), pruned)), CALIBRATE)
    outcomes = {"as before": 0, "finished": 0}
    for k in range(1, n + 1, stride):
        state = run_interrupted(lambda q=q: _calibrate(q), k, CALIBRATE)
        if not state["sent"]:  # a try: line last: nothing ran after it
            continue
        assert state["raised"], f"Ctrl-C after line {k} of {n} was not raised"
        now = _snapshot(model)
        if _same(now, before):
            outcomes["as before"] += 1
            continue
        # finished: compressed as an uninterrupted run (tensors compared by value; the objects are the model's own;
        # the training flags may not all be back: calibrate's last loop puts them back one by one)
        assert _structure(now) == _structure(finished) and all(torch.equal(x[1], y[1]) and x[0] == y[0]
                                                               for x, y in zip(now[0].values(), finished[0].values())), \
            f"Ctrl-C after line {k} of {n} left the model neither as before nor compressed"
        outcomes["finished"] += 1
        model = _llama()  # start again from an uncompressed model
        q = _quantizer(model, pruned)
        before = _snapshot(model)
    assert outcomes["as before"] > 0
    return outcomes


def test_ctrl_c_at_every_step_of_a_float64_calibration():
    out = _every_interrupt(pruned=False)
    assert out["as before"] > 100, out


def test_ctrl_c_at_steps_of_a_quantizer_calibrating_a_pruned_model():
    """The quantizer's layers hold the pruner's wrappers: the float64 pass gives their masked marks back too."""
    out = _every_interrupt(pruned=True, stride=7)
    assert out["as before"] > 20, out


def test_a_second_ctrl_c_during_the_rollback_waits_for_it(monkeypatch):
    """Ctrl-C in block 2, and again while block 1's layers are being put back: the model is as before, and the
    second KeyboardInterrupt is raised once they are."""
    model = _llama()
    q = _quantizer(model)
    before = _snapshot(model)
    restore = TorchOneShotBackend.restore
    restored = []

    def restore_with_ctrl_c(self, task, saved):
        if not restored:
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, in the middle of the rollback
        restore(self, task, saved)
        restored.append(task.name)

    monkeypatch.setattr(TorchOneShotBackend, "restore", restore_with_ctrl_c)
    write = TorchOneShotBackend.write

    def write_then_ctrl_c(self, task, result):
        write(self, task, result)
        if task.name == LAYERS[1]:
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, after the last layer was written

    monkeypatch.setattr(TorchOneShotBackend, "write", write_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as info:
        _calibrate(q)
    assert restored == LAYERS[::-1]  # both layers put back, newest first, despite the Ctrl-C after the first
    assert isinstance(info.value.__context__, KeyboardInterrupt)  # raised while the first was being handled
    assert _same(_snapshot(model), before)
    monkeypatch.undo()
    _calibrate(q)  # and the quantizer still works: the same result as on a fresh model
    fresh = _llama()
    _calibrate(_quantizer(fresh))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


# ------------------------------------------------------------------------------------------------ speedup_model
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


SPEEDUP = {os.path.join(ROOT, "torch/speedup.py"): None}


def test_ctrl_c_at_every_step_of_speedup_model():
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    masks = {"fc1": {"weight": torch.tensor([1, 0, 1, 1, 0, 1, 1, 0], dtype=torch.bool)[:, None].expand(8, 6).clone(),
                     "bias": torch.tensor([1, 0, 1, 1, 0, 1, 1, 0], dtype=torch.bool)}}

    def fresh():
        torch.manual_seed(0)
        return Net().eval()

    done = speedup_model(fresh(), x, masks=masks)
    assert done.fc1.out_features == 5 and done.fc2.in_features == 5
    n = count_lines(lambda: speedup_model(fresh(), x, masks=masks), SPEEDUP)
    model = fresh()
    before = _snapshot(model)
    finished = 0
    for k in range(1, n + 1, 3):
        state = run_interrupted(lambda m=model: speedup_model(m, x, masks=masks), k, SPEEDUP)
        if not state["sent"]:
            continue
        if not state["raised"]:  # the Ctrl-C came after the function returned: finished
            assert model.fc1.out_features == 5
            finished += 1
            model = fresh()
            before = _snapshot(model)
            continue
        assert _same(_snapshot(model), before), f"Ctrl-C after line {k} of {n} of speedup_model changed the model"
        assert model.fc1.out_features == 8 and model.fc1.in_features == 6
    assert n > 200 and finished <= 2


# ------------------------------------------------------------------------------------------------ pack_weights
PACK = {os.path.join(ROOT, "torch/quantization/lowbit.py"): {"pack_weights", "_pack"}}


def test_ctrl_c_at_every_step_of_pack_weights():
    """Every layer replaced, or none: the wrappers back in their places, QAT's scale buffers as they were."""
    from compressor.torch import QAT_Quantizer, RtnQuantizer
    from compressor.torch.quantization.lowbit import pack_weights

    def models():
        m = _llama()
        RtnQuantizer(m, [{"quant_bits": 4, "group_size": 8, "op_names": LAYERS}]).calibrate(progress=False)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        QAT_Quantizer(net, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Linear"]}]).compress()
        net(torch.randn(4, 6))
        return [m, net]

    for model in models():
        n = count_lines(lambda m=model: pack_weights(copy.deepcopy(m)), PACK)
        before = _snapshot(model)
        for k in range(1, n + 1):
            state = run_interrupted(lambda m=model: pack_weights(m), k, PACK)
            assert state["sent"] and state["raised"]
            packed = [type(mod).__name__ == "PackedLinear" for mod in model.modules()]
            if any(packed):  # finished: only a Ctrl-C on the last line ('return model') comes after the swaps
                assert k == n and sum(packed) == 2, f"Ctrl-C after line {k} of {n} of pack_weights: half packed"
                break
            assert _same(_snapshot(model), before), f"Ctrl-C after line {k} of {n} of pack_weights changed the model"
        else:
            pack_weights(model)  # and it still packs
        assert n > 20


def test_a_compressor_interrupted_while_it_wraps_the_model_leaves_it_as_it_was(monkeypatch):
    """Ctrl-C (or any exception) at each change a constructor makes to the model (every wrapper put in place, the
    optimizer hook, the family plug-in) puts every module back where it was: the same objects at the same paths,
    nothing wrapped, the optimizer without the hook; with nothing injected the layers are wrapped."""
    import compressor.torch.compressor as base
    from compressor.torch import LevelPruner

    model = _llama()
    before = _snapshot(model)
    places = {n: id(m) for n, m in model.named_modules()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = [{"sparsity": 0.5, "op_types": ["Linear"]}, {"op_names": ["lm_head"], "exclude": True}]
    calls = [0]
    real_setattr = setattr

    def counting(obj, name, value):
        calls[0] += 1
        if calls[0] == fail_at[0]:
            raise KeyboardInterrupt
        real_setattr(obj, name, value)

    monkeypatch.setattr(base, "setattr", counting, raising=False)
    fail_at = [0]
    p = LevelPruner(model, cfg, opt)
    total = calls[0]
    assert total == 14 and len(p.get_modules_wrapper()) == 14  # one setattr per wrapped layer
    p._unwrap_model()
    p.unhook()
    for k in range(1, total + 1):
        fail_at[0], calls[0] = k, 0
        with pytest.raises(KeyboardInterrupt):
            LevelPruner(model, cfg, opt)
        assert {n: id(m) for n, m in model.named_modules()} == places, k
        assert _same(_snapshot(model), before), k
    fail_at[0] = 0
    monkeypatch.setattr(base.families, "on_compress", lambda m: (_ for _ in ()).throw(RuntimeError("plug-in")))
    with pytest.raises(RuntimeError, match="plug-in"):
        LevelPruner(model, cfg, opt)
    assert {n: id(m) for n, m in model.named_modules()} == places
    assert base.hooks.hooked_compressors(opt) == []  # the hook installed before the plug-in failed is gone


# ------------------------------------------------------------------------------------------------ compress()
COMPRESS = {os.path.join(ROOT, p): None for p in (
    "torch/pruning/pruner.py", "torch/pruning/wrapper.py", "torch/pruning/dependency.py", "torch/pruning/masker.py",
    "core/interrupts.py")}


class _Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.conv2(torch.relu(self.conv1(x))).mean((2, 3)))


def _wrapped_pruner(kind):
    from compressor.torch import L1FilterPruner, LevelPruner

    torch.manual_seed(0)
    model = _Convs().eval()
    if kind == "level":
        return model, LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d", "Linear"]}])
    x = torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(0))
    return model, L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d"]}], dependency_aware=True,
                                 dummy_input=x)


def _tensors_equal(a, b):
    return a[0].keys() == b[0].keys() and all(torch.equal(x[1], y[1]) for x, y in zip(a[0].values(), b[0].values()))


@pytest.mark.parametrize("kind", ["level", "l1-dependency-aware"])
def test_ctrl_c_at_every_step_of_compress_takes_effect_once_it_has_finished(kind):
    """A pruner's compress() holds Ctrl-C back: sent at any line of it (but its first, before it holds anything),
    the KeyboardInterrupt comes once the model is pruned as by an uninterrupted call (every mask and weight equal),
    grad mode as before."""
    model, pruner = _wrapped_pruner(kind)
    pruner.compress()
    finished = _snapshot(model)
    n = count_lines(lambda: _wrapped_pruner(kind)[1].compress(), COMPRESS)
    assert n > 50
    outcomes = {"as before": 0, "finished": 0}
    for k in range(1, n + 1, 7):
        model, pruner = _wrapped_pruner(kind)
        before = _snapshot(model)
        state = run_interrupted(pruner.compress, k, COMPRESS)
        assert torch.is_grad_enabled(), f"Ctrl-C after line {k} of {n} of compress left grad mode off"
        if not state["sent"]:
            continue
        assert state["raised"], f"Ctrl-C after line {k} of {n} of compress was lost"
        if _same(_snapshot(model), before):
            outcomes["as before"] += 1
        else:
            assert _tensors_equal(_snapshot(model), finished), f"Ctrl-C after line {k} of {n}: half pruned"
            outcomes["finished"] += 1
    assert outcomes["as before"] <= 3 and outcomes["finished"] > 5, outcomes  # before the hold is in place


@pytest.mark.parametrize("kind", ["level", "l1-dependency-aware"])
def test_an_error_at_each_mask_of_compress_puts_every_mask_back(kind, monkeypatch):
    """An exception at the k-th mask compress() sets (a calc_mask failing half way) leaves the wrapped model
    bit-identical to before compress(), for every k; compress() called again then prunes as an uninterrupted
    call."""
    from compressor.torch.pruning.wrapper import PrunerModuleWrapper

    model, pruner = _wrapped_pruner(kind)
    pruner.compress()
    finished = _snapshot(model)
    real = PrunerModuleWrapper.set_mask
    calls = [0, None]

    def failing(self, name, value):
        calls[0] += 1
        if calls[0] == calls[1]:
            raise RuntimeError("calc_mask failed")
        return real(self, name, value)

    monkeypatch.setattr(PrunerModuleWrapper, "set_mask", failing)
    model, pruner = _wrapped_pruner(kind)
    pruner.compress()
    total = calls[0]
    assert total >= 3
    for k in range(1, total + 1):
        model, pruner = _wrapped_pruner(kind)
        before = _snapshot(model)
        calls[:] = [0, k]
        with pytest.raises(RuntimeError, match="calc_mask failed"):
            pruner.compress()
        assert _same(_snapshot(model), before), f"an error at mask {k} of {total} changed the model"
        calls[:] = [0, None]
        pruner.compress()
        assert _tensors_equal(_snapshot(model), finished), f"compress() after an error at mask {k} did not prune"
