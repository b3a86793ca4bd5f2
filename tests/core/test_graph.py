"""The neutral channel graph on hand-built graphs: classes, groups, zero analysis, speedup plans, counts."""

import numpy as np
import pytest

from compressor.core.errors import ModelError
from compressor.core.graph import (
    Graph,
    Node,
    channel_groups,
    class_scores,
    classify_reshape,
    count_graph,
    group_keep_classes,
    member_keep,
    speedup_plan,
)
from compressor.core.ops import NumpyOps

ops = NumpyOps()


def residual(dead1=None, bn_pass=True, dead2=None):
    p = [bn_pass] * 8
    return Graph([
        Node("x", "input", channels=3),
        Node("c1", "conv", ["x"], 8, layer="c1", attrs={"dead": dead1}),
        Node("b1", "norm", ["c1"], 8, layer="b1", attrs={"passes_zero": p}),
        Node("r1", "activation", ["b1"], 8),
        Node("c2", "conv", ["r1"], 8, layer="c2", attrs={"dead": dead2}),
        Node("b2", "norm", ["c2"], 8, layer="b2", attrs={"passes_zero": p}),
        Node("add", "elementwise", ["b2", "r1"], 8),
        Node("r2", "activation", ["add"], 8),
        Node("c3", "conv", ["r2"], 4, layer="c3"),
        Node("out", "output", ["c3"], 4),
    ])


def test_residual_groups_couple_the_add():
    groups = channel_groups(residual())
    assert [g.layers for g in groups] == [["c1", "b1", "c2", "b2"], ["c3"]]
    assert groups[0].n == 8 and groups[0].fixed == []
    assert all(idx == list(range(8)) for _, _, idx in groups[0].members)
    assert groups[1].n == 4 and groups[1].fixed == [0, 1, 2, 3]  # feeds the model output


def test_residual_plan_removes_only_channels_dead_on_both_branches():
    d = [False] * 8
    d1 = list(d)
    d1[2] = d1[5] = True
    d2 = list(d)
    d2[5] = True
    plan = speedup_plan(residual(d1, True, d2))
    # channel 2 is dead in c1 but c2 still writes it into the add -> kept; channel 5 is dead in both
    assert plan.removed == 1
    kept = [0, 1, 2, 3, 4, 6, 7]
    assert plan.keep == {n: kept for n in ("c1", "b1", "r1", "c2", "b2", "add", "r2")}
    assert plan.layer_keep()["c3"] == {"out": None, "in": kept}
    assert plan.layer_keep()["c1"] == {"out": kept, "in": None}


def test_norm_that_does_not_pass_zero_keeps_the_channel():
    d = [False] * 8
    d[5] = True
    plan = speedup_plan(residual(d, False, d))
    assert plan.removed == 0 and plan.keep == {}


def test_concat_offsets_and_groups():
    g = Graph([
        Node("x", "input", channels=3),
        Node("a", "conv", ["x"], 4, layer="a"),
        Node("b", "conv", ["x"], 6, layer="b"),
        Node("cat", "concat", ["a", "b"], 10),
        Node("c", "conv", ["x"], 10, layer="c"),
        Node("add", "elementwise", ["cat", "c"], 10),
        Node("d", "conv", ["add"], 2, layer="d"),
        Node("out", "output", ["d"], 2),
    ])
    groups = channel_groups(g)
    assert [g.layers for g in groups] == [["a", "b", "c"], ["d"]]
    members = {m[0]: m[2] for m in groups[0].members}
    assert members == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7, 8, 9], "c": list(range(10))}
    scores = {"a": np.array([1.0, 5, 1, 5]), "b": np.array([9.0, 0, 9, 9, 9, 9]), "c": np.arange(10.0)}
    total = class_scores(ops, groups[0], scores)
    np.testing.assert_array_equal(total, [1, 6, 3, 8, 13, 5, 15, 16, 17, 18])
    keep = group_keep_classes(ops, total, groups[0], 0.3)  # floor(10 * .3) = 3 lowest: classes 0, 2, 5
    np.testing.assert_array_equal(np.flatnonzero(~keep), [0, 2, 5])
    np.testing.assert_array_equal(member_keep(ops, keep, groups[0], "a"), [False, True, False, True])
    np.testing.assert_array_equal(member_keep(ops, keep, groups[0], "b"), [True, False, True, True, True, True])


