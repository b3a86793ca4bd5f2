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

``node.layer`` is the layer's :func:`~compressor.tf.compressor.iter_layers` path (the name compressors
and mask files use), ``node.op`` its class name, ``params`` its weights (BatchNorm moving statistics excluded, as on torch), ``macs`` per sample
through :func:`~compressor.core.graph.conv_macs` / :func:`~compressor.core.graph.linear_macs`
(positions = output spatial size; unknown sizes count as 1).
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np

from ..core.errors import ModelError
from ..core.graph import Graph, Node, classify_reshape, conv_macs, linear_macs
from .compressor import iter_layers

__all__ = ["build_graph", "is_graph_model", "output_producers", "walkable"]

_CONV = ("Conv1D", "Conv2D", "Conv3D", "Convolution1D", "Convolution2D", "Convolution3D")
_DEPTHWISE = ("DepthwiseConv1D", "DepthwiseConv2D")
_POOL = ("MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D", "AveragePooling2D",
         "AveragePooling3D", "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalAveragePooling3D",
         "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D", "MaxPool1D", "MaxPool2D",
         "MaxPool3D", "AvgPool1D", "AvgPool2D", "AvgPool3D", "GlobalAvgPool1D", "GlobalAvgPool2D",
         "GlobalAvgPool3D", "GlobalMaxPool1D", "GlobalMaxPool2D", "GlobalMaxPool3D")
_IDENTITY = ("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "GaussianNoise",
             "GaussianDropout", "AlphaDropout", "ActivityRegularization", "Identity", "ZeroPadding1D",
             "ZeroPadding2D", "ZeroPadding3D", "Cropping1D", "Cropping2D", "Cropping3D", "UpSampling1D",
             "UpSampling2D", "UpSampling3D", "Resizing", "RepeatVector")
_ACTIVATION_LAYERS = ("Activation", "ReLU", "LeakyReLU", "ELU")
_ELEMENTWISE = {"Add": "all", "Subtract": "all", "Maximum": "all", "Minimum": "all", "Average": "all",
                "Multiply": "any"}
#: activation functions applied per element (anything else, e.g. softmax, mixes channels: 'other')
ELEMENTWISE_ACTIVATIONS = frozenset((
    "linear", "relu", "relu6", "elu", "selu", "gelu", "silu", "swish", "tanh", "sigmoid", "hard_sigmoid",
    "hard_silu", "hard_swish", "softplus", "softsign", "exponential", "leaky_relu", "mish", "celu",
    "log_sigmoid", "sparse_plus", "squareplus", "tanh_shrink", "hard_tanh", "soft_shrink", "hard_shrink",
    "sparse_sigmoid", "threshold",
))


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


def _channels(shape: tuple[Any, ...]) -> int:
    if len(shape) < 2:
        return 1
    return int(shape[-1]) if shape[-1] is not None else 0


def _prod(dims: Any) -> int:
    return int(math.prod(int(d) if d is not None else 1 for d in dims))


def _np(v: Any) -> np.ndarray:
    return np.asarray(to_numpy(v), dtype=np.float64)


def to_numpy(v: Any) -> np.ndarray:
    """A variable's / tensor's value. Variables go through ``.numpy()``: ``keras.ops.convert_to_numpy`` on a
    TF variable calls ``np.array`` on it, which numpy 2 answers with a DeprecationWarning per call (1,612 of
    them while pruning NASNetMobile)."""
    numpy = getattr(v, "numpy", None)
    return np.asarray(numpy()) if callable(numpy) else keras.ops.convert_to_numpy(v)


# ---------------------------------------------------------------------------------- activations
def _activation_name(fn: Any) -> str | None:
    if fn is None:
        return "linear"
    if isinstance(fn, str):
        return fn
    name = getattr(fn, "__name__", None)
    return name


def _f0_is_zero(fn: Any) -> bool:
    z = np.zeros((1, 4), np.float32)
    try:
        out = keras.ops.convert_to_numpy(fn(keras.ops.convert_to_tensor(z)))
    except Exception:  # noqa: BLE001 - an activation we cannot evaluate is not assumed zero-preserving
        return False
    return bool(np.all(np.asarray(out) == 0))


def _activation_node(name: str, src: str, channels: int, fn: Any, op: str) -> Node | None:
    """The node of a fused / standalone activation function ``fn`` (None for linear)."""
    fname = _activation_name(fn)
    if fname == "linear":
        return None
    if fname not in ELEMENTWISE_ACTIVATIONS:
        return Node(name, "other", [src], channels, op=f"{op}({fname})")
    return Node(name, "activation", [src], channels, op=f"{op}({fname})",
                attrs={"zero_preserving": _f0_is_zero(keras.activations.get(fname))})


# ---------------------------------------------------------------------------------- zero facts
def _dead_filters(kernel: np.ndarray, bias: np.ndarray | None) -> list[bool]:
    """Output channel j (last kernel axis) is zero whatever the input."""
    k = kernel.reshape(-1, kernel.shape[-1])
    dead = ~np.any(k != 0, axis=0)
    if bias is not None:
        dead &= bias == 0
    return [bool(d) for d in dead]


