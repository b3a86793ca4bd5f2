"""ONNX in and out for the integer (QDQ) export of :mod:`.onnx_qdq`: the float model exported to ONNX bytes (the
TorchScript exporter with the quantized weights, a dynamic batch axis; the dynamo exporter for ops the
TorchScript one lacks), which the graph rewriting of :mod:`.onnx_qdq_graph` starts from, and the short value
names the written file gets."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..modules import innermost_module
from ..slots import SlottedLayer, _replace, slot_of
from .wrapper import QuantizerModuleWrapper


def _export_float(quantizer: Any, exported: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                  dummy_input: Any, onnx_kwargs: dict[str, Any], float_wrappers: list[Any] = ()) -> bytes:
    """The model with quantized weight values but no quantization ops, batch axis dynamic. ``float_wrappers``:
    the quantized layers without an integer kernel (``onnx_qdq.float_layers``), exported as plain layers."""
    model = quantizer.bound_model
    wrappers: list[QuantizerModuleWrapper] = quantizer.get_modules_wrapper()
    for w in wrappers:
        w.export_mode = True
        w._export_weight, w._export_bias = exported[w.name]
        w._export_plan = {t: "skip" for t in w.quant_types if t != "weight"}
        w._export_qparams = {t: None for t in w.quant_types}
    # PRESERVE (the model is in eval mode): the TorchScript exporter's EVAL mode would fold every unfolded
    # Conv -> BatchNorm pair into new conv weights, which are then no longer the quantized ones
    kwargs: dict[str, Any] = {"dynamo": False, "opset_version": 20, "do_constant_folding": True,
                              "training": torch.onnx.TrainingMode.PRESERVE}
    kwargs.update(onnx_kwargs)
    kwargs.pop("external_data", None)
    if not torch.is_tensor(dummy_input):  # (args, kwargs) of one forward: see compressor.torch.onnx_io
        from ..onnx_io import dynamic_axes_for, dynamic_shapes_for, input_names_for

        args, forward_kwargs = dummy_input
        kwargs["kwargs"] = forward_kwargs
        if kwargs.get("dynamo"):
            kwargs.setdefault("dynamic_shapes", dynamic_shapes_for(model, args, forward_kwargs))
        else:
            kwargs.setdefault("input_names", input_names_for(model, args, forward_kwargs))
            kwargs.setdefault("dynamic_axes", dynamic_axes_for(model, args, forward_kwargs, kwargs["input_names"]))
        dummy_input = args
    elif kwargs.get("dynamo"):
        if "dynamic_shapes" not in kwargs:
            kwargs["dynamic_shapes"] = ({0: torch.export.Dim("batch")},)
    else:  # batch dynamic; also the sequence axis of a token-id tensor (rank 2, integer)
        from ..onnx_io import dynamic_axes_for

        kwargs.setdefault("input_names", ["input"])
        kwargs.setdefault("dynamic_axes", dynamic_axes_for(model, (dummy_input,), {}, kwargs["input_names"][:1]))
    args = dummy_input if isinstance(dummy_input, tuple) else (dummy_input,)
    buf = io.BytesIO()
    try:
        from ..families import export_context  # model-family plug-ins, e.g. a causal LM without its KV cache

        with torch.no_grad(), warnings.catch_warnings(), export_context(model), \
                _plain_float_layers(quantizer, exported, float_wrappers):
            warnings.simplefilter("ignore")
            if kwargs.get("dynamo"):
                prog = torch.onnx.export(model, args, **kwargs)
                return prog.model_proto.SerializeToString()
            try:
                torch.onnx.export(model, args, buf, **kwargs)
            except torch.onnx.errors.UnsupportedOperatorError:
                # an op the TorchScript exporter lacks (e.g. aten::diff in transformers' mask code when no
                # attention_mask is given): the dynamo exporter, same dynamic axes
                if "dynamo" in onnx_kwargs:
                    raise
                return _export_dynamo(model, args, kwargs)
    finally:
        for w in wrappers:
            w.export_mode = False
            w._export_weight = w._export_bias = None
            w._export_plan = w._export_qparams = None
    return buf.getvalue()


@contextlib.contextmanager
def _plain_float_layers(quantizer: Any, exported: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                        float_wrappers: list[Any]) -> Iterator[None]:
    """While exporting: each quantized layer without an integer kernel (an LSTM's weight matrices, a norm ...)
    is its plain layer holding its quantized weight values (their wrappers run ``torch.func.functional_call``,
    which the TorchScript exporter cannot trace); the int8 graph keeps those layers in float."""
    model = quantizer.bound_model
    swaps: list[tuple[nn.Module, nn.Module]] = []  # (in the model, put there for the export)
    values: dict[int, tuple[nn.Module, str, torch.Tensor]] = {}  # id(param) -> (owner, name, exported value)
    parts: dict[tuple[int, str], dict[tuple[int, int], torch.Tensor]] = {}
    containers: dict[str, SlottedLayer] = {}
    for w in float_wrappers:
        weight, bias = exported[w.name]
        slot = slot_of(w)
        if slot is not None:
            container = model.get_submodule(slot.layer_name)
            if not isinstance(container, SlottedLayer):
                raise RuntimeError(f"int8 ONNX export: {slot.layer_name!r} is not the container of {w.name!r}")
            containers[slot.layer_name] = container
            owner = innermost_module(container.module)
            if slot.spec.rows is None:
                values[id(owner.get_parameter(slot.spec.param))] = (owner, slot.spec.param, weight)
            else:
                parts.setdefault((id(owner), slot.spec.param), {})[slot.spec.rows] = weight
                values.setdefault(id(owner.get_parameter(slot.spec.param)), (owner, slot.spec.param, None))
            continue
        layer = w.layer
        values[id(layer.weight)] = (layer, "weight", weight)
        if bias is not None and getattr(layer, "bias", None) is not None:
            values[id(layer.bias)] = (layer, "bias", bias)
        swaps.append((w, w.module))
    for container in containers.values():
        swaps.append((container, container.module))
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        for owner, pname, value in values.values():
            p = owner.get_parameter(pname)
            if value is None:  # row blocks (MultiheadAttention's in_proj_weight): unchanged rows keep theirs
                value = p.detach().clone()
                for (a, b), v in parts[(id(owner), pname)].items():
                    value[a:b] = v
            saved.append((p, p.data))
            p.data = value.detach().to(device=p.device, dtype=p.dtype)
        for old, new in swaps:
            _replace(model, old, new)
        yield
    finally:
        for old, new in reversed(swaps):
            _replace(model, new, old)
        for p, data in saved:
            p.data = data


def _export_dynamo(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> bytes:
    """The dynamo exporter with the TorchScript call's settings: its dynamic axes become dynamic shapes."""
    from ..onnx_io import dynamic_shapes_for

    forward_kwargs = kwargs.get("kwargs") or {}
    out = {k: v for k, v in kwargs.items()
           if k not in ("dynamo", "input_names", "dynamic_axes", "training", "do_constant_folding", "kwargs")}
    out.update({"dynamo": True, "external_data": False, "verbose": False, "opset_version": 18})
    # torch.export specialises an axis of size 1: trace a batch of 2 (the rows repeated) so batch stays dynamic
    def two(t: Any) -> Any:
        return t.repeat(2, *([1] * (t.dim() - 1))) if torch.is_tensor(t) and t.dim() and t.shape[0] == 1 else t

    args = tuple(two(a) for a in args)
    forward_kwargs = {k: two(v) for k, v in forward_kwargs.items()}
    if forward_kwargs:
        out["kwargs"] = forward_kwargs
    shapes = dynamic_shapes_for(model, args, forward_kwargs)
    if shapes is not None:
        out["dynamic_shapes"] = shapes
    prog = torch.onnx.export(model, args, **out)
    return prog.model_proto.SerializeToString()


def _compact_value_names(model: Any) -> None:
    """Short names for the intermediate tensors, no node names and no per-node metadata. The exporters name every value after its
    module path, and each name is stored once per producer and consumer: on a small Hugging Face model that
    was 60 % of the int8 file. Graph inputs/outputs and the integer weight and bias codes (``<layer>.weight_quantized``,
    ``<layer>.bias_quantized``: what ``compressor report`` and users look up; their scales are the
    DequantizeLinear's other inputs) keep their names. Graphs with subgraphs (If / Loop) are left as they are
    (their bodies may read outer names)."""
    g = model.graph
    if any(a.type in (a.GRAPH, a.GRAPHS) for n in g.node for a in n.attribute):
        return
    for n in g.node:  # the dynamo exporter's per-node stack traces / module paths (80 % of a GPT-2 file)
        del n.metadata_props[:]
        n.doc_string = ""
    keep = {i.name for i in g.input} | {o.name for o in g.output} | {""}
    mapping: dict[str, str] = {}
    for init in g.initializer:  # scales, zero points, float constants: short names; codes keep theirs
        if init.name.endswith((".weight_quantized", ".bias_quantized")) or init.name in keep:
            keep.add(init.name)
        else:
            mapping[init.name] = init.name = f"c{len(mapping)}"
    for n in g.node:
        n.name = ""
        for o in n.output:
            if o not in keep and o not in mapping:
                mapping[o] = f"t{len(mapping)}"
    for n in g.node:
        n.input[:] = [mapping.get(i, i) for i in n.input]
        n.output[:] = [mapping.get(o, o) for o in n.output]
