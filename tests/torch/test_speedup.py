"""Speedup on PyTorch: the autograd trace into the neutral graph, slicing per layer type, exact outputs,
counts, save/load, ONNX, training after speedup, refusals that leave the model untouched, HF models."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import compressor.torch as cth
from compressor.core.errors import ModelError
from compressor.core.graph import channel_groups

pytestmark = pytest.mark.torch


# ---------------------------------------------------------------------------------- helpers
@torch.no_grad()
def zero_channel(module: nn.Module, j: int) -> None:
    """Make output channel j of a layer dead (filter, bias, BN gamma/beta)."""
    from compressor.torch.graph import _is_hf_conv1d

    if isinstance(module, nn.Embedding):
        module.weight[:, j] = 0
        return
    if _is_hf_conv1d(module):
        module.weight[:, j] = 0
    else:
        module.weight[j] = 0
    if getattr(module, "bias", None) is not None:
        module.bias[j] = 0


def zero_groups(model: nn.Module, x, every: int = 2) -> int:
    """Zero every ``every``-th prunable class of every channel group, in all its members. Returns the
    number of classes zeroed."""
    graph, leaves = cth.build_graph(model, x)
    total = 0
    for g in channel_groups(graph):
        prunable = [i for i in range(g.n) if i not in g.fixed]
        prune = set(prunable[::every]) if len(prunable) >= 2 else set()
        total += len(prune)
        if g.unit > 1:  # attention heads: see tests/torch/test_speedup_attention.py
            continue
        for layer, _kind, index in g.members:
            for j, c in enumerate(index):
                if c in prune:
                    zero_channel(leaves[layer], j)
    return total


def randomize_bn(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                n = m.num_features
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.randn(n, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)


def first(out):
    if torch.is_tensor(out):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return out[0]


def assert_close(a, b):
    assert a.shape == b.shape
    assert (a - b).abs().max() <= 1e-5 * max(b.abs().max().item(), 1e-6)


def run(model, x):
    with torch.no_grad():
        if isinstance(x, dict):
            return first(model(**x))
        return first(model(x))


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------- hand-made models
class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 6, 3)
        self.bn2 = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6 * 4 * 4, 4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


def make_cnn():
    torch.manual_seed(0)
    m = CNN().eval()
    randomize_bn(m)
    for j in (1, 5):
        zero_channel(m.conv1, j)
        zero_channel(m.bn1, j)
    zero_channel(m.conv2, 2)
    zero_channel(m.bn2, 2)
    return m


X = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def test_cnn_flatten_linear_exact_channels_outputs_and_counts():
    m = make_cnn()
    ref = run(m, X)
    macs0, params0, _ = cth.count_flops_params(m, X)
    assert macs0 == 8 * 36 * 27 + 6 * 16 * 72 + 96 * 4
    small = cth.speedup_model(m, X)
    assert small is m
    assert (m.conv1.out_channels, m.bn1.num_features, m.conv2.in_channels, m.conv2.out_channels) == (6, 6, 6, 5)
    assert m.bn2.num_features == 5 and m.bn2.running_mean.shape == (5,) and m.fc.in_features == 5 * 16
    assert m.conv1.weight.shape == (6, 3, 3, 3) and m.conv2.weight.shape == (5, 6, 3, 3)
    assert_close(run(m, X), ref)
    macs1, params1, _ = cth.count_flops_params(m, X)
    # conv1: 2 filters of 27 + 2 biases; bn1: 2 x 2; conv2: 2 input columns of 9 for 6 filters, then 1 filter
    # of 6*9 + bias; bn2: 2; fc: 16 columns x 4
    assert params0 - params1 == 2 * 28 + 4 + (2 * 9 * 6) + (6 * 9 + 1) + 2 + 16 * 4
    assert macs1 == 6 * 36 * 27 + 5 * 16 * 54 + 80 * 4
    rep = cth.speedup_report(m)
    assert rep.params_before == params0 and rep.params_after == params1 and rep.macs_after == macs1
    assert rep.removed_classes == 3
    assert {r["layer"]: r["out"] for r in rep.layers}["conv1"] == (8, 6)
    assert "fine-grained" not in str(rep)  # only whole channels were zero


def test_save_load_onnx_and_training_after_speedup(tmp_path):
    m = make_cnn()
    ref = run(m, X)
    cth.speedup_model(m, X)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert_close(run(loaded, X), ref)
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "m.onnx"
    torch.onnx.export(m, (X,), str(path), dynamo=True, external_data=False, verbose=False)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: X.numpy()})[0])
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = m.conv1.weight.detach().clone()
    opt.zero_grad()
    m(X).square().sum().backward()
    opt.step()
    assert not torch.equal(before, m.conv1.weight)


def test_masks_dict_and_file_on_a_plain_model(tmp_path):
    torch.manual_seed(0)
    m = CNN().eval()
    randomize_bn(m)
    keep = torch.ones(8, dtype=torch.bool)
    keep[[0, 3, 4]] = False
    masks = {"conv1": {"weight": keep[:, None, None, None].expand(8, 3, 3, 3).clone(), "bias": keep.clone()},
             "bn1": {"weight": keep.clone(), "bias": keep.clone()}}
    path = tmp_path / "masks.pt"
    torch.save(masks, path)
    m2 = CNN().eval()
    m2.load_state_dict(m.state_dict())
    cth.speedup_model(m, X, masks=masks)
    cth.speedup_model(m2, X, masks=str(path))
    assert m.conv1.out_channels == m2.conv1.out_channels == 5 and m.conv2.in_channels == 5
    assert_close(run(m, X), run(m2, X))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.conv1 = nn.Conv2d(6, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(6)
        self.head = nn.Conv2d(6, 5, 1)
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        s = torch.relu(self.stem(x))
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(s)))))
        return self.fc(torch.relu(self.head(torch.relu(s + y))).mean((2, 3)))


def test_residual_add_removes_channels_dead_on_both_branches():
    torch.manual_seed(0)
    m = Residual().eval()
    randomize_bn(m)
    zero_channel(m.stem, 1)
    zero_channel(m.stem, 4)
    zero_channel(m.conv2, 4)  # channel 1 stays alive in conv2 -> kept
    zero_channel(m.bn2, 4)
    zero_channel(m.bn2, 1)  # bn2 dead in 1, but stem's conv2 branch... stem 1 dead too -> both zero
    zero_channel(m.conv1, 0)
    zero_channel(m.bn1, 0)
    ref = run(m, X)
    cth.speedup_model(m, X)
    assert (m.stem.out_channels, m.conv2.out_channels, m.bn2.num_features, m.head.in_channels) == (4, 4, 4, 4)
    assert (m.conv1.out_channels, m.bn1.num_features, m.conv2.in_channels) == (3, 3, 3)
    assert_close(run(m, X), ref)


class Concat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 6, 3, padding=1)
        self.c = nn.Conv2d(10, 5, 3, padding=1)

    def forward(self, x):
        return self.c(torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x)) * 2], 1))


def test_concat_offsets():
    torch.manual_seed(0)
    m = Concat().eval()
    zero_channel(m.a, 2)
    zero_channel(m.b, 0)
    zero_channel(m.b, 5)
    ref = run(m, X)
    cth.speedup_model(m, X)
    assert (m.a.out_channels, m.b.out_channels, m.c.in_channels) == (3, 4, 7)
    assert m.c.weight.shape == (5, 7, 3, 3)
    assert_close(run(m, X), ref)


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 6, 1)
        self.c = nn.Conv2d(4, 5, 1)

    def forward(self, x):
        p, q = self.a(x).split([4, 2], 1)  # sizes in the code: a channel split cannot be cut
        return self.c(p) + q.sum(1, keepdim=True)


def test_channel_split_blocks_speedup():
    torch.manual_seed(0)
    m = Split().eval()
    zero_channel(m.a, 1)
    with pytest.raises(ModelError, match="SplitWithSizesBackward0"):
        cth.speedup_model(m, X)
    assert m.a.out_channels == 6


class MBBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.expand = nn.Conv2d(4, 8, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.project = nn.Conv2d(8, 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(4)
        self.act = nn.ReLU6(inplace=True)

    def forward(self, x):
        y = self.act(self.bn1(self.expand(x)))
        y = self.act(self.bn2(self.dw(y)))
        return x + self.bn3(self.project(y))


def test_depthwise_block_follows_its_input():
    torch.manual_seed(0)
    m = MBBlock().eval()
    randomize_bn(m)
    x = torch.randn(2, 4, 5, 5)
    for j in (1, 2, 6):
        for layer in (m.expand, m.bn1, m.dw, m.bn2):
            zero_channel(layer, j)
    ref = run(m, x)
    cth.speedup_model(m, x)
    assert (m.expand.out_channels, m.bn1.num_features, m.dw.in_channels, m.dw.out_channels, m.dw.groups) == (5,) * 5
    assert m.bn2.num_features == 5 and m.project.in_channels == 5 and m.project.out_channels == 4
    assert_close(run(m, x), ref)


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


def test_ffn_on_sequences_slices_hidden_neurons():
    torch.manual_seed(0)
    m = FFN().eval()
    for j in range(0, 16, 3):
        zero_channel(m.fc1, j)
    x = torch.randn(2, 5, 8)
    ref = run(m, x)
    cth.speedup_model(m, x)
    assert (m.fc1.out_features, m.fc2.in_features, m.fc2.out_features) == (10, 10, 8)
    assert m.fc1.bias.shape == (10,) and m.fc2.weight.shape == (8, 10)
    assert_close(run(m, x), ref)


class Shared(nn.Module):
    """One conv called twice: both calls lose the same channels."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.head = nn.Conv2d(6, 2, 1)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)) + torch.relu(self.conv(x * 0.5)))


