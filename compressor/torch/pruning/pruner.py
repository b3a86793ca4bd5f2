"""``TorchPruner`` (alias ``Pruner``): wraps layers in :class:`PrunerModuleWrapper` and keeps masks current.

Clock: ``compress()`` computes the first masks; after every ``optimizer.step()`` the optimizer hook
calls :meth:`TorchPruner.step`, which calls ``calc_mask(wrapper, wrapper_idx)`` for every wrapper
(the seeds' contract: return ``{'weight_mask': ..., 'bias_mask': ...}`` or None, or assign
``wrapper.weight_mask`` yourself) and re-masks the weights in place.

:class:`OneShotPruner` is the base of the built-in one-shot pruners: one masker, masks computed once per
layer (as soon as the masker's statistics are ready), never recomputed. A user subclass that overrides
``calc_mask`` (a class outside this package, :func:`~compressor.core.clock.user_override`) gets it called
after every ``optimizer.step()``, as the seeds promise; the built-ins keep their no-recompute fast path.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ...core.clock import user_override
from ...core.dependency import substitute_heads
from ...core.errors import ConfigError, ModelError
from ...core.matching import LayerInfo
from ..compressor import Compressor
from .masker import WeightMasker
from .wrapper import PrunerModuleWrapper

__all__ = ["TorchPruner", "Pruner", "OneShotPruner", "DependencyAwareMixin"]


_ACCEPTS_IDX: dict[Any, bool] = {}


def _accepts_wrapper_idx(fn: Any) -> bool:
    """Seed examples define ``calc_mask(self, wrapper)``, ``(wrapper, **kwargs)`` or ``(wrapper, wrapper_idx=None)``."""
    key = getattr(fn, "__func__", fn)
    if key not in _ACCEPTS_IDX:
        try:
            params = inspect.signature(fn).parameters.values()
            _ACCEPTS_IDX[key] = any(p.name == "wrapper_idx" or p.kind is inspect.Parameter.VAR_KEYWORD
                                    for p in params)
        except (TypeError, ValueError):
            _ACCEPTS_IDX[key] = True
    return _ACCEPTS_IDX[key]


class TorchPruner(Compressor):
    """Base of all PyTorch pruners; subclasses implement :meth:`calc_mask`."""

    _kind = "pruner"

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: torch.optim.Optimizer | None = None):
        super().__init__(model, config_list, optimizer)
        self.current_epoch = 0
        self._mask_round = 0

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise ConfigError(
                f"{type(self).__name__}: layer {layer_info.name!r} ({layer_info.type}) has no weight tensor to prune"
            )

    def _create_wrapper(self, module: nn.Module, layer_info: LayerInfo, config: dict[str, Any]) -> nn.Module:
        return PrunerModuleWrapper(module, layer_info.name, layer_info.type, config, self)

    # ---------------------------------------------------------------- masks
    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        """Masks of ``wrapper`` now, or None to keep its current masks."""
        raise NotImplementedError(f"{type(self).__name__} must implement calc_mask()")

    def update_mask(self) -> None:
        """Run ``calc_mask`` on every wrapper, store returned masks, and re-mask changed layers."""
        self._mask_round += 1
        pass_idx = _accepts_wrapper_idx(self.calc_mask)
        for idx, wrapper in enumerate(self.modules_wrapper):
            masks = self.calc_mask(wrapper, wrapper_idx=idx) if pass_idx else self.calc_mask(wrapper)
            if masks is not None:
                wrapper.set_masks(masks)
        self.apply_masks()

    def apply_masks(self) -> None:
        """Re-mask in place every layer whose weights or masks changed since it was last masked
        (after an optimizer step: all that were stepped), in one multi-tensor multiply."""
        stale = [w for w in self.modules_wrapper if w._versions() != w._seen]
        if not stale:
            return
        tensors: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        for w in stale:
            w._mask_pairs(tensors, masks)
        with torch.no_grad():
            try:
                torch._foreach_mul_(tensors, masks)
            except RuntimeError:
                check_not_sharded(tensors, type(self).__name__)
                raise
        for w in stale:
            w._mark_masked()

    def compress(self) -> nn.Module:
        """Compute the initial masks and return the (wrapped) model."""
        self.update_mask()
        return self.bound_model

    def mark_weights_stale(self) -> None:
        """Make the next :meth:`apply_masks` re-mask every layer: the optimizer hook calls it after a fused
        optimizer step, whose kernels move the weights without bumping the version counters that
        :meth:`apply_masks` reads to find the layers that moved."""
        for w in self.modules_wrapper:
            object.__setattr__(w, "_seen", None)

    def step(self) -> None:
        """After ``optimizer.step()``: update masks, then zero the pruned weights the step moved."""
        self.update_mask()

    def update_epoch(self, epoch: int) -> None:
        self.current_epoch = int(epoch)

    def _wrapper_index(self, wrapper: nn.Module) -> int:
        for i, w in enumerate(self.modules_wrapper):
            if w is wrapper:
                return i
        raise ValueError(f"{getattr(wrapper, 'name', wrapper)!r} is not a wrapper of this pruner")

    # ---------------------------------------------------------------- state, export, report
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.current_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current_epoch = int(state.get("epoch", 0))

    def export_model(self, model_path: str | None, mask_path: str | None = None, onnx_path: str | None = None,
                     input_shape: tuple[int, ...] | None = None, device: Any = None, dummy_input: Any = None,
                     compressed_path: str | None = None, hf_path: str | None = None, hf_sparse_format: str = "dense",
                     **onnx_kwargs: Any) -> None:
        """Save a state_dict loadable into the ORIGINAL model class (pruned weights zeroed), optionally
        the masks (``{layer: {'weight': mask, 'bias': mask}}``) and an ONNX file checked with onnxruntime.
        ONNX inputs: ``dummy_input`` (a tensor, a tuple, or a dict of keyword arguments such as
        ``{'input_ids': ids, 'attention_mask': mask}``) or ``input_shape`` (a random float tensor); the
        graph has dynamic batch (and token sequence) axes; ``onnx_kwargs`` go to ``torch.onnx.export``.
        ``compressed_path``: also the same state_dict as a compressed file (kept values, positions, entropy
        coded; :mod:`compressor.core.packing`), read by ``compressor.unpack`` / ``load_compressed``.
        ``hf_path``: a Hugging Face model as a compressed-tensors checkpoint folder (pruned layers stored as
        ``hf_sparse_format``: ``'dense'``, ``'bitmask'``, ``'2:4'`` or ``'auto'``; one-shot quantized layers
        of a quantizer composed on top packed; see :mod:`compressor.torch.hf_checkpoint`); ``model_path``
        may then be None."""
        from .. import families
        from .export import export_pruned_model

        if hf_path is not None:
            families.save_checkpoint(self.bound_model, hf_path, sparse_format=hf_sparse_format)
            if model_path is None and mask_path is None and onnx_path is None and compressed_path is None:
                return

        export_pruned_model(self, model_path, mask_path, onnx_path, input_shape, device, dummy_input,
                            compressed_path=compressed_path, **onnx_kwargs)

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state_dict of the original model (or of the wrapped model) into the wrapped model."""
        from .export import load_into_wrapped

        load_into_wrapped(self, state)

    def report(self, dummy_input: Any = None, strict: bool = False) -> Any:
        """Per-layer and total sparsity: a list of dicts whose ``str()`` is a table. With ``dummy_input``
        also dense vs after-speedup params and MACs (the speedup runs on a copy)."""
        from .report import sparsity_report

        return sparsity_report(self, dummy_input=dummy_input, strict=strict)


