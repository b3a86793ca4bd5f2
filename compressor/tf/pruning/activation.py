"""Activation-rank filter pruners: ActivationAPoZRankFilterPruner, ActivationMeanRankFilterPruner.

Statistics of ``activation(output)`` per output channel (the last axis of a channels-last Keras output)
are collected by an activation collector, inside the traced graph, for ``statistics_batch_num`` calls of
each layer, as running sums in variables on the device (core ``activation_stats``; no per-batch tensors
kept, no host copies; a ``tf.cond`` stops adding after the last batch). Masks are computed in the
optimizer hook once a layer's statistics are in. The collector is removed at the next eager sync
(``update_epoch``, the callback's epoch begin) after every layer has its masks. Under tf.distribute each
batch's statistics are summed over the replicas before they are added (:mod:`compressor.tf.distributed`),
so every replica ranks the channels of the global batch.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...core.matching import LayerInfo
from ...core.pruner_config import (
    ACTIVATIONS,
    ActivationPrunerArgs,
    check_activation,
    check_statistics_batch_num,
)
from ...core.pruning import (
    activation_stats,
    apoz_importance,
    mean_activation_importance,
)
from .. import layout
from ..distributed import all_reduce_sum
from ..ops import ops
from .masker import WeightMasker, batches_ready, check_filter_layer, importance_filter_result
from .pruner import FILTER_DEFAULT_TYPES, OneShotPruner

__all__ = [
    "ACTIVATIONS", "ActivationAPoZRankFilterPruner", "ActivationAPoZRankFilterPrunerMasker", "ActivationFilterMasker",
    "ActivationMeanRankFilterPruner", "ActivationMeanRankFilterPrunerMasker", "check_activation",
]

_STATS = ("act_zeros", "act_total", "act_count")


def _channels(wrapper: Any) -> int:
    return wrapper.canonical_shape()[0]


class ActivationFilterMasker(WeightMasker):
    """Filter criterion from per-channel activation statistics; subclasses pick the importance."""

    needs_data = True

    def __init__(self, model: Any, pruner: Any, activation: str = "relu", statistics_batch_num: int = 1) -> None:
        super().__init__(model, pruner)
        self.activation = check_activation(activation, type(pruner).__name__)
        self.statistics_batch_num = check_statistics_batch_num(statistics_batch_num, type(pruner).__name__)
        self._index = {id(w): i for i, w in enumerate(pruner.get_modules_wrapper())}
        self._collector_id: int | None = None
        for idx, w in enumerate(pruner.get_modules_wrapper()):
            if w.ready:
                self.wrapper_ready(w, idx)

    @classmethod
    def check_layer(cls, layer_info: LayerInfo, layer: Any) -> None:
        check_filter_layer(layer_info, layer, cls.__name__)

    def wrapper_ready(self, wrapper: Any, wrapper_idx: int) -> None:
        c = _channels(wrapper)
        for name in _STATS:
            wrapper.add_state(name, tf.zeros([c], tf.float32))
        wrapper.add_state("act_batches", tf.constant(0, tf.int64))

    def start_statistics(self) -> None:
        for w in self.pruner.get_modules_wrapper():
            if w.ready:
                for name in _STATS:
                    getattr(w, name).assign(tf.zeros_like(getattr(w, name)))
                w.act_batches.assign(0)
        if self._collector_id is None:
            self._collector_id = self.pruner.add_activation_collector(self._collect)

    def stop_statistics(self) -> None:
        if self._collector_id is not None:
            self.pruner.remove_activation_collector(self._collector_id)
            self._collector_id = None

    def _collect(self, wrapper: Any, inputs: Any, output: Any) -> None:
        if id(wrapper) not in self._index or "act_batches" not in wrapper.state_variables():
            return
        out = tf.cast(tf.stop_gradient(output), tf.float32)
        if "heads_of" in wrapper.config:  # attention value [..., heads, head_dim]: one channel per context feature
            out = tf.reshape(out, tf.concat([tf.shape(out)[:-2], [out.shape[-2] * out.shape[-1]]], 0))
        axis = layout.channel_axis(wrapper.layer)
        stats = activation_stats(ops, out, axis, self.activation)
        if self.pruner.sync_ranks:  # the global batch's statistics on every replica (outside the cond)
            stats = all_reduce_sum(*stats)

        def add() -> Any:
            for name, x in zip(_STATS, stats):
                getattr(wrapper, name).assign_add(x)
            wrapper.act_batches.assign_add(1)
            return tf.constant(True)

        tf.cond(wrapper.act_batches < self.statistics_batch_num, add, lambda: tf.constant(False))

    def statistics_ready(self, wrapper_idx: int) -> Any:
        return batches_ready(self.pruner.get_modules_wrapper()[wrapper_idx], "act_batches", self.statistics_batch_num)

    def importance(self, wrapper: Any) -> Any:
        raise NotImplementedError

    def filter_importance(self, wrapper: Any) -> Any:
        """Per-channel importance (dependency-aware pruning sums it over coupled layers)."""
        return self.importance(wrapper)

    def calc_mask(self, sparsity: float, wrapper: Any, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        return importance_filter_result(wrapper, self.importance(wrapper), sparsity)


class ActivationAPoZRankFilterPrunerMasker(ActivationFilterMasker):
    """APoZ (Hu et al. 2016): prune the channels whose activations are most often zero."""

    def importance(self, wrapper: Any) -> Any:
        return apoz_importance(ops, tf.convert_to_tensor(wrapper.act_zeros), tf.convert_to_tensor(wrapper.act_count))


class ActivationMeanRankFilterPrunerMasker(ActivationFilterMasker):
    """Mean activation (Molchanov et al. 2017): prune the channels with the smallest mean activation."""

    def importance(self, wrapper: Any) -> Any:
        return mean_activation_importance(ops, tf.convert_to_tensor(wrapper.act_total),
                                          tf.convert_to_tensor(wrapper.act_count))


class _ActivationPruner(ActivationPrunerArgs, OneShotPruner):
    default_types = FILTER_DEFAULT_TYPES
    default_skips_classifier = True


class ActivationAPoZRankFilterPruner(_ActivationPruner):
    """Filters ranked by APoZ over ``statistics_batch_num`` calls after ``compress()``."""

    masker_class = ActivationAPoZRankFilterPrunerMasker


class ActivationMeanRankFilterPruner(_ActivationPruner):
    """Filters ranked by mean activation over ``statistics_batch_num`` calls after ``compress()``."""

    masker_class = ActivationMeanRankFilterPrunerMasker
