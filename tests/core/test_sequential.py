"""The sequential one-shot driver (core.oneshot.driver) on a numpy model: blocks are ``x -> relu(x W^T)``."""

from __future__ import annotations

import io

import numpy as np
import pytest

from compressor.core import oneshot as os1
from compressor.core.errors import ConfigError, ModelError
from compressor.core.oneshot import (
    AwqMethod,
    GptqMethod,
    LayerTask,
    OneShotBackend,
    RtnMethod,
    SparseGPTMethod,
    WandaMethod,
    quant_spec_of,
    run_sequential,
    search_subset,
)


class NumpyBackend(OneShotBackend):
    """Blocks ``relu(x @ W_i^T)`` then a head ``x @ H^T`` outside the blocks."""

    def __init__(self, weights, head, config):
        self.w = {f"b{i}": np.array(w, dtype=np.float64) for i, w in enumerate(weights)}
        self.w["head"] = np.array(head, dtype=np.float64)
        self.masks = {}
        self.config = config
        self.runs = []
        self.seen = {}

    def blocks(self):
        return [(n, n) for n in self.w if n != "head"]

    def block_layers(self, block):
        name = "head" if block is None else block
        return [LayerTask(name, self.config, self.w[name].shape[1], name)]

    def first_inputs(self, batches):
        return [np.array(b, dtype=np.float64) for b in batches]

    def _block(self, name, x, observe):
        if observe is not None and name in observe:
            observe[name](x)
            self.seen.setdefault(name, []).append(x.copy())
        y = x @ self.w[name].T
        return y if name == "head" else np.maximum(y, 0.0)

    def run_block(self, block, inputs, observe):
        self.runs.append((block, observe is not None))
        return [self._block(block, x, observe) for x in inputs]

    def run_model(self, batches, observe):
        self.runs.append(("model", True))
        for b in batches:
            x = np.array(b, dtype=np.float64)
            for n, _ in self.blocks():
                x = self._block(n, x, None)
            self._block("head", x, observe)

    def read_weight(self, task):
        return self.w[task.name].copy(), self.masks.get(task.name)

    def write(self, task, result):
        self.w[task.name] = result.weight
        if result.mask is not None:
            self.masks[task.name] = result.mask


RNG = np.random.default_rng(0)
W = [RNG.normal(size=(8, 8)), RNG.normal(size=(8, 8))]
HEAD = RNG.normal(size=(3, 8))
BATCHES = [RNG.normal(size=(4, 5, 8)) @ RNG.normal(size=(8, 8)) for _ in range(3)]


def test_each_block_calibrates_on_the_compressed_outputs_of_the_one_before():
    be = NumpyBackend(W, HEAD, {"sparsity": 0.5})
    rows = run_sequential(be, SparseGPTMethod(), BATCHES, progress=False)
    assert [r["layer"] for r in rows] == ["b0", "b1", "head"]
    assert all(r["sparsity"] == 0.5 for r in rows)
    # block 1 saw relu(x @ W0'^T) with W0' the PRUNED weight (what the compressed model computes)
    want = [np.maximum(x @ be.w["b0"].T, 0.0) for x in BATCHES]
    for got, ref in zip(be.seen["b1"], want):
        np.testing.assert_allclose(got, ref, rtol=0, atol=0)
    # and its weight is exactly what SparseGPT makes of the Gram matrix of those inputs
    acc = os1.GramAccumulator(8)
    for x in want:
        acc.add(x)
    ref = os1.sparsegpt_prune(W[1], acc.gram, 0.5)
    np.testing.assert_array_equal(be.w["b1"], ref.weight)
    # order: observe b0, run b0 compressed, observe b1, (the last block's outputs are not needed), model
    assert be.runs == [("b0", True), ("b0", False), ("b1", True), ("model", True)]