def test_fixed_classes_are_never_pruned_by_a_group():
    g = Graph([
        Node("x", "input", channels=4),
        Node("a", "conv", ["x"], 4, layer="a"),
        Node("add", "elementwise", ["a", "x"], 4),  # residual onto the model input: fixed
        Node("out", "output", ["add"], 4),
    ])
    (grp,) = channel_groups(g)
    assert grp.fixed == [0, 1, 2, 3]
    keep = group_keep_classes(ops, np.zeros(4), grp, 0.5)
    assert keep.all()


@pytest.mark.parametrize("order,expected", [("channels_first", [0, 1, 2]), ("channels_last", [0, 2, 4])])
def test_flatten_slices_per_position(order, expected):
    g = Graph([
        Node("x", "input", channels=1),
        Node("c", "conv", ["x"], 2, layer="c", attrs={"dead": [False, True]}),
        Node("f", "flatten", ["c"], 6, attrs={"positions": 3, "order": order}),
        Node("fc", "linear", ["f"], 5, layer="fc"),
        Node("out", "output", ["fc"], 5),
    ])
    plan = speedup_plan(g)
    assert plan.keep == {"c": [0], "f": expected}
    assert plan.layer_keep() == {"c": {"out": [0], "in": None}, "fc": {"out": None, "in": expected}}


@pytest.mark.parametrize("passes,removed", [(True, 1), (False, 0)])
def test_depthwise_follows_its_input(passes, removed):
    g = Graph([
        Node("x", "input", channels=3),
        Node("c", "conv", ["x"], 4, layer="c", attrs={"dead": [False, False, True, False]}),
        Node("dw", "depthwise", ["c"], 4, layer="dw", attrs={"passes_zero": [passes] * 4}),
        Node("p", "conv", ["dw"], 2, layer="p"),
        Node("out", "output", ["p"], 2),
    ])
    plan = speedup_plan(g)
    assert plan.removed == removed
    if removed:
        assert plan.layer_keep()["dw"] == {"out": [0, 1, 3], "in": [0, 1, 3]}
    groups = channel_groups(g)
    assert groups[0].layers == ["c", "dw"]


def test_depthwise_multiplier_removes_all_copies():
    g = Graph([
        Node("x", "input", channels=3),
        Node("c", "conv", ["x"], 2, layer="c", attrs={"dead": [True, False]}),
        Node("dw", "depthwise", ["c"], 4, layer="dw", attrs={"multiplier": 2, "passes_zero": [True] * 4}),
        Node("p", "conv", ["dw"], 2, layer="p"),
        Node("out", "output", ["p"], 2),
    ])
    assert speedup_plan(g).layer_keep()["dw"] == {"out": [2, 3], "in": [1]}


def other_graph():
    return Graph([
        Node("x", "input", channels=3),
        Node("c", "conv", ["x"], 4, layer="c", attrs={"dead": [True, False, False, False]}),
        Node("o", "other", ["c"], 4, op="CustomOp"),
        Node("d", "conv", ["c"], 2, layer="d"),
        Node("cat", "concat", ["o", "d"], 6),
        Node("out", "output", ["cat"], 6),
    ])


def test_unsupported_op_blocks_with_a_clear_error_or_note():
    with pytest.raises(ModelError, match="CustomOp 'o'"):
        speedup_plan(other_graph())
    plan = speedup_plan(other_graph(), strict=False)
    assert plan.keep == {} and "CustomOp 'o'" in plan.notes[0]


def test_attention_removes_whole_heads_only():
    g = Graph([
        Node("x", "input", channels=4),
        Node("att", "attention", ["x"], 6, layer="att",
             attrs={"heads": 3, "head_dim": 2, "dead": [True, True, True, False, False, False]}),
        Node("o", "linear", ["att"], 4, layer="o"),
        Node("out", "output", ["o"], 4),
    ])
    plan = speedup_plan(g)
    assert plan.heads == {"att": [1, 2]}
    assert plan.layer_keep() == {"att": {"out": [2, 3, 4, 5], "in": None, "heads": [1, 2]},
                                 "o": {"out": None, "in": [2, 3, 4, 5]}}


