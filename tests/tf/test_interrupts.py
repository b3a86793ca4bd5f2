"""Ctrl-C at steps of Keras one-shot ``calibrate`` (its float64 passes switch the block's dtype policies and
intercept layer calls, then put them back) leaves the model as it was -- every weight and wrapper state bit-
identical, dtypes included, no layer call left intercepted, every dtype policy back -- or finished; and a second
Ctrl-C during the rollback waits for it. The interrupt is a real SIGINT sent at the n-th traced line
(tests/_sigint.py)."""

from __future__ import annotations

import os
import signal

import keras
import numpy as np
import pytest

import compressor
from compressor.tf import GptqQuantizer
from compressor.tf.sequential import KerasOneShotBackend
from tests._sigint import count_lines, run_interrupted

pytestmark = [pytest.mark.tf, pytest.mark.filterwarnings("ignore:.*leaves out weighted layers")]

ROOT = os.path.dirname(compressor.__file__)
VOCAB, WIDTH = 32, 16
CALIB = np.random.default_rng(0).integers(0, VOCAB, (2, 8)).astype("int32")
LAYERS = ["block0/up", "block1/down"]
CHANGES = {"_intercepted", "_float64_policies", "run_block", "advance", "_observing", "_observe_call", "_call",
           "shared_inputs", "check", "first_inputs", "before", "rollback", "commit_layer", "write", "set_weight",
           "restore", "snapshot", "_write", "run_sequential", "calibrate", "drop_transients"}
CALIBRATE = {os.path.join(ROOT, p): CHANGES for p in (
    "tf/sequential/backend.py", "tf/sequential/blocks.py", "tf/sequential/mixin.py", "core/oneshot/memory.py",
    "core/oneshot/steps.py", "core/oneshot/driver.py", "tf/quantization/oneshot.py")}


class Block(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.ln = keras.layers.LayerNormalization(name="ln")
        self.up = keras.layers.Dense(2 * WIDTH, activation="gelu", name="up")
        self.down = keras.layers.Dense(WIDTH, name="down")

    def call(self, x):
        return x + self.down(self.up(self.ln(x)))


class TinyLM(keras.Model):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.embed = keras.layers.Embedding(VOCAB, WIDTH, name="embed")
        self.decoder = [Block(name=f"block{i}") for i in range(2)]
        self.head = keras.layers.Dense(VOCAB, name="head")

    def call(self, ids):
        x = self.embed(ids)
        for b in self.decoder:
            x = b(x)
        return self.head(x)


def _lm():
    keras.utils.set_random_seed(0)
    m = TinyLM()
    m(CALIB[:1])
    return m


def _quantizer(m):
    return GptqQuantizer(m, [{"quant_bits": 4, "group_size": 8, "op_names": LAYERS}])


def _calibrate(q):
    q.calibrate(CALIB, progress=False, forward_dtype="float64")


def _state(m, q):
    """Weights (bytes and dtype), the wrappers' state, every layer's intercepted calls and dtype policy (by path
    inside the model)."""
    def inside(path):
        return path.split("/", 1)[-1]

    weights = [(inside(v.path), v.dtype, v.numpy().copy()) for v in m.weights]
    states = {w.name: {n: v.numpy().copy() for n, v in w.state_variables().items()} for w in q.modules_wrapper}
    layers = {inside(getattr(lay, "path", lay.name)): (sorted(a for a in ("call", "quantized_call") if a in vars(lay)),
                                                      lay.dtype_policy.name)
              for lay in m._flatten_layers(include_self=False, recursive=True)}
    return weights, states, layers


def _same(a, b):
    (wa, sa, la), (wb, sb, lb) = a, b
    return (la == lb and len(wa) == len(wb)
            and all(x[0] == y[0] and x[1] == y[1] and np.array_equal(x[2], y[2]) for x, y in zip(wa, wb))
            and sa.keys() == sb.keys() and all(sa[k].keys() == sb[k].keys() for k in sa)
            and all(np.array_equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k]))