def test_a_backend_with_advance_gets_the_next_inputs_in_place_with_the_same_result():
    class InPlace(NumpyBackend):
        def advance(self, block, inputs):
            self.runs.append((block, "advance"))
            for i, x in enumerate(inputs):
                inputs[i] = self._block(block, x, None)
            return inputs

    plain, inplace = NumpyBackend(W, HEAD, {"sparsity": 0.5}), InPlace(W, HEAD, {"sparsity": 0.5})
    run_sequential(plain, SparseGPTMethod(), BATCHES, progress=False)
    run_sequential(inplace, SparseGPTMethod(), BATCHES, progress=False)
    assert inplace.runs == [("b0", True), ("b0", "advance"), ("b1", True), ("model", True)]
    for name in ("b0", "b1", "head"):
        np.testing.assert_array_equal(inplace.w[name], plain.w[name])


def test_wanda_uses_channel_norms_and_keeps_half_of_each_row():
    be = NumpyBackend(W, HEAD, {"sparsity": 0.5})
    run_sequential(be, WandaMethod(), BATCHES, progress=False)
    norms = np.sqrt(sum((x.reshape(-1, 8) ** 2).sum(0) for x in BATCHES))
    np.testing.assert_array_equal(be.masks["b0"], os1.wanda_mask(W[0], norms, 0.5))
    assert (be.masks["b0"].sum(axis=1) == 4).all()


def test_gptq_keeps_a_pruners_zeros_and_rtn_needs_no_data():
    be = NumpyBackend(W, HEAD, {"sparse_pattern": "2:4", "quant_bits": {"weight": 4}})
    run_sequential(be, SparseGPTMethod(), BATCHES, progress=False)
    zeros = {n: be.w[n] == 0 for n in be.w}
    rows = run_sequential(be, GptqMethod(), BATCHES, progress=False)
    for n in be.w:
        assert (be.w[n][zeros[n]] == 0).all()
    assert {r["bits"] for r in rows} == {4}
    be2 = NumpyBackend(W, HEAD, {"quant_bits": {"weight": 4}, "group_size": 4})
    run_sequential(be2, RtnMethod(), [], progress=False)
    assert be2.runs == []
    np.testing.assert_array_equal(be2.w["b0"], os1.rtn_quantize(W[0], os1.QuantSpec(4, group_size=4)).dequantized)


def test_awq_is_never_worse_than_rtn_on_the_layer_output():
    cfg = {"quant_bits": {"weight": 3}, "group_size": 4, "apply_clip": False}  # (the clipping search minimises each group alone)
    be = NumpyBackend(W, HEAD, cfg)
    run_sequential(be, AwqMethod(), BATCHES, progress=False)
    x = np.concatenate([b.reshape(-1, 8) for b in BATCHES])
    rtn = os1.rtn_quantize(W[0], quant_spec_of(cfg, "t")).dequantized
    assert os1.layer_output_error(x, W[0], be.w["b0"]) <= os1.layer_output_error(x, W[0], rtn)


def test_progress_lines_and_errors():
    out = io.StringIO()
    run_sequential(NumpyBackend(W, HEAD, {"sparsity": 0.25}), WandaMethod(), BATCHES, progress=out)
    lines = out.getvalue().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["[wanda] block 1/2 b0", "[wanda] block 2/2 b1",
                                                  "[wanda] outside the blocks"]
    with pytest.raises(ConfigError, match="calibration set is empty"):
        run_sequential(NumpyBackend(W, HEAD, {"sparsity": 0.5}), SparseGPTMethod(), [], progress=False)

    class Silent(NumpyBackend):
        def run_block(self, block, inputs, observe):
            return super().run_block(block, inputs, None)

    with pytest.raises(ModelError, match="layer 'b0' saw no input"):
        run_sequential(Silent(W, HEAD, {"sparsity": 0.5}), SparseGPTMethod(), BATCHES, progress=False)
    with pytest.raises(ConfigError, match="no weight bits"):
        quant_spec_of({"quant_bits": {}}, "GptqQuantizer")


