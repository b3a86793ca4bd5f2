"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU (gloo, 2 processes): what works and what does not.

* QAT_Quantizer: compress, then ``fully_shard``. Inside the forward FSDP gathers the whole weights, so
  weight ranges are those of the whole weight; activation ranges are reduced over the ranks. Every rank
  ends with the same state, equal to one process on the global batches.
* Pruners: refused with a clear error at the first optimizer step (the weights are sharded DTensors
  then; masks are full-size and the criteria need whole weights).
* A model already wrapped by FSDP cannot be compressed (the order is compress, then shard).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from compressor.core.errors import ModelError
from compressor.torch.distributed import compression_tensors, unsynchronized
from compressor.torch.pruning import LevelPruner
from compressor.torch.quantization import QAT_Quantizer

from ._dist import init, spawn

fsdp = pytest.importorskip("torch.distributed.fsdp")
fully_shard = getattr(fsdp, "fully_shard", None)
if fully_shard is None:
    pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) not available", allow_module_level=True)

CFG = [{"quant_types": ["input", "weight", "output"], "quant_bits": 8, "op_types": ["Linear"]}]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(4, 8, generator=g) for _ in range(3)]


def _qat_train(world: int = 1, rank: int = 0) -> tuple[QAT_Quantizer, dict[str, torch.Tensor]]:
    model = _net()
    q = QAT_Quantizer(model, CFG)
    q.compress()
    if world > 1:
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    q.hook_optimizer(opt)
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    for x in _batches():
        opt.zero_grad()
        model(x[rows]).pow(2).mean().backward()
        opt.step()
    return q, {k: v.detach().clone() for k, v in compression_tensors(q).items()}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    init(rank, world, port)
    try:
        q, state = _qat_train(world, rank)
        result = {"qat": state, "unsynchronized": unsynchronized(q)}
        model = _net()
        pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}])
        pruner.compress()
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pruner.hook_optimizer(opt)
        model(torch.ones(2, 8)).sum().backward()
        try:
            opt.step()
            result["prune_error"] = ""
        except ModelError as e:
            result["prune_error"] = str(e)
        try:
            LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}])
            result["refused"] = ""
        except ModelError as e:
            result["refused"] = str(e)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()



def test_fully_shard_qat_works_and_pruners_are_refused(tmp_path):
    spawn(_worker, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["unsynchronized"] == [] == r1["unsynchronized"]
    _, single = _qat_train()
    for name, t in single.items():
        for r in (r0, r1):
            if t.dtype == torch.bool:
                assert torch.equal(r["qat"][name], t), name
            else:
                torch.testing.assert_close(r["qat"][name], t, rtol=1e-5, atol=1e-7, msg=name)
    for r in (r0, r1):
        assert "sharded (FSDP / DTensor)" in r["prune_error"]
        assert "the model is wrapped in FSDP; compress the plain model first" in r["refused"]
