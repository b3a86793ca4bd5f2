"""torch.compile on compressed models (issue 17, item 7): no graph breaks caused by the wrappers (the graph
count of ``torch._dynamo.explain`` equals the plain model's), no recompilation after the first step, pruned
weights exactly 0 after compiled training steps, and compiled results equal to eager ones.

Tiny models (a one-layer Hugging Face BERT with random weights, an MLP). Training runs compile with the
``aot_eager`` backend (dynamo + AOT autograd, the parts our wrappers have to get through, without the C++
compile of inductor); one test runs inductor end to end.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch import nn

from compressor.torch import (
    BNNQuantizer,
    DoReFaQuantizer,
    LevelPruner,
    LsqQuantizer,
    NaiveQuantizer,
    PtqQuantizer,
    QAT_Quantizer,
    QuantGrad,
    Quantizer,
    QuantType,
    WeightSharingQuantizer,
)

tr = pytest.importorskip("transformers")  # a test dependency of the torch env

LIN = ["Linear"]
WIO = ["weight", "input", "output"]


def bert():
    torch.manual_seed(0)
    cfg = tr.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # eager == compiled RNG-free
    return tr.BertForSequenceClassification(cfg)


IDS = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
LABELS = torch.tensor([0, 2])


class ClipGrad(QuantGrad):
    """Seed 003's custom backward (edits grad_output in place)."""

    @staticmethod
    def quant_backward(tensor, grad_output, quant_type):
        if quant_type == QuantType.QUANT_OUTPUT:
            grad_output[torch.abs(tensor) > 1] = 0
        return grad_output


class Seed003Quantizer(Quantizer):
    """A user quantizer in seed 003's style: config-keyword methods, rounding without a gradient of its own."""

    def __init__(self, model, config_list, optimizer=None):
        super().__init__(model, config_list, optimizer)
        self.quant_grad = ClipGrad

    def quantize_weight(self, weight, config, **kwargs):
        return torch.round(weight * 8) / 8

    def quantize_output(self, output, config, **kwargs):
        return torch.round(output * 4) / 4


def _ptq(model, optimizer):
    q = PtqQuantizer(model, [{"quant_types": WIO, "quant_bits": 8, "op_types": LIN}], bn_fold=False, fuse_relu=False,
                     share_ranges=False)
    q.compress()
    q.calibrate([IDS if isinstance(model, tr.PreTrainedModel) else X])
    return q


def _prune_then_qat(model, optimizer):
    LevelPruner(model, [{"sparsity": 0.5, "op_types": LIN}], optimizer).compress()
    q = QAT_Quantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": LIN}], optimizer)
    q.compress()
    return q


#: name -> fn(model, optimizer) compressing the model in place
CASES = {
    "level": lambda m, o: LevelPruner(m, [{"sparsity": 0.5, "op_types": ["default"]}], o).compress(),
    "qat": lambda m, o: QAT_Quantizer(m, [{"quant_types": WIO, "quant_bits": 8, "op_types": LIN}], o).compress(),
    "qat_per_channel": lambda m, o: QAT_Quantizer(m, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": LIN,
                                                       "quant_dtype": "int",
                                                       "quant_scheme": "per_channel_symmetric"}], o).compress(),
    "dorefa": lambda m, o: DoReFaQuantizer(m, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": LIN}],
                                           o).compress(),
    "bnn": lambda m, o: BNNQuantizer(m, [{"quant_types": ["weight", "output"], "quant_bits": 1, "op_types": LIN}],
                                     o).compress(),
    "lsq": lambda m, o: LsqQuantizer(m, [{"quant_types": WIO, "quant_bits": 8, "op_types": LIN}], o).compress(),
    "naive": lambda m, o: NaiveQuantizer(m, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": LIN}],
                                         o).compress(),
    "ptq": _ptq,
    "prune_then_qat": _prune_then_qat,
    "weight_sharing": lambda m, o: WeightSharingQuantizer(m, [{"quant_types": ["weight"], "quant_bits": 3,
                                                               "op_types": LIN}], o, iterations=5).compress(),
    "seed003_clipgrad": lambda m, o: Seed003Quantizer(m, [{"quant_types": ["weight", "output"], "quant_bits": 8,
                                                           "op_types": LIN}], o).compress(),
}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


X = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
Y = torch.tensor([0, 1, 2, 1])


def compressed(case, momentum=0.9, weight_decay=0.0, make=bert):
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        CASES[case](model, opt)
    return model, opt


def graph_count(model, train):
    model.train(train)
    dynamo.reset()
    explained = dynamo.explain(lambda: model(input_ids=IDS).logits)()
    return explained.graph_count, explained.graph_break_count


