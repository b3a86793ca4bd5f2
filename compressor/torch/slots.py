"""Layers with several weight matrices (``nn.LSTM``/``GRU``/``RNN`` and their cells, ``nn.MultiheadAttention``)
compressed one matrix at a time.

A selected layer of these types becomes one *slot* per weight matrix (names and canonical layouts:
:mod:`compressor.core.layouts`): ``lstm.weight_ih_l0``, ``lstm.weight_hh_l0``, ...,
``attn.q_proj`` / ``k_proj`` / ``v_proj`` (the row blocks of ``in_proj_weight``, or the separate
``q/k/v_proj_weight``) and ``attn.out_proj`` (``out_proj.weight``). Each slot is a :class:`WeightSlot`,
a parameter-less module whose ``weight`` is that matrix (a row view for ``in_proj_weight``), so every
pruner and quantizer wraps it exactly as it wraps a Linear: masks, ``floor(n * s)`` per matrix, scales,
calibration records, report rows, all per slot.

The layer itself is replaced in the model by a :class:`SlottedLayer`: ``module`` (the original layer) and
``slots`` (a ModuleDict: slot -> its outermost compressor wrapper, or the bare WeightSlot). Its forward
asks each slot for its effective weight (calling a wrapped slot runs the wrapper's forward: a pruner
re-masks in place, a quantizer fake-quantizes) and calls the layer with them: directly when every
weight is the layer's own (pruning only: dense speed), else through ``torch.func.functional_call``.
State-dict keys: ``<layer>.module.<param>`` and ``<layer>.slots.<slot>.<buffer>``; export maps them back
to the original ``<layer>.<param>``. A pruner and a quantizer on the same layer share one SlottedLayer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.layouts import check_slot_config
from ..core.matching import LayerInfo
from .modules import _WRAPPER_FLAG, innermost_module, is_wrapper

__all__ = ["SlotSpec", "SlottedLayer", "WeightSlot", "expand_slots", "slot_specs", "slotted_layers"]

SLOTS_KIND = "slots"


@dataclass(frozen=True)
class SlotSpec:
    """One weight matrix of a layer: ``key`` (slot name), ``param`` (parameter path in the layer) and
    ``rows`` (``(start, stop)`` of a row block of that parameter, or None for all of it)."""

    key: str
    param: str
    rows: tuple[int, int] | None = None


def slot_specs(layer: nn.Module) -> list[SlotSpec] | None:
    """The weight matrices of a multi-weight layer (canonical order), or None for other layers."""
    if isinstance(layer, nn.RNNBase):
        return [SlotSpec(n, n) for n in layer._flat_weights_names if n.startswith("weight_")]
    if isinstance(layer, nn.RNNCellBase):
        return [SlotSpec("weight_ih", "weight_ih"), SlotSpec("weight_hh", "weight_hh")]
    if isinstance(layer, nn.MultiheadAttention):
        e = layer.embed_dim
        if layer._qkv_same_embed_dim:
            qkv = [SlotSpec(k, "in_proj_weight", (i * e, (i + 1) * e))
                   for i, k in enumerate(("q_proj", "k_proj", "v_proj"))]
        else:
            qkv = [SlotSpec(k, f"{k}_weight") for k in ("q_proj", "k_proj", "v_proj")]
        return qkv + [SlotSpec("out_proj", "out_proj.weight")]
    return None


class WeightSlot(nn.Module):
    """One weight matrix of ``owner`` seen as a single-weight layer (``weight``; ``bias`` is None).

    Holds no parameter of its own (the matrix stays the owner's Parameter; ``parameters()`` yields it
    for device queries only, it is not registered). Calling the slot returns its effective weight: the
    matrix, or what ``torch.func.functional_call`` substituted for ``weight`` (a quantized copy).
    """

    bias = None

    def __init__(self, owner: nn.Module, spec: SlotSpec, layer_name: str):
        super().__init__()
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_view", None)
        object.__setattr__(self, "_substitute", None)
        self.spec = spec
        self.layer_name = layer_name

    @property
    def owner(self) -> nn.Module:
        return self.__dict__["_owner"]

    def param(self) -> torch.Tensor:
        """The owner's Parameter holding this matrix."""
        return self.owner.get_parameter(self.spec.param)

    @property
    def weight(self) -> torch.Tensor:
        p = self.param()
        if self.spec.rows is None:
            return p
        if torch.compiler.is_compiling():  # torch.compile cannot trace data_ptr(): the view made eagerly
            cached = self.__dict__["_view"]
            return cached[1] if cached is not None else p[self.spec.rows[0]:self.spec.rows[1]]
        key = (id(p), p.data_ptr(), p.dtype, p.device)
        cached = self.__dict__["_view"]
        if cached is None or cached[0] != key:  # one view object per storage: stable identity and version
            a, b = self.spec.rows
            cached = (key, p[a:b])
            object.__setattr__(self, "_view", cached)
        return cached[1]

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":  # functional_call substitutes / restores the effective weight
            object.__setattr__(self, "_substitute", None if value is self.weight else value)
            return
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name == "weight":
            object.__setattr__(self, "_substitute", None)
            return
        super().__delattr__(name)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        yield self.param()

    def forward(self) -> torch.Tensor:
        sub = self.__dict__["_substitute"]
        return self.weight if sub is None else sub

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_view"] = None
        state["_substitute"] = None
        return state

    def extra_repr(self) -> str:
        rows = "" if self.spec.rows is None else f"[{self.spec.rows[0]}:{self.spec.rows[1]}]"
        return f"{self.spec.param}{rows}"


