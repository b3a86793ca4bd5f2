"""Every torch pruner on hand-built weights with exact expected masks, plus a small end-to-end run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError
from compressor.torch.pruning import (
    ActivationAPoZRankFilterPruner,
    ActivationMeanRankFilterPruner,
    AGPPruner,
    FPGMPruner,
    L1FilterPruner,
    L2FilterPruner,
    LevelPruner,
    LotteryTicketPruner,
    SensitivityPruner,
    SlimPruner,
    TaylorFOWeightFilterPruner,
)

from ._cuda import batch_and_step, no_host_sync


def filter_model(values, bias=True):
    """Conv2d(2 -> len(values), 3x3) whose filter i is ``ones * values[i]``; then a Linear head."""
    conv = nn.Conv2d(2, len(values), 3, bias=bias)
    with torch.no_grad():
        for i, v in enumerate(values):
            conv.weight[i].fill_(float(v))
        if bias:
            conv.bias.fill_(1.0)
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(len(values), 2))


def kept_filters(wrapper):
    return wrapper.weight_mask.flatten(1).all(1).nonzero().flatten().tolist()


CONV = [{"sparsity": 0.2, "op_types": ["Conv2d"]}]


def test_fpgm_prunes_the_two_middle_filters_and_their_bias():
    model = filter_model(range(1, 11))
    pruner = FPGMPruner(model, CONV)
    pruner.compress()
    w = model[0]
    assert kept_filters(w) == [0, 1, 2, 3, 6, 7, 8, 9]
    assert w.bias_mask.tolist() == [i not in (4, 5) for i in range(10)]
    assert (w.module.weight[4:6] == 0).all() and (w.module.bias[4:6] == 0).all()
    # a whole filter is either kept or pruned
    assert w.weight_mask.flatten(1).any(1).tolist() == w.weight_mask.flatten(1).all(1).tolist()


@pytest.mark.parametrize("cls", [L1FilterPruner, L2FilterPruner])
def test_l1_l2_at_0_6_keep_the_four_largest(cls):
    model = filter_model([3, 0, 9, 1, 7, 2, 8, 4, 6, 5])
    cls(model, [{"sparsity": 0.6, "op_types": ["Conv2d"]}]).compress()
    assert kept_filters(model[0]) == [2, 4, 6, 8]  # values 9, 7, 8, 6
    assert model[0].bias_mask.tolist() == [i in (2, 4, 6, 8) for i in range(10)]


def test_filter_pruner_ties_pruned_by_index_and_small_layers_untouched():
    model = filter_model([1, 1, 1, 1])
    L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d"]}]).compress()
    assert kept_filters(model[0]) == [2, 3]
    single = filter_model([5])
    L1FilterPruner(single, [{"sparsity": 0.9, "op_types": ["Conv2d"]}]).compress()
    assert kept_filters(single[0]) == [0]  # F < 2: nothing pruned


def test_filter_pruners_refuse_transposed_conv_and_leave_model_untouched():
    model = nn.Sequential(nn.ConvTranspose2d(2, 4, 3))
    before = repr(model)
    with pytest.raises(ConfigError, match="not supported"):
        FPGMPruner(model, [{"sparsity": 0.5, "op_types": ["ConvTranspose2d"]}])
    assert repr(model) == before


def test_slim_global_threshold_over_two_bn_layers():
    model = nn.Sequential(nn.Conv2d(1, 5, 1), nn.BatchNorm2d(5), nn.Conv2d(5, 5, 1), nn.BatchNorm2d(5))
    with torch.no_grad():
        model[1].weight.copy_(torch.arange(5.0))
        model[3].weight.copy_(-torch.arange(5.0))
        model[1].bias.fill_(0.5)
        model[3].bias.fill_(0.5)
    pruner = SlimPruner(model, [{"sparsity": 0.2, "op_types": ["BatchNorm2d"]}])
    pruner.compress()
    for bn in (model[1], model[3]):
        assert bn.weight_mask.tolist() == [False, True, True, True, True]
        assert bn.bias_mask.tolist() == [False, True, True, True, True]
        assert bn.module.bias[0] == 0  # beta masked with gamma
    penalty = pruner.l1_penalty(0.5)
    assert penalty.item() == pytest.approx(0.5 * 2 * (1 + 2 + 3 + 4))
    penalty.backward()
    assert model[1].module.weight.grad is not None


def test_slim_refuses_conflicting_sparsities():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    with pytest.raises(ConfigError, match="one sparsity"):
        SlimPruner(model, [{"sparsity": 0.2, "op_names": ["0"]}, {"sparsity": 0.5, "op_names": ["1"]}])


def test_level_exact_count_and_tie_break():
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    LevelPruner(model, [{"sparsity": 5 / 16, "op_types": ["Linear"]}]).compress()
    assert (~model[0].weight_mask).flatten().nonzero().flatten().tolist() == [0, 1, 2, 3, 4]


def test_last_matching_entry_wins_for_filter_pruners():
    model = filter_model(range(1, 11))
    pruner = L1FilterPruner(model, [{"sparsity": 0.8, "op_types": ["Conv2d"]},
                                    {"sparsity": 0.2, "op_names": ["0"]}])
    pruner.compress()
    assert kept_filters(model[0]) == list(range(2, 10))


def test_sensitivity_threshold_is_q_times_std_and_iterates():
    model = nn.Sequential(nn.Linear(7, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0]]))
    pruner = SensitivityPruner(model, [{"sensitivity": 0.9, "op_types": ["Linear"]}], iterations=2,
                               epochs_per_iteration=1)
    pruner.compress()  # std = 2, threshold 1.8
    assert model[0].weight_mask.tolist() == [[True, True, False, False, False, True, True]]
    pruner.update_epoch(1)  # kept {-3,-2,2,3}: std = sqrt(6.5), threshold 2.29
    assert model[0].weight_mask.tolist() == [[True, False, False, False, False, False, True]]
    pruner.update_epoch(2)  # only two iterations
    assert pruner.iteration == 2 and int(model[0].weight_mask.sum()) == 2


def test_sensitivity_refuses_sparsity_key():
    with pytest.raises(ConfigError, match="sensitivity"):
        SensitivityPruner(nn.Sequential(nn.Linear(2, 2)), [{"sparsity": 0.5, "op_types": ["Linear"]}])


def _activation_model():
    """Conv 1x1 with output channel c = w_c * x + b_c."""
    conv = nn.Conv2d(1, 4, 1)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([1.0, 0.1, 1.0, 1.0]).view(4, 1, 1, 1))
        conv.bias.copy_(torch.tensor([-0.5, 0.1, -2.0, 2.0]))
    return nn.Sequential(conv)


ACT_X = torch.tensor([[0.0, 0.25], [0.75, 1.0]]).view(1, 1, 2, 2)


@pytest.mark.parametrize("cls, pruned", [
    (ActivationAPoZRankFilterPruner, [0, 2]),  # importance 0.5, 1, 0, 1
    (ActivationMeanRankFilterPruner, [1, 2]),  # mean relu .1875, .15, 0, 2.5
])
def test_activation_rank_pruners(cls, pruned):
    model = _activation_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pruner = cls(model, [{"sparsity": 0.5, "op_types": ["Conv2d"]}], opt, statistics_batch_num=2)
    pruner.compress()
    for step in range(3):
        opt.zero_grad()
        model(ACT_X).sum().backward()
        opt.step()
        if step == 0:
            assert model[0].weight_mask.all()  # one batch is not enough
    assert [i for i in range(4) if i not in kept_filters(model[0])] == pruned
    assert not model[0]._forward_hooks  # collection stopped, no per-forward cost left
    with pytest.raises(ConfigError, match="activation"):
        cls(_activation_model(), [{"sparsity": 0.5, "op_types": ["Conv2d"]}], activation="tanh")


def test_taylor_fo_contributions_after_the_step():
    model = nn.Sequential(nn.Linear(2, 4, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]]))
    coeff = torch.tensor([4.0, 0.1, 1.0, 1.0])  # grad of row o = coeff_o * x; contributions 32, .08, 18, 32
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pruner = TaylorFOWeightFilterPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}], opt,
                                        statistics_batch_num=2)
    pruner.compress()
    for step in range(2):
        opt.zero_grad()
        (model(torch.ones(1, 2)) * coeff).sum().backward()
        opt.step()
        if step == 0:
            assert model[0].weight_mask.all()
    assert kept_filters(model[0]) == [0, 3]


def _agp_run(pruning_algorithm, model, config, epochs, data=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pruner = AGPPruner(model, config, opt, pruning_algorithm=pruning_algorithm)
    pruner.compress()
    x = torch.randn(4, *data, generator=torch.Generator().manual_seed(0)) if data else None
    history = []
    for epoch in range(epochs):
        pruner.update_epoch(epoch)
        for _ in range(2):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
            history.append([w.weight_mask.clone() for w in pruner.get_modules_wrapper()])
    return pruner, history


def test_agp_masks_change_only_on_schedule_epochs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10))
    config = [{"initial_sparsity": 0.0, "final_sparsity": 0.8, "start_epoch": 0, "end_epoch": 10,
               "frequency": 3, "op_types": ["Linear"]}]
    pruner, history = _agp_run("level", model, config, 12, data=(10,))
    pruned = [int((~h[0]).sum()) for h in history]
    # two steps per epoch; targets floor(100 * s): e0 0, e3 56, e6 77, e9 80
    assert pruned == [0] * 6 + [56] * 6 + [77] * 6 + [80] * 6
    changed = [i for i in range(1, len(history)) if not torch.equal(history[i][0], history[i - 1][0])]
    assert changed == [6, 12, 18]
    assert all(not (history[i][0] & ~history[i - 1][0]).any() for i in range(1, len(history)))  # monotone
    assert pruner.target_sparsity(0, epoch=3) == pytest.approx(0.8 - 0.8 * (2 / 3) ** 3)


@pytest.mark.parametrize("algo", ["l1", "l2", "fpgm", "apoz", "mean_activation", "taylorfo"])
def test_agp_over_filter_criteria_reaches_final_filter_count(algo):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))
    config = [{"final_sparsity": 0.5, "start_epoch": 0, "end_epoch": 3, "frequency": 1, "op_types": ["Conv2d"]}]
    pruner, history = _agp_run(algo, model, config, 4, data=(2, 7, 7))
    counts = [[int((~m.flatten(1).all(1)).sum()) for m in h] for h in history]
    assert counts[-1] == [4, 2]
    assert counts[0] == [0, 0]  # epoch 0 targets initial_sparsity 0


def test_agp_over_slim():
    model = nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Linear(6, 4), nn.BatchNorm1d(4))
    config = [{"final_sparsity": 0.5, "end_epoch": 3, "op_types": ["BatchNorm1d"]}]
    pruner, history = _agp_run("slim", model, config, 4, data=(3,))
    assert sum(int((~m).sum()) for m in history[-1]) == 5  # floor(10 * 0.5) channels, one threshold


def test_agp_bad_arguments():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="pruning_algorithm"):
        AGPPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}], pruning_algorithm="random")
    with pytest.raises(ConfigError, match="final_sparsity"):
        AGPPruner(model, [{"initial_sparsity": 0.1, "op_types": ["Linear"]}])
    with pytest.raises(ConfigError, match="initial_sparsity"):
        AGPPruner(model, [{"initial_sparsity": 0.6, "sparsity": 0.5, "op_types": ["Linear"]}])
    assert isinstance(model[0], nn.Linear)


def test_lottery_ticket_rounds_reset_weights_optimizer_and_scheduler():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    init = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    pruner = LotteryTicketPruner(model, [{"sparsity": 0.75, "prune_iterations": 2, "op_types": ["Linear"]}],
                                 opt, lr_scheduler=sched)
    pruner.compress()
    assert list(pruner.get_prune_iterations()) == [0, 1, 2]
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    masks = []
    for _ in pruner.get_prune_iterations():
        pruner.prune_iteration_start()
        masks.append(model[0].weight_mask.clone())
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1) and not opt.state  # rewound
        w = model[0].module.weight
        assert torch.equal(w, init * model[0].weight_mask)  # rewound to the initial weights, masked
        for _ in range(2):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
            sched.step()
            assert (w[~model[0].weight_mask] == 0).all()
    assert [int((~m).sum()) for m in masks] == [0, 8, 12]  # keep 0.5 per round
    assert not (masks[2] & ~masks[1]).any()
    with pytest.raises(RuntimeError, match="rounds are done"):
        pruner.prune_iteration_start()


def test_end_to_end_tiny_cnn_with_level_pruner():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 4 * 4, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    pruner = LevelPruner(model, [{"sparsity": 0.7, "op_types": ["default"]}], opt)
    model = pruner.compress()
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        for w in pruner.get_modules_wrapper():
            assert (w.weight[~w.weight_mask] == 0).all()
    assert losses[-1] < losses[0]
    rows = pruner.report()
    assert [r["pruned"] for r in rows] == [25, 201, 268]  # floor(0.7 * n) for n = 36, 288, 384
    assert "total" in str(rows) and rows.total["params"] == 36 + 288 + 384


CUDA_PRUNERS = {
    "level": (LevelPruner, {"sparsity": 0.5}, {}),
    "l1": (L1FilterPruner, {"sparsity": 0.5}, {}),
    "fpgm": (FPGMPruner, {"sparsity": 0.5}, {}),
    "apoz": (ActivationAPoZRankFilterPruner, {"sparsity": 0.5}, {"statistics_batch_num": 2}),
    "taylorfo": (TaylorFOWeightFilterPruner, {"sparsity": 0.5}, {"statistics_batch_num": 2}),
    "agp": (AGPPruner, {"final_sparsity": 0.5, "start_epoch": 0, "end_epoch": 2, "frequency": 1}, {}),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CUDA_PRUNERS))
def test_cuda_pruning_step_has_no_host_sync(name):
    """Masks live on the GPU, statistics and re-masking happen there, and the training step (including
    the steps where statistics are collected and masks computed) never waits for the host."""
    cls, cfg, kwargs = CUDA_PRUNERS[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 4 * 4, 5)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pruner = cls(model, [{**cfg, "op_types": ["Conv2d"]}], opt, **kwargs)
    x, step = batch_and_step(model, opt)
    pruner.compress()
    with no_host_sync():
        for epoch in range(3):
            if hasattr(pruner, "update_epoch"):
                pruner.update_epoch(epoch)
            step()
            step()
        with torch.no_grad():
            model.eval()(x)
    for wrapper in pruner.get_modules_wrapper():
        assert wrapper.weight_mask.device.type == "cuda" and wrapper.weight_mask.dtype == torch.bool
        assert wrapper._mul_cache == [None, None]  # no float copy of the mask on the GPU by default
        mask = wrapper.weight_mask
        if name in ("level", "agp"):  # unstructured: floor(n * 0.5) weights
            assert int((~mask).sum()) == mask.numel() // 2
        else:  # half of the 8 filters, whole
            assert int(mask.flatten(1).all(1).sum()) == 4 and int(mask.flatten(1).any(1).sum()) == 4
        assert not wrapper.weight[~mask].any()