@pytest.fixture(scope="module")
def plain_graphs():
    return {train: graph_count(bert(), train) for train in (True, False)}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


@pytest.mark.parametrize("case", list(CASES))
def test_no_graph_breaks_in_training_mode(case, plain_graphs):
    model, _ = compressed(case)
    assert plain_graphs[True] == (1, 0)
    assert graph_count(model, True) == plain_graphs[True]


@pytest.mark.parametrize("case", ["level", "qat", "lsq", "ptq"])
def test_no_graph_breaks_in_eval_mode(case, plain_graphs):
    model, _ = compressed(case)
    assert graph_count(model, False) == plain_graphs[False] == (1, 0)


def loss_of(run, model):
    if isinstance(model, tr.PreTrainedModel):
        return F.cross_entropy(run(input_ids=IDS).logits, LABELS)
    return F.cross_entropy(run(X), Y)


def train_steps(model, opt, steps, compiled, after_step=None):
    run = torch.compile(model, backend="aot_eager") if compiled else model
    model.train()
    losses = []
    with contextlib.ExitStack() as stack:
        for i in range(steps):
            opt.zero_grad()
            loss = loss_of(run, model)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            if after_step is not None:
                after_step(model)
            if i == 0 and compiled:  # from here on a recompilation is an error
                stack.enter_context(torch._dynamo.config.patch(error_on_recompile=True))
    return torch.stack(losses), run


def pruned_weights(model):
    return [(name, w.weight[~w.weight_mask]) for name, w in model.named_modules() if hasattr(w, "weight_mask")]


def test_compiled_pruned_training_keeps_masks_and_matches_eager():
    """Momentum and weight decay move pruned weights at every step; the optimizer hook re-zeroes them."""
    eager_model, eager_opt = compressed("level", weight_decay=0.1)
    model, opt = compressed("level", weight_decay=0.1)
    assert len(pruned_weights(model)) == 8  # q, k, v, attention out, intermediate, output, pooler, classifier

    def all_zero(m):
        for name, values in pruned_weights(m):
            assert values.numel() > 0 and bool((values == 0).all()), name

    ref, _ = train_steps(eager_model, eager_opt, 3, compiled=False)
    got, _ = train_steps(model, opt, 3, compiled=True, after_step=all_zero)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_forward_masks_weights_written_outside_a_step():
    """A write the optimizer hook never sees (here: fill_) is masked out of place by the compiled forward;
    the compiled forward does not write the stored weights (eager forwards and the next step re-mask them)."""
    model, _ = compressed("level")
    model.eval()
    run = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        run(input_ids=IDS)
        wrappers = [w for w in model.modules() if hasattr(w, "weight_mask")]
        for w in wrappers:
            w.weight.fill_(0.5)
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = run(input_ids=IDS).logits
        assert all(bool((w.weight == 0.5).all()) for w in wrappers)  # untouched by the compiled forward
        ref = model(input_ids=IDS).logits  # eager: re-masks in place first
        assert all(bool((w.weight[~w.weight_mask] == 0).all()) for w in wrappers)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_new_masks_reach_the_compiled_forward_without_recompiling():
    model, _ = compressed("level")
    model.eval()
    run = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        before = run(input_ids=IDS).logits
        w = model.bert.encoder.layer[0].output.dense
        w.weight_mask = torch.zeros_like(w.weight_mask)  # written in place into the mask buffer
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = run(input_ids=IDS).logits
        ref = model(input_ids=IDS).logits
    assert not torch.equal(got, before)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_loaded_masks_reach_the_compiled_forward_without_recompiling():
    model, _ = compressed("level")
    other, _ = compressed("level")
    w = other.bert.encoder.layer[0].intermediate.dense
    w.weight_mask = torch.rand(w.weight_mask.shape, generator=torch.Generator().manual_seed(4)) > 0.5
    model.eval()
    run = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        run(input_ids=IDS)
        model.load_state_dict(other.state_dict())
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = run(input_ids=IDS).logits
        ref = model(input_ids=IDS).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("cache", [None, False])
def test_masks_edited_in_place_reach_compiled_forwards(cache):
    """Without the float copy of the mask (accelerators, ``multiplier_cache=False``) compiled forwards read
    the bool mask itself: an in-place edit counts at once. With it (CPU default) the copy is refreshed by
    apply_masks / the next optimizer step (documented in the wrapper)."""
    model = bert().eval()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": LIN}])
    pruner.compress()
    w = model.bert.encoder.layer[0].output.dense
    for m in model.modules():
        if hasattr(m, "weight_mask"):
            m.multiplier_cache = cache
    run = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        before = run(input_ids=IDS).logits
        w.weight_mask[:4] = False
        if cache is None:
            pruner.apply_masks()
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = run(input_ids=IDS).logits
        ref = model(input_ids=IDS).logits
    assert not torch.equal(got, before)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


