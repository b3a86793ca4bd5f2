"""nn.DataParallel: compressor wrappers under replication.

DataParallel needs several CUDA devices; on CPU it just calls the module. These tests therefore run
torch's own ``torch.nn.parallel.replicate`` with its device broadcast swapped for a CPU emulation with
the same contract (replica 0 gets the ORIGINAL tensors: parameters as autograd views, buffers as the
very same tensors; the other replicas get copies, parameters connected to the originals by autograd),
and call the replicas one after the other as ``parallel_apply`` would in threads.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from compressor.torch.pruning import ActivationMeanRankFilterPruner, LevelPruner
from compressor.torch.quantization import QAT_Quantizer

REPLICATE = sys.modules["torch.nn.parallel.replicate"]


class _CpuBroadcast(torch.autograd.Function):
    """``Broadcast`` on CPU: outputs for replica 0 are the inputs themselves, then copies per replica."""

    @staticmethod
    def forward(ctx, n, *inputs):
        ctx.n, ctx.k = n, len(inputs)
        copies = [t.clone() for _ in range(n - 1) for t in inputs]
        ctx.mark_non_differentiable(*[o for i, o in enumerate([*inputs, *copies]) if not inputs[i % len(inputs)].requires_grad])
        return (*inputs, *copies)

    @staticmethod
    def backward(ctx, *grads):
        k = ctx.k
        out = []
        for i in range(k):
            gs = [grads[j * k + i] for j in range(ctx.n) if grads[j * k + i] is not None]
            out.append(sum(gs) if gs else None)
        return (None, *out)


def _cpu_broadcast_coalesced_reshape(tensors, devices, detach=False):
    if not tensors:
        return []
    n = len(devices)
    if detach:
        return [list(tensors)] + [[t.clone() for t in tensors] for _ in range(n - 1)]
    flat = _CpuBroadcast.apply(n, *tensors)
    return [list(flat[i:i + len(tensors)]) for i in range(0, len(flat), len(tensors))]


@pytest.fixture
def replicate(monkeypatch):
    monkeypatch.setattr(REPLICATE, "_broadcast_coalesced_reshape", _cpu_broadcast_coalesced_reshape)
    return lambda model: REPLICATE.replicate(model, [0, 1])


def _pruned_linear() -> tuple[nn.Sequential, LevelPruner, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 3))
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(1.0, 13.0).reshape(3, 4))
        model[0].bias.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}], opt)
    pruner.compress()
    return model, pruner, opt


def test_pruner_replicas_do_not_touch_original_masks(replicate):
    model, _, _ = _pruned_linear()
    wrapper = model[0]
    mask = wrapper.weight_mask
    ptr, version = mask.data_ptr(), mask._version
    expected_mask = torch.arange(1.0, 13.0).reshape(3, 4) > 6  # the 6 smallest |w| pruned
    assert torch.equal(mask, expected_mask)
    r0, r1 = replicate(model)
    # replica 0 shares the original's buffer, replica 1 holds its own copy; the original is untouched
    assert r0[0].weight_mask is mask
    assert r1[0].weight_mask is not mask and torch.equal(r1[0].weight_mask, mask)
    assert (mask.data_ptr(), mask._version) == (ptr, version)
    x = torch.arange(8.0).reshape(2, 4)
    dense_masked = x @ (torch.arange(1.0, 13.0).reshape(3, 4) * expected_mask).T + 1.0
    out = torch.cat([r0(x[:1]), r1(x[1:])])
    torch.testing.assert_close(out, dense_masked, rtol=0, atol=0)
    out.sum().backward()  # gradients of both chunks reach the ORIGINAL parameters
    torch.testing.assert_close(wrapper.weight.grad, x.sum(0).expand(3, 4))
    assert (mask.data_ptr(), mask._version) == (ptr, version)


def test_replicas_mask_out_of_place_when_original_is_stale(replicate):
    model, pruner, _ = _pruned_linear()
    wrapper = model[0]
    with torch.no_grad():  # e.g. a dense checkpoint loaded: the original is stale until re-masked
        wrapper.weight.copy_(torch.arange(1.0, 13.0).reshape(3, 4))
    assert wrapper.is_stale()
    r0, r1 = replicate(model)
    x = torch.ones(2, 4)
    out = torch.cat([r0(x[:1]), r1(x[1:])])
    kept = torch.arange(1.0, 13.0).reshape(3, 4) * (torch.arange(1.0, 13.0).reshape(3, 4) > 6)
    torch.testing.assert_close(out, (x @ kept.T) + 1.0, rtol=0, atol=0)
    # the replicas did not write the original's weights (only the pruner does)
    assert torch.count_nonzero(wrapper.weight).item() == 12
    pruner.apply_masks()
    assert torch.count_nonzero(wrapper.weight).item() == 6


def test_qat_ranges_update_the_original_buffers_in_place(replicate):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    reference = copy.deepcopy(model)
    QAT_Quantizer(model, [{"quant_types": ["input", "weight", "output"], "quant_bits": 8, "op_types": ["Linear"]}]).compress()
    QAT_Quantizer(reference, [{"quant_types": ["input", "weight", "output"], "quant_bits": 8, "op_types": ["Linear"]}]).compress()
    wrapper = model[0]
    names = ["tracked_min_input", "tracked_max_input", "tracked_min_output", "tracked_max_output",
             "input_scale", "output_scale", "output_zero_point", "weight_scale", "input_observed"]
    ptrs = {n: getattr(wrapper, n).data_ptr() for n in names}
    x = torch.tensor([[-1.0, 0.5, 2.0, 0.0], [3.0, -4.0, 1.0, 5.0]])
    for _ in range(2):  # two DataParallel forwards
        r0, r1 = replicate(model)
        torch.cat([r0(x[:1]), r1(x[1:])]).sum().backward()
        reference(x[:1])  # what the first device's chunk alone gives
    assert {n: getattr(wrapper, n).data_ptr() for n in names} == ptrs  # same tensors, updated in place
    assert wrapper.input_observed.item()
    for n in names:
        torch.testing.assert_close(getattr(wrapper, n), getattr(reference[0], n), rtol=0, atol=0, msg=n)
    assert wrapper.tracked_min_input.item() == -1.0 and wrapper.tracked_max_input.item() == 2.0


def test_activation_statistics_are_collected_from_all_replicas(replicate):
    model = nn.Sequential(nn.Linear(4, 6))
    with torch.no_grad():  # rows e0, e1, e2+e0, e3+e1, e2, e3 (as in test_prune_distributed)
        model[0].weight.copy_(torch.eye(6, 4) + torch.eye(6, 4).roll(2, 0))
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # on CPU both replicas live on one device, so one DataParallel forward brings 2 chunks there
    pruner = ActivationMeanRankFilterPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}], opt,
                                            statistics_batch_num=2)
    pruner.compress()
    x = torch.zeros(2, 4)
    x[0, 0] = x[1, 1] = 10.0  # chunk 0 excites channels 0, 2; chunk 1 channels 1, 3
    r0, r1 = replicate(model)
    torch.cat([r0(x[:1]), r1(x[1:])]).sum().backward()
    opt.step()
    # both chunks counted: channels 0-3 tie, 4 and 5 are zero -> prune 4, 5 and (lowest index first) 0;
    # replica 1's chunk alone would keep 1, 3, 5 and replica 0's alone 0, 2, 5
    assert model[0].weight_mask.all(1).tolist() == [False, True, True, True, False, False]
    assert model[0].bias_mask.tolist() == [False, True, True, True, False, False]
