"""Quantized joins for ``PtqQuantizer``: residual adds, products, concatenations and average pooling between
quantized layers get their own output range, so the int8 ONNX graph runs them on integers (``QLinearAdd``,
``QLinearMul``, ``QLinearConcat``, ``QLinearAveragePool``, ``QLinearGlobalAveragePool``), as onnxruntime's
``quantize_static`` quantizes them. Which joins, and which range each output gets, is the core rule
(:mod:`compressor.core.quant_joins`).

These ops are functions in the user's ``forward`` (``y + x``, ``torch.cat``, ``x.mean((2, 3))``), not
modules, so there is nothing to wrap. Instead:

* :func:`plan_joins` reads one recorded forward (:func:`.dataflow.record_flow`, run on the first calibration
  batch): the *counted* calls -- joins and ReLUs called outside the quantized layers -- numbered in call
  order; a join whose every tensor input lies on a grid (a quantized layer's output, a quantized join's, or
  either passed through ReLU / max pooling / reshapes) is quantized at its output, or after the ReLU that is
  its output's only reader (the ReLU folds into the range);
* :class:`JoinRunner` is a ``TorchFunctionMode`` entered around every forward of the model (forward hooks on
  the root module) that counts the same calls (skipping those inside quantized layers) and, at each planned
  point, observes the output (calibration), fake-quantizes it as onnxruntime's QuantizeLinear does (after
  calibration) or emits QuantizeLinear/DequantizeLinear (ONNX export).

The numbering assumes the forward calls the same ops in the same order on every input (no data-dependent
control flow between joins); a call that does not match the plan switches the joins off for that forward
and warns, naming the op.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ...core.quant_joins import quantize_join
from .fakequant import fake_quant, onnx_qdq

__all__ = ["JoinSite", "JoinRunner", "call_kind", "plan_joins"]

_KIND_BY_NAME = {
    "add": "add", "add_": "add", "__add__": "add", "__iadd__": "add", "__radd__": "add",
    "mul": "mul", "mul_": "mul", "__mul__": "mul", "__imul__": "mul", "__rmul__": "mul",
    "cat": "concat", "concat": "concat", "concatenate": "concat",
    "avg_pool2d": "avgpool", "relu": "relu", "relu_": "relu",
}
#: ops through which values keep their grid (first tensor input = data)
_GRID_NAMES = {"relu", "relu_", "max_pool1d", "max_pool2d", "max_pool3d", "_max_pool1d", "_max_pool2d",
               "_max_pool3d", "max_pool2d_with_indices", "flatten", "reshape", "view", "contiguous", "squeeze",
               "unsqueeze", "adaptive_max_pool2d", "_adaptive_max_pool2d", "pad", "relu6", "hardtanh"}


def _name(func: Any) -> str:
    return getattr(func, "__name__", "") or ""


def _is_hw(dims: Any) -> bool:
    if isinstance(dims, int) or dims is None:
        return False
    return sorted(int(d) % 4 for d in dims) == [2, 3]


def call_kind(func: Any, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """The join kind of a torch call (``'add'``, ``'mul'``, ``'concat'``, ``'avgpool'``, ``'global_avgpool'``),
    ``'relu'``, or None (not counted). ``adaptive_avg_pool2d(x, 1)`` and ``x.mean((2, 3))`` of a 4-D ``x``
    are global average pooling."""
    name = _name(func)
    kind = _KIND_BY_NAME.get(name)
    if kind is not None:
        return kind
    if name == "adaptive_avg_pool2d":
        size = args[1] if len(args) > 1 else kwargs.get("output_size")
        return "global_avgpool" if size in (1, (1, 1), [1, 1]) else None
    if name == "mean" and args and torch.is_tensor(args[0]) and args[0].dim() == 4:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        return "global_avgpool" if _is_hw(dims) and kwargs.get("dtype") is None else None
    return None


@dataclass
class JoinSite:
    """One quantized join: ``index`` of its call among the counted calls, ``point`` the index of the call
    whose output is quantized (the join, or the ReLU folded into it), ``output`` ``'own'`` or the source
    whose grid it reuses (``('layer', name)`` or ``('site', index)``)."""

    index: int
    kind: str
    point: int
    point_kind: str
    output: Any
    scope: str


def _inside(call: Any, names: set[str]) -> bool:
    return any(c.module in names for c in call.chain()[:-1])


def plan_joins(flow: Any, wrapper_names: set[str], output_layers: set[str]) -> tuple[list[JoinSite], list[dict]]:
    """The quantized joins of a recorded forward (``flow``, recorded with ``classify=call_kind``) and a report
    of every join call (``{'kind', 'scope', 'integer', 'reason'}``). ``output_layers``: the wrapped layers
    whose output is quantized (per tensor)."""
    counted = [f for f in flow.funcs if getattr(f, "kind", None) is not None and not _inside(f, wrapper_names)]
    index = {id(f): i for i, f in enumerate(counted)}
    grid: dict[Any, Any] = {}

    def source(value: Any) -> Any:
        for _ in range(10_000):
            if value in grid:
                return grid[value]
            for c in flow.made_by_module.get(value, []):
                if c.module in output_layers:
                    return ("layer", c.module)
            f = flow.made_by_func.get(value)
            if f is None or not f.inputs or _name(f.func) not in _GRID_NAMES:
                return None
            value = f.inputs[0]
        return None

    sites: list[JoinSite] = []
    report: list[dict] = []
    for i, f in enumerate(counted):
        if f.kind == "relu" or not f.outputs:
            continue
        scope = f.parent.module if f.parent is not None else ""
        sources = [source(v) for v in f.inputs]
        rule = quantize_join(f.kind, [s is not None for s in sources])
        if rule is None:
            report.append({"kind": f.kind, "scope": scope, "integer": False,
                           "reason": "an input is not on a quantization grid (a float tensor or a parameter)"})
            continue
        value, point = f.outputs[0], f
        readers = [g for g in flow.funcs if value in g.inputs and g is not f]
        if (rule.relu_folds and len(readers) == 1 and readers[0].kind == "relu" and id(readers[0]) in index
                and value not in flow.outputs and readers[0].outputs):
            point = readers[0]
        output = "own" if rule.output == "own" else sources[0]
        site = JoinSite(i, f.kind, index[id(point)], point.kind, output, scope)
        sites.append(site)
        grid[point.outputs[0]] = ("site", i)
        report.append({"kind": f.kind, "scope": scope, "integer": True,
                       "reason": "relu folded" if point is not f else ""})
    return sites, report


def wrapper_input_sites(flow: Any, sites: list[JoinSite], wrapper_names: set[str]) -> dict[str, int]:
    """``{layer: join index}`` for wrapped layers whose first input is a quantized join's output (through
    grid-preserving ops): they take the join's scale and zero point (one grid per tensor)."""
    counted = [f for f in flow.funcs if getattr(f, "kind", None) is not None and not _inside(f, wrapper_names)]
    at = {counted[s.point].outputs[0]: s.index for s in sites}
    out: dict[str, int] = {}
    for name in wrapper_names:
        calls = flow.calls.get(name, [])
        if len(calls) != 1 or not calls[0].inputs:
            continue
        value = calls[0].inputs[0]
        for _ in range(10_000):
            if value in at:
                out[name] = at[value]
                break
            f = flow.made_by_func.get(value)
            if f is None or not f.inputs or _name(f.func) not in _GRID_NAMES:
                break
            value = f.inputs[0]
    return out


