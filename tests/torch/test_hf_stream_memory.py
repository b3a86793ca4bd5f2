"""What a streamed run (compressor.torch.oneshot) keeps out of memory while the blocks run: the embeddings and head
(read only for block 0's inputs and for writing), the calibration activations (read back a batch at a time from
the run folder), the large Gram matrices of the layers not being solved (in the run folder meanwhile)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("accelerate")

from compressor.core.oneshot import memory, steps  # noqa: E402
from compressor.core.oneshot.stream import RecordedInputs  # noqa: E402
from compressor.torch.hf_oneshot import oneshot  # noqa: E402
from compressor.torch.sequential.backend import TorchOneShotBackend  # noqa: E402

from .test_hf_oneshot import GPTQ, llama, tensors_of, tokens  # noqa: E402

pytestmark = pytest.mark.torch


def test_embeddings_and_head_are_not_in_memory_while_blocks_run_and_inputs_come_a_batch_at_a_time(tmp_path,
                                                                                                 monkeypatch):
    src = llama(tmp_path, layers=3)
    path, _ = tokens(tmp_path)
    seen = []
    run_block = TorchOneShotBackend.run_block

    def spy(self, block, inputs, observe):
        model = self.model
        seen.append((model.get_input_embeddings().weight.device.type, model.get_output_embeddings().weight.device.type,
                     model.model.norm.weight.device.type, type(inputs)))
        return run_block(self, block, inputs, observe)
    monkeypatch.setattr(TorchOneShotBackend, "run_block", spy)
    # every Gram matrix "large": each waits in the run folder until its layer's turn (bytes out, same bytes back)
    monkeypatch.setattr(memory, "SPILL_BYTES", 1)
    spilled = []
    put = memory.GramSpill.put

    def put_spy(self, acc):
        put(self, acc)
        spilled.append(acc.gram is None)
    monkeypatch.setattr(memory.GramSpill, "put", put_spy)
    oneshot(src, tmp_path / "out", GPTQ, str(path), num_samples=8, seq_len=32, batch_size=4, progress=False)
    assert len(seen) == 3
    assert all(s[:3] == ("meta", "meta", "meta") and s[3] is RecordedInputs for s in seen)
    assert spilled and all(spilled)
    monkeypatch.setattr(memory, "SPILL_BYTES", 1 << 60)  # nothing spilled: the same checkpoint
    oneshot(src, tmp_path / "ref", GPTQ, str(path), num_samples=8, seq_len=32, batch_size=4, progress=False)
    got, ref = tensors_of(tmp_path / "out"), tensors_of(tmp_path / "ref")
    assert sorted(got) == sorted(ref) and "lm_head.weight" in got
    for k in ref:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(ref[k]), err_msg=k)


def test_layers_are_split_over_processes_by_solving_cost():
    from compressor.core.oneshot.collective import assign_layers, owner_of
    from compressor.core.oneshot.protocol import LayerTask

    tasks = [LayerTask(n, {}, w) for n, w in [("q", 2048), ("k", 2048), ("v", 2048), ("o", 2048), ("gate", 2048),
                                              ("up", 2048), ("down", 5632)]]
    owner = assign_layers([steps.solve_cost(t) for t in tasks], 2)
    assert owner == [1, 1, 1, 1, 1, 1, 0]  # the down projection alone
    assert assign_layers([1.0] * 5, 2) == [owner_of(i, 2) for i in range(5)]  # equal costs: i mod N
    assert assign_layers([3.0, 1.0, 1.0, 1.0], 3) == [0, 1, 2, 1]