# ------------------------------------------------------------------------------------------------ AWQ block search
class GluBackend(OneShotBackend):
    """One block ``x + (relu(x A^T) * (x B^T)) C^T`` (A and B read the same input, as gate / up)."""

    def __init__(self, config, fail_at=None):
        rng = np.random.default_rng(5)
        self.w = {"a": rng.normal(size=(12, 8)), "b": rng.normal(size=(12, 8)), "c": rng.normal(size=(8, 12)) / 3}
        self.config = config
        self.fail_at = fail_at
        self.outputs = 0

    def blocks(self):
        return [("blk", "blk")]

    def block_layers(self, block):
        if block is None:
            return []
        return [LayerTask(n, self.config, self.w[n].shape[1], n) for n in ("a", "b", "c")]

    def shared_inputs(self, block, inputs, tasks):
        return {"b": "a"}

    def first_inputs(self, batches):
        return [np.array(b, dtype=np.float64) for b in batches]

    def forward(self, x, observe=None):
        if observe and "a" in observe:
            observe["a"](x)
        g = np.maximum(x @ self.w["a"].T, 0.0) * (x @ self.w["b"].T)
        if observe and "c" in observe:
            observe["c"](g)
        return x + g @ self.w["c"].T

    def run_block(self, block, inputs, observe):
        return [self.forward(x, observe) for x in inputs]

    def block_output(self, block, inputs):
        self.outputs += 1
        if self.fail_at is not None and self.outputs >= self.fail_at:
            raise KeyboardInterrupt
        return [self.forward(x) for x in inputs]

    def set_weight(self, task, weight):
        self.w[task.name] = np.array(weight)

    def read_weight(self, task):
        return self.w[task.name].copy(), None

    def write(self, task, result):
        self.w[task.name] = result.weight

    def snapshot(self, task):
        return self.w[task.name].copy()

    def restore(self, task, saved):
        self.w[task.name] = saved


