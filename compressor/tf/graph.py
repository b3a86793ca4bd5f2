"""Keras 3 Functional / Sequential model -> the neutral channel graph of :mod:`compressor.core.graph`.

:func:`build_graph` walks the model's Functional graph (``model.inputs`` back to ``model.outputs``
through each tensor's ``_keras_history``), one :class:`~compressor.core.graph.Node` per layer call, and
reads the per-channel zero facts off the CURRENT weights. Nothing here reasons about channels: classes,
zero analysis and what speedup removes are core's. Keras' channel axis is the last axis everywhere.

Translation
-----------
* Conv1D/2D/3D ``conv`` (``groups > 1``: ``group_conv``; ``groups == in_channels`` with ``filters`` a multiple
  of it, as ConvNeXt writes its depthwise convs: ``depthwise`` with ``multiplier = filters // groups``); Dense and EinsumDense acting on the last axis
  only ``linear``; DepthwiseConv1D/2D ``depthwise`` (``multiplier`` = ``depth_multiplier``); Embedding
  ``embedding``; BatchNormalization over the last axis ``norm`` (inference semantics).
* A layer's fused ``activation`` becomes a separate node after the layer (``<node>:activation``, no
  layer): ``activation`` with ``zero_preserving`` = ``f(0) == 0`` (evaluated), or ``other`` for
  activations that mix channels (softmax, log_softmax, glu, sparsemax) or are unknown callables.
* Activation layers (Activation, ReLU, LeakyReLU, ELU): ``activation`` (``f(0) == 0`` evaluated);
  Softmax/PReLU and friends ``other``. Rescaling with scalar scale/offset: ``activation`` with
  ``zero_preserving = offset == 0``; other Rescaling, Normalization: ``other``.
* Pooling (Max/Average, Global*): ``pool``; Dropout-like, ZeroPadding, Cropping, UpSampling, Resizing,
  RepeatVector, Identity: ``identity``; Permute keeping the last axis last: ``identity``.
* Add/Subtract/Maximum/Minimum/Average ``elementwise`` (zero ``'all'``), Multiply (zero ``'any'``);
  Concatenate on the last axis ``concat``; Concatenate on another axis ``elementwise`` (zero ``'all'``:
  channel j of the output is channel j of every input).
* Flatten: ``flatten`` (``order='channels_last'``, ``positions`` = spatial size); Reshape: as
  :func:`~compressor.core.graph.classify_reshape` says (kept only if the channel axis ends last).
* keras.ops calls (``x + 3``, ``x * (1 / 6)``, ``keras.ops.relu6(x)``: hard-sigmoid / hard-swish written as
  functions): unary element-wise ops and binary ops with a scalar operand ``activation`` (``f(0) == 0``
  evaluated), binary ops on two tensors ``elementwise``; other ops ``other``.
* SeparableConv1D/2D: ``conv`` (input channel ``c`` = depthwise slice ``c`` + pointwise rows ``c*m..c*m+m-1``).
* Anything else (LayerNormalization, GroupNormalization, attention, non-layer ops,
  unknown layers, ``channels_first`` layers, weighted layers called more than once): ``other``
  (``op`` = class name): core never cuts through it.
* Nested Functional / Sequential models are flattened (their layers keep their ``iter_layers`` paths,
  e.g. ``block/conv``). Subclassed models raise :class:`~compressor.core.errors.ModelError`.

What a layer is (the classes by kind, zero facts, MACs and parameters) is :mod:`.graph_layers`'s; how a
keras.ops call carries channels, :mod:`.graph_ops`'s.

``node.layer`` is the layer's :func:`~compressor.tf.compressor.iter_layers` path (the name compressors
and mask files use), ``node.op`` its class name, ``params`` its weights (BatchNorm moving statistics excluded, as on torch), ``macs`` per sample
through :func:`~compressor.core.graph.conv_macs` / :func:`~compressor.core.graph.linear_macs`
(positions = output spatial size; unknown sizes count as 1).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from ..core.errors import ModelError
from ..core.graph import Graph, Node, classify_reshape, conv_macs, linear_macs
from .compressor import iter_layers
from .graph_layers import (
    _ACTIVATION_LAYERS,
    _CONV,
    _DEPTHWISE,
    _ELEMENTWISE,
    _IDENTITY,
    _POOL,
    ELEMENTWISE_ACTIVATIONS,
    _activation_name,
    _activation_node,
    _channels,
    _dead_filters,
    _einsum_is_linear,
    _f0_is_zero,
    _mha_parts,
    _mha_shapes,
    _np,
    _param_count,
    _prod,
    _var_np,
    bn_facts,
    mha_macs,
    rnn_macs,
)
from .graph_ops import BINARY_OPS as BINARY_OPS  # (re-exported, public names of this module before the split)
from .graph_ops import ELEMENTWISE_OPS as ELEMENTWISE_OPS
from .graph_ops import _classify_operation

__all__ = ["build_graph", "is_graph_model", "output_producers", "walkable"]


# ---------------------------------------------------------------------------------- model access
def _functional_class() -> Any:
    try:
        from keras.src.models.functional import Functional
    except ImportError:  # pragma: no cover - keras layout change
        return None
    return Functional


def is_graph_model(obj: Any) -> bool:
    """True for Functional and Sequential Keras models (whose layer graph is known)."""
    functional = _functional_class()
    return isinstance(obj, keras.Sequential) or (functional is not None and isinstance(obj, functional))


def walkable(model: Any) -> Any:
    """The Functional graph of ``model`` (a Sequential's inner one), or a clear ModelError."""
    if isinstance(model, keras.Sequential):
        fn = getattr(model, "_functional", None)
        if fn is None:
            raise ModelError(f"Sequential model {model.name!r} is not built: give it a keras.Input(...) as first "
                             f"layer or build it (model.build(input_shape)) before compressor reads its graph")
        return fn
    if is_graph_model(model):
        return model
    raise ModelError(
        f"{type(model).__name__} {getattr(model, 'name', '')!r} is a subclassed model: its layer graph is "
        f"unknown to Keras, so channels cannot be traced through it. Rebuild it with the Functional API "
        f"(keras.Model(inputs, outputs)) or as a keras.Sequential model"
    )


def _key(t: Any) -> tuple[int, int, int]:
    h = t._keras_history
    return id(h.operation), int(h.node_index), int(h.tensor_index)


def _shape(t: Any) -> tuple[Any, ...]:
    return tuple(t.shape)


# ---------------------------------------------------------------------------------- per layer
class _Builder:
    def __init__(self, model: Any):
        self.nodes: list[Node] = []
        self.used: dict[str, int] = {}
        self.paths = {id(layer): path for path, layer in iter_layers(model)}
        self.layers = {path: layer for path, layer in iter_layers(model)}
        #: id(nested model) -> names of the nodes feeding its inputs (first call)
        self.nested_inputs: dict[int, list[str]] = {}
        walkable(model)

    def name(self, base: str) -> str:
        k = self.used.get(base, 0)
        self.used[base] = k + 1
        return base if k == 0 else f"{base}#{k}"

    def add(self, node: Node) -> str:
        self.nodes.append(node)
        return node.name

    # -- walk -------------------------------------------------------------------------------------------
    def walk(self, fmodel: Any, input_names: list[str]) -> list[str]:
        """Add the nodes of ``fmodel`` fed by ``input_names``; the node names of its outputs."""
        names: dict[tuple[int, int, int], str] = {}
        for t, nm in zip(fmodel.inputs, input_names):
            names[_key(t)] = nm
        done: set[int] = set()
        stack: list[tuple[Any, bool]] = []

        def node_of(t: Any) -> Any:
            h = t._keras_history
            if isinstance(h.operation, keras.layers.InputLayer) and _key(t) not in names:
                raise ModelError(f"model {fmodel.name!r}: tensor {t.name!r} comes from input layer "
                                 f"{h.operation.name!r}, which is not an input of the model")
            return h.operation._inbound_nodes[h.node_index]

        for t in reversed(list(fmodel.outputs)):
            if _key(t) not in names:
                stack.append((node_of(t), False))
        while stack:
            kn, expanded = stack.pop()
            if id(kn) in done:
                continue
            if not expanded:
                stack.append((kn, True))
                for t in reversed(list(kn.input_tensors)):
                    if _key(t) not in names:
                        parent = node_of(t)
                        if id(parent) not in done:
                            stack.append((parent, False))
                continue
            done.add(id(kn))
            ins = [names[_key(t)] for t in kn.input_tensors]
            outs = self.translate(kn, ins)
            for t, nm in zip(kn.output_tensors, outs):
                names[_key(t)] = nm
        return [names[_key(t)] for t in fmodel.outputs]

    # -- attention -------------------------------------------------------------------------------------------
    def attention(self, op: Any, name: str, path: str, ins: list[str], in_shapes: list[Any], shape: Any,
                  params: int, kn_shapes: dict[str, Any]) -> str | None:
        """MultiHeadAttention as an ``attention`` node (its context: ``heads x value_dim`` channels, a head
        dead when its value kernel and bias are zero) followed by an internal ``linear`` node (the output
        projection; no layer of its own: its output channels are never cut). Query, value and key must
        be one tensor (self-attention) for its input channels to be cut; otherwise they stay."""
        parts = _mha_parts(op)
        if parts is None or len(shape) < 3 or any(len(s) != len(shape) for s in in_shapes[:1]):
            return None
        h, dv = int(op._num_heads), int(parts["value"][0].shape[2])
        cin = int(in_shapes[0][-1])
        if parts["query"][0].shape[0] != cin:
            return None
        vk, vb = parts["value"]
        dead = _dead_filters(vk.reshape(vk.shape[0], h * dv), None if vb is None else vb.reshape(-1))
        positions = _prod(shape[1:-1])
        macs = mha_macs(op, kn_shapes) - linear_macs(h * dv, int(shape[-1]), positions)  # output: its own node
        first = ins[0]
        node = self.add(Node(name, "attention", [first], h * dv, layer=path, op=type(op).__name__,
                             attrs={"heads": h, "head_dim": dv, "dead": dead}, params=params, macs=macs))
        rest = [i for i in ins[1:]]
        if any(i != first for i in rest):  # cross attention or a mask: every input keeps its channels
            self.add(Node(self.name(f"{name}:inputs"), "other", list(ins), 1, op=type(op).__name__))
        out_dim = int(shape[-1])
        return self.add(Node(self.name(f"{name}:output"), "linear", [node], out_dim, op=f"{type(op).__name__}(output)",
                             macs=linear_macs(h * dv, out_dim, positions)))

    # -- one call -------------------------------------------------------------------------------------------
    def translate(self, kn: Any, ins: list[str]) -> list[str]:
        op = kn.operation
        if is_graph_model(op):
            self.nested_inputs.setdefault(id(op), list(ins))
            return self.walk(walkable(op), ins)
        in_shapes = [_shape(t) for t in kn.input_tensors]
        out_shapes = [_shape(t) for t in kn.output_tensors]
        path = self.paths.get(id(op))
        base = path if path is not None else op.name
        cls = type(op).__name__
        name = self.name(base)
        params = _param_count(op) if isinstance(op, keras.layers.Layer) and op.built else 0
        if len(out_shapes) != 1:
            out = []
            for i, s in enumerate(out_shapes):
                nm = name if i == 0 else f"{name}:{i}"
                out.append(self.add(Node(nm, "other", list(ins), _channels(s), layer=path if i == 0 else None,
                                         op=cls, params=params if i == 0 else 0)))
            return out
        shape = out_shapes[0]
        c = _channels(shape)
        node = Node(name, "other", list(ins), c, layer=path, op=cls, params=params)
        if any(_channels(s) == 0 for s in in_shapes) or c == 0:
            return [self.add(node)]
        if not isinstance(op, keras.layers.Layer):
            _classify_operation(kn, node, in_shapes, shape)
            return [self.add(node)]
        if isinstance(op, keras.layers.MultiHeadAttention):
            shapes = _mha_shapes(kn)
            if path is not None:
                out = self.attention(op, name, path, ins, in_shapes, shape, params, shapes)
                if out is not None:
                    return [out]
            node.macs = mha_macs(op, shapes)
        if isinstance(op, keras.layers.RNN) or cls == "Bidirectional":
            node.macs = rnn_macs(op, in_shapes[0])
        fused = None
        cf = getattr(op, "data_format", "channels_last") == "channels_first"
        positions = _prod(shape[1:-1])
        if cls in _CONV:
            k = _prod(op.kernel_size)
            groups = int(getattr(op, "groups", 1))
            cin = int(in_shapes[0][1 if cf else -1])
            cout = int(op.filters)
            node.macs = conv_macs(cout, cin, groups, k, _prod(shape[2:]) if cf else positions)
            if not cf:
                node.kind = "conv" if groups == 1 else "group_conv"
                bias = _var_np(op, "bias") if op.use_bias else None
                node.attrs["dead"] = _dead_filters(_np(op.kernel), bias)
                if groups > 1 and groups == cin and cout % cin == 0:  # Conv2D(groups=C): a depthwise conv
                    node.kind = "depthwise"
                    node.attrs["multiplier"] = cout // cin
                    node.attrs["passes_zero"] = [True] * c if bias is None else [bool(b == 0) for b in bias]
                fused = op.activation
        elif cls == "Dense" or (cls == "EinsumDense" and _einsum_is_linear(op)):
            kernel = _np(op.kernel)
            node.macs = linear_macs(kernel.shape[0], kernel.shape[1], positions)
            node.kind = "linear"
            bias = _var_np(op, "bias") if getattr(op, "bias", None) is not None else None
            node.attrs["dead"] = _dead_filters(kernel, bias)
            fused = op.activation
        elif cls == "EinsumDense":
            node.macs = int(op.kernel.shape.num_elements() if hasattr(op.kernel.shape, "num_elements")
                            else _prod(op.kernel.shape)) * max(positions, 1)
        elif cls in _DEPTHWISE:
            k = _prod(op.kernel_size)
            m = int(op.depth_multiplier)
            cin = int(in_shapes[0][1 if cf else -1])
            node.macs = conv_macs(cin * m, cin, cin, k, _prod(shape[2:]) if cf else positions)
            if not cf:
                node.kind = "depthwise"
                node.attrs["multiplier"] = m
                kernel = _np(op.kernel)  # [k..., in, mult] -> output channel c * mult + m
                bias = _var_np(op, "bias") if op.use_bias else None
                flat = kernel.reshape(-1, kernel.shape[-2] * kernel.shape[-1])
                node.attrs["dead"] = _dead_filters(flat, bias)
                node.attrs["passes_zero"] = [True] * c if bias is None else [bool(b == 0) for b in bias]
                fused = op.activation
        elif cls in ("SeparableConv1D", "SeparableConv2D"):
            k = _prod(op.kernel_size)
            m = int(op.depth_multiplier)
            cin = int(in_shapes[0][1 if cf else -1])
            pos = _prod(shape[2:]) if cf else positions
            node.macs = conv_macs(cin * m, cin, cin, k, pos) + conv_macs(int(op.filters), cin * m, 1, 1, pos)
            if not cf:  # depthwise [k..., in, m] then pointwise [1.., in * m, out]: input channel c feeds rows
                node.kind = "conv"  # c * m .. c * m + m - 1 of the pointwise kernel (speedup slices both)
                bias = _var_np(op, "bias") if op.use_bias else None
                node.attrs["dead"] = _dead_filters(_np(op.pointwise_kernel), bias)
                fused = op.activation
        elif "Transpose" in cls and hasattr(op, "filters"):
            cin = int(in_shapes[0][1 if cf else -1])
            node.macs = conv_macs(int(op.filters), cin, 1, _prod(op.kernel_size),
                                  _prod(in_shapes[0][2:] if cf else in_shapes[0][1:-1]))
        elif cls == "Embedding":
            node.kind = "embedding"
            node.attrs["dead"] = [bool(d) for d in ~np.any(_np(op.embeddings) != 0, axis=0)]
        elif cls == "BatchNormalization":
            axis = op.axis if isinstance(op.axis, int) else (op.axis[0] if len(op.axis) == 1 else None)
            if axis is not None and axis % len(in_shapes[0]) == len(in_shapes[0]) - 1:
                node.kind = "norm"
                node.attrs.update(bn_facts(op))
        elif cls in _ACTIVATION_LAYERS:
            fn = getattr(op, "activation", None) if cls == "Activation" else op
            if cls != "Activation" or _activation_name(fn) in ELEMENTWISE_ACTIVATIONS:
                node.kind = "activation"
                node.attrs["zero_preserving"] = _f0_is_zero(fn)
        elif cls == "Rescaling":
            scale, offset = op.scale, op.offset
            if all(isinstance(v, (int, float)) for v in (scale, offset)):
                node.kind = "activation"
                node.attrs["zero_preserving"] = offset == 0
        elif cls in _POOL:
            if not cf:
                node.kind = "pool"
        elif cls in _IDENTITY:
            if not cf:
                node.kind = "identity"
        elif cls == "Permute":
            if tuple(op.dims)[-1] == len(shape) - 1:
                node.kind = "identity"
        elif cls in _ELEMENTWISE:
            if all(len(s) == len(shape) for s in in_shapes):
                node.kind = "elementwise"
                node.attrs["zero"] = _ELEMENTWISE[cls]
        elif cls == "Concatenate":
            if op.axis % len(shape) == len(shape) - 1:
                node.kind = "concat"
            elif all(_channels(s) == c for s in in_shapes):
                node.kind = "elementwise"
                node.attrs["zero"] = "all"
        elif cls == "Flatten":
            s = in_shapes[0]
            if not cf:
                if len(s) == 2:
                    node.kind = "identity"
                elif all(d is not None for d in s[1:]):
                    node.kind = "flatten"
                    node.attrs.update(positions=_prod(s[1:-1]), order="channels_last")
        elif cls == "Reshape":
            s = in_shapes[0]
            if all(d is not None for d in s[1:]) and all(d is not None for d in shape[1:]):
                kind, info = classify_reshape((1, *s[1:]), len(s) - 1, (1, *shape[1:]))
                if kind == "identity" and info == len(shape) - 1:
                    node.kind = "identity"
                elif kind == "flatten" and info[1] == "channels_last" and len(shape) == 2:
                    node.kind = "flatten"
                    node.attrs.update(positions=int(info[0]), order="channels_last")
        if node.kind in ("identity", "pool", "activation", "norm") and _channels(in_shapes[0]) != c:
            node.kind = "other"  # channel count changes: not the op we thought
        out = self.add(node)
        if fused is not None:
            act = _activation_node(f"{name}:activation", out, c, fused, cls)
            if act is not None:
                out = self.add(act)
        return [out]


def build_graph(model: Any) -> tuple[Graph, dict[str, Any]]:
    """The channel graph of a Functional or Sequential Keras ``model`` and ``{node.layer: layer}``.

    Input nodes are named after the model's input layers, output nodes ``output:<i>``; other nodes after
    the layer's ``iter_layers`` path (``#k`` appended for the k-th further call of a shared layer).
    Zero facts come from the current weights. ``graph.nested_inputs`` maps ``id(nested model)`` to the
    nodes feeding its inputs (speedup rebuilds nested models with their new input shapes). A subclassed model raises
    :class:`~compressor.core.errors.ModelError` (rebuild it with the Functional API).
    """
    fmodel = walkable(model)
    b = _Builder(model)
    ins = []
    for t in fmodel.inputs:
        op = t._keras_history.operation
        ins.append(b.add(Node(b.name(op.name), "input", [], _channels(_shape(t)), op=type(op).__name__)))
    outs = b.walk(fmodel, ins)
    by_name = {n.name: n for n in b.nodes}
    for i, nm in enumerate(outs):
        b.add(Node(b.name(f"output:{i}"), "output", [nm], by_name[nm].channels, op="output"))
    # a weighted layer called more than once must keep one set of channels: never cut it
    calls: dict[str, int] = {}
    for n in b.nodes:
        if n.layer is not None:
            calls[n.layer] = calls.get(n.layer, 0) + 1
    for n in b.nodes:
        if n.layer is not None and calls[n.layer] > 1 and n.params > 0 and n.kind != "other":
            n.kind = "other"
            n.attrs = {"shared": True}
    graph = Graph(b.nodes)
    graph.nested_inputs = b.nested_inputs  # type: ignore[attr-defined]  # for rebuilding nested models
    layers = {n.layer: b.layers[n.layer] for n in graph.nodes if n.layer is not None}
    return graph, layers


def output_producers(model: Any) -> set[str]:
    """Paths of the conv / linear layers whose output channels reach a model output (the classifier, or
    the convs of a residual stream that is the output): their filters are the model's outputs."""
    graph, _ = build_graph(model)
    cls = graph.classes()
    at_output: set[int] = set()
    for n in graph.nodes:
        if n.kind == "output":
            for i in n.inputs:
                b = graph.offset[i]
                at_output.update(cls[b + j] for j in range(graph.by_name[i].channels))
    return {n.layer for n in graph.nodes if n.layer is not None and n.kind in ("conv", "linear")
            and any(cls[graph.offset[n.name] + j] in at_output for j in range(n.channels))}
