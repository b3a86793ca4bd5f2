"""Dependency-aware channel pruning for Keras pruners (:mod:`compressor.core.dependency`), as a mixin.

:class:`DependencyAwareMixin` gives a :class:`~compressor.tf.pruning.pruner.TfPruner` with a filter masker
(``self.masker``, ``filter_importance(wrapper)``) what a dependency-aware pruner needs besides its own
clock: the followers (norms, depthwise convs carrying a group's channels, config key ``follower_of``)
wrapped from the Functional graph, the group members of a channel group, whether a group's statistics are
ready (a bool, or a bool tensor in-graph) and one group decision (graph-safe: eager or inside the traced
step), optionally monotone (channels the members have pruned already go first) and, for network
slimming, one global ranking over groups. :class:`~compressor.tf.pruning.agp.AGPPruner` uses it.

A wrapper whose config has ``heads_of`` stands for that attention layer in the channel graph (its value
projection).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ...core.errors import ConfigError, ConfigWarning
from ...core.matching import LayerInfo

__all__ = ["DependencyAwareMixin"]


class DependencyAwareMixin:
    """Channel groups for a Keras pruner; call :meth:`_init_dependency` before ``TfPruner.__init__`` (which
    calls :meth:`_extra_layers` and :meth:`_filter_selected`)."""

    #: False when masking a group's norms alone zeroes its channels (slimming selects the norms)
    _group_producers_needed = True
    #: True: one global ranking over every group (network slimming) instead of one decision per group
    _rank_globally = False

    def _init_dependency(self, dependency_aware: Any, dummy_input: Any = None, masker_class: Any = None) -> None:
        """Check the arguments before anything is wrapped (``masker_class``: the criterion, default
        ``self.masker_class``). ``dummy_input`` is not needed on Keras (the Functional graph gives the
        coupling); it is accepted, as on torch, and ignored."""
        self.dependency_aware = _check_dependency_args(self, dependency_aware, masker_class)
        self._dependency: Any = None

    @staticmethod
    def _member(config: dict[str, Any], name: str) -> str:
        """A wrapped layer's name in the channel graph: the attention layer for a value projection."""
        return config.get("heads_of", name)

    def _extra_layers(self, model: Any, selected: list[tuple[LayerInfo, dict[str, Any]]], layers: list[LayerInfo],
                      by_name: dict[str, Any]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        #: dependency-aware: ``{selected layer: why}`` of the layers left unwrapped (speedup could never shrink them)
        self.skipped: dict[str, str] = {}
        if not self.dependency_aware:
            return []
        from ...core.dependency import follower_configs, plan_dependency
        from ..graph import build_graph

        graph, _ = build_graph(model)
        self.skipped = _unprunable(graph, [self._member(cfg, info.name) for info, cfg in selected])
        if self.skipped:
            warnings.warn(f"{type(self).__name__}: {len(self.skipped)} selected layer(s) keep all their channels "
                          f"(speedup could not remove any): "
                          + "; ".join(f"{k!r}: {v}" for k, v in self.skipped.items())
                          + " (pruner.skipped lists them)", ConfigWarning, stacklevel=4)
            selected = [(i, c) for i, c in selected if self._member(c, i.name) not in self.skipped]
        names = [self._member(cfg, info.name) for info, cfg in selected]
        plan = plan_dependency(graph, names, type(self).__name__, producers_needed=self._group_producers_needed)
        for _info, cfg in selected:
            if "heads_of" in cfg and plan.group_of(cfg["heads_of"]) is None:
                raise ConfigError(f"{type(self).__name__}: the heads of {cfg['heads_of']!r} cannot be pruned: speedup "
                                  f"cannot cut them (a gated attention, or projections without one bias layout)")
        self._dependency = plan
        info_of = {info.name: info for info in layers}
        config_of = {self._member(cfg, info.name): cfg for info, cfg in selected}
        return [(info_of[name], cfg) for name, cfg in follower_configs(plan, config_of)]

    def _filter_selected(self, selected: list[tuple[LayerInfo, dict[str, Any]]]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """The selection without :attr:`skipped` (left unwrapped: speedup could never shrink them)."""
        skipped = getattr(self, "skipped", {})  # set by _extra_layers
        return [(i, c) for i, c in selected if self._member(c, i.name) not in skipped]

    def _group_members(self, group: Any) -> tuple[list[int], list[int]]:
        """(indices of the group's wrapped members, indices of those the config selected: the scored ones)."""
        index = {self._member(w.config, w.name): i for i, w in enumerate(self.modules_wrapper)}
        members = [index[layer] for layer in group.layers if layer in index]
        return members, [i for i in members if "follower_of" not in self.modules_wrapper[i].config]

    def _grouped_indices(self) -> set[int]:
        """Wrapper indices of every group member (the rest are masked layer by layer)."""
        return {i for g in self._dependency.groups for i in self._group_members(g)[0]}

    def _group_ready(self, group: Any) -> Any:
        """Whether every scored member is built and its statistics are ready: a bool, or a bool tensor in-graph."""
        import tensorflow as tf

        members, scored = self._group_members(group)
        if not scored or not all(self.modules_wrapper[i].ready for i in members):
            return False
        ready: Any = True
        for i in scored:
            r = self.masker.statistics_ready(i)
            if r is False:
                return False
            ready = r if ready is True else tf.logical_and(ready, r)
        return ready

    def _group_decision(self, groups: Any, sparsity_of: Callable[[int], float] | None = None,
                        monotone: bool = False) -> dict[int, dict[str, Any]]:
        """Masks (Keras layout) of every wrapped member of ``groups`` (one group or several) from one
        decision per group over summed member scores at the largest ``sparsity_of(wrapper_idx)`` of its
        scored members (default: ``self.sparsity_for``), or one global ranking over all of them
        (``_rank_globally``). ``monotone``: channels the members have pruned already go first.
        Graph-safe: called eagerly or inside the traced step."""
        from ...core.dependency import plan_keeps
        from ...core.pruning import expand_filter_mask, filter_keep_from_mask
        from ..ops import ops
        from .masker import filter_result

        groups = [groups] if not isinstance(groups, Sequence) else list(groups)
        wrappers = self.modules_wrapper
        if sparsity_of is None:
            sparsity_of = lambda i: self.sparsity_for(wrappers[i], i)  # noqa: E731
        name = {i: self._member(w.config, w.name) for i, w in enumerate(wrappers)}
        plans, member_ids = [], []
        for group in groups:
            members, scored = self._group_members(group)
            scores = {name[i]: self.masker.filter_importance(wrappers[i]) for i in scored}
            kept = {name[i]: filter_keep_from_mask(ops, wrappers[i].canonical_mask()) for i in members} if monotone else None
            plans.append((group, [name[i] for i in members], scores, max(sparsity_of(i) for i in scored), kept))
            member_ids.append(members)
        keeps = plan_keeps(ops, plans, self._rank_globally, monotone)
        out = {}
        for members in member_ids:
            for i in members:
                w = wrappers[i]
                keep = keeps[name[i]]
                out[i] = filter_result(w, expand_filter_mask(ops, keep, w.canonical_shape()), keep)
        return out


def _check_dependency_args(pruner: Any, dependency_aware: Any, masker_class: Any = None) -> bool:
    """Refuse a bad ``dependency_aware`` before anything is traced or wrapped (``masker_class``: the criterion,
    default ``pruner.masker_class``; Keras needs no dummy input: the Functional graph is known)."""
    what = type(pruner).__name__
    masker_class = pruner.masker_class if masker_class is None else masker_class
    if not isinstance(dependency_aware, bool):
        raise ConfigError(f"{what}: dependency_aware must be True or False, got {dependency_aware!r}")
    if dependency_aware and not hasattr(masker_class, "filter_importance"):
        raise ConfigError(f"{what}: dependency_aware=True needs a filter criterion (L1, L2, FPGM, APoZ, mean "
                          f"activation, Taylor FO); {masker_class.__name__} has no per-filter importance")
    return dependency_aware


def _unprunable(graph: Any, names: Sequence[str]) -> dict[str, str]:
    """``{layer: why}`` for the selected layers whose channels speedup can never remove: in no channel
    group (a depthwise conv or norm fed by an op that cannot be cut, e.g. a LayerNormalization) or in a
    group whose every channel is fixed (it reaches a model output or such an op), with the ops that fix them."""
    from ...core.graph import channel_groups

    groups = channel_groups(graph)
    in_group = {layer: g for g in groups for layer in g.layers}
    cls = graph.classes()
    blockers = graph.blockers()
    out: dict[str, str] = {}
    for name in names:
        g = in_group.get(name)
        if g is not None and len(g.fixed) < g.n:
            continue
        nodes = [n for n in graph.nodes if n.layer == name]
        by = []
        for n in nodes:
            b = graph.offset[n.name]
            for j in range(n.channels):
                blk = blockers.get(cls[b + j])
                if blk is not None and blk.describe() not in by:
                    by.append(blk.describe())
        if nodes:
            out[name] = "its channels reach " + (", ".join(by[:3]) + (" ..." if len(by) > 3 else "") if by
                                                 else "no layer that produces them")
    return out
