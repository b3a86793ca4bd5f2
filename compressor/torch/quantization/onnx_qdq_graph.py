"""The ONNX graph rewriting of the integer (QDQ) export (:func:`.onnx_qdq.export_int8_onnx` drives it): a small
editor over the exported GraphProto (:class:`_Graph`: initializers, consumers, Q/DQ insertion, topological order)
and the passes that use it: a zero Pad folded into its Conv, embedding tables stored as int8 codes with only
the gathered rows dequantized, no-op activations on a grid, the exporter's own Q/DQ pairs (quantized joins),
ReduceMean over H, W as GlobalAveragePool, the dynamic-quantization MatMul pattern; and the ops left in float
(:func:`float_ops`). Numbers in, ONNX out: no wrapper or quantizer is read here."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["FLOAT_REPORTED", "INTEGER_BETWEEN_QDQ", "float_ops"]


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


def _int8_embedding(graph: _Graph, name: str, qp: dict[str, Any], weight: torch.Tensor, taken: set[str],
                    made: set[str]) -> dict[str, Any]:
    """Store the embedding table ``weight`` of layer ``name`` (already on its grid, weight qparams ``qp``) as int8
    codes: each ``Gather(table, ids)`` becomes
    ``Gather(codes, ids)`` followed by ``DequantizeLinear`` (per-tensor scale), or, with one scale per row, by
    ``Cast -> Mul`` with the gathered rows' scales (``Gather(scales, ids)``). Only the gathered rows are
    dequantized at run time, not the table (onnxruntime's own quantizers write ``DequantizeLinear(table) ->
    Gather``, which dequantizes the whole table on every run). The values are those of the fake-quant model:
    ``code * scale`` in float32. A table some other node also reads (an output head tied to it) stays float."""
    from onnx import TensorProto, helper

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
        raise RuntimeError(f"int8 ONNX export: embedding {name!r}: the exported table is not on its recorded grid "
                           f"(max error {err:.3g})")
    q_name = graph.add_init(f"{name}.weight_quantized", codes.astype(qp["dtype"]))
    s_name = graph.add_init(f"{name}.weight_scale", s.astype(np.float32))
    z_name = None if per_row else graph.add_init(f"{name}.weight_zero_point", z.astype(qp["dtype"]))
    for user in users:
        ids, out = user.input[1], user.output[0]
        rows = graph.unique(f"{name}.rows_quantized")
        user.input[0], user.output[0] = q_name, rows
        if not per_row:
            graph.dq(out, rows, s_name, z_name, None)
            graph.names.discard(out)
            graph.new_nodes[-1].output[0] = out
            continue
        rs, ru, rf = (graph.unique(f"{name}.{k}") for k in ("row_scale", "row_scale_b", "rows_float"))
        axes = graph.add_init(f"{name}.last_axis", np.array([-1], dtype=np.int64))
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
    """Replace ``node`` (MatMul with the weight as ``[in, out]``, or Gemm) by dynamic int8 per token (the
    fake-quant model's :func:`~compressor.torch.quantization.ptq.dynamic_fake_quant`): each row of ``x`` divided
    by its max |x| (``Abs -> ReduceMax -> Max(tiny) -> Div``), then the graph of onnxruntime's
    ``quantize_dynamic``, ``DynamicQuantizeLinear(x') -> MatMulInteger(x_q, W_q, x_zp, W_zp) -> Cast(float) ->
    Mul(x_scale * W_scale)``, which onnxruntime fuses into ``DynamicQuantizeMatMul``, then ``Mul(row max)`` (+ the
    Gemm's bias). The row division makes the scale per token: an outlier token no longer sets every token's."""
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
    xa, xm, xmc, xn = (graph.unique(f"{name}.input_{k}") for k in ("abs", "row_max", "row_scale", "per_token"))
    xq, xs, xz = (graph.unique(f"{name}.input_{k}") for k in ("quantized", "scale", "zero_point"))
    acc, accf, sc, yt = (graph.unique(f"{name}.{k}") for k in ("acc", "acc_float", "out_scale", "per_token_out"))
    w_q = graph.add_init(f"{name}.weight_quantized", np.ascontiguousarray(codes))
    w_z = graph.add_init(f"{name}.weight_zero_point", zp)
    w_s = graph.add_init(f"{name}.weight_scale", scale.astype(np.float32))
    tiny = graph.add_init(f"{name}.row_scale_min", np.array(np.finfo(np.float32).tiny, dtype=np.float32))
    opset = max((o.version for o in graph.model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset >= 18:  # ReduceMax takes its axes as an input from opset 18
        reduce = helper.make_node("ReduceMax", [xa, graph.add_init(f"{name}.last_axis", np.array([-1], np.int64))],
                                  [xm], keepdims=1)
    else:
        reduce = helper.make_node("ReduceMax", [xa], [xm], axes=[-1], keepdims=1)
    bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
    y = graph.unique(f"{name}.matmul") if bias else out
    new = [helper.make_node("Abs", [x], [xa]), reduce,
           helper.make_node("Max", [xm, tiny], [xmc]),
           helper.make_node("Div", [x, xmc], [xn]),
           helper.make_node("DynamicQuantizeLinear", [xn], [xq, xs, xz]),
           helper.make_node("MatMulInteger", [xq, w_q, xz, w_z], [acc]),
           helper.make_node("Cast", [acc], [accf], to=TensorProto.FLOAT),
           helper.make_node("Mul", [xs, w_s], [sc]),
           helper.make_node("Mul", [accf, sc], [yt]),
           helper.make_node("Mul", [yt, xmc], [y])]
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
