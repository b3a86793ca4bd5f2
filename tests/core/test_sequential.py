"""The sequential one-shot driver (core.sequential) on a numpy model: blocks are ``x -> relu(x W^T)``."""

from __future__ import annotations

import io

import numpy as np
import pytest

from compressor.core import oneshot as os1
from compressor.core.errors import ConfigError, ModelError
from compressor.core.sequential import (
    AwqMethod,
    GptqMethod,
    LayerTask,
    RtnMethod,
    SparseGPTMethod,
    WandaMethod,
    quant_spec_of,
    run_sequential,
)


class NumpyBackend:
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
    cfg = {"quant_bits": {"weight": 3}, "group_size": 4}
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
