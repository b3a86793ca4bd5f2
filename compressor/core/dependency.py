"""Dependency-aware channel pruning, once for both backends.

With ``dependency_aware=True`` a filter pruner prunes coupled layers (outputs meeting at an add, a
depthwise conv, a norm, a concat, ...) together: the channel groups come from
:func:`compressor.core.graph.channel_groups`; a group's importance is the sum of its scored members'
per-channel scores; exactly ``floor(P * sparsity)`` of its ``P`` prunable channels are pruned (the lowest
summed scores, ties by index); every member, the norms and depthwise convs carrying those channels
included ("followers", wrapped automatically), gets the same channels masked, weight and bias. So the
masked model has truly dead channels and :func:`~compressor.core.graph.speedup_plan` can remove them.

Choices: when members ask for different sparsities the group uses the largest; a pruner chooses only
channels speedup can remove (:func:`plan_dependency`): channels that reach a model output or an op that
cannot be cut, or that a coupled layer the config does not select still writes, are not pruned, and one
warning lists per layer what was skipped and why.

Gradual pruning (AGP) repeats the decision at growing sparsities; passing the members' current
per-channel keep-masks (``kept``) makes it monotone: classes pruned before get the lowest score, so they
are pruned first and stay pruned.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigWarning
from .graph import (
    ChannelGroup,
    Graph,
    channel_groups,
    class_scores,
    group_keep_classes,
    member_keep,
)
from .pruning import prune_count
from .slimming import global_keep

__all__ = ["substitute_heads", "DependencyPlan", "plan_dependency", "follower_configs", "class_kept", "dependency_keep", "plan_keeps",
           "global_dependency_keep", "FOLLOWER_KINDS"]

#: node kinds that carry a group's channels without producing them; wrapped automatically
FOLLOWER_KINDS = ("norm", "depthwise")


@dataclass
class DependencyPlan:
    """Groups with at least one selected member; the follower layers to wrap; warnings issued."""

    groups: list[ChannelGroup]
    followers: list[str]
    warnings: list[str] = field(default_factory=list)
    #: selected layer -> why some or all of its channels are not pruned
    skipped: dict[str, list[str]] = field(default_factory=dict)

    def group_of(self, layer: str) -> ChannelGroup | None:
        for g in self.groups:
            if layer in g.layers:
                return g
        return None


def plan_dependency(graph: Graph, selected: Sequence[str], what: str = "pruner",
                    producers_needed: bool = True) -> DependencyPlan:
    """Which groups the selected layers belong to, which followers must be masked with them, and which
    channels a dependency-aware pruner may choose at all.

    A pruner may only choose channels that speedup can remove (:func:`~compressor.core.graph.removal_blockers`,
    decided here once for both backends): a class that would stay (it reaches a model output, an op the
    graph cannot classify, a grouped conv, a split; a coupled layer the config does not select still
    writes it; an op turns its zeros into nonzeros) is made *fixed* in its group, so it is never pruned.
    Selected layers that belong to no group (the trace did not reach them, they are inside a module traced
    as one node, or they are an op speedup cannot slice) are not pruned either (``plan.skipped``). One
    ``ConfigWarning`` lists per layer what was skipped and why.

    ``producers_needed``: kept for callers; whether unselected producers matter is read off the graph (a
    norm that is masked zeroes its channels whatever the conv before it writes, as network slimming needs)."""
    from .graph import removal_blockers

    chosen = set(selected)
    groups, followers = [], []
    for g in channel_groups(graph):
        if not chosen.intersection(g.layers):
            continue
        groups.append(g)
        for layer, kind, _ in g.members:
            if layer not in chosen and kind in FOLLOWER_KINDS and layer not in followers:
                followers.append(layer)
    blocked = removal_blockers(graph, chosen | set(followers))
    skipped: dict[str, list[str]] = {}
    for g in groups:
        fixed = set(g.fixed)
        why: dict[str, int] = {}
        for i, c in enumerate(g.classes):
            if i in fixed or c in blocked:
                fixed.add(i)
                r = blocked.get(c, "they cannot be cut")
                why[r] = why.get(r, 0) + 1
        if g.unit > 1:  # a head goes whole or not at all
            fixed |= {k for i in fixed for k in range(i - i % g.unit, i - i % g.unit + g.unit)}
        if fixed:
            reasons = "; ".join(f"{k}: {r}" for r, k in sorted(why.items(), key=lambda kv: -kv[1]))
            for name in sorted(chosen.intersection(g.layers)):
                skipped.setdefault(name, []).append(f"{len(fixed)} of {g.n} channels never pruned ({reasons})")
        g.fixed = sorted(fixed)
    layer_kind = {n.layer: n for n in graph.nodes if n.layer is not None and n.kind not in ("input", "output")}
    grouped = {layer for g in groups for layer in g.layers}
    for name in selected:
        if name in grouped or name in skipped:
            continue
        n = layer_kind.get(name)
        block = next((a.layer for a in graph.nodes if a.kind == "attention" and a.layer
                      and name.startswith(a.layer + ".")), None)
        if block is not None:
            reason = (f"it is a projection inside the attention block {block!r}, which is pruned by whole heads: "
                      f"name that block's type in op_types to prune heads")
        elif n is not None and n.kind in FOLLOWER_KINDS:
            reason = (f"it only carries the channels of the layers before it ({n.kind}), and no selected layer "
                      f"produces channels that speedup could remove there")
        elif n is None:
            reason = "the trace on dummy_input does not reach it (not run on that input, or inside a module traced as one node)"
        else:
            reason = f"its channels are not channels speedup can cut ({n.describe()} is of kind {n.kind!r})"
        skipped[name] = [f"not pruned: {reason}"]
    notes = []
    if skipped:
        lines = "\n".join(f"  {layer}: {'; '.join(r)}" for layer, r in skipped.items())
        notes.append(f"{what}: dependency-aware pruning chooses only channels speedup can remove; skipped:\n{lines}")
    for n in notes:
        warnings.warn(n, ConfigWarning, stacklevel=3)
    return DependencyPlan(groups=groups, followers=followers, warnings=notes, skipped=skipped)


def follower_configs(plan: DependencyPlan, config_of: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """``(follower layer, config)`` of every follower of ``plan`` to wrap: the config of the first
    selected member of its group (``config_of``: selected layer -> config) plus ``follower_of`` = that
    member. Both backends' dependency-aware pruners wrap these besides the config's layers."""
    out = []
    for name in plan.followers:
        group = plan.group_of(name)
        leader = next(layer for layer in group.layers if layer in config_of)
        out.append((name, {**config_of[leader], "follower_of": leader}))
    return out


def class_kept(ops: Any, group: ChannelGroup, member_kept: dict[str, Any] | None) -> Any:
    """Per-class bool of ``group``: False where some member's channel of that class is already pruned.
    ``member_kept`` maps members to their current per-channel keep-masks (see
    :func:`compressor.core.pruning.filter_keep_from_mask`); None when no member is given."""
    pruned = {name: ops.cast(ops.logical_not(k), "float32") for name, k in (member_kept or {}).items()
              if name in group.layers}
    if not pruned:
        return None
    return ops.logical_not(ops.greater(class_scores(ops, group, pruned), 0.5))


def _lowest_first(ops: Any, scores: Any, kept: Any) -> Any:
    """``scores`` with the classes not ``kept`` below every score (finite: fixed classes may add inf)."""
    if kept is None:
        return scores
    lo = ops.min(scores)
    return ops.where(kept, scores, ops.reshape(lo - ops.abs(lo) - 1.0, (1,)) + ops.zeros_like(scores))


def dependency_keep(ops: Any, group: ChannelGroup, member_scores: dict[str, Any], sparsity: float,
                    layers: Sequence[str] | None = None, kept: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-channel keep-masks of the group's ``layers`` (default: every member) from summed scores.

    ``kept``: the members' current per-channel keep-masks; classes pruned in any of them are pruned
    first (monotone gradual pruning: at a sparsity at least the previous one they stay pruned)."""
    scores = _lowest_first(ops, class_scores(ops, group, member_scores), class_kept(ops, group, kept))
    keep = group_keep_classes(ops, scores, group, sparsity)
    names = group.layers if layers is None else layers
    return {name: member_keep(ops, keep, group, name) for name in names}


