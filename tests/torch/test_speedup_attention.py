"""Attention heads (HF BERT / ViT self-attention) in the torch channel graph: one ``attention`` node per
module; heads whose value rows are zero are removed by speedup (query/key/value rows, the output
projection's columns, the head count); L1/L2 filter pruners prune whole heads with dependency_aware=True."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import compressor.torch as cth
from compressor.core.errors import ConfigError
from compressor.core.graph import channel_groups
from compressor.torch.graph import attention_spec, build_graph

pytestmark = pytest.mark.torch

import transformers as tr  # noqa: E402  (a test dependency of the torch env)


def bert():
    torch.manual_seed(0)
    cfg = tr.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16)
    m = tr.BertModel(cfg).eval()
    ids = torch.randint(0, 50, (2, 7))
    return m, {"input_ids": ids, "attention_mask": torch.ones(2, 7, dtype=torch.long)}


def vit():
    torch.manual_seed(0)
    cfg = tr.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                       image_size=16, patch_size=4, num_channels=3)
    return tr.ViTModel(cfg).eval(), torch.randn(2, 3, 16, 16)


def kill_heads(linear, heads, d=8):
    with torch.no_grad():
        for h in heads:
            linear.weight[h * d:(h + 1) * d] = 0
            linear.bias[h * d:(h + 1) * d] = 0


def out_of(model, x):
    with torch.no_grad():
        r = model(**x) if isinstance(x, dict) else model(x)
    return r.last_hidden_state


def assert_close(a, b):
    assert a.shape == b.shape
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_bert_graph_has_one_attention_node_per_layer_in_head_groups():
    m, x = bert()
    graph, leaves = build_graph(m, x)
    att = [n for n in graph.nodes if n.kind == "attention"]
    assert [n.layer for n in att] == [f"encoder.layer.{i}.attention.self" for i in range(2)]
    assert all(n.attrs["heads"] == 4 and n.attrs["head_dim"] == 8 and n.channels == 32 for n in att)
    groups = {g.layers[0]: g for g in channel_groups(graph)}
    g = groups["encoder.layer.0.attention.self"]
    assert (g.n, g.unit, g.fixed) == (32, 8, [])
    assert attention_spec(leaves["encoder.layer.0.attention.self"])["v"] == "value"


def test_bert_zero_value_heads_are_removed_exactly():
    m, x = bert()
    a = m.encoder.layer[0].attention
    kill_heads(a.self.value, [0, 2])
    kill_heads(m.encoder.layer[1].attention.self.value, [1])  # a partial head elsewhere: also removed
    ref = out_of(m, x)
    cth.speedup_model(m, x)
    assert a.self.num_attention_heads == 2 and a.self.all_head_size == 16
    assert a.self.query.out_features == a.self.key.out_features == a.self.value.out_features == 16
    assert a.output.dense.in_features == 16
    assert m.encoder.layer[1].attention.self.num_attention_heads == 3
    assert_close(out_of(m, x), ref)


def test_partially_zero_head_stays():
    m, x = bert()
    with torch.no_grad():
        m.encoder.layer[0].attention.self.value.weight[0:4] = 0
        m.encoder.layer[0].attention.self.value.bias[0:4] = 0
    cth.speedup_model(m, x)
    assert m.encoder.layer[0].attention.self.num_attention_heads == 4


def test_vit_heads_with_inner_output_projection():
    m, x = vit()
    att = m.layers[0].attention
    kill_heads(att.v_proj, [1, 3])
    ref = out_of(m, x)
    cth.speedup_model(m, x)
    assert att.num_attention_heads == 2
    assert att.q_proj.out_features == att.k_proj.out_features == att.v_proj.out_features == 16
    assert att.o_proj.in_features == 16 and att.o_proj.out_features == 32
    assert_close(out_of(m, x), ref)


@pytest.mark.parametrize("pruner", ["L1FilterPruner", "L2FilterPruner"])
def test_filter_pruner_prunes_whole_heads_and_mask_file_speedup(pruner, tmp_path):
    m, x = bert()
    p = getattr(cth, pruner)(m, [{"sparsity": 0.5, "op_types": ["BertSelfAttention"]}],
                             dependency_aware=True, dummy_input=x)
    p.compress()
    names = [w.name for w in p.get_modules_wrapper()]
    assert names == [f"encoder.layer.{i}.attention.self.value" for i in range(2)]
    for w in p.get_modules_wrapper():
        per_head = w.weight_mask.all(1).view(4, 8)
        assert (per_head.all(1) == per_head.any(1)).all()  # whole heads
        assert int((~per_head.all(1)).sum()) == 2
        assert torch.equal(w.bias_mask.view(4, 8).all(1), per_head.all(1))
    ref = out_of(m, x)
    p.export_model(str(tmp_path / "m.pt"), str(tmp_path / "mask.pt"))
    small = cth.speedup_model(p, x)
    assert [layer.attention.self.num_attention_heads for layer in small.encoder.layer] == [2, 2]
    assert_close(out_of(small, x), ref)
    # from the exported state dict and mask file, on a fresh model
    m2, _ = bert()
    m2.load_state_dict(torch.load(tmp_path / "m.pt"))
    cth.speedup_model(m2, x, masks=str(tmp_path / "mask.pt"))
    assert m2.encoder.layer[0].attention.output.dense.in_features == 16
    assert_close(out_of(m2, x), ref)


def test_selecting_attention_needs_dependency_aware():
    m, _ = bert()
    with pytest.raises(ConfigError, match="dependency_aware=True"):
        cth.L1FilterPruner(m, [{"sparsity": 0.5, "op_types": ["BertSelfAttention"]}])


def test_heads_that_the_trace_cannot_cut_are_refused_before_any_change():
    from transformers.models.bert.modeling_bert import BertSelfAttention

    class Raw(nn.Module):  # attention straight on the model input: its channel axis is not the features
        def __init__(self):
            super().__init__()
            self.att = BertSelfAttention(tr.BertConfig(hidden_size=16, num_attention_heads=4))

        def forward(self, x):
            return self.att(x)[0]

    torch.manual_seed(0)
    m = Raw().eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ConfigError, match="heads of 'att' cannot be pruned"):
        cth.L1FilterPruner(m, [{"sparsity": 0.5, "op_types": ["BertSelfAttention"]}], dependency_aware=True,
                           dummy_input=torch.randn(2, 5, 16))
    assert type(m.att.value) is nn.Linear
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