def runtime_fake_quant(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Fake quantization with onnxruntime QuantizeLinear's value, ``round(x / s) + zp`` (clipped STE gradient)."""
    out = fake_quant(x, scale, zp, qmin, qmax, None)
    if x.dtype != torch.float32:
        return out
    with torch.no_grad():
        z = zp.round()
        runtime = (torch.clamp(torch.round(x / scale) + z, qmin, qmax) - z) * scale
    return out + (runtime - out).detach()


class _Mode(TorchFunctionMode):
    def __init__(self, runner: JoinRunner):
        super().__init__()
        self.runner = runner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        r = self.runner
        if r.depth or r.off or not torch.is_tensor(out):
            return out
        kind = call_kind(func, args, kwargs)
        if kind is None:
            return out
        i = r.count
        r.count += 1
        site = r.points.get(i)
        if site is None:
            return out
        if site.point_kind != kind:
            r.off = True
            warnings.warn(f"PtqQuantizer: the forward called {_name(func)!r} ({kind}) where calibration saw a "
                          f"{site.point_kind} (join {site.kind} in {site.scope or 'the model'!r}); joins stay float "
                          f"in this forward (a data-dependent forward; pass quantize_joins=False to silence)",
                          RuntimeWarning, stacklevel=2)
            return out
        return r.apply(site, out)


class JoinRunner:
    """Applies the planned join quantization during the model's forwards (see the module docstring)."""

    def __init__(self, quantizer: Any, sites: list[JoinSite], spec: Any):
        self.quantizer = quantizer
        self.sites = {s.index: s for s in sites}
        self.points = {s.point: s for s in sites}
        self.spec = spec  # bits / integer range of every join output (the layers' output spec)
        self.qparams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.count = 0
        self.depth = 0
        self.off = False
        self.exporting = False
        self._mode: _Mode | None = None
        self._handles: list[Any] = []

    # ---------------------------------------------------------------- hooks
    def install(self, model: torch.nn.Module, wrappers: list[Any]) -> None:
        def enter(module: Any, args: Any) -> None:
            if self._mode is not None:
                return
            self.count, self.depth, self.off = 0, 0, False
            self._mode = _Mode(self)
            self._mode.__enter__()

        def leave(module: Any, args: Any, out: Any) -> None:
            if self._mode is not None:
                mode, self._mode = self._mode, None
                mode.__exit__(None, None, None)

        def down(module: Any, args: Any) -> None:
            self.depth += 1

        def up(module: Any, args: Any, out: Any) -> None:
            self.depth -= 1

        self._handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
        for w in wrappers:
            self._handles += [w.register_forward_pre_hook(down), w.register_forward_hook(up, always_call=True)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---------------------------------------------------------------- values
    def observer_key(self, site: JoinSite) -> tuple[str, str]:
        return (f"<join {site.index}>", "output")

    def source_qparams(self, ref: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Scale and zero point of a grid source (a layer's output or another join's)."""
        kind, key = ref
        if kind == "site":
            site = self.sites[key]
            return self.qparams.get(key) if site.output == "own" else self.source_qparams(site.output)
        w = {w.name: w for w in self.quantizer.modules_wrapper}[key]
        return w._buffers["output_scale"], w._buffers["output_zero_point"]

    def apply(self, site: JoinSite, out: torch.Tensor) -> torch.Tensor:
        q = self.quantizer
        if q._calibrating:
            obs = q._act_observers.get(self.observer_key(site))
            if obs is not None:
                obs.observe(out.detach())
            return out
        qp = self.qparams.get(site.index) if site.output == "own" else self.source_qparams(site.output)
        if qp is None:
            return out
        scale, zp = qp
        if self.exporting:
            return onnx_qdq(out, scale.detach().clone(), zp.detach().clone(), self.spec.qmin, self.spec.qmax)
        return runtime_fake_quant(out, scale, zp, self.spec.qmin, self.spec.qmax)