def global_dependency_keep(ops: Any, groups: Sequence[ChannelGroup], member_scores: dict[str, Any], sparsity: float,
                           layers: Sequence[str] | None = None, kept: dict[str, Any] | None = None) -> dict[str, Any]:
    """Network slimming over groups: ONE ranking of every group's summed class scores, the
    ``floor(P * sparsity)`` lowest of all ``P`` prunable classes pruned (every group keeps a class; ties
    spread evenly over the groups, :func:`~compressor.core.slimming.global_keep`); per-channel keep-masks
    of ``layers`` (default: every member of every group). ``kept``: as in :func:`dependency_keep`
    (classes already pruned anywhere go first)."""
    totals, sizes, fixed_all, kept_all, prunable = [], [], [], [], 0
    for g in groups:
        s = class_scores(ops, g, member_scores)
        k = class_kept(ops, g, kept)
        totals.append(s)
        kept_all.append(ops.ones_like(s, "bool") if k is None else k)
        fixed = set(g.fixed)
        fixed_all.extend(float("inf") if i in fixed else 0.0 for i in range(g.n))
        sizes.append(g.n)
        prunable += g.n - len(g.fixed)
    if not totals:
        return {}
    scores = ops.concat(totals, axis=0)
    if kept is not None:
        scores = _lowest_first(ops, scores, ops.concat(kept_all, axis=0))
    if any(fixed_all):
        scores = scores + ops.asarray(fixed_all, like=scores)
    # every group keeps a class; ties at the threshold are spread evenly over the groups
    parts, _ = global_keep(ops, ops.split(scores, sizes, 0), prune_count(prunable, sparsity),
                           [len(g.fixed) + 1 for g in groups])
    keep = ops.concat(parts, axis=0)
    wanted = None if layers is None else set(layers)
    out = {}
    for g, k in zip(groups, ops.split(keep, sizes, 0)):
        for name in g.layers:
            if wanted is None or name in wanted:
                out[name] = member_keep(ops, k, g, name)
    return out