def test_awq_block_search_one_alpha_for_layers_sharing_an_input_by_the_block_output_error():
    cfg = {"quant_bits": {"weight": 3}, "group_size": 4, "apply_clip": False}  # the scale search alone
    be = GluBackend(cfg)
    w0 = {n: w.copy() for n, w in be.w.items()}
    rows = run_sequential(be, AwqMethod(), BATCHES, progress=False)
    assert [r["layer"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["alpha"] == rows[1]["alpha"] and rows[0]["group"] == rows[1]["group"] == "a"
    assert "group" not in rows[2]  # alone: searched on its own output error
    # the same alpha by hand: s from the shared input statistics and the stacked weights (duo scaling),
    # the loss = mean squared error of the block output (a and b quantized, c float) vs the float block
    spec = quant_spec_of(cfg, "t")
    x = np.concatenate([b.reshape(-1, 8) for b in BATCHES])
    acc = os1.GramAccumulator(8, gram=False)
    for b in BATCHES:
        acc.add(b)
    xm = acc.abs_mean()
    np.testing.assert_allclose(xm, np.abs(x).mean(axis=0), rtol=1e-12)
    wm = os1.awq_weight_mean(np.concatenate([w0["a"], w0["b"]]), 4)
    ref = GluBackend(cfg)
    want = [ref.forward(b) for b in BATCHES]
    losses = []
    cands = os1.awq_candidates()
    for alpha, duo in cands:
        s = os1.awq_scales(xm, alpha, wm if duo else None)
        ref.w["a"], ref.w["b"] = (os1.awq_quantize(w0[n], s, spec).effective for n in "ab")
        got = [ref.forward(b) for b in BATCHES]
        losses.append(sum(((g - r) ** 2).sum() for g, r in zip(got, want)) / sum(r.size for r in want))
    best = int(np.argmin(losses))
    assert (rows[0]["alpha"], rows[0]["duo"]) == cands[best]
    assert rows[0]["error"] == pytest.approx(losses[best], rel=1e-12)
    s = os1.awq_scales(xm, cands[best][0], wm if cands[best][1] else None)
    for n in "ab":
        np.testing.assert_array_equal(be.w[n], os1.awq_quantize(w0[n], s, spec).effective)
    assert be.outputs == 1 + 20  # the float reference + one run per alpha
    # 'layer': each layer alone (a and b may get different alphas), no block runs
    be2 = GluBackend({**cfg, "awq_search": "layer"})
    rows2 = run_sequential(be2, AwqMethod(), BATCHES, progress=False)
    assert be2.outputs == 0 and all("group" not in r for r in rows2)
    assert rows2[0]["alpha"] != rows2[1]["alpha"]  # (this data: the layers alone disagree)


class ParentGluBackend(GluBackend):
    """A block ``h = x + mlp(x / 2)``, ``out = h + tanh(h)``; ``mlp`` (the parent of a, b, c) is a sub-module:
    AWQ's loss for the a / b group is mlp's output on its recorded inputs, not the block's output."""

    def __init__(self, config):
        super().__init__(config)
        self.calls = {"record": 0, "module": 0}

    def mlp(self, y, observe=None):
        if observe and "a" in observe:
            observe["a"](y)
        g = np.maximum(y @ self.w["a"].T, 0.0) * (y @ self.w["b"].T)
        if observe and "c" in observe:
            observe["c"](g)
        return g @ self.w["c"].T

    def forward(self, x, observe=None, record=None):
        if record is not None:
            record.append(x / 2)
        h = x + self.mlp(x / 2, observe)
        return h + np.tanh(h)

    def awq_parent(self, block, tasks):
        assert [t.name for t in tasks] == ["a", "b"]
        return "mlp"

    def record_calls(self, block, inputs, modules):
        self.calls["record"] += 1
        got = []
        for x in inputs:
            self.forward(x, record=got)
        return [got for _ in modules]

    def module_output(self, module, calls):
        assert module == "mlp"
        self.calls["module"] += 1
        return [self.mlp(y).astype(np.float32) for y in calls]


def _mlp_losses(cfg, w0, ys, xm, wm, spec):
    """The reference parent-module loss per alpha: mlp's output with a / b quantized at that alpha's scales vs
    the float mlp, on the inputs ``ys``."""
    ref = ParentGluBackend(cfg)
    want = [ref.mlp(y).astype(np.float32) for y in ys]
    losses = []
    for alpha, duo in os1.awq_candidates():
        s = os1.awq_scales(xm, alpha, wm if duo else None)
        ref.w["a"], ref.w["b"] = (os1.awq_quantize(w0[n], s, spec).effective for n in "ab")
        got = [ref.mlp(y).astype(np.float32) for y in ys]
        losses.append(sum(((g.astype(np.float64) - r) ** 2).sum() for g, r in zip(got, want)) / sum(r.size for r in want))
    return losses


def test_awq_block_search_takes_the_loss_on_the_parent_module_output_run_once_per_alpha():
    cfg = {"quant_bits": {"weight": 3}, "group_size": 4, "apply_clip": False}  # the scale search alone
    be = ParentGluBackend(cfg)
    w0 = {n: w.copy() for n, w in be.w.items()}
    rows = run_sequential(be, AwqMethod(), BATCHES, progress=False)
    assert rows[0]["alpha"] == rows[1]["alpha"] and rows[0]["group"] == "a"
    # no block output run at all: one recording run of the block, the float mlp once, one mlp run per alpha
    assert be.outputs == 0 and be.calls == {"record": 1, "module": 1 + 20}
    spec = quant_spec_of(cfg, "t")
    ys = [b / 2 for b in BATCHES]
    acc = os1.GramAccumulator(8, gram=False)
    for y in ys:
        acc.add(y)
    xm = acc.abs_mean()  # the statistics of the parent's (and a / b's) input x / 2
    wm = os1.awq_weight_mean(np.concatenate([w0["a"], w0["b"]]), 4)
    losses = _mlp_losses(cfg, w0, ys, xm, wm, spec)
    best = int(np.argmin(losses))
    assert (rows[0]["alpha"], rows[0]["duo"]) == os1.awq_candidates()[best]
    assert rows[0]["error"] == pytest.approx(losses[best], rel=1e-12)
    alpha, duo = os1.awq_candidates()[best]
    s = os1.awq_scales(xm, alpha, wm if duo else None)
    for n in "ab":
        np.testing.assert_array_equal(be.w[n], os1.awq_quantize(w0[n], s, spec).effective)


def test_awq_a_layer_alone_is_computed_first_and_written_at_its_turn(monkeypatch):
    """c (searched alone, on its own statistics) is computed right after the observing pass: its Gram matrix is
    gone by the time the parent records its inputs, its weight stays float until its turn (the a / b search sees
    the float c), and it ends as c compressed from its observing-pass statistics; the rows keep the block's order."""
    import gc
    import weakref

    made = []
    init = os1.GramAccumulator.__init__

    def tracked(self, *a, **k):
        init(self, *a, **k)
        made.append(weakref.ref(self))
    monkeypatch.setattr(os1.GramAccumulator, "__init__", tracked)

    class Watch(ParentGluBackend):
        def record_calls(self, block, inputs, modules):
            gc.collect()
            self.alive = sorted(a().in_features for a in made if a() is not None)
            self.c_then = self.w["c"].copy()
            return super().record_calls(block, inputs, modules)

    cfg = {"quant_bits": {"weight": 3}, "group_size": 4}
    be = Watch(cfg)
    w0 = {n: w.copy() for n, w in be.w.items()}
    rows = run_sequential(be, AwqMethod(), BATCHES, progress=False)
    assert [r["layer"] for r in rows] == ["a", "b", "c"]
    assert be.alive == [8]  # a / b's shared accumulator only: c's (12 inputs) was dropped
    np.testing.assert_array_equal(be.c_then, w0["c"])
    ref = ParentGluBackend(cfg)
    acc = os1.GramAccumulator(12)
    for b in BATCHES:
        y = b / 2
        acc.add(np.maximum(y @ w0["a"].T, 0.0) * (y @ w0["b"].T))
    want = AwqMethod().compress(LayerTask("c", cfg, 12, "c"), w0["c"], None, acc)
    np.testing.assert_array_equal(be.w["c"], want.weight)
    assert rows[2]["alpha"] == want.info["alpha"] and ref.w["c"].shape == want.weight.shape


def test_search_subset_spreads_the_chosen_batches_evenly():
    items = list("abcdefghij")
    assert search_subset(items, None) == items
    assert search_subset(items, 10) == items and search_subset(items, 50) == items
    assert search_subset(items, 1) == ["a"]
    assert search_subset(items, 2) == ["a", "j"]
    assert search_subset(items, 4) == ["a", "d", "g", "j"]  # i * 9 / 3 = 0, 3, 6, 9
    assert search_subset(items, 5) == ["a", "c", "e", "h", "j"]  # i * 9 / 4 = 0, 2.25, 4.5 (-> 4), 6.75, 9


def test_awq_search_samples_scores_the_grid_on_those_batches_and_the_statistics_on_all():
    batches = [RNG.normal(size=(4, 5, 8)) @ RNG.normal(size=(8, 8)) for _ in range(5)]
    cfg = {"quant_bits": {"weight": 3}, "group_size": 4, "search_samples": 2}
    be = ParentGluBackend(cfg)
    w0 = {n: w.copy() for n, w in be.w.items()}
    rows = run_sequential(be, AwqMethod(), batches, progress=False)
    spec = quant_spec_of(cfg, "t")
    acc = os1.GramAccumulator(8, gram=False)
    for b in batches:  # statistics: every batch
        acc.add(b / 2)
    xm = acc.abs_mean()
    wm = os1.awq_weight_mean(np.concatenate([w0["a"], w0["b"]]), 4)
    ys = [batches[0] / 2, batches[4] / 2]  # the loss: the first and the last batch only
    losses = _mlp_losses(cfg, w0, ys, xm, wm, spec)
    best = int(np.argmin(losses))
    assert (rows[0]["alpha"], rows[0]["duo"]) == os1.awq_candidates()[best]
    assert rows[0]["error"] == pytest.approx(losses[best], rel=1e-12)
    assert be.calls == {"record": 1, "module": 1 + 20}


def test_a_run_that_fails_part_way_restores_every_layer():
    cfg = {"quant_bits": {"weight": 3}, "group_size": 4}
    be = GluBackend(cfg, fail_at=5)  # KeyboardInterrupt in the middle of the alpha search
    before = {n: w.copy() for n, w in be.w.items()}
    with pytest.raises(KeyboardInterrupt):
        run_sequential(be, AwqMethod(), BATCHES, progress=False)
    for n in before:
        np.testing.assert_array_equal(be.w[n], before[n])

    class LateFailure(NumpyBackend):  # block 2 fails after block 1 was compressed
        def run_block(self, block, inputs, observe):
            if block == "b1":
                raise RuntimeError("boom in b1")
            return super().run_block(block, inputs, observe)

        def snapshot(self, task):
            return self.w[task.name].copy(), self.masks.get(task.name)

        def restore(self, task, saved):
            self.w[task.name] = saved[0]
            if saved[1] is None:
                self.masks.pop(task.name, None)
            else:
                self.masks[task.name] = saved[1]

    be2 = LateFailure(W, HEAD, {"sparsity": 0.5})
    w_before = {n: w.copy() for n, w in be2.w.items()}
    with pytest.raises(RuntimeError, match="boom in b1"):
        run_sequential(be2, SparseGPTMethod(), BATCHES, progress=False)
    assert be2.masks == {}
    for n in w_before:
        np.testing.assert_array_equal(be2.w[n], w_before[n])


def test_quant_range_full_gives_the_signed_int4_grid():
    w = RNG.normal(size=(6, 16))
    full = quant_spec_of({"quant_bits": {"weight": 4}, "quant_range": "full"}, "t")
    narrow = quant_spec_of({"quant_bits": {"weight": 4}}, "t")
    assert (full.qrange, narrow.qrange) == ((-8, 7), (-7, 7))
    q = os1.rtn_quantize(w, full)
    assert q.codes.min() >= -8 and q.codes.max() <= 7 and (q.zero_point == 0).all()
    # compressed-tensors' symmetric int4: scale = max|w| / 7.5 per row, codes = clip(round(w / scale), -8, 7)
    scale = np.abs(w).max(axis=1, keepdims=True) / 7.5
    np.testing.assert_allclose(q.scale, scale, rtol=1e-15)
    np.testing.assert_array_equal(q.codes, np.clip(np.round(w / q.scale), -8, 7))
    assert (q.codes == -8).any()  # a row's negative extreme sits on -7.5 and rounds (half to even) to -8
    with pytest.raises(ConfigError, match="quant_range 'wide' is not one of"):
        quant_spec_of({"quant_bits": {"weight": 4}, "quant_range": "wide"}, "t")


def test_the_undo_copies_go_to_a_temporary_file_and_come_back_exactly():
    from compressor.core.oneshot.memory import Undo, _Spilled

    class ViewBackend:  # hands over views of its live arrays, as the torch adapter does
        def __init__(self):
            self.w = {"big": np.arange(40_000, dtype=np.float32).reshape(200, 200), "small": np.ones(3)}

        def snapshot(self, task):
            return {"weight": self.w[task.name], "meta": ("x", 1)}

        def restore(self, task, saved):
            self.w[task.name][...] = saved["weight"]
            assert saved["meta"] == ("x", 1)

    be = ViewBackend()
    undo = Undo(be)
    for n in ("big", "small"):
        undo.before(LayerTask(n, {}, 1, n))
    assert isinstance(undo.saved[0][1]["weight"], _Spilled)  # 160 kB: on disk, not in memory
    assert isinstance(undo.saved[1][1]["weight"], np.ndarray)  # tiny: an in-memory copy
    before = {n: w.copy() for n, w in be.w.items()}
    for w in be.w.values():
        w[...] = -7
    undo.rollback()
    for n in before:
        np.testing.assert_array_equal(be.w[n], before[n])
    assert undo.spill.file is None and undo.saved == []


def test_awq_group_search_scores_each_candidate_on_the_layers_effective_weights_computed_when_read():
    """AwqMethod.search_group hands block_loss a mapping of candidate weights: each read is Q(W s) / s of that
    layer for the candidate's scales (masked weights stay 0), computed then and not stored; the chosen alpha is
    the grid point of the smallest loss, and the results carry those scales."""
    rng = np.random.default_rng(7)
    cfg = {"quant_bits": {"weight": 4}, "group_size": 8}
    tasks = [LayerTask("q", cfg, 16), LayerTask("k", cfg, 16)]
    wq, wk = rng.standard_normal((6, 16)), rng.standard_normal((4, 16))
    mask = np.ones_like(wk, dtype=bool)
    mask[:, ::2] = False
    x = rng.standard_normal((50, 16)) * np.linspace(0.1, 3.0, 16)
    stats = os1.GramAccumulator(16)
    stats.add(x)
    spec = quant_spec_of(cfg, "AwqQuantizer")
    target = x @ np.concatenate([wq, np.where(mask, wk, 0.0)]).T
    seen = []

    def block_loss(cand):
        assert sorted(cand) == ["k", "q"]
        first, again = cand["q"], cand["q"]
        assert first is not again and np.array_equal(first, again)  # computed on each read
        seen.append((first, cand["k"]))
        return float(np.sum((x @ np.concatenate([first, cand["k"]]).T - target) ** 2))

    results = list(AwqMethod().search_group(tasks, [(wq.astype(np.float32), None), (wk, mask)], stats, block_loss))
    grid = os1.awq_candidates(os1.AWQ_N_GRID, True)
    w_mean = os1.awq_weight_mean(np.concatenate([wq.astype(np.float32).astype(np.float64), np.where(mask, wk, 0.0)]), 8)
    losses = []
    for (alpha, duo), (q, k) in zip(grid, seen, strict=True):
        s = os1.awq_scales(stats.abs_mean(), alpha, w_mean if duo else None)
        np.testing.assert_array_equal(q, os1.awq_quantize(wq.astype(np.float32), s, spec).effective)
        np.testing.assert_array_equal(k, np.where(mask, os1.awq_quantize(np.where(mask, wk, 0.0), s, spec).effective, 0.0))
        losses.append(float(np.sum((x @ np.concatenate([q, k]).T - target) ** 2)))
    best = int(np.argmin(losses))
    assert [r.info["alpha"] for r in results] == [grid[best][0]] * 2
    s_best = os1.awq_scales(stats.abs_mean(), *((grid[best][0], w_mean) if grid[best][1] else (grid[best][0], None)))
    for r in results:
        np.testing.assert_array_equal(r.scales, s_best)
    assert np.all(results[1].weight[~mask] == 0)


def test_observe_calls_stops_after_the_first_calls_last_layer_once_every_layer_has_fired():
    from compressor.core.oneshot import ObserveCalls

    def run(calls, order):
        calls.begin()
        for i, name in enumerate(order):
            if calls.fired(name):
                return i  # the hook would raise here
        return None

    c = ObserveCalls(["q", "o", "gate", "down"])
    assert run(c, ["q", "o", "gate", "down"]) is None  # the first call runs to the end
    assert run(c, ["q", "o", "gate", "down"]) == 3
    assert run(c, ["q", "o", "gate", "down"]) == 3
    # an order that changes: "down" first does not stop the call before the others fired
    assert run(c, ["down", "q", "o", "gate"]) is None
    # a layer called twice per block in the first call: never stops
    twice = ObserveCalls(["a", "b"])
    assert run(twice, ["a", "b", "a"]) is None
    assert run(twice, ["a", "b", "a"]) is None
    assert run(twice, ["a", "b"]) is None
    # a hooked layer the first call did not reach: never stops
    partial = ObserveCalls(["a", "b", "c"])
    assert run(partial, ["a", "b"]) is None
    assert run(partial, ["a", "b", "c"]) is None


@pytest.mark.parametrize("fail", [False, True])
def test_the_heap_is_trimmed_once_the_run_is_over_or_rolled_back(fail, monkeypatch):
    """What the last block freed (its activations, statistics, solver copies) goes back to the OS when the run
    ends, after the last layer is written (or put back, when the run fails)."""
    import compressor.core.oneshot.driver as seq

    b = NumpyBackend(W, HEAD, {"sparsity": 0.5})
    log = []
    monkeypatch.setattr(seq, "release_freed_heap", lambda: log.append("trim"))
    write = b.write

    def logged(task, result):
        log.append(task.name)
        if fail and task.name == "head":
            raise RuntimeError("head failed")
        write(task, result)
    b.write = logged
    if fail:
        with pytest.raises(RuntimeError, match="head failed"):
            run_sequential(b, SparseGPTMethod(), BATCHES, progress=False)
    else:
        run_sequential(b, SparseGPTMethod(), BATCHES, progress=False)
    assert log[-1] == "trim" and "head" in log and log.index("head") < len(log) - 1
