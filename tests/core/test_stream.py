"""The streamed one-shot driver (core.oneshot.stream) on a numpy model whose blocks live "on disk": one block in
memory at a time, the same result as the in-memory driver, and a run killed at any step that resumes to the very
same result."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from compressor.core.errors import ConfigError, ModelError
from compressor.core.oneshot import GptqMethod, LayerTask, SparseGPTMethod, WandaMethod, run_sequential
from compressor.core.oneshot.stream import BlockIO, RunStore, run_streamed
from tests.core.test_sequential import BATCHES, HEAD, NumpyBackend, W

W4 = [np.random.default_rng(i).normal(size=(8, 8)) for i in range(4)]


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (not an Exception, so no handler in the code under test eats it)."""


class DiskBackend(NumpyBackend):
    """The numpy model with only the blocks selected (no head) and every block's weight on "disk" (``self.disk``):
    ``self.w`` holds a block only between load_block and release_block."""

    def __init__(self, weights, config, kill_at=None):
        super().__init__(weights, HEAD, config)
        self.w.pop("head")
        self.disk = {n: w.copy() for n, w in self.w.items()}
        self.w = {}
        self.steps = 0
        self.kill_at = kill_at
        self.peak = 0

    def blocks(self):
        return [(n, n) for n in self.disk]

    def block_layers(self, block):
        if block is None:
            return []
        return [LayerTask(block, self.config, self.disk[block].shape[1], block)]

    def step(self):
        self.steps += 1
        if self.kill_at is not None and self.steps == self.kill_at:
            raise Killed


class DiskIO(BlockIO):
    def __init__(self, be: DiskBackend):
        self.be = be

    def load_block(self, block):
        self.be.step()
        self.be.w[block] = self.be.disk[block].copy()
        self.be.peak = max(self.be.peak, len(self.be.w))

    def save_block(self, block, path):
        self.be.step()
        np.save(path + ".tmp.npy", self.be.w[block])
        os.replace(path + ".tmp.npy", path)

    def release_block(self, block):
        self.be.w.pop(block, None)

    def save_inputs(self, inputs, path):
        self.be.step()
        np.save(path + ".tmp.npy", np.stack(inputs))
        os.replace(path + ".tmp.npy", path)

    def load_inputs(self, path):
        return list(np.load(path))


def streamed(tmp_path, method, config, weights=W4, kill_at=None):
    be = DiskBackend(weights, config, kill_at)
    store = RunStore(tmp_path / "run", "key-1", len(weights))
    rows = run_streamed([(be, method)], DiskIO(be), BATCHES, store, progress=False)
    return be, store, rows


def finished(store: RunStore, n: int) -> list[np.ndarray]:
    return [np.load(store.block_path(i)) for i in range(n)]


@pytest.mark.parametrize("method, config", [(SparseGPTMethod(), {"sparsity": 0.5}),
                                            (GptqMethod(), {"quant_bits": {"weight": 4}}),
                                            (WandaMethod(), {"sparsity": 0.5})])
def test_streamed_run_equals_the_in_memory_run_one_block_in_memory(tmp_path, method, config):
    be, store, rows = streamed(tmp_path, method, config)
    ref = NumpyBackend(W4, HEAD, config)
    ref_rows = run_sequential(_BlocksOnly(ref), method, BATCHES, progress=False)
    for i, got in enumerate(finished(store, 4)):
        np.testing.assert_array_equal(got, ref.w[f"b{i}"])
    assert be.peak == 1 and be.w == {}  # one block in memory at a time, none left
    assert [r["layer"] for r in rows] == [r["layer"] for r in ref_rows] == ["b0", "b1", "b2", "b3"]
    assert json.load(open(store.folder + "/state.json")) == {"version": 1, "key": "key-1", "blocks": 4, "done": 4}
    assert sorted(os.listdir(store.folder)) == ["block-00000", "block-00001", "block-00002", "block-00003",
                                                "state.json"]  # every block's inputs removed once it is done


