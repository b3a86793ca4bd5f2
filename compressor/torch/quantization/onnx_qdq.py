"""Integer ONNX export of a QAT-quantized model: int8 weights + QDQ activations that onnxruntime fuses.

:func:`export_int8_onnx` exports the FLOAT model (the wrappers run their layer with the exported,
already quantized weight and bias; no quantization ops are traced) with a dynamic batch axis, then
rewrites the graph with the ``onnx`` API from the scales/zero points the quantizer recorded:

* each quantized weight initializer becomes integer codes (int8 for signed grids, uint8 for unsigned)
  followed by ``DequantizeLinear`` (``axis`` = output-channel axis for per-channel scales): the file holds
  one byte per weight;
* each configured input / output quantization becomes ``QuantizeLinear -> DequantizeLinear`` (uint8 or
  int8, the quantizer's scale and zero point) on the layer's input edge / after the layer (after its
  ReLU for a layer with ``fused_relu``: onnxruntime folds ``DQ -> Conv -> Relu -> Q`` into one
  ``QLinearConv`` when the zero point is the lowest code, which a ReLU output's range gives);
* after a grid-preserving op (Relu, MaxPool, Flatten, Reshape, ...) fed by a quantized output, that
  output's QDQ pair is repeated: the values already lie on that grid, so this changes nothing
  numerically, but onnxruntime then runs those ops on uint8/int8 (or drops the Relu) and a following
  layer without input quantization sees a quantized input;
* the bias of a layer with a quantized input becomes int32 codes with ``scale = input_scale *
  weight_scale`` and zero point 0 (+ ``DequantizeLinear``), the form onnxruntime's QDQ fusion requires
  (a float bias keeps Conv in float).

onnxruntime (graph optimisation ``ORT_ENABLE_EXTENDED`` and above, the default is ALL) then replaces
``DQ -> Conv -> Q`` with ``QLinearConv``, ``DQ -> Gemm (-> Q)`` with ``QGemm``, ``DQ -> MatMul -> Q`` with
``QLinearMatMul``. Differences to the fake-quant torch model: QuantizeLinear computes ``round(x / s) + zp``
(the model ``round(x / s + zp)``; ties differ), the int32 bias rounds the bias to ``s_in * s_w``, and the
integer kernels requantize; outputs agree within about one quantization step.
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import numpy as np
import torch

from ...core.atomic import atomic_path
from .wrapper import QuantizerModuleWrapper, quant_axis

__all__ = ["int8_export_problem", "check_int8_ready", "export_int8_onnx", "float_layers", "integer_kernel_layer"]

#: ops through which values on a quantization grid stay on the same grid (first input = data)
GRID_PRESERVING = {"Relu", "MaxPool", "Flatten", "Reshape", "Identity", "Transpose", "Squeeze", "Unsqueeze"}
#: ops onnxruntime turns into integer kernels when their inputs come from DequantizeLinear
COMPUTE_OPS = {"Conv", "Gemm", "MatMul", "ConvTranspose"}


def _containers(qmin: int, qmax: int) -> np.dtype | None:
    if 0 <= qmin and qmax <= 255:
        return np.dtype(np.uint8)
    if -128 <= qmin and qmax <= 127:
        return np.dtype(np.int8)
    return None


def integer_kernel_layer(w: QuantizerModuleWrapper) -> bool:
    """Whether ``w``'s layer maps to an onnxruntime integer kernel: Conv / Linear / HF Conv1D with a quantized
    weight (QLinearConv, QGemm, QLinearMatMul)."""
    from ..layout import is_hf_conv1d

    return "weight" in w.quant_types and (w._fn in ("conv", "linear") or is_hf_conv1d(w.layer))


def embedding_layer(w: QuantizerModuleWrapper) -> bool:
    """Whether ``w`` is an ``nn.Embedding`` quantizing only its weight: the int8 ONNX graph stores its table as
    int8 codes and gathers rows of codes (see :func:`_int8_embedding`)."""
    return isinstance(w.layer, torch.nn.Embedding) and list(w.quant_types) == ["weight"]


def float_layers(quantizer: Any) -> list[QuantizerModuleWrapper]:
    """The quantized layers the integer ONNX graph keeps in float (no onnxruntime integer kernel)."""
    return [w for w in quantizer.get_modules_wrapper() if not integer_kernel_layer(w) and not embedding_layer(w)]


def int8_export_problem(quantizer: Any) -> str | None:
    """Why this quantizer's model cannot be exported as an integer ONNX graph (None: it can). Layers without
    an integer kernel (LSTM, Embedding, ...) do not block it: they stay float (see :func:`float_layers`), as
    long as at least one layer is integer."""
    if not getattr(quantizer, "integer_onnx", False):
        return f"the integer ONNX form needs QAT_Quantizer (got {type(quantizer).__name__})"
    wrappers: list[QuantizerModuleWrapper] = quantizer.get_modules_wrapper()
    if not wrappers:
        return "no layer is quantized"
    if not any(integer_kernel_layer(w) or embedding_layer(w) for w in wrappers):
        return (f"no quantized layer maps to an integer kernel (only Conv/Linear/Conv1D layers with quantized "
                f"weights do; quantized: {', '.join(f'{w.name!r} ({w.type})' for w in wrappers)})")
    left = [w for w in wrappers if not integer_kernel_layer(w) and not embedding_layer(w)]
    if left:  # (their functional forward cannot be traced by the TorchScript exporter the int8 form uses)
        return (f"layers {', '.join(f'{w.name!r} ({w.type})' for w in left)} have no onnxruntime integer kernel "
                f"(only Conv/Linear/Conv1D layers with quantized weights do); leave them out of the config to get "
                f"the int8 form for the others, with those layers in float")
    for w in wrappers:
        if not w.quant_active:
            return f"layer {w.name!r} is not quantized yet (quant_start_step not reached)"
        if not integer_kernel_layer(w) and not embedding_layer(w):
            continue
        for t in w.quant_types:
            qp = w.qparams(t)
            if qp is None or w.quant_bits.get(t) != 8 or _containers(qp[2], qp[3]) is None:
                return f"layer {w.name!r}: {t} is not an 8-bit quantization with scale/zero point"
    return None


def check_int8_ready(quantizer: Any) -> None:
    """Raise ValueError when an activation scale is unknown (no forward pass / calibration yet)."""
    missing = []
    for w in quantizer.get_modules_wrapper():
        for t in w.quant_types:
            observed = w._buffers.get(f"{t}_observed")
            if observed is not None and not bool(observed):
                missing.append(f"{w.name}.{t}")
    if missing:
        raise ValueError(
            "export_model: the integer ONNX export needs the activation scales, but these were never observed: "
            f"{', '.join(missing)}. Run the model forward in training mode on calibration data (or call "
            "quantizer.load_calibration_config(...)) before exporting; nothing was written.")


def _host_qparams(w: QuantizerModuleWrapper, t: str) -> dict[str, Any]:
    scale, zp, qmin, qmax = w.qparams(t)
    s = scale.detach().cpu().double().numpy()
    z = np.rint(zp.detach().cpu().double().numpy())
    axis = quant_axis(w.layer, t) if s.ndim > 0 else None
    return {"scale": s, "zp": z, "qmin": int(qmin), "qmax": int(qmax), "axis": axis,
            "dtype": _containers(qmin, qmax)}


def _export_float(quantizer: Any, exported: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                  dummy_input: Any, onnx_kwargs: dict[str, Any]) -> bytes:
    """The model with quantized weight values but no quantization ops, batch axis dynamic."""
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

        with torch.no_grad(), warnings.catch_warnings(), export_context(model):
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


class _Graph:
    """Small helper around a GraphProto: initializers, consumers, node insertion. The Q/DQ nodes it adds
    have no names (their tensors are named after the layer): names are ~20% of a small model's file."""

    def __init__(self, model: Any):
        from onnx import numpy_helper

        self.model = model
        self.g = model.graph
        for node in [n for n in self.g.node if n.op_type == "Constant" and len(n.attribute) == 1
                     and n.attribute[0].name == "value"]:  # constants -> initializers (one place to look)
            tensor = node.attribute[0].t
            tensor.name = node.output[0]
            self.g.initializer.append(tensor)
            self.g.node.remove(node)
        outputs = {o.name for o in self.g.output}
        inits = {i.name for i in self.g.initializer}
        for node in [n for n in self.g.node if n.op_type == "Identity" and n.input[0] in inits
                     and n.output[0] not in outputs]:
            # the TorchScript exporter writes one initializer for equal tensors (e.g. the all-zero biases of a
            # freshly initialised model) and an Identity of it per further user: readers read it directly, so a
            # layer's bias Add is seen as adding a constant
            for user in self.g.node:
                user.input[:] = [node.input[0] if i == node.output[0] else i for i in user.input]
            self.g.node.remove(node)
        self.inits = {i.name: i for i in self.g.initializer}
        self.arrays = {name: numpy_helper.to_array(i) for name, i in self.inits.items()}
        self.new_nodes: list[Any] = []
        self.names: set[str] = set(self.inits) | {o for n in self.g.node for o in n.output}

    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self.names:
            name, k = f"{base}_{k}", k + 1
        self.names.add(name)
        return name

    def add_init(self, base: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        name = self.unique(base)
        self.g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        self.inits[name] = self.g.initializer[-1]
        return name

    def consumers(self, name: str) -> list[Any]:
        return [n for n in self.g.node if name in n.input]

    def dq(self, base: str, q_name: str, scale: str, zp: str, axis: int | None) -> str:
        from onnx import helper

        out = self.unique(base)
        kw = {} if axis is None else {"axis": axis}
        self.new_nodes.append(helper.make_node("DequantizeLinear", [q_name, scale, zp], [out], **kw))
        return out

    def qdq(self, base: str, src: str, qp: dict[str, Any], out: str | None = None) -> str:
        """``src -> QuantizeLinear -> DequantizeLinear -> out`` (a new name unless given)."""
        from onnx import helper

        if qp["axis"] is not None:
            raise ValueError("per-channel activation quantization has no integer ONNX kernel; use a per_tensor scheme")
        scale = self.add_init(base + ".scale", np.float32(qp["scale"]))
        zp = self.add_init(base + ".zero_point", qp["zp"].astype(qp["dtype"]))
        q = self.unique(base + ".quantized")
        self.new_nodes.append(helper.make_node("QuantizeLinear", [src, scale, zp], [q]))
        if out is None:
            return self.dq(base + ".dequantized", q, scale, zp, None)
        self.names.add(out)
        self.new_nodes.append(helper.make_node("DequantizeLinear", [q, scale, zp], [out]))
        return out

    def drop_unused_initializers(self) -> None:
        used = {i for n in list(self.g.node) + self.new_nodes for i in n.input}
        used |= {o.name for o in self.g.output}
        keep = [i for i in self.g.initializer if i.name in used]
        del self.g.initializer[:]
        self.g.initializer.extend(keep)

    def finish(self) -> None:
        """Append the new nodes and restore a topological order."""
        nodes = list(self.g.node) + self.new_nodes
        ready = {i.name for i in self.g.input} | {i.name for i in self.g.initializer} | {""}
        ordered, pending = [], nodes
        while pending:
            rest = []
            for n in pending:
                if all(i in ready for i in n.input):
                    ordered.append(n)
                    ready.update(n.output)
                else:
                    rest.append(n)
            if len(rest) == len(pending):
                missing = sorted({i for n in rest for i in n.input if i not in ready} - {o for n in rest for o in n.output})
                raise RuntimeError(f"int8 ONNX rewrite: the graph has a cycle or a dangling input: {missing[:5]}")
            pending = rest
        del self.g.node[:]
        self.g.node.extend(ordered)
        self.new_nodes = []


def _find_weight(graph: _Graph, weight: np.ndarray, taken: set[str]) -> tuple[str, bool] | None:
    """The float initializer holding ``weight`` (or its transpose, for MatMul): (name, transposed)."""
    for transposed in (False, True):
        want = weight.T if transposed else weight
        if transposed and weight.ndim != 2:
            break
        for name, arr in graph.arrays.items():
            if name in taken or arr.dtype != np.float32 or arr.shape != want.shape:
                continue
            if np.array_equal(arr, want):
                return name, transposed
    return None


def _constant_value(graph: _Graph, name: str, made: dict[str, Any], limit: int = 32) -> np.ndarray | None:
    """The value of tensor ``name`` when it is computed from initializers only (the TorchScript exporter leaves
    e.g. a Pad's pads as Cast(Reshape(Slice(...))) of constants), evaluated with onnx's reference evaluator."""
    if name in graph.arrays:
        return graph.arrays[name]
    nodes, todo, seen = [], [name], set()
    while todo:
        t = todo.pop()
        if t in graph.arrays or t in seen or t == "":
            continue
        seen.add(t)
        n = made.get(t)
        if n is None or len(nodes) >= limit:
            return None
        nodes.append(n)
        todo.extend(n.input)
    try:
        from onnx import helper
        from onnx.reference import ReferenceEvaluator

        uniq = list({id(n): n for n in nodes}.values())
        used = {i for n in uniq for i in n.input}
        g = helper.make_graph(uniq[::-1], "const", [], [helper.make_tensor_value_info(name, 0, None)],
                              [graph.inits[i] for i in used if i in graph.inits])
        m = helper.make_model(g, opset_imports=list(graph.model.opset_import))
        return np.asarray(ReferenceEvaluator(m).run(None, {})[0])
    except Exception:  # noqa: BLE001  (anything the evaluator cannot run: not folded)
        return None


def _fold_pads(graph: _Graph, convs: list[Any]) -> int:
    """Move a constant-zero spatial ``Pad`` whose only reader is a 2-D ``Conv`` into the conv's ``pads``."""
    from onnx import helper

    made = {o: n for n in graph.g.node for o in n.output}
    outputs = {o.name for o in graph.g.output}
    done = 0
    for conv in convs:
        pad = made.get(conv.input[0])
        if pad is None or pad.op_type != "Pad" or pad.output[0] in outputs or len(graph.consumers(pad.output[0])) != 1:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in pad.attribute}
        cattrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
        mode = attrs.get("mode", b"constant")
        pads = attrs.get("pads") if "pads" in attrs else (
            _constant_value(graph, pad.input[1], made) if len(pad.input) > 1 else None)
        value = graph.arrays.get(pad.input[2]) if len(pad.input) > 2 and pad.input[2] else np.zeros(())
        if (mode not in (b"constant", "constant") or pads is None or value is None or np.any(value != 0)
                or (len(pad.input) > 3 and pad.input[3]) or cattrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET")):
            continue
        pads = [int(v) for v in np.asarray(pads).ravel()]
        if len(pads) != 8 or any(pads[i] for i in (0, 1, 4, 5)) or min(pads) < 0:
            continue
        old = list(cattrs.get("pads", [0, 0, 0, 0]))
        new = [old[0] + pads[2], old[1] + pads[3], old[2] + pads[6], old[3] + pads[7]]
        for a in list(conv.attribute):
            if a.name == "pads":
                conv.attribute.remove(a)
        conv.attribute.append(helper.make_attribute("pads", new))
        conv.input[0] = pad.input[0]
        graph.g.node.remove(pad)
        done += 1
    return done


def _int8_embedding(graph: _Graph, w: QuantizerModuleWrapper, weight: torch.Tensor, taken: set[str],
                    made: set[str]) -> dict[str, Any]:
    """Store ``w``'s embedding table (already on its grid) as int8 codes: each ``Gather(table, ids)`` becomes
    ``Gather(codes, ids)`` followed by ``DequantizeLinear`` (per-tensor scale), or, with one scale per row, by
    ``Cast -> Mul`` with the gathered rows' scales (``Gather(scales, ids)``). Only the gathered rows are
    dequantized at run time, not the table (onnxruntime's own quantizers write ``DequantizeLinear(table) ->
    Gather``, which dequantizes the whole table on every run). The values are those of the fake-quant model:
    ``code * scale`` in float32. A table some other node also reads (an output head tied to it) stays float."""
    from onnx import TensorProto, helper

    qp = _host_qparams(w, "weight")
    table = weight.detach().cpu().float().numpy()
    found = _find_weight(graph, table, taken)
    info: dict[str, Any] = {"op": "Gather", "input": False, "output": False, "bias": None}
    users = graph.consumers(found[0]) if found is not None and not found[1] else []
    if not users or any(u.op_type != "Gather" or u.input[0] != found[0] or any(
            a.name == "axis" and a.i != 0 for a in u.attribute) for u in users):
        info["weight"] = "float (the table is not only gathered: tied to another layer)" if users else "float"
        return info
    init = found[0]
    taken.add(init)
    s, z = qp["scale"], qp["zp"]
    per_row = s.ndim > 0
    s_b, z_b = (s.reshape(-1, 1), z.reshape(-1, 1)) if per_row else (s, z)
    if per_row and (qp["axis"] != 0 or np.any(z)):
        info["weight"] = "float (per-channel scales along the embedding axis or with zero points)"
        return info
    codes = np.clip(np.rint(table.astype(np.float64) / s_b + z_b), qp["qmin"], qp["qmax"])
    err = np.max(np.abs((codes - z_b) * s_b - table)) if table.size else 0.0
    if err > 1e-5 * max(1.0, float(np.max(np.abs(table))) if table.size else 1.0):
        raise RuntimeError(f"int8 ONNX export: embedding {w.name!r}: the exported table is not on its recorded grid "
                           f"(max error {err:.3g})")
    q_name = graph.add_init(f"{w.name}.weight_quantized", codes.astype(qp["dtype"]))
    s_name = graph.add_init(f"{w.name}.weight_scale", s.astype(np.float32))
    z_name = None if per_row else graph.add_init(f"{w.name}.weight_zero_point", z.astype(qp["dtype"]))
    for user in users:
        ids, out = user.input[1], user.output[0]
        rows = graph.unique(f"{w.name}.rows_quantized")
        user.input[0], user.output[0] = q_name, rows
        if not per_row:
            graph.dq(out, rows, s_name, z_name, None)
            graph.names.discard(out)
            graph.new_nodes[-1].output[0] = out
            continue
        rs, ru, rf = (graph.unique(f"{w.name}.{k}") for k in ("row_scale", "row_scale_b", "rows_float"))
        axes = graph.add_init(f"{w.name}.last_axis", np.array([-1], dtype=np.int64))
        graph.new_nodes += [helper.make_node("Gather", [s_name, ids], [rs]),
                            helper.make_node("Unsqueeze", [rs, axes], [ru]),
                            helper.make_node("Cast", [rows], [rf], to=TensorProto.FLOAT),
                            helper.make_node("Mul", [rf, ru], [out])]
        made.add(out)  # (not a float op of the model: the rows' dequantization)
    info["weight"] = f"{qp['dtype'].name}{' per-row' if per_row else ''}"
    return info


def _noop_activation(graph: _Graph, node: Any, qp: dict[str, Any]) -> bool:
    """Whether ``node`` (Relu, or Clip with constant bounds) leaves every value of grid ``qp`` unchanged."""
    lo = (qp["qmin"] - float(np.max(qp["zp"]))) * float(np.max(qp["scale"]))
    hi = (qp["qmax"] - float(np.min(qp["zp"]))) * float(np.max(qp["scale"]))
    if node.op_type == "Relu":
        return lo >= 0.0
    if node.op_type != "Clip":
        return False
    bounds = [graph.arrays.get(i) if i else None for i in list(node.input[1:3]) + [""] * (3 - len(node.input))]
    cmin = -np.inf if bounds[0] is None else float(bounds[0])
    cmax = np.inf if bounds[1] is None else float(bounds[1])
    if len(node.input) > 1 and node.input[1] and bounds[0] is None:
        return False
    if len(node.input) > 2 and node.input[2] and bounds[1] is None:
        return False
    return cmin <= lo and cmax >= hi * (1 - 1e-6)


def _traced_qdq(graph: _Graph) -> dict[str, dict[str, Any]]:
    """``{DequantizeLinear output: qparams}`` of the per-tensor QuantizeLinear -> DequantizeLinear pairs the
    exporter already wrote (the quantized joins of :mod:`.joins`)."""
    made = {o: n for n in graph.g.node for o in n.output}
    out: dict[str, dict[str, Any]] = {}
    for n in graph.g.node:
        q = made.get(n.input[0]) if n.op_type == "DequantizeLinear" and len(n.input) == 3 else None
        if q is None or q.op_type != "QuantizeLinear":
            continue
        s, z = graph.arrays.get(n.input[1]), graph.arrays.get(n.input[2])
        if s is None or z is None or s.ndim or z.dtype not in (np.uint8, np.int8):
            continue
        info = np.iinfo(z.dtype)
        out[n.output[0]] = {"scale": s.astype(np.float64), "zp": z.astype(np.float64), "qmin": int(info.min),
                            "qmax": int(info.max), "axis": None, "dtype": np.dtype(z.dtype)}
    return out


def _reduce_mean_to_gap(graph: _Graph, joins: dict[str, dict[str, Any]]) -> int:
    """``ReduceMean`` over axes (2, 3) whose output a join's QuantizeLinear reads becomes ``GlobalAveragePool``
    (onnxruntime has no integer ReduceMean, but QLinearGlobalAveragePool), followed, after the join's
    DequantizeLinear, by a ``Reshape`` to ``[N, C]`` when the mean dropped the axes. Returns the count."""
    from onnx import helper

    done = 0
    for node in list(graph.g.node):
        if node.op_type != "ReduceMean":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axes = attrs.get("axes")
        if axes is None and len(node.input) > 1:
            axes = graph.arrays.get(node.input[1])
        if axes is None or sorted(int(a) % 4 for a in np.asarray(axes).ravel()) != [2, 3]:
            continue
        users = graph.consumers(node.output[0])
        if len(users) != 1 or users[0].op_type != "QuantizeLinear":
            continue
        deqs = [d for d in graph.consumers(users[0].output[0]) if d.op_type == "DequantizeLinear"]
        if len(deqs) != 1 or deqs[0].output[0] not in joins:
            continue
        gap = helper.make_node("GlobalAveragePool", [node.input[0]], [node.output[0]])
        graph.g.node.remove(node)
        graph.g.node.append(gap)
        if attrs.get("keepdims", 1) == 0:
            dq = deqs[0]
            name = dq.output[0]
            raw = graph.unique(name + ".nchw")
            dq.output[0] = raw
            joins[raw] = joins[name]
            shape = graph.add_init(name + ".shape", np.array([0, -1], dtype=np.int64))
            graph.g.node.append(helper.make_node("Reshape", [raw, shape], [name]))
        done += 1
    return done


def _same_grid(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    return (a is not None and a["axis"] is None and b["axis"] is None and a["dtype"] == b["dtype"]
            and np.float32(a["scale"]) == np.float32(b["scale"]) and float(a["zp"]) == float(b["zp"]))


def _dynamic_matmul(graph: _Graph, name: str, node: Any, codes: np.ndarray, scale: np.ndarray, zp: np.ndarray,
                    axis: int | None, made: set[str]) -> None:
    """Replace ``node`` (MatMul with the weight as ``[in, out]``, or Gemm) by the graph of onnxruntime's
    ``quantize_dynamic``: ``DynamicQuantizeLinear(x) -> MatMulInteger(x_q, W_q, x_zp, W_zp) -> Cast(float) ->
    Mul(x_scale * W_scale)`` (+ the Gemm's bias), which onnxruntime fuses into ``DynamicQuantizeMatMul``."""
    from onnx import TensorProto, helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gemm":
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            raise RuntimeError(f"int8 ONNX export (dynamic): layer {name!r}: Gemm with transA/alpha/beta {attrs}")
        if attrs.get("transB", 0):
            codes = codes.T
            axis = None if axis is None else 1 - axis
    if axis is not None and axis != 1:
        raise RuntimeError(f"int8 ONNX export (dynamic): layer {name!r}: per-channel weight scales along the input "
                           f"axis have no MatMulInteger form")
    x, out = node.input[0], node.output[0]
    xq, xs, xz = (graph.unique(f"{name}.input_{k}") for k in ("quantized", "scale", "zero_point"))
    acc, accf, sc = (graph.unique(f"{name}.{k}") for k in ("acc", "acc_float", "out_scale"))
    w_q = graph.add_init(f"{name}.weight_quantized", np.ascontiguousarray(codes))
    w_z = graph.add_init(f"{name}.weight_zero_point", zp)
    w_s = graph.add_init(f"{name}.weight_scale", scale.astype(np.float32))
    bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
    y = graph.unique(f"{name}.matmul") if bias else out
    new = [helper.make_node("DynamicQuantizeLinear", [x], [xq, xs, xz]),
           helper.make_node("MatMulInteger", [xq, w_q, xz, w_z], [acc]),
           helper.make_node("Cast", [acc], [accf], to=TensorProto.FLOAT),
           helper.make_node("Mul", [xs, w_s], [sc]),
           helper.make_node("Mul", [accf, sc], [y])]
    if bias:
        new.append(helper.make_node("Add", [y, bias], [out]))
    graph.g.node.remove(node)
    graph.new_nodes.extend(new)
    made.update(o for n in new for o in n.output)


#: ops the int8 graph may keep in float (listed in ``quantizer.onnx_float_ops`` after an export)
FLOAT_REPORTED = {"Softmax", "LayerNormalization", "Erf", "Gelu", "FastGelu", "Tanh", "Sigmoid", "Div", "Sqrt", "Pow",
                  "ReduceMean", "MatMul", "Gemm", "Conv", "Add", "Mul", "Sub", "AveragePool", "GlobalAveragePool",
                  "Concat", "Clip", "Pad", "LSTM", "GRU"}
#: ... of which onnxruntime runs these as one integer kernel (or folds them into the grid) when DequantizeLinear
#: feeds them and QuantizeLinear reads their output; the others (Gelu, LayerNorm, Erf, Div ...) have no integer
#: kernel and run in float between the two
INTEGER_BETWEEN_QDQ = {"MatMul", "Gemm", "Conv", "Add", "Mul", "Concat", "AveragePool", "GlobalAveragePool",
                       "Sigmoid", "Softmax", "Clip", "Pad"}


def float_ops(model: Any, made: set[str] = frozenset()) -> dict[str, int]:
    """``{op type: count}`` of the compute ops of an int8 ONNX graph that onnxruntime runs in float: those in
    :data:`FLOAT_REPORTED` with no integer kernel (:data:`INTEGER_BETWEEN_QDQ`), or whose output is not quantized
    (read by a QuantizeLinear) -- Softmax, LayerNorm,
    GELU (one Gelu node: the export is opset 20), attention's activation x activation MatMuls, residual adds of float values ... -- other than a
    MatMul / Gemm / Conv with a dequantized weight (an integer kernel with a float output) and the nodes of
    the dynamic-quantization pattern."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list[Any]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    out: dict[str, int] = {}
    for n in g.node:
        if n.op_type not in FLOAT_REPORTED or any(o in made for o in n.output):
            continue
        users = readers.get(n.output[0], [])
        if n.op_type in INTEGER_BETWEEN_QDQ and users and all(u.op_type == "QuantizeLinear" for u in users):
            continue
        if n.op_type in ("MatMul", "Gemm", "Conv") and len(n.input) > 1:
            p = producer.get(n.input[1])
            if p is not None and p.op_type == "DequantizeLinear":
                continue
        if n.op_type == "Concat" and not any(i in producer and producer[i].op_type not in ("Shape", "Unsqueeze",
                                                                                         "Gather", "Constant")
                                             for i in n.input):
            continue  # shape arithmetic
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return dict(sorted(out.items()))


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


def export_int8_onnx(quantizer: Any, exported: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                     onnx_path: str | os.PathLike, dummy_input: Any, weight_dtype: str = "int8",
                     **onnx_kwargs: Any) -> dict[str, Any]:
    """Write the integer (QDQ, int8 weights) ONNX graph to ``onnx_path``; returns a per-layer summary
    ``{layer: {'op', 'weight', 'input', 'output', 'bias'}}``. Nothing is left at ``onnx_path`` on error.

    ``weight_dtype='uint8'`` stores symmetric int8 weight codes ``c`` as uint8 ``c + 128`` with zero point 128
    (the same dequantized values): onnxruntime then runs u8u8 kernels, which are exact on x86 CPUs with AVX2
    but without VNNI, where its u8s8 kernels add pairs of products in saturating int16 (several % error on
    layers with wide activations, e.g. ConvNeXt's and ViT's MLPs). ``'int8'`` keeps int8 codes: the
    fast path on VNNI / ARM and the form onnxruntime's own quantizer writes."""
    import onnx

    wrappers: list[QuantizerModuleWrapper] = [w for w in quantizer.get_modules_wrapper() if integer_kernel_layer(w)]
    params = {w.name: {t: _host_qparams(w, t) for t in w.quant_types} for w in wrappers}
    dynamic = getattr(quantizer, "activation", "static") == "dynamic"
    made: set[str] = set()  # outputs of the nodes the dynamic rewrite adds
    proto = _export_float(quantizer, exported, dummy_input, dict(onnx_kwargs))
    model = onnx.load_from_string(proto)
    graph = _Graph(model)
    summary: dict[str, Any] = {}
    taken: set[str] = set()
    layers = []  # (wrapper, compute node, weight axis in the initializer)
    for w in wrappers:
        weight = exported[w.name][0].detach().cpu().float().numpy()
        found = _find_weight(graph, weight, taken)
        if found is None:
            raise RuntimeError(f"int8 ONNX export: the weight of layer {w.name!r} is not an initializer of the "
                               f"exported graph")
        init, transposed = found
        taken.add(init)
        nodes = [n for n in graph.consumers(init) if n.op_type in COMPUTE_OPS]
        if len(nodes) != 1:
            raise RuntimeError(f"int8 ONNX export: layer {w.name!r}: expected one Conv/Gemm/MatMul using its weight, "
                               f"found {[n.op_type for n in nodes]}")
        node = nodes[0]
        qp = params[w.name]["weight"]
        axis = qp["axis"]
        if axis is not None and transposed:
            axis = 1 - axis
        layers.append((w, node, init, transposed, axis))

    # 0. a zero Pad feeding only a Conv becomes the Conv's own padding (QLinearConv pads with the zero point),
    # so no float Pad is left between the producer's DequantizeLinear and the conv (HF's TF-style padding)
    _fold_pads(graph, [node for _, node, *_ in layers if node.op_type == "Conv"])

    # 1. outputs (so the input propagation below can find them)
    out_qdq: dict[str, dict[str, Any]] = {}  # dequantized activation tensor -> its qparams
    for w, node, *_ in layers:
        info = summary.setdefault(w.name, {"op": node.op_type})
        info["output"] = False
        if "output" not in w.quant_types:
            continue
        end = node
        has_bias = exported[w.name][1] is not None or getattr(w.layer, "bias", None) is not None
        if node.op_type == "MatMul" and has_bias:  # Linear on >2-D inputs: MatMul + Add(bias)
            users = graph.consumers(node.output[0])
            # the bias Add adds a constant; an Add of two activations is the model's (a residual: Llama's
            # o_proj / down_proj have no bias and feed one), after which this layer's output grid is wrong
            if len(users) == 1 and users[0].op_type == "Add" and any(i in graph.arrays for i in users[0].input):
                end = users[0]
        fused = getattr(w, "fused_relu", False)
        if fused:  # the wrapper's own relu / relu6: quantize after it (DQ-Conv-Relu-Q / -Clip-Q fuse)
            users = graph.consumers(end.output[0])
            if len(users) != 1 or users[0].op_type != ("Clip" if fused == "relu6" else "Relu"):
                raise RuntimeError(f"int8 ONNX export: layer {w.name!r} fuses a ReLU, but the exported graph has "
                                   f"{[n.op_type for n in users]} after it")
            end = users[0]
        name = end.output[0]
        raw = graph.unique(name + ".float")
        end.output[0] = raw
        graph.qdq(f"{w.name}.output", raw, params[w.name]["output"], out=name)
        out_qdq[name] = params[w.name]["output"]
        info["output"] = True

    # 1a. quantized joins (Q -> DQ pairs the exporter wrote, see .joins): their outputs are quantized values
    # too; a mean over H, W becomes GlobalAveragePool (an integer kernel in onnxruntime)
    joins = _traced_qdq(graph)
    _reduce_mean_to_gap(graph, joins)
    out_qdq.update(joins)

    # 1b. values stay on a quantized output's grid through Relu/MaxPool/Flatten/...: repeat its QDQ pair
    # after such ops (exact), so onnxruntime runs them on integers and the next layer sees a DQ input
    for node in list(graph.g.node):  # topological order
        if not node.input or node.input[0] not in out_qdq or not (
                node.op_type in GRID_PRESERVING or _noop_activation(graph, node, out_qdq[node.input[0]])):
            continue  # (a Clip counts only where it changes no value of the grid: a ReLU6 after a fused ReLU6)
        qp, name = out_qdq[node.input[0]], node.output[0]
        out_qdq[name] = qp
        outputs = {o.name for o in graph.g.output}
        if _noop_activation(graph, node, qp) and name not in outputs:
            # a ReLU of values dequantized from a grid whose zero point is its lowest code changes nothing:
            # its readers read its input (onnxruntime would keep a DQ -> Q re-quantization for such a ReLU
            # when a residual add also reads it)
            for user in graph.consumers(name):
                user.input[:] = [node.input[0] if i == name else i for i in user.input]
            out_qdq[node.input[0]] = qp
            graph.g.node.remove(node)
            continue
        if any(n.op_type in ("Relu", "MaxPool") for n in graph.consumers(name)):
            continue  # only at the end of a Relu/MaxPool run (ORT fuses DQ -> Relu -> MaxPool -> Q best)
        raw = graph.unique(name + ".float")
        node.output[0] = raw
        graph.qdq(name, raw, qp, out=name)

    # 2. weights (int codes + DequantizeLinear), inputs, int32 bias
    for w, node, init, _transposed, axis in layers:
        info = summary[w.name]
        qp = params[w.name]["weight"]
        weight = graph.arrays[init].astype(np.float64)
        s, z = qp["scale"], qp["zp"]
        if axis is not None:
            shape = [1] * weight.ndim
            shape[axis] = -1
            s_b, z_b = s.reshape(shape), z.reshape(shape)
        else:
            s_b, z_b = s, z
        codes = np.clip(np.rint(weight / s_b + z_b), qp["qmin"], qp["qmax"])
        err = np.max(np.abs((codes - z_b) * s_b - weight)) if weight.size else 0.0
        if err > 1e-5 * max(1.0, float(np.max(np.abs(weight))) if weight.size else 1.0):
            raise RuntimeError(f"int8 ONNX export: layer {w.name!r}: the exported weight is not on its recorded grid "
                               f"(max error {err:.3g}); was the weight scale changed after the last forward?")
        dtype = qp["dtype"]
        if weight_dtype == "uint8" and dtype == np.int8 and not np.any(z) and qp["qmin"] >= -127:
            codes, z, dtype = codes + 128, np.full_like(z, 128), np.dtype(np.uint8)  # same values, u8u8 kernels
        if dynamic:
            _dynamic_matmul(graph, w.name, node, codes.astype(dtype), s, z.astype(dtype), axis, made)
            info.update(weight=f"{dtype.name}{' per-channel' if axis is not None else ''}", input="dynamic",
                        bias="float" if node.op_type == "MatMul" or len(node.input) < 3 or not node.input[2] else "float")
            continue
        q_name = graph.add_init(f"{w.name}.weight_quantized", codes.astype(dtype))
        s_name = graph.add_init(f"{w.name}.weight_scale", s.astype(np.float32))
        z_name = graph.add_init(f"{w.name}.weight_zero_point", z.astype(dtype))
        deq = graph.dq(f"{w.name}.weight_dequantized", q_name, s_name, z_name, axis)
        node.input[1] = deq
        info["weight"] = f"{dtype.name}{' per-channel' if axis is not None else ''}"

        # input: configured, or inherited through grid-preserving ops from a quantized output
        in_qp = params[w.name].get("input")
        src = node.input[0]
        if in_qp is None:
            in_qp = out_qdq.get(src)  # already the output of a DequantizeLinear (step 1 / 1b)
            info["input"] = "inherited" if in_qp is not None else False
        elif _same_grid(out_qdq.get(src), in_qp):
            info["input"] = "shared"  # already dequantized from this grid: a second Q/DQ pair would be a no-op
        else:
            info["input"] = True
            node.input[0] = graph.qdq(f"{w.name}.input", src, in_qp)

        # bias
        info["bias"] = "float" if len(node.input) > 2 and node.input[2] else None
        if in_qp is not None and info["bias"] and node.input[2] in graph.arrays and node.op_type in ("Conv", "Gemm"):
            bias = graph.arrays[node.input[2]].astype(np.float64)
            bscale = float(in_qp["scale"]) * np.asarray(s, dtype=np.float64)
            bscale32 = bscale.astype(np.float32)
            bcodes = np.rint(bias / bscale32.astype(np.float64))
            if bias.ndim == 1 and np.all(np.abs(bcodes) <= 2**31 - 1):
                b_q = graph.add_init(f"{w.name}.bias_quantized", bcodes.astype(np.int32))
                b_s = graph.add_init(f"{w.name}.bias_scale", bscale32)
                b_z = graph.add_init(f"{w.name}.bias_zero_point", np.zeros(bscale32.shape, np.int32))
                node.input[2] = graph.dq(f"{w.name}.bias_dequantized", b_q, b_s, b_z, 0 if bscale32.ndim else None)
                info["bias"] = "int32"

    # 3. embedding tables: int8 codes, rows gathered as codes, then scaled
    for w in quantizer.get_modules_wrapper():
        if embedding_layer(w):
            summary[w.name] = _int8_embedding(graph, w, exported[w.name][0], taken, made)

    graph.drop_unused_initializers()
    graph.finish()
    # shapes/types of renamed tensors are stale; onnxruntime re-infers them. Deliberately not re-inferred with
    # onnx's data propagation (onnx.shape_inference.infer_shapes(data_prop=True)), although onnxruntime then
    # folds more of a transformer's shape arithmetic, as on a quant_pre_process'ed model: with the shapes known it
    # also fuses each residual Add + LayerNormalization into SkipLayerNormalization, which onnxruntime 1.32's CPU
    # kernel runs slower (a tiny BERT, 1 thread: 1.28x at batch 1, 1.32x at batch 32), and the folding alone
    # gained nothing measurable (issue 27, benchmarks/RESULTS.md)
    for vi in list(model.graph.value_info):
        model.graph.value_info.remove(vi)
    if not any(o.domain in ("", "ai.onnx") and o.version >= 13 for o in model.opset_import):
        raise RuntimeError("int8 ONNX export needs opset >= 13 (per-channel DequantizeLinear)")
    model.producer_name = "compressor"
    quantizer.onnx_float_ops = float_ops(model, made)
    _compact_value_names(model)
    onnx.checker.check_model(model)
    with atomic_path(onnx_path) as tmp:  # nothing at onnx_path unless the whole file is written
        onnx.save(model, tmp)
    return summary
