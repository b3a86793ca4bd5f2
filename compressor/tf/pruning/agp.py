"""AGPPruner: automated gradual pruning (Zhu & Gupta 2017) over any built-in criterion.

The target sparsity of each layer follows core ``agp_sparsity`` on the epoch clock (``update_epoch``,
which :class:`~compressor.tf.hooks.CompressionCallback` calls at each epoch begin); masks are recomputed
only on the epochs core ``agp_should_update`` names (start, every ``frequency`` epochs, up to the last ramp
epoch). Weight criteria (level, l1, l2, fpgm, slim) recompute at ``update_epoch``, eagerly on the device,
between train steps. Data criteria (apoz, mean_activation, taylorfo) collect ``statistics_batch_num``
batches after that epoch starts and recompute in the optimizer hook, in-graph, under ``tf.cond`` on a
per-layer ``agp_pending`` variable; the epoch's target sparsity is a trace-time constant, so
``update_epoch`` retraces the model's ``fit``/``predict`` functions on such epochs (retrace a custom
``tf.function`` loop yourself). Masks are monotone.

``dependency_aware=True`` (filter criteria; the Functional graph gives the coupling, ``dummy_input`` is
not needed): coupled layers (:mod:`compressor.core.dependency`) get one decision per group on every
schedule update, at the epoch's target sparsity (summed member scores; slim: one global ranking over the
groups), channels pruned at earlier updates first; norms and depthwise convs carrying the channels are
masked with them. Weight criteria decide eagerly at ``update_epoch``; data criteria in-graph, one
``tf.cond`` per group.

``sparse_pattern: 'N:M'`` (``pruning_algorithm='level'``): as on torch, the final sparsity is the
pattern's ``(M - N) / M``, the last schedule update gives exactly N:M, and every intermediate update prunes
exactly ``floor(n * s_t)`` weights among those the N:M groups may still drop (at most ``M - N`` per group;
core :func:`~compressor.core.pruning.nm_mask`), so the masks are identical to torch's at every update.

Config keys, their validation, the schedule and its driver (which layers are due at an epoch, the pending
set, statistics on/off, checkpoints) are core's (:class:`compressor.core.agp.AGPScheduleMixin`); this module
keeps what touches the framework.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ... import tf_plugin
from ...core.agp import AGPScheduleMixin, agp_schedule, resolve_agp_criteria
from ...core.matching import LayerInfo
from .activation import ActivationAPoZRankFilterPrunerMasker, ActivationMeanRankFilterPrunerMasker
from .dependency import DependencyAwareMixin
from .filters import FPGMPrunerMasker, L1FilterPrunerMasker, L2FilterPrunerMasker
from .level import LevelPrunerMasker, check_nm_layer
from .masker import WeightMasker
from .pruner import TfPruner
from .slim import BN_TYPES, SlimPrunerMasker
from .taylor import TaylorFOWeightFilterPrunerMasker

__all__ = ["AGPPruner", "AGP_CRITERIA", "agp_schedule"]

#: pruning_algorithm -> (masker class, what op_types 'default' means); the table is core's
AGP_CRITERIA: dict[str, tuple[type[WeightMasker], tuple[str, ...]]] = resolve_agp_criteria(
    (LevelPrunerMasker, L1FilterPrunerMasker, L2FilterPrunerMasker, FPGMPrunerMasker, SlimPrunerMasker,
     ActivationAPoZRankFilterPrunerMasker, ActivationMeanRankFilterPrunerMasker, TaylorFOWeightFilterPrunerMasker),
    {"weighted": tf_plugin.DEFAULT_TYPES, "filter": ("Conv2D",), "bn": BN_TYPES})


class AGPPruner(AGPScheduleMixin, DependencyAwareMixin, TfPruner):
    """Gradual pruning from ``initial_sparsity`` to ``final_sparsity`` with ``pruning_algorithm`` as criterion."""

    config_keys = ("sparse_pattern",)
    AGP_CRITERIA = AGP_CRITERIA

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None,
                 pruning_algorithm: str = "level", statistics_batch_num: int = 1, activation: str = "relu",
                 dependency_aware: bool = False, dummy_input: Any = None) -> None:
        self._agp_setup(pruning_algorithm, statistics_batch_num, activation, dependency_aware)
        self._init_dependency(dependency_aware, dummy_input, self._masker_class)
        self.masks_bias = pruning_algorithm != "level"
        super().__init__(model, config_list, optimizer)
        self.set_wrappers_attribute("agp_pending", tf.constant(False))
        self._agp_start(model, activation, statistics_batch_num)

    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)
        self._masker_class.check_layer(layer_info, layer)
        check_nm_layer(layer_info, layer, config, type(self).__name__)

    # ------------------------------------------------------------ schedule
    def _on_layers_due(self, due: set[int]) -> None:
        for idx in due:
            self.modules_wrapper[idx].agp_pending = True
        self.masker.start_statistics()
        if self.masker.needs_data:
            self._retrace()  # the epoch's target sparsity is traced into the step

    def _on_wrapper_ready(self, wrapper: Any, deferred: bool = False) -> None:
        self.masker.wrapper_ready(wrapper, self._wrapper_index(wrapper))
        if not deferred:  # deferred: still pending, computed in-graph by the next step
            super()._on_wrapper_ready(wrapper)

    def update_epoch(self, epoch: int) -> None:
        """Advance the clock; on a schedule epoch, recompute masks (data criteria: once statistics are in)."""
        self.sync()
        super().update_epoch(epoch)

    def _recompute_now(self) -> None:
        with tf.init_scope():
            self.update_mask()

    def calc_mask(self, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        """Eager: the masks at the epoch's target once due (and statistics are in), else None."""
        idx = self._wrapper_index(wrapper) if wrapper_idx is None else wrapper_idx
        if idx not in self._pending or not bool(self.masker.statistics_ready(idx)):
            return None
        if self._dependency is not None and idx in self._grouped_indices():
            return None  # decided with its group (update_mask)
        masks = self.masker.calc_mask(self.target_sparsity(idx), wrapper, idx)
        wrapper.agp_pending = False
        self._done(idx)
        return masks

    # ------------------------------------------------------------ dependency-aware groups
    def _due_groups(self) -> list[Any]:
        """Groups with a member whose masks are due (pending) at this schedule update."""
        return [g for g in self._dependency.groups if any(i in self._pending for i in self._group_members(g)[0])]

    def _set_group_masks(self, decision: dict[int, dict[str, Any]]) -> None:
        for i, masks in decision.items():
            w = self.modules_wrapper[i]
            w.set_masks(masks)
            w.apply_masks()
            w.agp_pending = False

    def update_mask(self) -> None:
        """Dependency-aware and eager: one monotone decision per due group whose statistics are ready
        (slim: one over all of them), at the epoch's target; then the layers outside groups."""
        if self._dependency is not None and not tf.inside_function():
            due = [g for g in self._due_groups() if bool(self._group_ready(g))]
            batches = [due] if self._rank_globally and due else [[g] for g in due]
            for groups in batches:
                decision = self._group_decision(groups, self.target_sparsity, monotone=True)
                self._set_group_masks(decision)
                for i in decision:
                    self._done(i)
        super().update_mask()

    def _update_groups_in_step(self) -> None:
        """In-graph: each due group gets its monotone decision once its statistics are ready (``tf.cond``
        on the readiness and its members' ``agp_pending``; slim: one cond over all due groups)."""
        due = [(g, self._group_ready(g)) for g in self._due_groups()]
        due = [(g, r) for g, r in due if r is not False]
        batches = [due] if self._rank_globally and due else [[d] for d in due]
        for batch in batches:
            groups = [g for g, _ in batch]
            ready = [tf.convert_to_tensor(r) for _, r in batch]
            pending = [self.modules_wrapper[i].agp_pending for g in groups for i in self._group_members(g)[0]]
            cond = tf.logical_and(tf.reduce_all(tf.stack(ready)), tf.reduce_any(tf.stack(pending)))

            def compute(groups: list[Any] = groups) -> Any:
                self._set_group_masks(self._group_decision(groups, self.target_sparsity, monotone=True))
                return tf.constant(True)

            tf.cond(cond, compute, lambda: tf.constant(False))

    def _gradients_hook(self, pairs: list[tuple[Any, Any]]) -> None:
        if self._pending:
            self.masker.after_step(pairs)

    def _update_in_step(self) -> None:
        if not self._pending:
            return
        if not tf.inside_function():
            self.update_mask()
            return
        grouped: set[int] = set()
        if self._dependency is not None:
            self._update_groups_in_step()
            grouped = self._grouped_indices()
        for idx in sorted(self._pending):
            if idx in grouped:
                continue
            wrapper = self.modules_wrapper[idx]
            ready = self.masker.statistics_ready(idx)
            if not wrapper.ready or ready is False:
                continue
            sparsity = self.target_sparsity(idx)

            def compute(w: Any = wrapper, i: int = idx, s: float = sparsity) -> Any:
                masks = self.masker.calc_mask(s, w, i)
                if masks is not None:
                    w.set_masks(masks)
                w.apply_masks()
                w.agp_pending = False
                return tf.constant(True)

            due = tf.logical_and(tf.convert_to_tensor(ready), wrapper.agp_pending)
            tf.cond(due, compute, lambda: tf.constant(False))

    def sync(self) -> None:
        """Eager bookkeeping between steps: note layers whose pending masks were computed in-graph."""
        for idx in sorted(self._pending):
            w = self.modules_wrapper[idx]
            if w.ready and not bool(w.agp_pending.numpy()):
                self._done(idx)

    def state_dict(self) -> dict[str, Any]:
        self.sync()
        return super().state_dict()

    def _on_pending_loaded(self) -> None:
        for idx, w in enumerate(self.modules_wrapper):
            w.agp_pending = idx in self._pending
