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

Here: which quantizers and layers can take this form (:func:`int8_export_problem`, :func:`float_layers`) and
the export's steps; the graph rewriting is :mod:`.onnx_qdq_graph`'s, the float export and the file's value
names :mod:`.onnx_qdq_io`'s.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ...core.atomic import atomic_path
from .onnx_qdq_graph import FLOAT_REPORTED as FLOAT_REPORTED  # (re-exported: public before the split)
from .onnx_qdq_graph import INTEGER_BETWEEN_QDQ as INTEGER_BETWEEN_QDQ
from .onnx_qdq_graph import (
    _dynamic_matmul,
    _find_weight,
    _fold_pads,
    _Graph,
    _int8_embedding,
    _noop_activation,
    _reduce_mean_to_gap,
    _same_grid,
    _traced_qdq,
    float_ops,
)
from .onnx_qdq_io import _compact_value_names, _export_float
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
    # layers without an integer kernel are exported as their plain layer holding the quantized weight values
    # (see .onnx_qdq_io._plain_float_layers) and named in export_model's warning
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
    proto = _export_float(quantizer, exported, dummy_input, dict(onnx_kwargs), float_layers(quantizer))
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
            summary[w.name] = _int8_embedding(graph, w.name, _host_qparams(w, "weight"), exported[w.name][0], taken,
                                              made)

    graph.drop_unused_initializers()
    graph.finish()
    # shapes/types of renamed tensors are stale; onnxruntime re-infers them. Deliberately not re-inferred with
    # onnx's data propagation (onnx.shape_inference.infer_shapes(data_prop=True)), although onnxruntime then
    # folds more of a transformer's shape arithmetic, as on a quant_pre_process'ed model: with the shapes known it
    # also fuses each residual Add + LayerNormalization into SkipLayerNormalization, which onnxruntime 1.32's CPU
    # kernel runs slower (a tiny BERT, 1 thread: 1.28x at batch 1, 1.32x at batch 32), and the folding alone
    # gained nothing measurable (benchmarks/RESULTS.md)
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
