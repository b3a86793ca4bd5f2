"""Data-driven pruners under torch.distributed: ranks that saw different batches choose the same filters."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from compressor.torch.pruning import ActivationMeanRankFilterPruner, TaylorFOWeightFilterPruner

from ._dist import init, spawn

ALGOS = {"taylor": TaylorFOWeightFilterPruner, "mean": ActivationMeanRankFilterPruner}



def _worker(rank: int, world: int, port: int, out: dict) -> None:
    init(rank, world, port)
    try:
        for name, cls in ALGOS.items():
            model = nn.Sequential(nn.Linear(4, 6))
            with torch.no_grad():  # rows e0, e1, e2+e0, e3+e1, e2, e3
                model[0].weight.copy_(torch.eye(6, 4) + torch.eye(6, 4).roll(2, 0))
                model[0].bias.zero_()
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            pruner = cls(model, [{"sparsity": 0.5, "op_types": ["Linear"]}], opt, statistics_batch_num=1)
            pruner.compress()
            x = torch.zeros(1, 4)
            x[0, rank] = 10.0  # rank 0 excites channels 0 and 2, rank 1 channels 1 and 3
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            out[(name, rank)] = model[0].weight_mask.all(1).tolist()
    finally:
        dist.destroy_process_group()


def test_statistics_are_summed_over_ranks():
    with mp.Manager() as manager:
        out = manager.dict()
        spawn(_worker, out)
        masks = dict(out)
    # Alone, rank 0 would keep {0, 2, 5} and rank 1 {1, 3, 5}. Summed, channels 0-3 tie and 4, 5 are 0:
    # prune 4, 5 and (lowest index first) 0.
    for name in ALGOS:
        assert masks[(name, 0)] == masks[(name, 1)] == [False, True, True, True, False, False], name
