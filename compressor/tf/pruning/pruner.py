"""``TfPruner`` (alias ``Pruner``): wraps Keras layers in :class:`PrunerLayerWrapper` and keeps masks current.

Clock (mirror of torch): ``compress()`` computes the first masks (eagerly, on the device). After every
optimizer update the optimizer hook runs, inside the traced train step: the step counter is incremented,
the pruned weights are zeroed again (``apply_masks``), gradient statistics are taken (Taylor), then
masks are updated: ``calc_mask(wrapper, wrapper_idx)`` for every wrapper (the seeds' contract: return
``{'weight_mask': ..., 'bias_mask': ...}`` in the layer's Keras layout, or None). Python state read by
``calc_mask`` (e.g. ``wrapper.if_calculated = True`` set by an eager ``compress()``) is a trace-time
constant; state that changes inside the graph must be a variable (``set_wrappers_attribute`` with a
tensor) and branch with ``tf.cond``, as the built-in pruners do.

:class:`OneShotPruner` is the base of the built-in one-shot pruners: one masker, masks computed once per
layer (as soon as the masker's statistics are ready: in-graph ``tf.cond`` on a per-wrapper
``if_calculated`` variable), never recomputed. A user subclass that overrides ``calc_mask`` (a class outside
this package) gets it called after every optimizer update (in the traced step), as the seeds promise;
the built-ins keep their no-recompute fast path.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ...core.clock import user_override
from ...core.dependency import substitute_heads
from ...core.errors import ConfigError
from ...core.interrupts import commit_changes, deferred_interrupts, record_undo, undone_on_error
from ...core.matching import LayerInfo
from ...core.pruner_config import MASK_NAMES
from .. import layout
from ..compressor import Compressor
from .dependency import DependencyAwareMixin
from .masker import WeightMasker
from .wrapper import PrunerLayerWrapper

__all__ = ["TfPruner", "Pruner", "OneShotPruner"]

MASK_MODES = ("inplace", "forward")


class TfPruner(Compressor):
    """Base of all TF pruners; subclasses implement :meth:`calc_mask`.

    ``mask_mode``: ``'inplace'`` (default; zero pruned weights after each update, no forward cost) or
    ``'forward'`` (mask in every call); see :mod:`compressor.tf.pruning.wrapper`.
    """

    _kind = "pruner"
    mask_mode = "inplace"
    #: False for criteria that never mask the bias (level, sensitivity, lottery): the step skips re-masking it
    masks_bias = True

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None) -> None:
        if self.mask_mode not in MASK_MODES:
            raise ConfigError(f"{type(self).__name__}: mask_mode = {self.mask_mode!r} is invalid; allowed: {list(MASK_MODES)}")
        self._compressed = False
        self._deferred: set[int] = set()
        super().__init__(model, config_list, optimizer)
        self.current_epoch = 0

    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        if getattr(layer, "built", False) and layout.weight_of(layer, layer_info.extra.get("slot")) is None:
            raise ConfigError(f"{type(self).__name__}: layer {layer_info.name!r} ({layer_info.type}) has no weight "
                              f"to prune; prunable: {layout.KNOWN_WEIGHTS}")

    def _create_wrapper(self, layer: Any, layer_info: LayerInfo, config: dict[str, Any]) -> PrunerLayerWrapper:
        return PrunerLayerWrapper(layer, layer_info, config, self)

    # ---------------------------------------------------------------- masks
    def calc_mask(self, wrapper: PrunerLayerWrapper, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        """Masks of ``wrapper`` now (Keras layout), or None to keep its current masks."""
        raise NotImplementedError(f"{type(self).__name__} must implement calc_mask()")

    def update_mask(self) -> None:
        """Run ``calc_mask`` on every (built) wrapper, store returned masks and re-mask those layers."""
        for idx, wrapper in enumerate(self.modules_wrapper):
            if not wrapper.ready:
                continue
            masks = self.calc_mask(wrapper, wrapper_idx=idx)
            if masks is not None:
                wrapper.set_masks(masks)
                wrapper.apply_masks()

    def apply_masks(self) -> None:
        """Zero the pruned weights of every wrapped layer in place (graph-safe)."""
        for wrapper in self.modules_wrapper:
            wrapper.apply_masks()

    def compress(self) -> Any:
        """Compute the initial masks (eagerly, even when called while tracing) and return the model.
        A Ctrl-C while it runs takes effect when it has finished; an error (a ``calc_mask`` raising) puts every mask
        it set back: the model is as before."""
        self._refresh_ready()
        self._masks_in_one_commit(self.update_mask)
        return self.model

    def _masks_in_one_commit(self, compute: Any) -> None:
        """``compute()`` sets masks (eagerly); the weights are then masked all at once. A Ctrl-C meanwhile takes
        effect when it has finished; if ``compute()`` raises, the masks it set are put back and the pruner is not
        marked compressed (the model as before)."""
        was = self._compressed
        with deferred_interrupts():
            self._compressed = True
            try:
                with tf.init_scope(), undone_on_error():
                    self._undoable_round()
                    compute()
                    commit_changes()
                    self.apply_masks()
            except BaseException:
                self._compressed = was
                raise

    def _undoable_round(self) -> None:
        """What a mask round changes besides the masks, put back too if it does not finish: the pruner's own
        state and its wrappers' other state variables (``if_calculated``, statistics)."""
        kept = [(v, v.numpy().copy()) for w in self.modules_wrapper if w.ready
                for name, v in w.state_variables().items() if name not in MASK_NAMES]
        state = self.state_dict()

        def undo() -> None:
            self.load_state_dict(state)
            for v, value in kept:
                v.assign(value)
        record_undo(("pruner", id(self)), undo, change=False)

    def _refresh_ready(self) -> None:
        """Eager bookkeeping: masks for layers built since wrapping but not called yet (``model.build``);
        forget deferred layers whose initial masks the graph has computed."""
        for wrapper in self.modules_wrapper:
            if not wrapper.ready:
                wrapper._ensure_ready()
        for idx in sorted(self._deferred):
            if bool(self.modules_wrapper[idx].masks_initialized.numpy()):
                self._deferred.discard(idx)

    def _on_wrapper_ready(self, wrapper: PrunerLayerWrapper, deferred: bool = False) -> None:
        """A layer built after wrapping just got masks (called eagerly): compute them if compress() ran.

        ``deferred``: the layer was built inside a trace and its weights cannot be read yet; the initial
        masks are computed in-graph by the next optimizer step (:meth:`_deferred_in_graph`).
        """
        if not self._compressed:
            return
        if deferred:
            wrapper.add_state("masks_initialized", tf.constant(False))
            self._deferred.add(self._wrapper_index(wrapper))
            return
        self._initial_masks(wrapper)

    def _initial_masks(self, wrapper: PrunerLayerWrapper) -> Any:
        masks = self.calc_mask(wrapper, wrapper_idx=self._wrapper_index(wrapper))
        if masks is not None:
            wrapper.set_masks(masks)
        wrapper.apply_masks()
        return tf.constant(True)

    def _deferred_in_graph(self) -> None:
        """Initial masks of layers built inside a trace, once, under ``tf.cond`` (graph-safe)."""
        for idx in sorted(self._deferred):
            w = self.modules_wrapper[idx]

            def init(w: PrunerLayerWrapper = w) -> Any:
                self._initial_masks(w)
                w.masks_initialized = True
                return tf.constant(True)

            tf.cond(w.masks_initialized, lambda: tf.constant(False), init)

    def _after_optimizer_apply(self, grads: Any, variables: Any) -> None:
        self._step.assign_add(1)
        self.apply_masks()  # momentum / weight decay moved pruned weights: zero them before any statistics
        self._deferred_in_graph()
        self._gradients_hook([(g, v) for g, v in zip(grads, variables) if g is not None])
        self._update_in_step()

    def step(self) -> None:
        """After an optimizer update you made yourself (unhooked optimizer): count it, re-mask, update masks."""
        self._step.assign_add(1)
        self.apply_masks()
        self._deferred_in_graph()
        self._update_in_step()

    def _update_in_step(self) -> None:
        self.update_mask()

    def update_epoch(self, epoch: int) -> None:
        self._refresh_ready()
        super().update_epoch(epoch)
        self.current_epoch = int(epoch)

    def _wrapper_index(self, wrapper: Any) -> int:
        for i, w in enumerate(self.modules_wrapper):
            if w is wrapper:
                return i
        raise ValueError(f"{getattr(wrapper, 'name', wrapper)!r} is not a wrapper of this pruner")

    # ---------------------------------------------------------------- state, export, report
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch": self.current_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.current_epoch = int(state.get("epoch", 0))

    def export_model(self, model_path: str | None = None, mask_path: str | None = None,
                     saved_model_path: str | None = None, tflite_path: str | None = None,
                     compressed_path: str | None = None) -> Any:
        """Save the plain (unwrapped) model with masked weights: ``.keras`` file, SavedModel, masks
        (``.npz``: layer name -> mask) and/or TFLite flatbuffer; loadable without compressor installed.
        ``compressed_path``: also its weights (by Keras path) as a compressed file (kept values, positions,
        entropy coded; :mod:`compressor.core.cmpk`), read by ``compressor.unpack`` / ``load_compressed``.
        The pruner stays installed; returns the model."""
        from .export import export_pruned_model

        self._refresh_ready()
        return export_pruned_model(self, model_path, mask_path, saved_model_path, tflite_path, compressed_path)

    def export_masks(self, mask_path: str) -> None:
        """Save ``{layer name: weight mask, 'layer name:bias': bias mask}`` (bool, Keras layout) as ``.npz``."""
        from .export import save_masks

        self._refresh_ready()
        save_masks(self, mask_path)

    def report(self, flops: bool = False, strict: bool = False) -> Any:
        """Per-layer and total sparsity: a list of dicts whose ``str()`` is a table. With ``flops=True``
        also dense vs after-speedup params and MACs (the speedup builds a new model; this one is kept)."""
        from .report import sparsity_report

        self._refresh_ready()
        return sparsity_report(self, flops=flops, strict=strict)


