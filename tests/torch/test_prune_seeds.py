"""The seed documents' example pruners (seeds 000 and 003) run as written; only imports are adapted."""

from __future__ import annotations

import torch
from torch import nn

from compressor.torch.pruning import Pruner, WeightMasker

X = torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(0))


def model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def train(model, optimizer, steps=2):
    for _ in range(steps):
        optimizer.zero_grad()
        model(X).sum().backward()
        optimizer.step()


# ---------------------------------------------------------------- seed 000, "A basic pruner"
class NewPruner(Pruner):
    def __init__(self, model, config_list, optimizer):
        super().__init__(model, config_list, optimizer)
        # do some initialization

    def calc_mask(self, wrapper, **kwargs):
        # do something to calculate weight_mask
        weight_mask = (wrapper.module.weight.abs() > 0.1).float()  # a float 0/1 mask, as user code makes
        wrapper.weight_mask = weight_mask


def test_seed000_new_pruner_assigns_float_mask():
    model, optimizer = model_and_opt()
    expected = [model[0].weight.detach().abs() > 0.1, model[3].weight.detach().abs() > 0.1]
    pruner = NewPruner(model, [{"sparsity": 0.7, "op_types": ["Conv2d", "Linear"]}], optimizer)
    model = pruner.compress()
    for w, e in zip(pruner.get_modules_wrapper(), expected):
        assert w.weight_mask.dtype == torch.bool and torch.equal(w.weight_mask, e) and not e.all()
    train(model, optimizer)
    for w in pruner.get_modules_wrapper():
        assert (w.module.weight[~w.weight_mask] == 0).all()


# ---------------------------------------------------------------- seed 000, "Set wrapper attribute"
class NewPrunerWithFlag(Pruner):
    def __init__(self, model, config_list, optimizer):
        super().__init__(model, config_list, optimizer)
        self.set_wrappers_attribute("if_calculated", False)
        self.updates = 0

    def calc_mask(self, wrapper):
        # do something to calculate weight_mask
        if wrapper.if_calculated:
            pass
        else:
            wrapper.if_calculated = True
            # update masks
            self.updates += 1
            wrapper.weight_mask = torch.zeros_like(wrapper.weight_mask)


def test_seed000_if_calculated_flag():
    model, optimizer = model_and_opt()
    pruner = NewPrunerWithFlag(model, [{"sparsity": 0.7, "op_types": ["Conv2d"]}], optimizer)
    pruner.compress()
    train(model, optimizer, 3)
    assert pruner.updates == 1
    assert not model[0].module.weight.any()


# ---------------------------------------------------------------- seed 000, collector example
class ActivationRankFilterPruner(Pruner):
    def __init__(self, model, config_list, optimizer, activation='relu', statistics_batch_num=1):
        super().__init__(model, config_list, optimizer)
        self.set_wrappers_attribute("if_calculated", False)
        self.set_wrappers_attribute("collected_activation", [])
        self.statistics_batch_num = statistics_batch_num

        def collector(module_, input_, output):
            if len(module_.collected_activation) < self.statistics_batch_num:
                module_.collected_activation.append(self.activation(output.detach().cpu()))
        self.add_activation_collector(collector)
        assert activation in ['relu', 'relu6']
        if activation == 'relu':
            self.activation = torch.nn.functional.relu
        elif activation == 'relu6':
            self.activation = torch.nn.functional.relu6
        else:
            self.activation = None

    def calc_mask(self, wrapper, **kwargs):
        return None


def test_seed000_activation_collector():
    model, optimizer = model_and_opt()
    pruner = ActivationRankFilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d"]}], optimizer,
                                        statistics_batch_num=2)
    pruner.compress()
    train(model, optimizer, 3)
    acts = model[0].collected_activation
    assert len(acts) == 2 and acts[0].shape == (4, 4, 4, 4) and (acts[0] >= 0).all()


# ---------------------------------------------------------------- seed 003, MyMasker / MyPruner
class MyMasker(WeightMasker):
    def __init__(self, model, pruner):
        super().__init__(model, pruner)
        # You can do some initialization here, such as collecting some statistics data
        # if it is necessary for your algorithms to calculate the masks.

    def calc_mask(self, sparsity, wrapper, wrapper_idx=None):
        # calculate the masks based on the wrapper.weight, and sparsity,
        # and anything else
        w = wrapper.module.weight.detach().abs().flatten()
        k = int(w.numel() * sparsity)
        mask = (wrapper.module.weight.detach().abs() > w.kthvalue(k).values).float()
        return {'weight_mask': mask}


class MyPruner(Pruner):
    def __init__(self, model, config_list, optimizer):
        super().__init__(model, config_list, optimizer)
        self.set_wrappers_attribute("if_calculated", False)
        # construct a weight masker instance
        self.masker = MyMasker(model, self)

    def calc_mask(self, wrapper, wrapper_idx=None):
        sparsity = wrapper.config['sparsity']
        if wrapper.if_calculated:
            # Already pruned, do not prune again as a one-shot pruner
            return None
        else:
            # call your masker to actually calcuate the mask for this layer
            masks = self.masker.calc_mask(sparsity=sparsity, wrapper=wrapper, wrapper_idx=wrapper_idx)
            wrapper.if_calculated = True
            return masks


def test_seed003_my_pruner_with_masker():
    model, optimizer = model_and_opt()
    configure_list = [{'sparsity': 0.5, 'op_types': ['Conv2d', 'Linear']}]
    pruner = MyPruner(model, configure_list, optimizer)
    model = pruner.compress()
    train(model, optimizer, 3)
    conv, fc = pruner.get_modules_wrapper()
    assert int((~conv.weight_mask).sum()) == 18 and int((~fc.weight_mask).sum()) == 64
    assert all(w.if_calculated for w in (conv, fc))
    assert (conv.module.weight[~conv.weight_mask] == 0).all()


class MyCollectingMasker(WeightMasker):
    def __init__(self, model, pruner):
        super().__init__(model, pruner)
        # Set attribute `collected_activation` for all wrappers to store
        # activations for each layer
        self.pruner.set_wrappers_attribute("collected_activation", [])
        self.activation = torch.nn.functional.relu

        def collector(wrapper, input_, output):
            # The collected activation can be accessed via each wrapper's collected_activation
            # attribute
            wrapper.collected_activation.append(self.activation(output.detach().cpu()))

        self.pruner.hook_id = self.pruner.add_activation_collector(collector)


def test_seed003_collector_add_and_remove():
    model, optimizer = model_and_opt()
    pruner = MyPruner(model, [{'sparsity': 0.5, 'op_types': ['Conv2d']}], optimizer)
    masker = MyCollectingMasker(model, pruner)
    model(X)
    model(X)
    assert len(model[0].collected_activation) == 2
    # Save the collector identifier ... remove it when not used any more
    masker.pruner.remove_activation_collector(pruner.hook_id)
    model(X)
    assert len(model[0].collected_activation) == 2
