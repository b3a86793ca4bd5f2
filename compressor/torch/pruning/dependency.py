"""Dependency-aware channel pruning for PyTorch pruners (:mod:`compressor.core.dependency`), as a mixin.

:class:`DependencyAwareMixin` gives a :class:`~compressor.torch.pruning.pruner.TorchPruner` with a filter
masker (``self.masker``, ``filter_importance(wrapper, wrapper_idx)``) what a dependency-aware pruner needs
besides its own clock: the value projections of selected attention modules wrapped in their place (config
key ``heads_of``), the followers (norms, depthwise convs carrying a group's channels, config key
``follower_of``) wrapped from one trace of ``dummy_input``, the group members of a channel group, whether a
group's statistics are ready and one group decision, optionally monotone (channels the members have pruned
already go first) and, for network slimming, one global ranking over groups.
:class:`~compressor.torch.pruning.pruner.OneShotPruner` and :class:`~compressor.torch.pruning.agp.AGPPruner`
use it. The Keras mirror is :mod:`compressor.tf.pruning.dependency`.

A wrapper whose config has ``heads_of`` stands for that attention module in the channel graph (its value
projection).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ...core.dependency import substitute_heads
from ...core.errors import ConfigError
from ...core.matching import LayerInfo

__all__ = ["DependencyAwareMixin"]


class DependencyAwareMixin:
    """Channel groups for a PyTorch pruner; call :meth:`_init_dependency` before ``TorchPruner.__init__``
    (which calls :meth:`_substitute_layers` and :meth:`_extra_layers`)."""

    #: False when masking a group's norms alone zeroes its channels (slimming selects the norms)
    _group_producers_needed = True
    #: True: one global ranking over every group (network slimming) instead of one decision per group
    _rank_globally = False

    def _init_dependency(self, dependency_aware: Any, dummy_input: Any, masker_class: Any = None) -> None:
        """Check the arguments (before anything is traced or wrapped) and keep ``dummy_input`` for the trace
        (``masker_class``: the criterion, default ``self.masker_class``)."""
        self.dependency_aware = _check_dependency_args(self, dependency_aware, dummy_input, masker_class)
        self._dummy_input = dummy_input
        self._dependency: Any = None

    @staticmethod
    def _member(config: dict[str, Any], name: str) -> str:
        """A wrapped layer's name in the channel graph: the attention module for a value projection."""
        return config.get("heads_of", name)

    def _substitute_layers(self, selected: list[tuple[LayerInfo, dict[str, Any]]], layers: list[LayerInfo],
                           modules: dict[str, nn.Module]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """Attention heads: a selected attention module (``op_types: ['BertSelfAttention']``, see
        :func:`~compressor.torch.graph.attention_spec`) is pruned by whole heads through its VALUE
        projection: that Linear is wrapped (config key ``heads_of`` = the attention module) and its rows
        of the pruned heads masked, weight and bias, so the heads' context is zero and speedup removes
        them. Needs ``dependency_aware=True`` (the head decision is the attention group's)."""
        from ..graph import attention_spec
        from ..modules import innermost_module

        info_of = {info.name: info for info in layers}
        heads: dict[str, tuple[LayerInfo, dict[str, Any]]] = {}
        for info, cfg in selected:
            spec = attention_spec(innermost_module(modules[info.name]))
            if spec is None:
                continue
            if not self.dependency_aware:
                raise ConfigError(
                    f"{type(self).__name__}: layer {info.name!r} ({info.type}) is an attention module; its heads "
                    f"are pruned with dependency_aware=True and dummy_input=... (a filter criterion)")
            value = f"{info.name}.{spec['v']}" if info.name else spec["v"]
            heads[info.name] = (info_of[value], {**cfg, "heads_of": info.name})
        return substitute_heads(selected, heads)

    def _extra_layers(self, model: nn.Module, selected: list[tuple[LayerInfo, dict[str, Any]]],
                      layers: list[LayerInfo], modules: dict[str, nn.Module]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """The followers of the selected layers' channel groups, traced on ``dummy_input``."""
        if not self.dependency_aware:
            return []
        from ...core.dependency import follower_configs, plan_dependency
        from ..graph import build_graph

        graph, _ = build_graph(model, self._dummy_input)
        plan = plan_dependency(graph, [self._member(cfg, info.name) for info, cfg in selected], type(self).__name__,
                               producers_needed=self._group_producers_needed)
        for _info, cfg in selected:
            group = plan.group_of(cfg["heads_of"]) if "heads_of" in cfg else None
            if "heads_of" in cfg and (group is None or group.unit <= 1):
                raise ConfigError(
                    f"{type(self).__name__}: the heads of {cfg['heads_of']!r} cannot be pruned: on dummy_input the "
                    f"trace does not see it as one attention block whose heads speedup can cut (its input must "
                    f"come from a layer, its context must feed a projection)")
        self._dependency = plan
        info_of = {info.name: info for info in layers}
        config_of = {self._member(cfg, info.name): cfg for info, cfg in selected}
        return [(info_of[name], cfg) for name, cfg in follower_configs(plan, config_of)]

    def _member_index(self) -> dict[str, int]:
        """Group member name -> wrapper index (an attention module's member is its value projection)."""
        index = {name: i for i, name in enumerate(self._wrapper_names)}
        for i, w in enumerate(self.modules_wrapper):
            if "heads_of" in w.config:
                index[w.config["heads_of"]] = i
        return index

    def _member_names(self, group: Any, index: dict[str, int]) -> tuple[list[str], list[str]]:
        """(the group's wrapped members, those the config selected: the scored ones), by graph name."""
        members = [layer for layer in group.layers if layer in index]
        return members, [layer for layer in members if "follower_of" not in self.modules_wrapper[index[layer]].config]

    def _group_members(self, group: Any, index: dict[str, int] | None = None) -> tuple[list[int], list[int]]:
        """(indices of the group's wrapped members, indices of those the config selected: the scored ones);
        ``index``: :meth:`_member_index`, when the caller has it already."""
        index = self._member_index() if index is None else index
        members, scored = self._member_names(group, index)
        return [index[layer] for layer in members], [index[layer] for layer in scored]

    def _grouped_indices(self) -> set[int]:
        """Wrapper indices of every group member (the rest are masked layer by layer)."""
        index = self._member_index()
        return {i for g in self._dependency.groups for i in self._group_members(g, index)[0]}

    def _ungrouped_indices(self) -> set[int]:
        """Wrapper indices of the selected layers that belong to no group (never masked)."""
        return set(range(len(self.modules_wrapper))) - self._grouped_indices()

    def _group_ready(self, group: Any, index: dict[str, int] | None = None) -> bool:
        """Whether the group has a scored member and every scored member's statistics are ready."""
        _members, scored = self._group_members(group, index)
        return bool(scored) and all(self.masker.statistics_ready(i) for i in scored)

    def _group_decision(self, groups: Any, sparsity_of: Callable[[int], float] | None = None,
                        monotone: bool = False) -> dict[int, dict[str, Any]]:
        """Masks of every wrapped member of ``groups`` (one group or several), by wrapper index, from one
        decision per group over summed member scores at the largest ``sparsity_of(wrapper_idx)`` of its
        scored members (default: ``self.sparsity_for``), or one global ranking over all of them
        (``_rank_globally``). ``monotone``: channels the members have pruned already go first."""
        from ...core.dependency import plan_keeps
        from ...core.pruning import expand_filter_mask, filter_keep_from_mask
        from ..layout import canonical_shape, from_canonical, to_canonical
        from ..ops import ops

        groups = [groups] if not isinstance(groups, Sequence) else list(groups)
        wrappers = self.modules_wrapper
        if sparsity_of is None:
            sparsity_of = lambda i: self.sparsity_for(wrappers[i], i)  # noqa: E731
        index = self._member_index()
        plans = []
        for group in groups:
            members, scored = self._member_names(group, index)
            scores = {layer: self.masker.filter_importance(wrappers[index[layer]], index[layer]) for layer in scored}
            kept = ({layer: filter_keep_from_mask(ops, to_canonical(wrappers[index[layer]],
                                                                   wrappers[index[layer]].weight_mask))
                     for layer in members}
                    if monotone else None)
            plans.append((group, members, scores, max(sparsity_of(index[layer]) for layer in scored), kept))
        keeps = plan_keeps(ops, plans, self._rank_globally, monotone)
        out: dict[int, dict[str, Any]] = {}
        for _group, members, *_ in plans:
            for layer in members:
                w = wrappers[index[layer]]
                keep = keeps[layer]
                masks = {"weight_mask": from_canonical(w, expand_filter_mask(ops, keep,
                                                                             canonical_shape(w, w.weight.shape)))}
                if w.bias_mask is not None:
                    masks["bias_mask"] = keep.reshape(w.bias_mask.shape)  # a GRN's beta is [1, 1, 1, C]
                out[index[layer]] = masks
        return out

    def _group_round(self, due: Callable[[int], bool], sparsity_of: Callable[[int], float],
                     monotone: bool = False) -> list[int]:
        """One decision per channel group with a member ``due(wrapper_idx)``, once its statistics are ready
        (:meth:`_group_ready`; slimming: one global ranking over all of them), the same channels masked in
        every member (followers included). Returns the wrapper indices masked."""
        index = self._member_index()
        groups = [g for g in self._dependency.groups
                  if any(due(i) for i in self._group_members(g, index)[0]) and self._group_ready(g, index)]
        decision = self._group_decision(groups, sparsity_of, monotone) if groups else {}
        for i, masks in decision.items():
            self.modules_wrapper[i].set_masks(masks)
        return list(decision)


def _check_dependency_args(pruner: Any, dependency_aware: Any, dummy_input: Any, masker_class: Any = None) -> bool:
    """Refuse bad ``dependency_aware`` / ``dummy_input`` before anything is traced or wrapped
    (``masker_class``: the criterion, default ``pruner.masker_class``)."""
    what = type(pruner).__name__
    masker_class = pruner.masker_class if masker_class is None else masker_class
    if not isinstance(dependency_aware, bool):
        raise ConfigError(f"{what}: dependency_aware must be True or False, got {dependency_aware!r}")
    if not dependency_aware:
        return False
    if not hasattr(masker_class, "filter_importance"):
        raise ConfigError(f"{what}: dependency_aware=True needs a filter criterion (L1, L2, FPGM, APoZ, mean "
                          f"activation, Taylor FO); {masker_class.__name__} has no per-filter importance")
    if dummy_input is None:
        raise ConfigError(f"{what}: dependency_aware=True needs dummy_input= (a tensor, a tuple of tensors or a "
                          f"dict of keyword arguments for the model's forward) to trace the channel dependencies")
    return True
