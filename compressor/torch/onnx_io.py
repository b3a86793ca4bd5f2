"""ONNX export shared by the pruner and quantizer exports: model inputs, dynamic axes, the onnxruntime check.

* ``dummy_input`` is what one forward takes: a tensor, a tuple of positional inputs, or a dict of keyword
  arguments (``{'input_ids': ids, 'attention_mask': mask}`` for a Hugging Face model); ``input_shape`` is
  the old shortcut (a float ``torch.randn`` tensor).
* The graph gets a dynamic batch axis on every tensor input (axis 0) and, on token inputs (integer or
  bool tensors of rank 2: ids, attention masks, token types), a dynamic sequence axis (axis 1), unless the
  caller gives ``dynamic_shapes`` / ``dynamic_axes`` (or ``dynamic=False``); an input of batch 1 is traced as
  a batch of 2 (torch.export would fix an axis of size 1).
* Model outputs may be a tensor, a tuple / list, a dict or a Hugging Face ``ModelOutput``: every tensor
  leaf, in order, is compared with the ONNX output of the same position (onnxruntime, CPU).
* The file is written under a temporary name (:mod:`compressor.core.atomic`) and moved into place only
  after the check passed: a failed export or check leaves nothing new at ``onnx_path``.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..core.atomic import atomic_path
from ..core.errors import ConfigError
from .families import export_context

__all__ = ["tensor_leaves", "model_inputs", "run_model", "export_onnx", "check_onnx", "dynamic_shapes_for",
           "dynamic_axes_for", "input_names_for"]

_TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) tensor / tuple / list / dict / ``ModelOutput``, in order; None and
    non-tensor values are skipped (a ``ModelOutput`` is a dict of its non-None fields)."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensor_leaves(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in tensor_leaves(v)]
    return []


def model_inputs(dummy_input: Any = None, input_shape: Any = None, device: Any = None,
                 what: str = "export_model") -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of one forward from ``dummy_input`` (tensor, tuple/list, dict of keyword
    arguments) or, without it, a ``torch.randn(*input_shape)`` tensor on ``device``."""
    if dummy_input is None:
        if input_shape is None:
            raise ConfigError(f"{what}: onnx_path needs dummy_input= (a tensor, a tuple of tensors or a dict of "
                              f"keyword arguments for the model's forward) or input_shape= (e.g. (1, 3, 32, 32))")
        try:
            shape = tuple(int(s) for s in input_shape)
        except (TypeError, ValueError):
            raise ConfigError(f"{what}: input_shape must be a tuple of ints, got {input_shape!r}") from None
        return (torch.randn(*shape, device=device),), {}
    if torch.is_tensor(dummy_input):
        return (dummy_input,), {}
    if isinstance(dummy_input, (tuple, list)):
        return tuple(dummy_input), {}
    if isinstance(dummy_input, Mapping):
        bad = [k for k in dummy_input if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{what}: a dict dummy_input maps keyword-argument names to values; keys {bad!r} "
                              f"are not strings")
        return (), dict(dummy_input)
    raise ConfigError(f"{what}: dummy_input must be a tensor, a tuple of positional inputs or a dict of keyword "
                      f"arguments, got {type(dummy_input).__name__}")