def test_elementwise_mul_zero_if_any_input_is_zero():
    g = Graph([
        Node("x", "input", channels=3),
        Node("a", "conv", ["x"], 2, layer="a", attrs={"dead": [True, False]}),
        Node("s", "conv", ["x"], 2, layer="s"),
        Node("g", "activation", ["s"], 2, attrs={"zero_preserving": False}),  # sigmoid gate
        Node("m", "elementwise", ["a", "g"], 2, attrs={"zero": "any"}),
        Node("p", "conv", ["m"], 2, layer="p"),
        Node("out", "output", ["p"], 2),
    ])
    plan = speedup_plan(g)
    assert plan.layer_keep() == {"a": {"out": [1], "in": None}, "s": {"out": [1], "in": None},
                                 "p": {"out": None, "in": [1]}}


def test_pruning_every_channel_is_refused():
    d = [True] * 8
    with pytest.raises(ModelError, match="every channel"):
        speedup_plan(residual(d, True, d))


def test_count_graph_sums_macs_and_params_per_layer():
    g = Graph([
        Node("x", "input", channels=3),
        Node("c", "conv", ["x"], 4, layer="c", op="Conv2d", params=112, macs=4 * 100 * 27),
        Node("c_again", "conv", ["c"], 4, layer="c", op="Conv2d", params=112, macs=5),
    ])
    macs, params, rows = count_graph(g)
    assert (macs, params) == (10805, 112)
    assert rows == [{"name": "c", "type": "Conv2d", "params": 112, "macs": 10805}]


@pytest.mark.parametrize("ins,axis,outs,expected", [
    ((2, 8, 4, 4), 1, (2, 8, 16), ("identity", 1)),          # torch flatten(2)
    ((2, 8, 16), 1, (2, 8, 4, 4), ("identity", 1)),
    ((2, 8, 4, 4), 1, (2, 128), ("flatten", (16, "channels_first"))),
    ((2, 8, 1, 1), 1, (2, 8), ("identity", 1)),               # pooled features
    ((2, 4, 4, 8), 3, (2, 128), ("flatten", (16, "channels_last"))),
    ((2, 5, 12), 2, (2, 5, 3, 4), ("other", None)),           # heads split the channel axis
    ((2, 5, 12), 2, (10, 12), ("identity", 1)),
])
def test_classify_reshape(ins, axis, outs, expected):
    assert classify_reshape(ins, axis, outs) == expected


def test_bad_graphs_are_refused():
    with pytest.raises(ValueError, match="unknown kind"):
        Node("a", "magic")
    with pytest.raises(ValueError, match="not an earlier node"):
        Graph([Node("a", "conv", ["b"], 2)])
    with pytest.raises(ModelError, match="cannot give"):
        Graph([Node("x", "input", channels=3), Node("n", "norm", ["x"], 4)]).classes()


def test_masked_but_live_channels_are_kept_and_named_in_the_notes():
    d = [False] * 8
    d[5] = True
    plan = speedup_plan(residual(d, False, d))  # the norms do not pass zero: channel 5 lives on
    assert plan.removed == 0
    assert plan.notes and plan.notes[0].startswith("kept 1 channel(s) whose filters are pruned")


def _chain(mid_kind="activation", zero_preserving=True, tail="linear"):
    return Graph([
        Node("x", "input", channels=3),
        Node("a", "linear", ["x"], 6, layer="a", op="Linear"),
        Node("f", mid_kind, ["a"], 6, op="Fn", attrs={"zero_preserving": zero_preserving}),
        Node("b", tail, ["f"], 2, layer="b", op="Linear"),
        Node("out", "output", ["b"], 2),
    ])