def _var_np(layer: Any, attr: str) -> np.ndarray | None:
    v = getattr(layer, attr, None)
    return None if v is None else _np(v)


def bn_facts(layer: Any) -> dict[str, list[bool]]:
    """Inference-time zero facts of a BatchNormalization: ``dead`` (gamma = beta = 0) and ``passes_zero``
    (``beta - mean * gamma / sqrt(var + eps) == 0``)."""
    mean = _np(layer.moving_mean)
    var = _np(layer.moving_variance)
    gamma = _var_np(layer, "gamma") if layer.scale else None
    beta = _var_np(layer, "beta") if layer.center else None
    g = gamma if gamma is not None else np.ones_like(mean)
    b = beta if beta is not None else np.zeros_like(mean)
    dead = (g == 0) & (b == 0)
    at_zero = b - mean * g / np.sqrt(var + float(layer.epsilon))
    passes = dead | (at_zero == 0)
    return {"dead": [bool(d) for d in dead], "passes_zero": [bool(p) for p in passes]}


def _einsum_is_linear(layer: Any) -> bool:
    """EinsumDense contracting the last input axis into the last output axis, like Dense."""
    eq = str(getattr(layer, "equation", "")).replace(" ", "")
    try:
        lhs, out = eq.split("->")
        inp, ker = lhs.split(",")
    except ValueError:
        return False
    if "." in eq or len(ker) != 2 or not inp or not out:
        return False
    bias_axes = getattr(layer, "bias_axes", None)
    return (ker[0] == inp[-1] and ker[1] == out[-1] and inp[:-1] == out[:-1] and ker[0] not in out
            and ker[1] not in inp and bias_axes in (None, out[-1]))


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


#: keras.ops functions applied per element (activations written as functions: ``keras.ops.relu6(x)``)
ELEMENTWISE_OPS = frozenset((
    "relu", "relu6", "elu", "selu", "gelu", "silu", "swish", "tanh", "sigmoid", "hardsigmoid", "hardsilu",
    "hardswish", "softplus", "softsign", "exp", "leakyrelu", "mish", "celu", "logsigmoid", "sparseplus",
    "squareplus", "tanhshrink", "hardtanh", "softshrink", "hardshrink", "sparsesigmoid", "threshold",
    "abs", "absolute", "negative", "square", "sqrt", "sign", "clip", "round", "floor", "ceil", "erf",
    "cast", "identity", "stopgradient",
))
#: binary keras.ops: with a scalar operand they act per element; with two tensors, the rule of the zero
#: analysis (add: zero when every input is, multiply: when any is)
BINARY_OPS = {"add": "all", "subtract": "all", "maximum": "all", "minimum": "all", "multiply": "any",
              "divide": None, "truedivide": None, "power": None}


def _is_scalar(v: Any) -> bool:
    if isinstance(v, (bool, int, float, np.number)):
        return True
    if isinstance(v, keras.KerasTensor):
        return False
    try:
        return int(np.size(to_numpy(v))) == 1
    except Exception:  # noqa: BLE001 - not a constant we can read
        return False


def _zero_maps_to_zero(kn: Any) -> bool:
    """Evaluate the op on zeros in place of its tensor arguments (its constants as they are)."""
    def zero(v: Any) -> Any:
        if isinstance(v, keras.KerasTensor):
            return np.zeros([1 if d is None else int(d) for d in v.shape], v.dtype or "float32")
        return v

    try:
        args = keras.tree.map_structure(zero, kn.arguments.args)
        kwargs = keras.tree.map_structure(zero, kn.arguments.kwargs)
        out = keras.ops.convert_to_numpy(kn.operation(*args, **kwargs))
    except Exception:  # noqa: BLE001 - an op we cannot evaluate is not assumed zero-preserving
        return False
    return bool(np.all(np.asarray(out) == 0))


def _classify_operation(kn: Any, node: Node, in_shapes: list[Any], shape: Any) -> None:
    """A keras.ops call in a Functional graph (``x + 3``, ``x * (1 / 6)``, ``keras.ops.relu6(x)``): an
    ``activation`` when it acts per element (a unary element-wise op, or a binary one with a scalar
    operand; ``zero_preserving`` evaluated on zeros), ``elementwise`` for a binary op on two tensors of the
    output's rank; otherwise it stays ``other``."""
    kind = type(kn.operation).__name__.lower().replace("_", "")
    args = list(getattr(getattr(kn, "arguments", None), "args", ()) or ())
    tensors = [a for a in args if isinstance(a, keras.KerasTensor)]
    if len(in_shapes) != len(tensors) or any(len(s) != len(shape) for s in in_shapes):
        return
    if kind in ELEMENTWISE_OPS and len(tensors) == 1 and _channels(in_shapes[0]) == node.channels:
        node.kind = "activation"
    elif kind in BINARY_OPS and len(args) == 2:
        if len(tensors) == 1 and _is_scalar(args[1 - args.index(tensors[0])]) \
                and _channels(in_shapes[0]) == node.channels:
            node.kind = "activation"
        elif len(tensors) == 2 and BINARY_OPS[kind] is not None:
            node.kind = "elementwise"
            node.attrs["zero"] = BINARY_OPS[kind]
            return
    if node.kind == "activation":
        node.attrs["zero_preserving"] = _zero_maps_to_zero(kn)