def run_model(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    with torch.no_grad():
        return model(*args, **kwargs)


def _param_names(model: nn.Module, args: tuple) -> list[str] | None:
    """Names of the forward's parameters the positional ``args`` bind to (None if unknown)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    names = []
    for i in range(len(args)):
        if i >= len(params) or params[i].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD):
            return None
        names.append(params[i].name)
    return names


def _axes(t: torch.Tensor) -> dict[int, str]:
    axes = {0: "batch"} if t.dim() >= 1 else {}
    if t.dim() == 2 and t.dtype in _TOKEN_DTYPES:
        axes[1] = "sequence"
    return axes


def dynamic_shapes_for(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``dynamic_shapes`` for ``torch.onnx.export(dynamo=True)``: batch (and token sequence) axes dynamic."""
    dims: dict[str, Any] = {}

    def spec(obj: Any) -> Any:
        if torch.is_tensor(obj):
            axes = _axes(obj)
            if not axes:
                return None
            return {ax: dims.setdefault(name, torch.export.Dim(name)) for ax, name in axes.items()}
        if isinstance(obj, (tuple, list)):
            return type(obj)(spec(v) for v in obj)
        if isinstance(obj, Mapping):
            return {k: spec(v) for k, v in obj.items()}
        return None

    if not kwargs:
        return tuple(spec(a) for a in args)
    names = _param_names(model, args)
    if names is None:
        return None
    out = {n: spec(a) for n, a in zip(names, args)}
    out.update({k: spec(v) for k, v in kwargs.items()})
    return out


def _named_inputs(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> list[tuple[str | None, torch.Tensor]]:
    """Tensor inputs in export order with the forward parameter name each binds to (None if nested)."""
    names = _param_names(model, args) or [None] * len(args)
    out: list[tuple[str | None, torch.Tensor]] = []
    for name, value in list(zip(names, args)) + list(kwargs.items()):
        if torch.is_tensor(value):
            out.append((name, value))
        else:
            out.extend((None, t) for t in tensor_leaves(value))
    return out


def input_names_for(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> list[str]:
    """ONNX input names for the TorchScript exporter (the forward's parameter names where known)."""
    names, seen = [], set()
    for i, (name, _) in enumerate(_named_inputs(model, args, kwargs)):
        n = name if name and name not in seen else f"input_{i}"
        seen.add(n)
        names.append(n)
    return names


def _onnx_kwargs(model: nn.Module, args: tuple, kwargs: dict[str, Any], onnx_kwargs: dict[str, Any],
                 dynamic: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"dynamo": True, "external_data": False, "verbose": False}
    out.update(onnx_kwargs)
    if kwargs:
        out["kwargs"] = kwargs
    if not dynamic:
        return out
    if out["dynamo"]:
        if "dynamic_shapes" not in out and "dynamic_axes" not in out:
            shapes = dynamic_shapes_for(model, args, kwargs)
            if shapes is not None:
                out["dynamic_shapes"] = shapes
    else:
        out.pop("external_data", None)
        out.setdefault("input_names", input_names_for(model, args, kwargs))
        out.setdefault("dynamic_axes", dynamic_axes_for(model, args, kwargs, out["input_names"]))
    return out


def dynamic_axes_for(model: nn.Module, args: tuple, kwargs: dict[str, Any], input_names: list[str]) -> dict[str, Any]:
    """``dynamic_axes`` for the TorchScript exporter (``dynamo=False``), keyed by ``input_names``."""
    tensors = [t for _, t in _named_inputs(model, args, kwargs)]
    return {n: _axes(t) for n, t in zip(input_names, tensors) if _axes(t)}


def _feeds(session: Any, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """onnxruntime feeds: by name where every graph input is a named model input, else by position."""
    named = _named_inputs(model, args, kwargs)
    graph_inputs = [i.name for i in session.get_inputs()]
    by_name = {n: t for n, t in named if n is not None}
    if all(n in by_name for n in graph_inputs):
        pairs = [(n, by_name[n]) for n in graph_inputs]
    elif len(graph_inputs) == len(named):
        pairs = [(n, t) for n, (_, t) in zip(graph_inputs, named)]
    else:
        raise RuntimeError(f"ONNX export check: the graph's inputs {graph_inputs} do not correspond to the "
                           f"model's tensor inputs {[n for n, _ in named]}")
    return {n: t.detach().cpu().numpy() for n, t in pairs}


def check_onnx(onnx_path: str | os.PathLike, model: nn.Module, args: tuple, kwargs: dict[str, Any],
               expected: Any = None, rtol: float = 1e-3, atol: float | None = 1e-4, optimize: bool = True) -> None:
    """Run the ONNX file in onnxruntime (CPU) on ``(args, kwargs)`` and compare every output tensor with the
    tensor leaf of the same position in ``expected`` (default: the model's output): count, shapes and
    (unless ``atol`` is None) values. RuntimeError on a difference. Does nothing without onnxruntime."""
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - optional dependency
        return
    import numpy as np

    so = ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(os.fspath(onnx_path), so, providers=["CPUExecutionProvider"])
    got = session.run(None, _feeds(session, model, args, kwargs))
    want = tensor_leaves(run_model(model, args, kwargs) if expected is None else expected)
    if len(got) != len(want):
        raise RuntimeError(f"ONNX export check failed: onnxruntime gives {len(got)} outputs, the model "
                           f"{len(want)} tensors")
    for i, (g, w) in enumerate(zip(got, want)):
        w = w.detach().cpu().numpy()
        if g.shape != w.shape:
            raise RuntimeError(f"ONNX export check failed: output {i} has shape {g.shape} in onnxruntime, "
                               f"{w.shape} in the model")
        if atol is not None and not np.allclose(g, w, rtol=rtol, atol=atol):
            diff = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))))
            raise RuntimeError(f"ONNX export check failed: output {i} differs from the model's (max abs "
                               f"diff {diff:.3g}, rtol={rtol}, atol={atol})")