Pruner = TfPruner


#: what ``op_types: ['default']`` means for filter pruners (Dense filters are output features)
FILTER_DEFAULT_TYPES = ("Conv1D", "Conv2D", "Conv3D", "Dense")


class OneShotPruner(DependencyAwareMixin, TfPruner):
    """Masks each layer once with ``masker_class`` at its config's ``sparsity``."""

    masker_class: type[WeightMasker] = WeightMasker
    required_keys = ("sparsity",)

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None,
                 dependency_aware: bool = False, dummy_input: Any = None, **masker_kwargs: Any) -> None:
        self._init_dependency(dependency_aware, dummy_input)
        self._pending: dict[int, Any] = {}
        super().__init__(model, config_list, optimizer)
        self._calculated: set[int] = set()
        self.set_wrappers_attribute("if_calculated", tf.constant(False))
        self.masker = self.masker_class(model, self, **masker_kwargs)

    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)
        if "heads_of" not in config:  # an attention value projection: filters = context channels
            self.masker_class.check_layer(layer_info, layer)

    def sparsity_for(self, wrapper: PrunerLayerWrapper, wrapper_idx: int) -> float:
        return wrapper.config["sparsity"]

    def _all_calculated(self) -> bool:
        return len(self._calculated) == len(self.modules_wrapper)

    def compress(self) -> Any:
        if not self._all_calculated():
            self.masker.start_statistics()
        return super().compress()

    def _on_wrapper_ready(self, wrapper: PrunerLayerWrapper, deferred: bool = False) -> None:
        self.masker.wrapper_ready(wrapper, self._wrapper_index(wrapper))
        if not deferred:  # deferred: the in-graph one-shot update below computes it at the first step
            super()._on_wrapper_ready(wrapper)

    def _compute(self, idx: int, wrapper: PrunerLayerWrapper) -> Any:
        masks = self.masker.calc_mask(self.sparsity_for(wrapper, idx), wrapper, idx)
        if masks is None:
            return tf.constant(False)
        wrapper.set_masks(masks)
        wrapper.apply_masks()
        wrapper.if_calculated = True
        return tf.constant(True)

    #: ``op_types: ['default']`` leaves out the model's classifier (layers whose filters are model outputs)
    default_skips_classifier = False

    def _default_selection(self, selected: list[tuple[LayerInfo, dict[str, Any]]],
                           model: Any) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """``selected`` without the layers whose output channels are model outputs (the classifier) that
        only ``'default'`` selected (a layer named by type or name stays): their filters are the model's
        outputs, which pruning must not change. Functional / Sequential models only."""
        from ...core.errors import ModelError
        from ...core.matching import expand_op_types
        from ..graph import is_graph_model, output_producers

        def by_default(info: LayerInfo, cfg: dict[str, Any]) -> bool:
            types = [t for t in cfg.get("op_types", ()) if t != "default"]
            return ("default" in cfg.get("op_types", ()) and info.type not in expand_op_types(types, ())
                    and info.name not in cfg.get("op_names", ()))

        if not self.default_skips_classifier or not any(by_default(i, c) for i, c in selected):
            return selected
        if not is_graph_model(model):
            return selected
        try:
            outputs = output_producers(model)
        except ModelError:  # an unbuilt Sequential: its graph (and classifier) is not known yet
            return selected
        return [(i, c) for i, c in selected if not (by_default(i, c) and i.name in outputs)]

    # -- dependency-aware pruning (core.dependency; weight criteria, computed eagerly in compress())
    def _substitute_layers(self, selected: list[tuple[LayerInfo, dict[str, Any]]], layers: list[LayerInfo],
                           by_name: dict[str, Any]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """Attention heads (mirror of torch): a selected ``MultiHeadAttention`` is pruned by whole heads
        through its VALUE projection: that EinsumDense sub-layer (``'<mha>/value'``) is wrapped (config key
        ``heads_of`` = the attention layer's path) and the kernel columns ``[:, head, :]`` and bias rows of
        the pruned heads masked, so the heads' context is zero and speedup removes them. Needs
        ``dependency_aware=True`` (the head decision is the attention group's: core block pruning in
        units of ``head_dim``) and a built layer. Without ``dependency_aware`` the attention layer is pruned
        matrix by matrix instead (``query`` / ``key`` / ``value`` / ``attention_output`` kernels, see
        :mod:`compressor.tf.slots`)."""
        import keras

        selected = self._default_selection(selected, self.bound_model)
        heads: dict[str, tuple[LayerInfo, dict[str, Any]]] = {}
        info_of = {info.name: info for info in layers}
        for info, cfg in selected:
            layer = by_name[info.name]
            if not isinstance(layer, keras.layers.MultiHeadAttention):
                continue
            what = f"{type(self).__name__}: layer {info.name!r} ({info.type})"
            if not self.dependency_aware:
                if hasattr(getattr(self, "masker_class", None), "filter_importance"):
                    raise ConfigError(f"{what} is an attention layer; a filter criterion prunes its heads, with "
                                      f"dependency_aware=True")
                continue  # pruned weight by weight: one slot per projection kernel (compressor.tf.slots)
            dense = getattr(layer, "_value_dense", None) if layer.built else None
            value = next((p for p in info_of if p.startswith(info.name + "/") and by_name[p] is dense), None)
            if dense is None or value is None or layout.weight_of(dense) is None or len(dense.kernel.shape) != 3:
                raise ConfigError(f"{what}: its heads are pruned through its value projection, a built EinsumDense "
                                  f"with a [input, heads, head_dim] kernel; build the model first (call it on "
                                  f"data or keras.Input)")
            heads[info.name] = (info_of[value], {**cfg, "heads_of": info.name})
        return substitute_heads(selected, heads)

    def _group_masks(self, wrapper: PrunerLayerWrapper, idx: int) -> dict[str, Any] | None:
        """Eager: ``wrapper``'s masks from its group's decision, once all scored members are ready."""
        if idx not in self._pending:
            group = self._dependency.group_of(self._member(wrapper.config, wrapper.name))
            if not bool(self._group_ready(group)):
                return None
            self._pending.update(self._group_decision(group))
        return self._pending.pop(idx)

    def _update_groups_in_step(self) -> None:
        """In-graph: each group not yet masked gets its masks once its statistics are ready (tf.cond)."""
        for group in self._dependency.groups:
            members, scored = self._group_members(group)
            if not scored or all(i in self._calculated for i in members):
                continue
            if not all(self.modules_wrapper[i].ready for i in members):
                continue
            ready = self._group_ready(group)
            if ready is False:
                continue
            lead = self.modules_wrapper[scored[0]]

            def compute(group: Any = group) -> Any:
                for i, masks in self._group_decision(group).items():
                    w = self.modules_wrapper[i]
                    w.set_masks(masks)
                    w.apply_masks()
                    w.if_calculated = True
                return tf.constant(True)

            tf.cond(tf.logical_and(tf.convert_to_tensor(ready), tf.logical_not(lead.if_calculated)), compute,
                    lambda: tf.constant(False))

    def calc_mask(self, wrapper: PrunerLayerWrapper, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        """Eager: the masks once the statistics are ready, then None forever."""
        idx = self._wrapper_index(wrapper) if wrapper_idx is None else wrapper_idx
        if idx in self._calculated or not bool(self.masker.statistics_ready(idx)):
            return None
        grouped = (self._dependency is not None
                   and self._dependency.group_of(self._member(wrapper.config, wrapper.name)) is not None)
        masks = (self._group_masks(wrapper, idx) if grouped
                 else self.masker.calc_mask(self.sparsity_for(wrapper, idx), wrapper, idx))
        if masks is None:
            return None
        wrapper.if_calculated = True
        self._calculated.add(idx)
        if self._all_calculated():
            self.masker.stop_statistics()
        return masks

    def update_mask(self) -> None:
        if tf.inside_function():
            self._update_in_step()
        else:
            super().update_mask()

    def _gradients_hook(self, pairs: list[tuple[Any, Any]]) -> None:
        if not self._all_calculated():
            self.masker.after_step(pairs)

    def _update_in_step(self) -> None:
        """In-graph: each layer not yet masked gets its masks once its statistics are ready (tf.cond).
        A user's ``calc_mask`` (a subclass overriding it) instead runs at every step, as the seeds say."""
        if user_override(self, "calc_mask"):
            TfPruner.update_mask(self)
            return
        if self._all_calculated():
            return
        if not tf.inside_function():
            super().update_mask()
            return
        grouped: set[int] = set()
        if self._dependency is not None:
            self._update_groups_in_step()
            grouped = {i for g in self._dependency.groups for i in self._group_members(g)[0]}
        for idx, wrapper in enumerate(self.modules_wrapper):
            if idx in self._calculated or not wrapper.ready or idx in grouped:
                continue
            ready = self.masker.statistics_ready(idx)
            if ready is False:
                continue
            due = tf.logical_and(tf.convert_to_tensor(ready), tf.logical_not(wrapper.if_calculated))
            tf.cond(due, lambda i=idx, w=wrapper: self._compute(i, w), lambda: tf.constant(False))

    def sync(self) -> None:
        """Eager bookkeeping between steps: note layers masked in-graph; stop statistics when all are."""
        if self._all_calculated():
            return
        for idx, wrapper in enumerate(self.modules_wrapper):
            if wrapper.ready and bool(wrapper.if_calculated.numpy()):
                self._calculated.add(idx)
        if self._all_calculated():
            self.masker.stop_statistics()

    def update_epoch(self, epoch: int) -> None:
        super().update_epoch(epoch)
        self.sync()

    def state_dict(self) -> dict[str, Any]:
        self.sync()
        return {**super().state_dict(), "calculated": sorted(self._calculated)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._calculated = set(state.get("calculated", ()))
        for idx, wrapper in enumerate(self.modules_wrapper):
            wrapper.if_calculated = idx in self._calculated
        if self._all_calculated():
            self.masker.stop_statistics()