def test_layer_called_twice_is_sliced_once():
    torch.manual_seed(0)
    m = Shared().eval()
    zero_channel(m.conv, 3)
    ref = run(m, X)
    cth.speedup_model(m, X)
    assert m.conv.out_channels == 5 and m.head.in_channels == 5
    assert_close(run(m, X), ref)


class Blocked(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.conv2(torch.cumsum(self.conv1(x), 1))


def test_unsupported_op_in_the_way_raises_and_leaves_the_model_untouched():
    torch.manual_seed(0)
    m = Blocked().eval()
    zero_channel(m.conv1, 1)
    before = state(m)
    with pytest.raises(ModelError, match="CumsumBackward0"):
        cth.speedup_model(m, X)
    after = m.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
    assert m.conv1.out_channels == 4
    # masks given to a plain model are undone too on an error
    masks = {"conv1": {"weight": torch.zeros(4, 3, 3, 3, dtype=torch.bool)}}
    with pytest.raises(ModelError):
        cth.speedup_model(m, X, masks=masks)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    ref = run(m, X)
    cth.speedup_model(m, X, strict=False)
    assert m.conv1.out_channels == 4
    assert any("CumsumBackward0" in n for n in cth.speedup_report(m).notes)
    assert_close(run(m, X), ref)


def test_pruner_speedup_returns_a_copy_and_the_pruner_keeps_working():
    torch.manual_seed(0)
    m = Residual().eval()
    randomize_bn(m)
    p = cth.L1FilterPruner(m, [{"sparsity": 0.5, "op_types": ["Conv2d"]}], dependency_aware=True, dummy_input=X)
    p.compress()
    ref = run(m, X)
    small = cth.speedup_model(p, X)
    assert small is not m and small.conv1.out_channels == 2 and small.stem.out_channels == 3
    assert_close(run(small, X), ref)
    assert_close(run(m, X), ref)  # the wrapped model is unchanged


def test_graph_of_a_plain_cnn():
    graph, leaves = cth.build_graph(make_cnn(), X)
    kinds = [(n.name, n.kind) for n in graph.nodes]
    assert kinds[0] == ("input", "input") and kinds[-1] == ("output", "output")
    flat = next(n for n in graph.nodes if n.kind == "flatten")
    assert flat.attrs == {"positions": 16, "order": "channels_first"} and flat.channels == 96
    assert set(leaves) == {"conv1", "bn1", "conv2", "bn2", "fc"}
    assert graph.by_name["conv1"].attrs["dead"] == [False, True, False, False, False, True, False, False]


# ---------------------------------------------------------------------------------- HF models
def hf_check(model, x, min_drop=0.1):
    torch.manual_seed(0)
    model.eval()
    randomize_bn(model)
    n = zero_groups(model, x)
    assert n > 0
    ref = run(model, x)
    params0 = sum(p.numel() for p in model.parameters())
    cth.speedup_model(model, x)
    params1 = sum(p.numel() for p in model.parameters())
    assert params1 < (1 - min_drop) * params0
    assert_close(run(model, x), ref)
    return model


def test_hf_resnet():
    import transformers as tr
    torch.manual_seed(0)
    cfg = tr.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_channels=3,
                          layer_type="bottleneck", num_labels=3)
    m = hf_check(tr.ResNetForImageClassification(cfg), torch.randn(2, 3, 32, 32))
    assert m.classifier[1].in_features < 32


