"""Speedup: physically remove pruned channels from a PyTorch model, and count MACs / parameters.

:func:`speedup_model` traces the model into the neutral graph (:func:`compressor.torch.graph.build_graph`),
asks core for the plan (:func:`compressor.core.graph.speedup_plan`: which channels are identically zero
wherever a layer mixes channels and may therefore go) and then slices each layer with one small function
per layer type. The plan is computed and validated before any module changes, so on an error the model
is left as it was. Fine-grained (unstructured) zeros that are not whole channels stay in the weights.

The report of the last speedup of a model: :func:`speedup_report` (also ``str()``-able).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.errors import ConfigError, ModelError
from ..core.graph import count_graph, speedup_plan
from ..core.interrupts import deferred_interrupts
from .families import after_speedup
from .graph import build_graph
from .graph_layers import _is_hf_conv1d, attention_spec
from .layout import is_grn

__all__ = ["speedup_model", "count_flops_params", "speedup_report", "SpeedupReport"]


@dataclass
class SpeedupReport:
    """What :func:`speedup_model` did. ``layers``: one dict per changed layer with ``layer``, ``type``,
    ``out`` and ``in`` as ``(channels before, after)`` (``None`` where unchanged)."""

    layers: list[dict[str, Any]] = field(default_factory=list)
    params_before: int = 0
    params_after: int = 0
    macs_before: int = 0
    macs_after: int = 0
    removed_classes: int = 0
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"speedup: removed {self.removed_classes} channel classes; params {self.params_before} -> "
                 f"{self.params_after}, MACs {self.macs_before} -> {self.macs_after}"]
        for r in self.layers:
            parts = [f"{k} {r[k][0]} -> {r[k][1]}" for k in ("out", "in") if r[k] is not None]
            lines.append(f"  {r['layer']} ({r['type']}): " + ", ".join(parts))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


_REPORTS: weakref.WeakKeyDictionary[nn.Module, SpeedupReport] = weakref.WeakKeyDictionary()


def speedup_report(model: nn.Module) -> SpeedupReport | None:
    """The :class:`SpeedupReport` of the last :func:`speedup_model` that returned ``model`` (or None)."""
    return _REPORTS.get(model)


# ---------------------------------------------------------------------------------- counting
def count_flops_params(model: nn.Module, dummy_input: Any) -> tuple[int, int, list[dict[str, Any]]]:
    """``(macs, params, per_layer)``: multiply-accumulates of the convs and linears of one forward on
    ``dummy_input`` (batch excluded: per sample), the number of parameters of the model (each once,
    layers the forward does not reach included) and per traced layer ``{name, type, params, macs}``."""
    graph, _ = build_graph(model, dummy_input)
    macs, _, per_layer = count_graph(graph)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return int(macs), int(params), per_layer


# ---------------------------------------------------------------------------------- slicing
def _new_param(old: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value.detach().clone().to(dtype=old.dtype, device=old.device), requires_grad=old.requires_grad)


def _set(module: nn.Module, name: str, index: list[int] | None, dim: int) -> None:
    t = getattr(module, name, None)
    if t is None or index is None:
        return
    idx = torch.as_tensor(index, dtype=torch.long, device=t.device)
    value = t.detach().index_select(dim, idx)
    if name in module._parameters:
        setattr(module, name, _new_param(t, value))
    else:
        module._buffers[name] = value.clone()


def _slice_conv(m: nn.Conv1d, out: list[int] | None, inp: list[int] | None) -> None:
    if m.groups > 1:  # depthwise: groups and in channels follow the kept channels
        if inp is None or out is None:
            raise ModelError(f"depthwise {type(m).__name__}: input and output channels must shrink together")
        _set(m, "weight", out, 0)
        _set(m, "bias", out, 0)
        m.in_channels = m.groups = len(inp)
        m.out_channels = len(out)
        return
    _set(m, "weight", out, 0)
    _set(m, "bias", out, 0)
    _set(m, "weight", inp, 1)
    if out is not None:
        m.out_channels = len(out)
    if inp is not None:
        m.in_channels = len(inp)


def _slice_linear(m: nn.Linear, out: list[int] | None, inp: list[int] | None) -> None:
    _set(m, "weight", out, 0)
    _set(m, "bias", out, 0)
    _set(m, "weight", inp, 1)
    if out is not None:
        m.out_features = len(out)
    if inp is not None:
        m.in_features = len(inp)


def _slice_hf_conv1d(m: nn.Module, out: list[int] | None, inp: list[int] | None) -> None:
    _set(m, "weight", inp, 0)  # stored [in, out]
    _set(m, "weight", out, 1)
    _set(m, "bias", out, 0)
    if out is not None:
        m.nf = len(out)
    if inp is not None and hasattr(m, "nx"):
        m.nx = len(inp)


def _slice_bn(m: nn.modules.batchnorm._BatchNorm, out: list[int] | None, inp: list[int] | None) -> None:
    keep = out if out is not None else inp
    for name in ("weight", "bias", "running_mean", "running_var"):
        _set(m, name, keep, 0)
    if keep is not None:
        m.num_features = len(keep)


def _slice_grn(m: nn.Module, out: list[int] | None, inp: list[int] | None) -> None:
    """GRN (:func:`~compressor.torch.layout.is_grn`): gamma / beta of the kept channels. Its ``N`` divides by the
    MEAN of the channels' spatial norms, and the removed channels are zero there (they add 0 to the sum but
    counted in the mean), so gamma is scaled by ``C / C_kept``: exact up to GRN's ``eps`` (1e-6 in the
    denominator, relative change ~1e-6 / mean norm)."""
    keep = out if out is not None else inp
    if keep is None:
        return
    c = m.weight.shape[-1]
    with torch.no_grad():
        idx = torch.as_tensor(keep, device=m.weight.device)
        m.weight = _new_param(m.weight, m.weight.index_select(-1, idx) * (c / len(keep)))
        m.bias = _new_param(m.bias, m.bias.index_select(-1, idx))


def _slice_embedding(m: nn.Embedding, out: list[int] | None, inp: list[int] | None) -> None:
    _set(m, "weight", out, 1)
    if out is not None:
        m.embedding_dim = len(out)


def _slice_attention(m: nn.Module, out: list[int] | None, inp: list[int] | None) -> None:
    """An attention module (:func:`~compressor.torch.graph.attention_spec`): ``out`` = kept context
    channels (whole heads), so query / key / value keep the rows of the kept heads; ``inp`` = kept
    input features (their columns). The head count attributes follow; an inner output projection is a
    layer of its own (its input columns are sliced by the Linear slicer)."""
    from .modules import innermost_module

    spec = attention_spec(m)
    h, d = spec["heads"], spec["head_dim"]
    heads = None
    if out is not None:
        heads = sorted({j // d for j in out})
        if [hh * d + t for hh in heads for t in range(d)] != list(out):
            raise ModelError(f"speedup: {type(m).__name__} can lose whole heads only")
    for c in (spec["q"], spec["k"], spec["v"]):
        _slice_linear(innermost_module(m._modules[c]), out, inp)
    if heads is not None:
        setattr(m, spec["heads_attr"], len(heads))
        if hasattr(m, "all_head_size"):
            m.all_head_size = len(heads) * d
        if hasattr(m, "num_key_value_heads") and isinstance(m.num_key_value_heads, int):
            m.num_key_value_heads = len(heads)
        pruned = getattr(m, "pruned_heads", None)
        if isinstance(pruned, set):
            pruned.update(hh for hh in range(h) if hh not in heads)


def _slicer(module: nn.Module) -> Callable[[Any, Any, Any], None] | None:
    if attention_spec(module) is not None:
        return _slice_attention
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        return _slice_conv
    if isinstance(module, nn.Linear):
        return _slice_linear
    if _is_hf_conv1d(module):
        return _slice_hf_conv1d
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return _slice_bn
    if is_grn(module):
        return _slice_grn
    if isinstance(module, nn.Embedding):
        return _slice_embedding
    return None


def _sizes(module: nn.Module) -> tuple[int, int]:
    """(out channels, in channels) of a sliceable layer."""
    spec = attention_spec(module)
    if spec is not None:
        q = getattr(module, spec["q"])
        q = getattr(q, "module", q)
        return q.out_features, q.in_features
    if isinstance(module, nn.modules.conv._ConvNd):
        return module.out_channels, module.in_channels
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    if _is_hf_conv1d(module):
        return module.weight.shape[1], module.weight.shape[0]
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return module.num_features, module.num_features
    if is_grn(module):
        return module.weight.shape[-1], module.weight.shape[-1]
    if isinstance(module, nn.Embedding):
        return module.embedding_dim, module.num_embeddings
    return 0, 0


# ---------------------------------------------------------------------------------- masks
def _load_masks(masks: Any) -> dict[str, dict[str, torch.Tensor]]:
    if isinstance(masks, (str, os.PathLike)):
        from .pruning.export import load_mask_file

        masks = load_mask_file(masks)
    if not isinstance(masks, dict) or not all(isinstance(v, dict) for v in masks.values()):
        raise ConfigError("masks must be {layer: {'weight': mask, 'bias': mask}} or the path of such a file "
                          "(export_model(..., mask_path=...))")
    return masks


def _apply_masks(model: nn.Module, masks: dict[str, dict[str, torch.Tensor]],
                 backup: dict[tuple[str, str], torch.Tensor]) -> None:
    """Zero the masked weights in place, each one's original values put in ``backup`` first (to restore on error
    or interrupt). Every mask is checked before any weight changes."""
    todo = []
    for name, entry in masks.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ConfigError(f"masks name layer {name!r}, which the model does not have") from None
        for pname, mask in entry.items():
            mask = _binary_mask(mask, f"{name}.{pname}")
            param = getattr(module, pname, None)
            if not torch.is_tensor(param) or tuple(param.shape) != tuple(mask.shape):
                raise ConfigError(f"mask {name}.{pname} of shape {tuple(mask.shape)} does not fit the model")
            todo.append((name, pname, param, mask))
    with torch.no_grad():
        for name, pname, param, mask in todo:
            backup[(name, pname)] = param.detach().clone()
            param.masked_fill_(~mask.to(param.device), 0)


def _binary_mask(mask: Any, where: str) -> torch.Tensor:
    """``mask`` (a torch tensor or numpy array, bool or 0/1 numbers) as a CPU bool tensor; anything else is
    a ConfigError naming the mask (a mask scaling weights by 0.5 is no mask)."""
    if isinstance(mask, np.ndarray):
        if mask.dtype == object or not (mask.dtype == bool or np.issubdtype(mask.dtype, np.number)):
            raise ConfigError(f"mask {where}: dtype {mask.dtype} is not bool or numeric")
        mask = torch.from_numpy(np.ascontiguousarray(mask))
    elif not torch.is_tensor(mask):
        raise ConfigError(f"mask {where}: a mask must be a torch tensor or a numpy array, got {type(mask).__name__}")
    mask = mask.detach().cpu()
    if mask.dtype != torch.bool:
        if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            raise ConfigError(f"mask {where}: values must be 0 / 1 (or bool); got values other than 0 and 1")
        mask = mask != 0
    return mask


def _restore(model: nn.Module, backup: dict[tuple[str, str], torch.Tensor]) -> None:
    with torch.no_grad():
        for (name, pname), value in backup.items():
            getattr(model.get_submodule(name), pname).copy_(value)


class _ModuleRecord:
    """What every module of a model holds (its attributes; the dicts, lists and sets among them -- parameters,
    buffers, submodules, hooks, HF's ``pruned_heads`` -- copied one level deep), taken before the model is changed
    in place and put back by :meth:`restore`: the slicers and the config update only assign (new parameters,
    widths, a new config), so this undoes them whatever point they reached."""

    _CONTAINERS = (dict, list, set)

    def __init__(self, model: nn.Module) -> None:
        self.saved = []
        for m in model.modules():
            attrs = dict(m.__dict__)
            inner = {k: (v, v.copy()) for k, v in attrs.items() if isinstance(v, self._CONTAINERS)}
            self.saved.append((m, attrs, inner))

    def restore(self) -> None:
        for m, attrs, inner in self.saved:
            for obj, content in inner.values():
                obj.clear()
                if isinstance(obj, dict):
                    obj.update(content)
                elif isinstance(obj, list):
                    obj.extend(content)
                else:
                    obj |= content
            m.__dict__.clear()
            m.__dict__.update(attrs)


# ---------------------------------------------------------------------------------- speedup
def speedup_model(model_or_pruner: Any, dummy_input: Any, masks: Any = None, strict: bool = True) -> nn.Module:
    """Remove the pruned channels for real; returns the smaller model (its outputs equal the masked
    model's, eval mode).

    ``model_or_pruner``: a ``TorchPruner`` (its masked model is unwrapped into a COPY: the pruner and its
    wrapped model stay usable) or a plain ``nn.Module`` (changed in place; ``masks``, a
    ``{layer: {'weight': mask, 'bias': mask}}`` dict or a mask file written by ``export_model``, are
    applied to its weights first). ``dummy_input``: a tensor, tuple or dict of keyword tensors for one
    forward. ``strict``: raise :class:`ModelError` when pruned channels cannot be removed (they reach an
    op the speedup cannot cut); ``False`` keeps them and notes it in the report.

    The model is traced and the plan validated before any layer changes; what every module holds is
    recorded first, so on an error or a Ctrl-C at any point (a second one included) the model is left as it
    was. Unstructured zeros that are not whole channels stay in the weights (no masks remain: they
    are plain zeros a further training would revive). See :func:`speedup_report` for what changed.
    """
    from .pruning.export import pruner_wrappers, unwrapped_model

    if not isinstance(strict, bool):
        raise ConfigError(f"speedup_model: strict must be True or False, got {strict!r}")
    if isinstance(model_or_pruner, nn.Module):
        model = model_or_pruner
        if pruner_wrappers(model):
            model = unwrapped_model(model)
    elif isinstance(getattr(model_or_pruner, "bound_model", None), nn.Module):
        if masks is not None:
            raise ConfigError("speedup_model: masks are taken from the pruner; pass masks only with a plain model")
        model = unwrapped_model(model_or_pruner.bound_model)
    else:
        raise ModelError(f"speedup_model needs a TorchPruner or an nn.Module, not {type(model_or_pruner).__name__}")

    record = _ModuleRecord(model)  # taken before anything changes: an interrupt at any point below is undone
    backup: dict[tuple[str, str], torch.Tensor] = {}
    try:
        return _speedup(model, masks, dummy_input, strict, backup)
    except BaseException:
        with deferred_interrupts():  # all of it back, even if Ctrl-C is pressed again meanwhile
            record.restore()
            _restore(model, backup)
        raise


def _speedup(model: nn.Module, masks: Any, dummy_input: Any, strict: bool,
             backup: dict[tuple[str, str], torch.Tensor]) -> nn.Module:
    if masks is not None:
        _apply_masks(model, _load_masks(masks), backup)
    graph, leaves = build_graph(model, dummy_input)
    macs0, _, _ = count_graph(graph)
    params0 = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    plan = speedup_plan(graph, strict)
    # per layer: one keep for every call of it, a slicer for its type, indices in range
    work: dict[str, tuple[nn.Module, Any, Any, Callable]] = {}
    for n in graph.nodes:
        if n.layer is None or n.kind in ("input", "output"):
            continue
        out = plan.keep.get(n.name)
        inp = plan.keep.get(n.inputs[0]) if n.inputs else None
        if n.kind in ("norm",):
            inp = None
        if n.layer in work:
            _, o2, i2, _ = work[n.layer]
            if (o2, i2) != (out, inp):
                raise ModelError(f"speedup: layer {n.layer!r} is called more than once with different "
                                 f"channels removed; it cannot be sliced")
            continue
        if out is None and inp is None:
            work[n.layer] = (leaves[n.layer], None, None, None)  # type: ignore[assignment]
            continue
        module = leaves[n.layer]
        fn = _slicer(module)
        if fn is None:
            raise ModelError(f"speedup: layer {n.layer!r} ({type(module).__name__}) would lose channels, "
                             f"but speedup cannot slice that layer type")
        co, ci = _sizes(module)
        if (out and max(out) >= co) or (inp and max(inp) >= ci):
            raise ModelError(f"speedup: channel indices out of range for layer {n.layer!r}")
        work[n.layer] = (module, out, inp, fn)

    report = SpeedupReport(params_before=params0, macs_before=macs0, removed_classes=plan.removed,
                           notes=list(plan.notes))
    for layer, (module, out, inp, fn) in work.items():
        if fn is None:
            continue
        co, ci = _sizes(module)
        spec = attention_spec(module) if fn is _slice_attention else None
        fn(module, out, inp)
        row = {"layer": layer, "type": type(module).__name__,
               "out": (co, len(out)) if out is not None else None,
               "in": (ci, len(inp)) if inp is not None else None}
        if spec is not None and out is not None:
            row["heads"] = (spec["heads"], len(out) // spec["head_dim"])
        report.layers.append(row)
    report.notes.extend(after_speedup(model, report.layers))  # model-family plug-ins (HF: the config's widths)
    report.macs_after, report.params_after, _ = count_flops_params(model, dummy_input)
    zeros, where = 0, 0
    for module in {id(m): m for m in leaves.values()}.values():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() > 1:
            z = int((w == 0).sum())
            zeros, where = zeros + z, where + (z > 0)
    if zeros:
        report.notes.append(f"fine-grained (unstructured) masks left in place: {zeros} zero weight(s) remain in "
                            f"{where} layer(s); they save neither memory nor time in dense kernels")
    _REPORTS[model] = report
    return model
