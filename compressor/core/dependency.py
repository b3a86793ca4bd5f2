"""Dependency-aware channel pruning, once for both backends.

With ``dependency_aware=True`` a filter pruner prunes coupled layers (outputs meeting at an add, a
depthwise conv, a norm, a concat, ...) together: the channel groups come from
:func:`compressor.core.graph.channel_groups`; a group's importance is the sum of its scored members'
per-channel scores; exactly ``floor(P * sparsity)`` of its ``P`` prunable channels are pruned (the lowest
summed scores, ties by index); every member, the norms and depthwise convs carrying those channels
included ("followers", wrapped automatically), gets the same channels masked, weight and bias. So the
masked model has truly dead channels and :func:`~compressor.core.graph.speedup_plan` can remove them.

Choices: when members ask for different sparsities the group uses the largest; members the config does
not select are not touched (a warning names them: their channels then stay, so speedup cannot remove the
group's channels either); groups whose channels reach a model output or an op that cannot be cut are
not pruned at all (their classes are fixed).

Gradual pruning (AGP) repeats the decision at growing sparsities; passing the members' current
per-channel keep-masks (``kept``) makes it monotone: classes pruned before get the lowest score, so they
are pruned first and stay pruned.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigWarning
from .graph import (
    PRODUCERS,
    ChannelGroup,
    Graph,
    channel_groups,
    class_scores,
    group_keep_classes,
    member_keep,
)
from .pruning import prune_count
from .slimming import global_keep

__all__ = ["substitute_heads", "DependencyPlan", "plan_dependency", "follower_configs", "class_kept", "dependency_keep",
           "global_dependency_keep", "FOLLOWER_KINDS"]

#: node kinds that carry a group's channels without producing them; wrapped automatically
FOLLOWER_KINDS = ("norm", "depthwise")


@dataclass
class DependencyPlan:
    """Groups with at least one selected member; the follower layers to wrap; warnings issued."""

    groups: list[ChannelGroup]
    followers: list[str]
    warnings: list[str] = field(default_factory=list)

    def group_of(self, layer: str) -> ChannelGroup | None:
        for g in self.groups:
            if layer in g.layers:
                return g
        return None


def plan_dependency(graph: Graph, selected: Sequence[str], what: str = "pruner",
                    producers_needed: bool = True) -> DependencyPlan:
    """Which groups the selected layers belong to and which followers must be masked with them.

    ``producers_needed=False`` when masking the group's norms alone makes its channels zero (network
    slimming selects the norms): unselected convs are then no reason for a warning."""
    chosen = set(selected)
    groups, followers, notes = [], [], []
    for g in channel_groups(graph):
        if not chosen.intersection(g.layers):
            continue
        groups.append(g)
        for layer, kind, _ in g.members:
            if layer in chosen:
                continue
            if kind in FOLLOWER_KINDS:
                if layer not in followers:
                    followers.append(layer)
            elif kind in PRODUCERS and producers_needed:
                notes.append(f"{what}: layer {layer!r} shares channels with {sorted(chosen.intersection(g.layers))} "
                             f"but is not selected by the config; it keeps all its channels, so the group's "
                             f"pruned channels cannot be removed by speedup. Select it too")
        if len(g.fixed) == g.n:
            notes.append(f"{what}: the channels of {sorted(chosen.intersection(g.layers))} reach a model output or "
                         f"an op that cannot be cut; dependency-aware pruning leaves them unpruned")
    for n in notes:
        warnings.warn(n, ConfigWarning, stacklevel=3)
    return DependencyPlan(groups=groups, followers=followers, warnings=notes)


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