def test_ctrl_c_at_steps_of_a_float64_calibration():
    m = _lm()
    q = _quantizer(m)
    before = _state(m, q)
    fm = _lm()
    fq = _quantizer(fm)
    _calibrate(fq)
    finished = _state(fm, fq)
    n = count_lines(lambda: _calibrate(_quantizer(_lm())), CALIBRATE)
    outcomes = {"as before": 0, "finished": 0}
    for k in range(1, n + 1, 2):
        state = run_interrupted(lambda q=q: _calibrate(q), k, CALIBRATE)
        if not state["sent"]:
            continue
        assert state["raised"], f"Ctrl-C after line {k} of {n} was not raised"
        now = _state(m, q)
        if _same(now, before):
            outcomes["as before"] += 1
            continue
        assert _same(now, finished), f"Ctrl-C at line {k} of {n} left the model neither as before nor compressed"
        outcomes["finished"] += 1
        m = _lm()
        q = _quantizer(m)
        before = _state(m, q)
    assert outcomes["as before"] > 50, outcomes


def test_a_second_ctrl_c_during_the_rollback_waits_for_it(monkeypatch):
    m = _lm()
    q = _quantizer(m)
    before = _state(m, q)
    restore, write = KerasOneShotBackend.restore, KerasOneShotBackend.write
    restored = []

    def restore_with_ctrl_c(self, task, saved):
        if not restored:
            os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, in the middle of the rollback
        restore(self, task, saved)
        restored.append(task.name)

    def write_then_ctrl_c(self, task, result):
        write(self, task, result)
        if task.name == LAYERS[1]:
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C, after the last layer was written

    monkeypatch.setattr(KerasOneShotBackend, "restore", restore_with_ctrl_c)
    monkeypatch.setattr(KerasOneShotBackend, "write", write_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as info:
        _calibrate(q)
    assert restored == LAYERS[::-1]
    assert isinstance(info.value.__context__, KeyboardInterrupt)
    assert _same(_state(m, q), before)


def test_a_compressor_interrupted_while_it_wraps_the_model_leaves_every_layer_as_it_was(monkeypatch):
    """Ctrl-C at each change a Keras compressor's constructor makes to its layers (a layer's call intercepted, the
    wrapper put on the layer) takes every wrapper off again: no layer keeps an intercepted call or a wrapper
    attribute, and the model computes what it did; with nothing injected the layers are wrapped."""
    import compressor.tf.compressor as base
    from compressor.tf import LevelPruner

    m = _lm()
    ref = np.asarray(m(CALIB))
    layers = [m.embed, m.head] + [ly for b in m.decoder for ly in (b.ln, b.up, b.down)]
    cfg = [{"sparsity": 0.5, "op_types": ["Dense"]}]
    calls = [0]
    fail_at = [0]
    real_setattr = setattr

    def counting(obj, name, value):
        calls[0] += 1
        if calls[0] == fail_at[0]:
            raise KeyboardInterrupt
        real_setattr(obj, name, value)

    monkeypatch.setattr(base, "setattr", counting, raising=False)
    p = LevelPruner(m, cfg)
    total = calls[0]
    assert total == 5 and len(p.modules_wrapper) == 5  # head + 2 x (up, down): one wrapper attribute each
    p.strip()
    for k in range(1, total + 1):
        fail_at[0], calls[0] = k, 0
        with pytest.raises(KeyboardInterrupt):
            LevelPruner(m, cfg)
        assert not any("call" in vars(ly) for ly in layers), k  # no call left intercepted
        assert not any(isinstance(v, base.LayerWrapper) for ly in layers for v in vars(ly).values()), k
        np.testing.assert_array_equal(np.asarray(m(CALIB)), ref)


# ------------------------------------------------------------------------------------------------ compress()
def _convs():
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(inp)
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv2")(x)
    out = keras.layers.Dense(3, name="fc")(keras.layers.GlobalAveragePooling2D()(x))
    return keras.Model(inp, out)


def _wrapped_pruner():
    from compressor.tf import LevelPruner

    m = _convs()
    return m, LevelPruner(m, [{"sparsity": 0.5, "op_types": ["Conv2D", "Dense"]}])


def _pruner_state(m, p):
    weights = [(v.path.split("/", 1)[-1], v.numpy().copy()) for v in m.weights]
    masks = {w.name: {n: v.numpy().copy() for n, v in w.state_variables().items()} for w in p.modules_wrapper}
    return weights, masks


def _pruner_same(a, b):
    return (len(a[0]) == len(b[0]) and all(x[0] == y[0] and np.array_equal(x[1], y[1]) for x, y in zip(a[0], b[0]))
            and a[1].keys() == b[1].keys() and all(np.array_equal(a[1][k][n], b[1][k][n]) for k in a[1] for n in a[1][k]))


COMPRESS = {os.path.join(ROOT, p): None for p in ("tf/pruning/pruner.py", "tf/pruning/wrapper.py",
                                                   "tf/pruning/masker.py", "core/interrupts.py")}


def test_ctrl_c_at_steps_of_compress_takes_effect_once_it_has_finished():
    """Keras pruner compress() holds Ctrl-C back: sent at a line of it, the KeyboardInterrupt comes once every
    weight is masked as by an uninterrupted call (or, sent before the hold is in place, with nothing changed)."""
    m, p = _wrapped_pruner()
    p.compress()
    finished = _pruner_state(m, p)
    n = count_lines(lambda: _wrapped_pruner()[1].compress(), COMPRESS)
    assert n > 30
    outcomes = {"as before": 0, "finished": 0}
    for k in range(1, n + 1, max(1, n // 25)):
        m, p = _wrapped_pruner()
        before = _pruner_state(m, p)
        state = run_interrupted(p.compress, k, COMPRESS)
        if not state["sent"]:
            continue
        assert state["raised"], f"Ctrl-C after line {k} of {n} of compress was lost"
        now = _pruner_state(m, p)
        if _pruner_same(now, before):
            outcomes["as before"] += 1
        else:
            assert _pruner_same(now, finished), f"Ctrl-C after line {k} of {n}: half pruned"
            outcomes["finished"] += 1
    assert outcomes["as before"] <= 3 and outcomes["finished"] > 5, outcomes


def test_an_error_at_each_mask_of_compress_puts_every_mask_back(monkeypatch):
    """An exception at the k-th mask a Keras pruner's compress() sets leaves every weight and mask as before, for
    every k; compress() called again then prunes as an uninterrupted call."""
    from compressor.tf.pruning.wrapper import PrunerLayerWrapper

    m, p = _wrapped_pruner()
    p.compress()
    finished = _pruner_state(m, p)
    real = PrunerLayerWrapper.set_mask
    calls = [0, None]

    def failing(self, name, value):
        calls[0] += 1
        if calls[0] == calls[1]:
            raise RuntimeError("calc_mask failed")
        return real(self, name, value)

    monkeypatch.setattr(PrunerLayerWrapper, "set_mask", failing)
    m, p = _wrapped_pruner()
    p.compress()
    total = calls[0]
    assert total >= 3
    for k in range(1, total + 1):
        m, p = _wrapped_pruner()
        before = _pruner_state(m, p)
        calls[:] = [0, k]
        with pytest.raises(RuntimeError, match="calc_mask failed"):
            p.compress()
        assert _pruner_same(_pruner_state(m, p), before), f"an error at mask {k} of {total} changed the model"
        calls[:] = [0, None]
        p.compress()
        assert _pruner_same(_pruner_state(m, p), finished), f"compress() after an error at mask {k} did not prune"