def _mha_shapes(kn: Any) -> dict[str, Any]:
    """Shapes of a MultiHeadAttention call's query / value / key (key defaults to value) and output."""
    args = list(kn.arguments.args)
    kwargs = dict(kn.arguments.kwargs)
    names = ("query", "value", "key")
    got = {k: v for k, v in zip(names, args)}
    got.update({k: kwargs[k] for k in names if kwargs.get(k) is not None})
    got.setdefault("key", got.get("value"))
    out = {k: tuple(v.shape) for k, v in got.items() if v is not None}
    out["output"] = tuple(kn.output_tensors[0].shape)
    return out


def mha_macs(op: Any, shapes: dict[str, Any]) -> int:
    """Multiply-accumulates of one MultiHeadAttention call per sample (query length ``Tq``, key/value
    length ``Tk``, ``h`` heads of key size ``dk`` and value size ``dv``, inputs of ``dq`` / ``dkin`` /
    ``dvin`` features, ``dout`` output features):
    ``Tq*dq*h*dk + Tk*dkin*h*dk + Tk*dvin*h*dv`` (projections) ``+ h*Tq*Tk*dk`` (Q @ K^T)
    ``+ h*Tq*Tk*dv`` (attention @ V) ``+ Tq*h*dv*dout`` (output projection). Softmax, scaling and biases
    are not counted. Lengths are the products of the axes between batch and features (attention over
    several axes); unknown sizes count as 1."""
    h = int(op._num_heads)
    dk = int(op._key_dim)
    dv = int(op._value_dim) if getattr(op, "_value_dim", None) else dk
    q, v = shapes["query"], shapes.get("value", shapes["query"])
    k = shapes.get("key", v)
    out = shapes["output"]
    tq, tk = _prod(q[1:-1]), _prod(k[1:-1])
    dq, dkin, dvin, dout = (int(s[-1]) if s[-1] is not None else 1 for s in (q, k, v, out))
    return (tq * dq * h * dk + tk * dkin * h * dk + _prod(v[1:-1]) * dvin * h * dv
            + h * tq * tk * dk + h * tq * tk * dv + tq * h * dv * dout)


#: matrix products per step of each recurrent cell (gates): SimpleRNN 1, GRU 3, LSTM 4
_GATES = {"SimpleRNNCell": 1, "GRUCell": 3, "LSTMCell": 4}


def rnn_macs(op: Any, in_shape: Any) -> int:
    """Multiply-accumulates of a SimpleRNN / GRU / LSTM layer per sample over ``T`` steps of ``d`` input
    features with ``u`` units and ``g`` gates (1 / 3 / 4): ``T * g * (d * u + u * u)`` (input and recurrent
    kernels; biases and the element-wise gate math not counted). Bidirectional: both directions. Other
    cells: 0 (not counted)."""
    if type(op).__name__ == "Bidirectional":
        return rnn_macs(op.forward_layer, in_shape) + rnn_macs(op.backward_layer, in_shape)
    cell = getattr(op, "cell", None)
    g = _GATES.get(type(cell).__name__)
    if g is None or len(in_shape) != 3:
        return 0
    steps = int(in_shape[1]) if in_shape[1] is not None else 1
    d, u = int(in_shape[-1]), int(cell.units)
    return steps * g * (d * u + u * u)


def _mha_parts(op: Any) -> dict[str, Any] | None:
    """Weights of a built MultiHeadAttention whose heads speedup can cut (no gate, bias on every
    projection or on none, 3-d head kernels), as numpy arrays; None otherwise."""
    if not op.built or getattr(op, "_use_gate", False) or not hasattr(op, "_output_dense"):
        return None
    parts: dict[str, Any] = {}
    for key, sub in (("query", "_query_dense"), ("key", "_key_dense"), ("value", "_value_dense"),
                     ("output", "_output_dense")):
        dense = getattr(op, sub, None)
        if dense is None or type(dense).__name__ != "EinsumDense":
            return None
        kernel = _np(dense.kernel)
        bias = _np(dense.bias) if getattr(dense, "bias", None) is not None else None
        parts[key] = (kernel, bias)
    h = int(op._num_heads)
    if any(parts[k][0].ndim != 3 or parts[k][0].shape[1] != h for k in ("query", "key", "value")):
        return None
    if parts["output"][0].ndim != 3 or parts["output"][0].shape[:2] != parts["value"][0].shape[1:]:
        return None
    return parts


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


#: normalization statistics are state, not parameters (torch keeps them as buffers): not counted
_STATISTICS = ("moving_mean", "moving_variance")


def _param_count(layer: Any) -> int:
    """Weights of ``layer`` as torch counts parameters: trainable or not, except BatchNorm's moving
    statistics (buffers on torch), so both backends report one number for the same model."""
    return sum(int(np.prod(w.shape)) for w in layer.weights
               if not any(str(getattr(w, "path", w.name)).endswith(s) for s in _STATISTICS))


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