@pytest.mark.parametrize("tf_padding", [True, False])  # True (the default): zero F.pad, recorded by the trace
def test_hf_mobilenet_v2(tf_padding):
    import transformers as tr
    torch.manual_seed(0)
    cfg = tr.MobileNetV2Config(depth_multiplier=0.25, image_size=32, num_labels=3, tf_padding=tf_padding)
    hf_check(tr.MobileNetV2ForImageClassification(cfg), torch.randn(2, 3, 32, 32), min_drop=0.3)


def test_hf_convnext():
    import transformers as tr
    torch.manual_seed(0)
    cfg = tr.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=3)
    m = tr.ConvNextForImageClassification(cfg)
    hf_check(m, torch.randn(2, 3, 32, 32), min_drop=0.2)
    assert m.convnext.encoder.stages[0].layers[0].pwconv1.out_features == 32


def test_hf_bert_ffn_neurons():
    import transformers as tr
    torch.manual_seed(0)
    cfg = tr.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    m = tr.BertModel(cfg)
    ids = torch.randint(0, 50, (2, 7))
    hf_check(m, {"input_ids": ids, "attention_mask": torch.ones(2, 7, dtype=torch.long)}, min_drop=0.05)
    layer = m.encoder.layer[0]
    assert layer.intermediate.dense.out_features == 16 and layer.output.dense.in_features == 16
    assert layer.attention.self.query.out_features == 16  # no head was zeroed: heads are not cut