def test_removal_blockers_name_the_op_and_the_layer_before_it():
    from compressor.core.graph import removal_blockers

    g = _chain()
    cls = g.classes()
    a = {cls[g.slot("a", j)] for j in range(6)}
    b = {cls[g.slot("b", j)] for j in range(2)}
    # 'a' alone is removable; 'b' reaches the model output
    assert removal_blockers(g, ["a"]) == {}
    assert removal_blockers(g, ["a", "b"]) == {c: "they reach a model output, which speedup cannot cut" for c in b}
    # f(0) != 0 (sigmoid, x + 3): a's channels stay nonzero at b, named with the layer before the op
    g = _chain(zero_preserving=False)
    assert removal_blockers(g, ["a"]) == {c: "op Fn (after layer 'a') does not keep zero channels zero (f(0) != 0)"
                                          for c in a}
    # an op the graph cannot classify fixes every class it touches
    g = _chain(mid_kind="other")
    assert removal_blockers(g, ["a"]) == {c: "they reach op Fn (after layer 'a'), which speedup cannot cut" for c in a}


def test_plan_dependency_fixes_blocked_classes_and_warns_per_layer():
    from compressor.core.dependency import plan_dependency
    from compressor.core.errors import ConfigWarning

    g = Graph([
        Node("x", "input", channels=3),
        Node("a", "conv", ["x"], 4, layer="a", op="Conv2d"),
        Node("s", "conv", ["x"], 4, layer="s", op="Conv2d"),
        Node("add", "elementwise", ["a", "s"], 4, attrs={"zero": "all"}),
        Node("b", "conv", ["add"], 2, layer="b", op="Conv2d"),
        Node("out", "output", ["b"], 2),
    ])
    with pytest.warns(ConfigWarning, match=r"a: 4 of 4 channels never pruned \(4: layer 's' \(Conv2d\) shares them but "
                                           r"is not selected by the config, so they stay nonzero\)"):
        plan = plan_dependency(g, ["a"], "P")
    assert [grp.fixed for grp in plan.groups] == [[0, 1, 2, 3]]
    assert plan.skipped == {"a": ["4 of 4 channels never pruned (4: layer 's' (Conv2d) shares them but is not "
                                  "selected by the config, so they stay nonzero)"]}
    with pytest.warns(ConfigWarning, match="b: 2 of 2 channels never pruned"):
        plan = plan_dependency(g, ["a", "s", "b"], "P")
    assert [grp.fixed for grp in plan.groups] == [[], [0, 1]]


def test_norm_after_a_concat_merges_groups_but_decides_per_producer():
    # DenseNet: a norm after a concat carries two producers' channels; one decision must mask it and
    # both convs alike, and each producer still loses floor(F * s) of its own filters
    g = Graph([
        Node("x", "input", channels=3),
        Node("a", "conv", ["x"], 4, layer="a"),
        Node("b", "conv", ["a"], 2, layer="b"),
        Node("cat", "concat", ["a", "b"], 6),
        Node("bn", "norm", ["cat"], 6, layer="bn"),
        Node("c", "conv", ["bn"], 2, layer="c"),
        Node("out", "output", ["c"], 2),
    ])
    groups = channel_groups(g)
    assert [g.layers for g in groups] == [["a", "b", "bn"], ["c"]]
    grp = groups[0]
    assert grp.n == 6 and grp.fixed == [] and grp.blocks is not None and len(set(grp.blocks)) == 2
    members = {m[0]: m[2] for m in grp.members}
    assert members == {"a": [0, 1, 2, 3], "b": [4, 5], "bn": [0, 1, 2, 3, 4, 5]}
    scores = {"a": np.array([1.0, 5, 2, 6]), "b": np.array([0.5, 0.4])}
    total = class_scores(ops, grp, scores)
    # one ranking over the 6 classes would prune 5 (0.4), 4 (0.5), 0 (1.0): all of b; per producer: a loses
    # 2 of 4 (classes 0, 2), b 1 of 2 (class 5)
    keep = group_keep_classes(ops, total, grp, 0.5)
    np.testing.assert_array_equal(np.flatnonzero(~keep), [0, 2, 5])
    np.testing.assert_array_equal(member_keep(ops, keep, grp, "bn"), [False, True, False, True, True, False])
    np.testing.assert_array_equal(member_keep(ops, keep, grp, "b"), [True, False])
    keep = group_keep_classes(ops, total, grp, 0.3)  # a: floor(4 * .3) = 1, b: floor(2 * .3) = 0
    np.testing.assert_array_equal(np.flatnonzero(~keep), [0])