class SlottedLayer(nn.Module):
    """Stands in the model for a multi-weight layer whose matrices are compressed (see the module doc)."""

    def __init__(self, module: nn.Module, layer_name: str, specs: list[SlotSpec]):
        super().__init__()
        self.module = module
        self.name = layer_name
        self.specs = list(specs)
        self.slots = nn.ModuleDict({s.key: WeightSlot(module, s, layer_name) for s in specs})
        object.__setattr__(self, _WRAPPER_FLAG, SLOTS_KIND)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or name.startswith("_compressor"):
                raise
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
        return getattr(innermost_module(module), name)  # model code reading the layer's attributes

    def slot(self, key: str) -> WeightSlot:
        return innermost_module(self.slots[key])

    @property
    def bare(self) -> bool:
        """True when no compressor wraps any slot any more."""
        return not any(is_wrapper(m) for m in self.slots.values())

    def effective_weights(self) -> dict[str, torch.Tensor]:
        """``{param path: tensor}`` for the parameters whose effective value is not the layer's own."""
        eff: dict[str, dict[str, torch.Tensor]] = {}
        changed: set[str] = set()
        for spec in self.specs:
            top = self.slots[spec.key]
            slot = innermost_module(top)
            own = slot.weight
            w = top() if top is not slot else own
            eff.setdefault(spec.param, {})[spec.key] = w
            if w is not own:
                changed.add(spec.param)
        out = {}
        for param in changed:
            parts = [s for s in self.specs if s.param == param]
            if parts[0].rows is None:
                out[param] = eff[param][parts[0].key]
            else:
                out[param] = torch.cat([eff[param][s.key] for s in sorted(parts, key=lambda s: s.rows)], 0)
        return out

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        subs = self.effective_weights()
        layer = self.module
        if not subs:
            return layer(*args, **kwargs)
        prefix = ""
        m = layer
        while is_wrapper(m):
            prefix, m = prefix + "module.", m.module
        return torch.func.functional_call(layer, {prefix + k: v for k, v in subs.items()}, args, kwargs)

    def extra_repr(self) -> str:
        return f"name={self.name!r}"


def slotted_layers(model: nn.Module) -> dict[str, SlottedLayer]:
    """Path -> SlottedLayer for every one in ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, SlottedLayer)}


class SlotPlan:
    """What :func:`expand_slots` decided: where each slot's wrapper goes, which containers are new."""

    def __init__(self) -> None:
        self.places: dict[str, list[tuple[nn.Module, str]]] = {}
        self.new: list[tuple[nn.Module, SlottedLayer]] = []  # (layer module in the model, its container)
        self.containers: list[SlottedLayer] = []

    def install(self, model: nn.Module) -> None:
        """Put the new containers into the model (the only mutation)."""
        for target, container in self.new:
            _replace(model, target, container)


def _replace(model: nn.Module, target: nn.Module, new: nn.Module) -> None:
    for parent in list(model.modules()):
        for attr, child in list(parent._modules.items()):
            if child is target and parent is not new:
                setattr(parent, attr, new)


def expand_slots(what: str, selected: list[tuple[LayerInfo, dict[str, Any]]],
                 modules: dict[str, nn.Module]) -> tuple[list[tuple[LayerInfo, dict[str, Any]]], SlotPlan]:
    """Replace each selected multi-weight layer by its slots (``<layer>.<slot>``, the layer's type; their
    modules are added to ``modules``); layers nested in a selected multi-weight layer (MultiheadAttention's
    ``out_proj``) are dropped, its slots cover them. Checks what these layers cannot take
    (:func:`~compressor.core.layouts.check_slot_config`). Builds containers but changes nothing."""
    plan = SlotPlan()
    out: list[tuple[LayerInfo, dict[str, Any]]] = []
    multi = [info.name for info, _ in selected
             if info.name and slot_specs(innermost_module(modules[info.name])) is not None]
    for info, cfg in selected:
        if any(info.name.startswith(m + ".") for m in multi):
            continue
        module = modules[info.name]
        layer = innermost_module(module)
        check_slot_config(what, info.name, info.type, cfg)
        specs = slot_specs(layer) if info.name else None
        if specs is None:
            out.append((info, cfg))
            continue
        if isinstance(module, SlottedLayer):
            container = module
        else:
            container = SlottedLayer(module, info.name, specs)
            plan.new.append((module, container))
        plan.containers.append(container)
        for spec in container.specs:
            name = f"{info.name}.{spec.key}"
            slot = container.slot(spec.key)
            extra = {**info.extra, "slot": spec.key, "params": slot.weight.numel()}
            modules[name] = container.slots[spec.key]
            plan.places[name] = [(container.slots, spec.key)]
            out.append((LayerInfo(name, info.type, extra), cfg))
    return out, plan