def export_onnx(model: nn.Module, onnx_path: str | os.PathLike, args: tuple, kwargs: dict[str, Any] | None = None,
                check: bool = True, expected: Any = None, rtol: float = 1e-3, atol: float | None = 1e-4,
                optimize: bool = True, dynamic: bool = True, **onnx_kwargs: Any) -> None:
    """``torch.onnx.export`` of ``model`` on ``(args, kwargs)`` with dynamic batch (and token sequence)
    axes (``dynamic=False``: the shapes of the inputs given), checked with :func:`check_onnx` before the
    file is moved to ``onnx_path``. ``onnx_kwargs`` go to ``torch.onnx.export`` (e.g. ``dynamo=False``,
    ``opset_version``, ``dynamic_shapes``)."""
    kwargs = dict(kwargs or {})
    options = _onnx_kwargs(model, args, kwargs, onnx_kwargs, dynamic)
    trace_args = args
    if dynamic and options.get("dynamo") and "dynamic_shapes" in options and "dynamic_shapes" not in onnx_kwargs:
        # torch.export specialises an axis of size 1: a batch of one is traced as two (its rows repeated) so the
        # batch axis stays dynamic; the check below runs the inputs given
        trace_args, trace_kwargs = batch_of_two(args), batch_of_two(kwargs)
        if trace_kwargs:
            options["kwargs"] = trace_kwargs
    if options.get("external_data"):
        raise ConfigError("export_model: external_data=True is not supported: the ONNX file is checked and moved "
                          "into place as one file (weights inside, up to protobuf's 2 GB)")
    with export_context(model), atomic_path(onnx_path) as tmp:
        _export_and_check(model, tmp, args, kwargs, options, check, expected, rtol, atol, optimize, trace_args)


def batch_of_two(obj: Any) -> Any:
    """``obj`` (a tuple / dict of inputs) with every tensor's batch axis repeated to 2 when ALL its tensors of
    rank >= 1 have batch 1 (inputs of mixed batch sizes are left as they are)."""
    leaves = [t for t in tensor_leaves(obj) if t.dim() >= 1]
    if not leaves or any(t.shape[0] != 1 for t in leaves):
        return obj

    def two(v: Any) -> Any:
        if torch.is_tensor(v):
            return v.repeat(2, *([1] * (v.dim() - 1))) if v.dim() >= 1 else v
        if isinstance(v, (tuple, list)):
            return type(v)(two(x) for x in v)
        if isinstance(v, Mapping):
            return {k: two(x) for k, x in v.items()}
        return v

    return two(obj)


def _export_and_check(model: nn.Module, path: str, args: tuple, kwargs: dict[str, Any], options: dict[str, Any],
                      check: bool, expected: Any, rtol: float, atol: float | None, optimize: bool,
                      trace_args: tuple | None = None) -> None:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args if trace_args is None else trace_args, path, **options)
    if check:
        check_onnx(path, model, args, kwargs, expected, rtol=rtol, atol=atol, optimize=optimize)