def substitute_heads(selected: Sequence[tuple[Any, dict[str, Any]]],
                     heads: dict[str, tuple[Any, dict[str, Any]]]) -> list[tuple[Any, dict[str, Any]]]:
    """The selection with every selected attention layer replaced by its value projection
    (``heads[attention name] = (value layer info, config with 'heads_of')``); a value projection the config
    also selected on its own is wrapped once, as the attention's."""
    if not heads:
        return list(selected)
    values = {v[0].name for v in heads.values()}
    out = []
    for info, cfg in selected:
        if info.name in heads:
            out.append(heads[info.name])
        elif info.name not in values:
            out.append((info, cfg))
    return out


def plan_keeps(ops: Any, plans: Sequence[tuple[Any, Sequence[str], Mapping[str, Any], float, Mapping[str, Any] | None]],
               rank_globally: bool, monotone: bool) -> dict[str, Any]:
    """The kept channels of every member of the planned groups, as both backends' dependency-aware pruners decide
    them. ``plans``: one ``(group, member names, scores by member, sparsity, kept so far by member or None)`` per
    group; ``rank_globally``: one ranking over all groups' channels (slimming), else one decision per group;
    ``monotone``: channels pruned before stay pruned."""
    if rank_globally:
        return global_dependency_keep(ops, [p[0] for p in plans], {k: v for p in plans for k, v in p[2].items()},
                                      max(p[3] for p in plans),
                                      kept={k: v for p in plans for k, v in (p[4] or {}).items()} if monotone else None)
    keeps: dict[str, Any] = {}
    for group, members, scores, sparsity, kept in plans:
        keeps.update(dependency_keep(ops, group, scores, sparsity, list(members), kept=kept))
    return keeps