Pruner = TorchPruner


def check_not_sharded(tensors: list[torch.Tensor], what: str) -> None:
    """Explain the failure of masking parameters that FSDP has sharded (DTensors): masks are full-size
    tensors and the criteria need whole weights, so pruning under FSDP is not supported."""
    if any(type(t).__name__ == "DTensor" for t in tensors):
        raise ModelError(
            f"{what}: the pruned weights are sharded (FSDP / DTensor); pruners need whole weights and full-size "
            f"masks, so they do not work under FSDP. Prune with DDP (or on one device), export, then train the "
            f"pruned model with FSDP. See docs/guides/distributed.md"
        )


class DependencyAwareMixin:
    """Dependency-aware channel pruning (:mod:`compressor.core.dependency`) for a :class:`TorchPruner`
    with a filter masker (``self.masker``): traces ``dummy_input`` once, wraps the followers (norms,
    depthwise convs: config key ``follower_of``) and the value projections of selected attention modules
    (``heads_of``), and makes one decision per channel group (:meth:`_group_round`). Used by
    :class:`OneShotPruner` and :class:`~compressor.torch.pruning.agp.AGPPruner`."""

    #: False when masking a group's norms alone zeroes its channels (slimming selects the norms)
    _group_producers_needed = True
    #: True: one global ranking over every group (network slimming) instead of one decision per group
    _rank_globally = False

    def _init_dependency(self, dependency_aware: Any, dummy_input: Any, masker_class: Any = None) -> None:
        """Check the arguments (before anything is traced or wrapped) and keep ``dummy_input`` for the trace."""
        self.dependency_aware = _check_dependency_args(self, dependency_aware, dummy_input, masker_class)
        self._dummy_input = dummy_input
        self._dependency: Any = None

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
        if not self.dependency_aware:
            return []
        from ...core.dependency import follower_configs, plan_dependency
        from ..graph import build_graph

        graph, _ = build_graph(model, self._dummy_input)
        plan = plan_dependency(graph, [cfg.get("heads_of", info.name) for info, cfg in selected], type(self).__name__,
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
        config_of = {cfg.get("heads_of", info.name): cfg for info, cfg in selected}
        return [(info_of[name], cfg) for name, cfg in follower_configs(plan, config_of)]

    def _member_index(self) -> dict[str, int]:
        """Group member name -> wrapper index (an attention module's member is its value projection)."""
        index = {name: i for i, name in enumerate(self._wrapper_names)}
        for i, w in enumerate(self.modules_wrapper):
            if "heads_of" in w.config:
                index[w.config["heads_of"]] = i
        return index

    def _grouped_indices(self) -> set[int]:
        """Wrapper indices of every group member (the rest are masked layer by layer)."""
        index = self._member_index()
        return {index[layer] for g in self._dependency.groups for layer in g.layers if layer in index}

    def _ungrouped_indices(self) -> set[int]:
        """Wrapper indices of the selected layers that belong to no group (never masked)."""
        return set(range(len(self.modules_wrapper))) - self._grouped_indices()

    def _decide_groups(self, todo: list[tuple[Any, dict[str, Any], float, list[str], Any]]) -> dict[str, Any]:
        """Per-channel keep-masks of every member from ``(group, member scores, sparsity, members, kept)``:
        one decision per group, or one global ranking (``_rank_globally``)."""
        from ...core.dependency import dependency_keep, global_dependency_keep
        from ..ops import ops

        if self._rank_globally:
            scores = {k: v for _, s, _, _, _ in todo for k, v in s.items()}
            kept = None
            if any(k is not None for *_, k in todo):
                kept = {name: v for *_, k in todo for name, v in (k or {}).items()}
            return global_dependency_keep(ops, [g for g, *_ in todo], scores, max(t[2] for t in todo), kept=kept)
        out: dict[str, Any] = {}
        for group, scores, sparsity, members, kept in todo:
            out.update(dependency_keep(ops, group, scores, sparsity, members, kept=kept))
        return out

    def _group_round(self, due: Any, sparsity_of: Any, monotone: bool = False) -> list[int]:
        """One decision per channel group with a member ``due(wrapper_idx)``, once every scored member's
        statistics are ready: summed member scores at the largest ``sparsity_of(wrapper_idx)`` of its
        scored members, the same channels masked in every member (followers included). ``monotone``:
        channels the members have pruned already go first. Returns the wrapper indices masked."""
        from ...core.pruning import expand_filter_mask, filter_keep_from_mask
        from ..layout import canonical_shape, from_canonical, to_canonical
        from ..ops import ops

        index = self._member_index()
        todo = []
        for group in self._dependency.groups:
            members = [layer for layer in group.layers if layer in index]
            if not any(due(index[layer]) for layer in members):
                continue
            scored = [layer for layer in members if "follower_of" not in self.modules_wrapper[index[layer]].config]
            if not scored or not all(self.masker.statistics_ready(index[layer]) for layer in scored):
                continue
            scores = {layer: self.masker.filter_importance(self.modules_wrapper[index[layer]], index[layer]) for layer in scored}
            sparsity = max(sparsity_of(index[layer]) for layer in scored)
            kept = ({layer: filter_keep_from_mask(ops, to_canonical(self.modules_wrapper[index[layer]],
                                                                   self.modules_wrapper[index[layer]].weight_mask))
                     for layer in members}
                    if monotone else None)
            todo.append((group, scores, sparsity, members, kept))
        keeps = self._decide_groups(todo) if todo else {}
        done = []
        for _group, _scores, _sparsity, members, _kept in todo:
            for layer in members:
                w = self.modules_wrapper[index[layer]]
                keep = keeps[layer]
                masks = {"weight_mask": from_canonical(w, expand_filter_mask(ops, keep,
                                                                             canonical_shape(w, w.weight.shape)))}
                if w.bias_mask is not None:
                    masks["bias_mask"] = keep.reshape(w.bias_mask.shape)  # a GRN's beta is [1, 1, 1, C]
                w.set_masks(masks)
                done.append(index[layer])
        return done


class OneShotPruner(DependencyAwareMixin, TorchPruner):
    """Masks each layer once with ``masker_class`` at its config's ``sparsity``."""

    masker_class: type[WeightMasker] = WeightMasker
    required_keys = ("sparsity",)

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: torch.optim.Optimizer | None = None,
                 dependency_aware: bool = False, dummy_input: Any = None, **masker_kwargs: Any):
        self._init_dependency(dependency_aware, dummy_input)
        super().__init__(model, config_list, optimizer)
        self._dummy_input = None  # traced already: do not keep the user's tensors alive
        self._calculated: set[int] = set()
        self.masker = self.masker_class(model, self, **masker_kwargs)

    def _update_groups(self) -> None:
        """One decision per channel group not decided yet (groups wait until every scored member's
        statistics are ready)."""
        self._calculated.update(self._group_round(lambda i: i not in self._calculated,
                                                  lambda i: self.sparsity_for(self.modules_wrapper[i], i)))

    def update_mask(self) -> None:
        if self._dependency is None:
            return super().update_mask()
        self._mask_round += 1
        self._update_groups()
        # selected layers in no group (the plan's warning says why) stay unpruned: speedup could not remove them
        self._calculated.update(self._ungrouped_indices())
        if len(self._calculated) == len(self.modules_wrapper):
            self.masker.stop_statistics()
        self.apply_masks()

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        self.masker_class.check_layer(layer_info, module)

    def compress(self) -> nn.Module:
        if len(self._calculated) < len(self.modules_wrapper):
            self.masker.start_statistics()
        return super().compress()

    def step(self) -> None:
        self.apply_masks()  # first zero what the step moved, so statistics see the masked weights
        pending = len(self._calculated) < len(self.modules_wrapper)
        if pending:
            self.masker.after_step()
        if pending or user_override(self, "calc_mask"):
            # built-ins stop once every layer is masked; a user's calc_mask runs at every step (seed 000)
            self.update_mask()

    def sparsity_for(self, wrapper: nn.Module, wrapper_idx: int) -> float:
        return wrapper.config["sparsity"]

    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        idx = self._wrapper_index(wrapper) if wrapper_idx is None else wrapper_idx
        if idx in self._calculated or not self.masker.statistics_ready(idx):
            return None
        masks = self.masker.calc_mask(self.sparsity_for(wrapper, idx), wrapper, idx)
        self._calculated.add(idx)
        if len(self._calculated) == len(self.modules_wrapper):
            self.masker.stop_statistics()
        return masks

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "calculated": sorted(self._calculated)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._calculated = set(state.get("calculated", ()))
        if len(self._calculated) == len(self.modules_wrapper):
            self.masker.stop_statistics()


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