def unwrap_containers(model: nn.Module) -> None:
    """Put the original layer back for every container none of whose slots is wrapped any more."""
    for container in slotted_layers(model).values():
        if container.bare:
            _replace(model, container, container.module)


def rewrap_containers(model: nn.Module, containers: list[SlottedLayer]) -> None:
    """Undo :func:`unwrap_containers` for ``containers``."""
    present = {id(m) for m in model.modules()}
    for container in containers:
        if id(container) not in present:
            _replace(model, container.module, container)


# ---------------------------------------------------------------------------------------- export helpers
def slot_of(wrapper: nn.Module) -> WeightSlot | None:
    """The WeightSlot inside a compressor wrapper, or None for a wrapper of an ordinary layer."""
    inner = innermost_module(wrapper)
    return inner if isinstance(inner, WeightSlot) else None


def slot_state_entries(state: dict[str, torch.Tensor], wrapper: nn.Module,
                       weight: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """``{state key: value}`` writing a slot wrapper's exported ``weight`` into ``state`` (the state_dict of
    the model with this compressor's wrappers taken out), or None if ``wrapper`` is not a slot's."""
    slot = slot_of(wrapper)
    if slot is None:
        return None
    candidates = [f"{slot.layer_name}.{slot.spec.param}", f"{slot.layer_name}.module.{slot.spec.param}"]
    key = next((k for k in candidates if k in state), None)
    if key is None:
        raise RuntimeError(f"export_model: none of {candidates} is in the unwrapped model's state_dict")
    if slot.spec.rows is None:
        return {key: weight}
    full = state[key].detach().clone()
    a, b = slot.spec.rows
    full[a:b] = weight.to(full.dtype)
    return {key: full}


def container_masks(model: nn.Module, pruner_wrappers: dict[str, nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer path: {param: mask}}`` of the pruned slots of every container (full-size masks; row blocks
    joined), in the format of a mask file: ``attn.out_proj.weight`` is entry ``attn.out_proj``, ``weight``."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    by_slot = {id(slot_of(w)): w for w in pruner_wrappers.values() if slot_of(w) is not None}
    for path, container in slotted_layers(model).items():
        for param in dict.fromkeys(s.param for s in container.specs):
            parts = sorted((s for s in container.specs if s.param == param), key=lambda s: s.rows or (0, 0))
            ws = [by_slot.get(id(container.slot(s.key))) for s in parts]
            if any(w is None for w in ws):
                continue
            mask = torch.cat([w.weight_mask.detach().cpu() for w in ws], 0) if len(ws) > 1 \
                else ws[0].weight_mask.detach().cpu().clone()
            owner, _, leaf = f"{path}.{param}".rpartition(".")
            out.setdefault(owner, {})[leaf] = mask
    return out


def apply_slot_masks(model: nn.Module, name: str, entry: dict[str, torch.Tensor],
                     pruner_wrapper_type: type) -> bool:
    """Apply mask-file entry ``name`` (``{param: mask}``) if it belongs to a container (its layer, or
    ``<layer>.out_proj``): the slots' pruning wrappers get the masks (else the weights are just zeroed).
    False if ``name`` is not inside a container. ValueError for a mask that does not fit."""
    for path, container in slotted_layers(model).items():
        if not (name == path or name.startswith(path + ".")):
            continue
        for param, mask in entry.items():
            rel = f"{name}.{param}"[len(path) + 1:]
            parts = [s for s in container.specs if s.param == rel]
            if not parts:
                raise ValueError(f"mask {name}.{param} names no weight matrix of {path!r} "
                                 f"(its matrices: {sorted({s.param for s in container.specs})})")
            p = container.slot(parts[0].key).param()
            if tuple(p.shape) != tuple(mask.shape):
                raise ValueError(f"mask {name}.{param} of shape {tuple(mask.shape)} does not fit the model "
                                 f"(weight shape {tuple(p.shape)})")
            for s in parts:
                a, b = s.rows or (0, p.shape[0])
                m = mask[a:b].to(p.device)
                w = container.slots[s.key]
                while is_wrapper(w) and not isinstance(w, pruner_wrapper_type):
                    w = w.module
                if isinstance(w, pruner_wrapper_type):
                    w.set_mask("weight_mask", m)
                    w.apply_masks()
                else:
                    with torch.no_grad():
                        container.slot(s.key).weight.mul_(m)
        return True
    return False