class _BlocksOnly(NumpyBackend):
    """The in-memory reference without the head."""

    def __init__(self, inner):
        self.__dict__ = inner.__dict__

    def block_layers(self, block):
        return [] if block is None else super().block_layers(block)


def test_a_run_killed_at_any_step_resumes_to_the_same_blocks(tmp_path):
    cfg = {"quant_bits": {"weight": 4}}
    _, store, _ = streamed(tmp_path / "ref", GptqMethod(), cfg)
    ref = finished(store, 4)
    be, _, _ = streamed(tmp_path / "count", GptqMethod(), cfg)
    total = be.steps  # load + save + save-inputs per block, the last block saves no inputs
    assert total == 4 * 3 - 1
    for kill in range(1, total + 1):
        with pytest.raises(Killed):
            streamed(tmp_path / f"k{kill}", GptqMethod(), cfg, kill_at=kill)
        state = RunStore(tmp_path / f"k{kill}" / "run", "key-1", 4)
        assert state.done == (kill - 1) // 3  # a block counts as done only once its state and next inputs are on disk
        _, store2, rows = streamed(tmp_path / f"k{kill}", GptqMethod(), cfg)
        assert [r["layer"] for r in rows] == [f"b{i}" for i in range(state.done, 4)]  # finished blocks not redone
        for a, b in zip(finished(store2, 4), ref):
            np.testing.assert_array_equal(a, b)


def test_another_runs_state_is_refused_and_bad_models_are_errors(tmp_path):
    streamed(tmp_path, SparseGPTMethod(), {"sparsity": 0.5})
    with pytest.raises(ModelError, match="holds the progress of another run"):
        RunStore(tmp_path / "run", "key-2", 4)
    with pytest.raises(ModelError, match="holds the progress of another run"):
        RunStore(tmp_path / "run", "key-1", 5)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "state.json").write_text("{not json")
    with pytest.raises(ModelError, match="not the state of a compressor run"):
        RunStore(tmp_path / "bad", "key-1", 4)
    be = NumpyBackend(W, HEAD, {"sparsity": 0.5})  # the head is selected and outside every block
    with pytest.raises(ConfigError, match=r"layers outside the decoder blocks are selected \(\['head'\]\)"):
        run_streamed([(be, SparseGPTMethod())], DiskIO(DiskBackend(W, {})), BATCHES, RunStore(tmp_path / "r2", "k", 2),
                     progress=False)
    with pytest.raises(ConfigError, match="calibration set is empty"):
        run_streamed([(DiskBackend(W, {"sparsity": 0.5}), SparseGPTMethod())], DiskIO(DiskBackend(W, {})), [],
                     RunStore(tmp_path / "r3", "k", 2), progress=False)


def test_two_stages_compress_each_block_in_turn_before_it_feeds_the_next(tmp_path):
    """SparseGPT then GPTQ on the same block: the quantizer sees the pruned weights (and keeps their zeros)."""
    be = DiskBackend(W4, {"sparsity": 0.5})
    q = _SameModel(be, {"quant_bits": {"weight": 4}})
    store = RunStore(tmp_path / "run", "k", 4)
    rows = run_streamed([(be, SparseGPTMethod()), (q, GptqMethod())], DiskIO(be), BATCHES, store, progress=False)
    assert [(r["layer"], r["method"]) for r in rows] == [(f"b{i}", m) for i in range(4) for m in ("sparsegpt", "gptq")]
    for w in finished(store, 4):
        assert np.count_nonzero(w == 0) >= 32  # half of the 64 weights pruned, still zero after quantization


class _SameModel(DiskBackend):
    """A second stage's view of the first stage's model (same weights, its own config)."""

    def __init__(self, inner, config):
        self.__dict__ = dict(inner.__dict__)
        self.inner, self.config = inner, config

    def read_weight(self, task):
        return self.inner.w[task.name].copy(), self.inner.masks.get(task.name)

    def write(self, task, result):
        self.inner.write(task, result)

    def run_block(self, block, inputs, observe):
        return self.inner.run_block(block, inputs, observe)