QUANT_CASES = [c for c in CASES if c != "level"]
#: every quantizer on the MLP; on BERT the main ones (the others there are slow: about 5 s each)
TRAIN_PARAMS = [pytest.param(c, mlp, id=f"{c}-mlp") for c in QUANT_CASES] + [
    pytest.param(c, bert, id=f"{c}-bert", marks=() if c in ("qat", "prune_then_qat") else pytest.mark.slow)
    for c in QUANT_CASES]


@pytest.mark.parametrize("case, make", TRAIN_PARAMS)
def test_compiled_quantized_training_matches_eager(case, make):
    eager_model, eager_opt = compressed(case, make=make)
    model, opt = compressed(case, make=make)
    ref, _ = train_steps(eager_model, eager_opt, 2, compiled=False)
    got, run = train_steps(model, opt, 2, compiled=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    if case == "prune_then_qat":
        assert all(bool((v == 0).all()) for _, v in pruned_weights(model))
    model.eval()
    eager_model.eval()
    with torch.no_grad():
        if make is bert:
            got, ref = run(input_ids=IDS).logits, eager_model(input_ids=IDS).logits
        else:
            got, ref = run(X), eager_model(X)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


class Attention(nn.Module):
    """nn.MultiheadAttention: compressed one weight matrix (slot) at a time, q/k/v as row views."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x)
        return self.fc(self.mha(h, h, h)[0])


MHA_PRUNE = [{"sparsity": 0.5, "op_types": ["MultiheadAttention"]}]
MHA_QUANT = [{"quant_types": ["weight"], "quant_bits": 4, "op_types": ["MultiheadAttention"]}]


@pytest.mark.parametrize("order", ["prune", "quantize", "prune_then_quantize", "quantize_then_prune"])
def test_attention_slots_compile_without_breaks_and_match_eager(order):
    model = Attention().eval()
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(5))
    plain = dynamo.explain(lambda: model(x))()
    for step in order.split("_then_"):
        if step == "prune":
            LevelPruner(model, MHA_PRUNE).compress()
        else:
            QAT_Quantizer(model, MHA_QUANT).compress()
    dynamo.reset()
    explained = dynamo.explain(lambda: model(x))()
    assert (explained.graph_count, explained.graph_break_count) == (plain.graph_count, plain.graph_break_count) == (1, 0)
    dynamo.reset()
    run = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        got = run(x)
        if "prune" in order:  # a write no optimizer step re-masks
            model.mha.module.in_proj_weight.add_(0.25)
            got = run(x)
        ref = model(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    slots = [m for m in model.modules() if type(m).__name__ == "WeightSlot"]
    assert len(slots) == 4 and all(m._substitute is None for m in slots)  # no state left by the compiled call


def test_swapping_quant_grad_after_compiling_takes_effect():
    """The default gradient is the clipped STE; a swapped-in ``quant_grad`` must reach compiled code (dynamo
    guards on it and recompiles)."""

    class ZeroGrad(QuantGrad):
        @staticmethod
        def quant_backward(tensor, grad_output, quant_type):
            return torch.zeros_like(grad_output)

    model = mlp()
    q = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": LIN}])
    q.compress()
    run = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    run(x).sum().backward()
    assert model[0].module.weight.grad.abs().sum() > 0
    model.zero_grad()
    q.quant_grad = ZeroGrad
    run(x).sum().backward()
    assert torch.equal(model[0].module.weight.grad, torch.zeros(8, 6))
    assert torch.equal(model[2].module.weight.grad, torch.zeros(3, 8))


def test_compiled_ptq_before_calibration_raises():
    model = mlp()
    PtqQuantizer(model, [{"quant_types": WIO, "quant_bits": 8, "op_types": LIN}], bn_fold=False,
                 fuse_relu=False, share_ranges=False).compress()
    run = torch.compile(model, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"calibrate\(data\)"):
        run(torch.randn(2, 6))


def test_inductor_compiled_train_step_pruned_and_quantized_mlp():
    """End to end with the default backend (C++ codegen): prune + QAT, masks kept, equal to eager."""
    def build():
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        _prune_then_qat(model, opt)
        return model, opt

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 1, 2, 1])
    results = []
    for compiled in (False, True):
        model, opt = build()
        run = torch.compile(model) if compiled else model
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(run(x), y).backward()
            opt.step()
            assert all(bool((v == 0).all()) for _, v in pruned_weights(model))
        results.append(copy.deepcopy([p.detach() for p in model.parameters()]))
    for p, q in zip(*results):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
