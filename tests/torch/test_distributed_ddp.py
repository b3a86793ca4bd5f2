"""DistributedDataParallel on CPU (gloo, 2 processes): compress, then wrap in DDP.

Every rank must end with bit-identical masks and quantization state, and with the state one process
reaches on the same GLOBAL batches: DDP averages the ranks' gradients, so rank r training on rows
[4r, 4r + 4) of each 8-row batch with a mean loss takes the same steps as one process on all 8 rows
(up to float summation order). Data statistics (activation counts, Taylor contributions, QAT ranges, LSQ's
first step sizes) are reduced over the ranks before masks and scales are derived from them, so they are
the global batch's. Each rank starts from a DIFFERENT random initialisation: DDP broadcasts rank 0's
weights and the compressors' buffers when it wraps the model, which is why compressing comes first.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from compressor.core.errors import ModelError
from compressor.torch.distributed import compression_tensors, sync_compressor, unsynchronized
from compressor.torch.pruning import (
    ActivationAPoZRankFilterPruner,
    AGPPruner,
    LevelPruner,
    LotteryTicketPruner,
    TaylorFOWeightFilterPruner,
)
from compressor.torch.quantization import LsqQuantizer, QAT_Quantizer

from ._dist import init, spawn

WORLD = 2
GLOBAL_BATCH = 8
EPOCHS, STEPS = 3, 2
ALGOS = ("agp", "taylorfo", "apoz", "qat", "lsq")
CONV = ["Conv2d"]
# torch >= 2.13 renamed broadcast_buffers (both still sync buffers once, when DDP wraps the model)
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(96, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(GLOBAL_BATCH, 1, 8, 8, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g))
            for _ in range(EPOCHS * STEPS)]


def _compressor(algo: str, model: nn.Module, opt: torch.optim.Optimizer):
    if algo == "agp":
        cfg = [{"initial_sparsity": 0.0, "final_sparsity": 0.6, "start_epoch": 0, "end_epoch": 3, "frequency": 1,
                "op_types": ["Conv2d", "Linear"]}]
        return AGPPruner(model, cfg, opt, pruning_algorithm="level")
    if algo == "taylorfo":
        return TaylorFOWeightFilterPruner(model, [{"sparsity": 0.5, "op_types": CONV}], opt, statistics_batch_num=2)
    if algo == "apoz":
        return ActivationAPoZRankFilterPruner(model, [{"sparsity": 0.5, "op_types": CONV}], opt, statistics_batch_num=2)
    cfg = [{"quant_types": ["input", "weight", "output"], "quant_bits": 8, "op_types": ["Conv2d", "Linear"]}]
    if algo == "qat":
        return QAT_Quantizer(model, cfg, opt)
    return LsqQuantizer(model, cfg, opt)


def train(algo: str, seed: int, rank: int = 0, world: int = 1, epochs: range = range(EPOCHS),
          resume: dict | None = None, **ddp_kwargs) -> tuple[nn.Module, object, torch.optim.Optimizer]:
    """Compress, wrap in DDP when distributed, train ``epochs`` (rank ``rank`` on its slice of each batch)."""
    model = _net(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    comp = _compressor(algo, model, opt)
    if resume is not None:  # a checkpoint rank 0 saved: wrapped model, optimizer, schedule position
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        comp.load_state_dict(resume["compressor"])
    comp.compress()
    net = DDP(model, **ddp_kwargs) if world > 1 else model
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    data = _batches()
    for epoch in epochs:
        comp.update_epoch(epoch)
        for step in range(STEPS):
            x, y = data[epoch * STEPS + step]
            opt.zero_grad()
            F.mse_loss(net(x[rows]), y[rows]).backward()
            opt.step()
    return model, comp, opt


def _state(comp) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in compression_tensors(comp).items()}



def _spawn(worker, out: Path) -> None:
    spawn(worker, str(out), nprocs=WORLD)


# ---------------------------------------------------------------------------------------------- training
def _train_worker(rank: int, world: int, port: int, out: str) -> None:
    init(rank, world, port)
    try:
        # DDP must come after compressing: a compressor refuses a DDP-wrapped model
        try:
            LevelPruner(DDP(_net(0)), [{"sparsity": 0.5, "op_types": CONV}])
            refused = ""
        except ModelError as e:
            refused = str(e)
        results = {"refused": refused}
        # masks chosen per rank from different weights (no DDP), then rank 0's copied to all
        model = _net(rank)
        pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": CONV}])
        pruner.compress()
        before = unsynchronized(pruner)
        sync_compressor(pruner)
        # lottery ticket: every rank rewinds to rank 0's initial weights (DDP copied them after the pruner's copy)
        model = _net(rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        lottery = LotteryTicketPruner(model, [{"sparsity": 0.5, "prune_iterations": 1, "op_types": CONV}], opt)
        lottery.compress()
        net = DDP(model, **NO_FORWARD_BUFFER_SYNC)
        x, y = _batches()[0]
        rows = slice(rank * 4, rank * 4 + 4)
        for _ in lottery.get_prune_iterations():
            lottery.prune_iteration_start()
            rewound = {k: v.detach().clone() for k, v in model.state_dict().items()}
            opt.zero_grad()
            F.mse_loss(net(x[rows]), y[rows]).backward()
            opt.step()
        results["lottery"] = {"after_last_round_start": rewound, "unsynchronized": unsynchronized(lottery)}
        results["sync"] = {"before": before, "after": unsynchronized(pruner), "state": _state(pruner),
                           "weight_zero_where_pruned": bool((model[0].weight[~model[0].weight_mask] == 0).all())}
        for algo in ALGOS:
            # rank r starts from seed r. Without forward buffer sync DDP does not copy rank 0's buffers (masks,
            # ranges) over the others' at every forward, so the ranks agree by the compressors' own doing
            _, comp, _ = train(algo, seed=rank, rank=rank, world=world, **NO_FORWARD_BUFFER_SYNC)
            results[algo] = {"state": _state(comp), "unsynchronized": unsynchronized(comp)}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    _spawn(_train_worker, out)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_compressing_a_ddp_model_is_refused_with_the_order_to_use(ddp_results):
    assert "compress the plain model first, then wrap it" in ddp_results[0]["refused"]


def test_lottery_ticket_rewinds_every_rank_to_rank0_initial_weights(ddp_results):
    r0, r1 = (r["lottery"] for r in ddp_results)
    assert r0["unsynchronized"] == [] == r1["unsynchronized"]
    for name, t in r0["after_last_round_start"].items():
        assert torch.equal(r1["after_last_round_start"][name], t), name
    initial = _net(0).state_dict()  # rank 0's initialisation, masked
    torch.testing.assert_close(r0["after_last_round_start"]["0.module.weight"],
                               initial["0.weight"] * r0["after_last_round_start"]["0.weight_mask"], rtol=0, atol=0)


def test_sync_compressor_copies_rank0_masks(ddp_results):
    r0, r1 = (r["sync"] for r in ddp_results)
    assert r0["before"] == r1["before"] == ["0.weight_mask", "2.weight_mask"]  # different seeds, different masks
    assert r0["after"] == r1["after"] == []
    for name, t in r0["state"].items():
        assert torch.equal(r1["state"][name], t), name
    assert r0["weight_zero_where_pruned"] and r1["weight_zero_where_pruned"]  # re-masked with rank 0's masks
    own = LevelPruner(_net(0), [{"sparsity": 0.5, "op_types": CONV}])  # rank 0's masks, computed here
    own.compress()
    assert torch.equal(own.bound_model[0].weight_mask, r1["state"]["0.weight_mask"])


@pytest.mark.parametrize("algo", ALGOS)
def test_ranks_hold_bit_identical_state(ddp_results, algo):
    r0, r1 = (r[algo] for r in ddp_results)
    assert r0["unsynchronized"] == [] and r1["unsynchronized"] == []
    assert r0["state"].keys() == r1["state"].keys()
    for name, t in r0["state"].items():
        other = r1["state"][name]
        assert t.dtype == other.dtype and torch.equal(t.view(-1).view(torch.uint8), other.view(-1).view(torch.uint8)), name


@pytest.mark.parametrize("algo", ALGOS)
def test_ddp_equals_one_process_on_the_global_batches(ddp_results, algo):
    _, comp, _ = train(algo, seed=0)  # one process, all 8 rows, rank 0's initialisation
    single = _state(comp)
    ddp = ddp_results[0][algo]["state"]
    assert single.keys() == ddp.keys()
    for name, t in single.items():
        if t.dtype == torch.bool:  # masks and flags: exactly equal
            assert torch.equal(t, ddp[name]), name
        else:  # scales, ranges: equal up to the order in which DDP sums the gradients
            torch.testing.assert_close(ddp[name], t, rtol=1e-5, atol=1e-7, msg=name)
    masks = {k: v for k, v in single.items() if k.endswith("weight_mask")}
    if algo == "agp":  # the schedule reached its final sparsity: floor(n * 0.6) weights pruned per layer
        assert {k: int((~v).sum()) for k, v in masks.items()} == {
            "0.weight_mask": 21, "2.weight_mask": 129, "5.weight_mask": 172}
    elif algo in ("taylorfo", "apoz"):  # floor(F * 0.5) whole filters
        assert [int((~v.flatten(1).all(1)).sum()) for v in masks.values()] == [2, 3]


# ---------------------------------------------------------------------------------------------- resume
def _resume_worker(rank: int, world: int, port: int, out: str) -> None:
    init(rank, world, port)
    path = Path(out) / "checkpoint.pt"
    try:
        # DDP's defaults here (broadcast_buffers=True)
        _, full, _ = train("agp", seed=rank, rank=rank, world=world)  # uninterrupted epochs 0..2
        model, comp, opt = train("agp", seed=rank, rank=rank, world=world, epochs=range(2))
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "compressor": comp.state_dict()}, path)
        dist.barrier()
        ckpt = torch.load(path)
        # resume on both ranks from a fresh, differently seeded model
        _, resumed, _ = train("agp", seed=10 + rank, rank=rank, world=world, epochs=range(2, EPOCHS), resume=ckpt)
        torch.save({"full": _state(full), "resumed": _state(resumed), "saved": {k: v for k, v in ckpt["model"].items()
                                                                                 if k.endswith("_mask")},
                    "position": (full.state_dict(), resumed.state_dict(), ckpt["compressor"]),
                    "unsynchronized": unsynchronized(resumed)}, Path(out) / f"resume{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_checkpoint_on_rank0_resumes_on_two_ranks(tmp_path):
    _spawn(_resume_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"resume{r}.pt") for r in range(WORLD))
    assert r0["unsynchronized"] == [] == r1["unsynchronized"]
    full_pos, resumed_pos, saved_pos = r0["position"]
    assert saved_pos == {"epoch": 1, "scheduled_epoch": 1, "pending": []}  # saved mid-schedule
    assert resumed_pos == full_pos == {"epoch": 2, "scheduled_epoch": 2, "pending": []}
    assert r1["position"][:2] == r0["position"][:2]
    # the checkpoint held epoch 1's masks: AGP sparsity 0.6 - 0.6 * (1 - 1/2)^3 = 0.525, floor(216 * 0.525)
    assert int((~r0["saved"]["2.weight_mask"]).sum()) == 113
    for r in (r0, r1):
        for name, t in r["full"].items():
            assert torch.equal(r["resumed"][name], t), name  # same final masks as without the interruption