class Padded(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value
        self.a = nn.Conv2d(3, 4, 3)
        self.b = nn.Conv2d(4, 2, 3)

    def forward(self, x):
        return self.b(torch.nn.functional.pad(self.a(x), (1, 1, 1, 1), value=self.value))


@pytest.mark.parametrize("value,kept", [(0.0, 3), (1.0, 4)])
def test_constant_pad_value_decides_whether_a_dead_channel_goes(value, kept):
    torch.manual_seed(0)
    m = Padded(value).eval()
    with torch.no_grad():
        m.a.weight[1] = 0
        m.a.bias[1] = 0
    x = torch.randn(2, 3, 8, 8)
    ref = run(m, x)
    cth.speedup_model(m, x)
    assert m.a.out_channels == kept and m.b.in_channels == kept
    assert_close(run(m, x), ref)


def test_fine_grained_zeros_are_left_and_reported():
    torch.manual_seed(0)
    m = make_cnn().eval()
    with torch.no_grad():
        m.conv2.weight[0, 0, 0, 0] = 0.0
        m.conv2.weight[1, 2, 1, 1] = 0.0
    ref = run(m, X)
    cth.speedup_model(m, X)
    assert_close(run(m, X), ref)
    note = next(n for n in cth.speedup_report(m).notes if "fine-grained" in n)
    assert "2 zero weight(s) remain in 1 layer(s)" in note


def test_convnextv2_grn_passes_channels_and_is_sliced_exactly():
    """ConvNeXt V2's GRN (gamma / beta [1, 1, 1, C], x + gamma * x * N + beta, N = spatial L2 norm / its mean
    over channels) is a per-channel norm: dependency-aware pruning masks its beta with pwconv1's filters,
    speedup removes the block's hidden channels (pwconv1 rows, GRN entries, pwconv2 columns) and scales the
    kept gamma by C / C_kept (the removed channels were zeros counted in the channel mean): the sped-up model
    gives the masked model's outputs, and no zero weight is left in a conv / linear."""
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tr.ConvNextV2ForImageClassification(tr.ConvNextV2Config(
        num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=32, num_labels=10)).eval()
    grns = [m for m in model.modules() if type(m).__name__ == "ConvNextV2GRN"]
    with torch.no_grad():  # trained-like: nonzero gamma AND beta (HF initialises both to zero)
        for m in grns:
            m.weight.normal_(0, 0.5)
            m.bias.normal_(0, 0.5)
    x = torch.randn(4, 3, 32, 32)
    pruner = cth.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], dependency_aware=True,
                                dummy_input=x[:1])
    pruner.compress()
    with torch.no_grad():
        masked = pruner.bound_model(x).logits
    small = cth.speedup_model(pruner, x[:1]).eval()
    grns = [m for m in small.modules() if type(m).__name__ == "ConvNextV2GRN"]
    assert [tuple(m.weight.shape) for m in grns] == [(1, 1, 1, 32), (1, 1, 1, 64)]  # 4 * hidden, halved
    assert [tuple(m.bias.shape) for m in grns] == [(1, 1, 1, 32), (1, 1, 1, 64)]
    with torch.no_grad():
        torch.testing.assert_close(small(x).logits, masked, rtol=1e-4, atol=1e-5)
    zeros = sum(int((m.weight == 0).sum()) for m in small.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    assert zeros == 0
