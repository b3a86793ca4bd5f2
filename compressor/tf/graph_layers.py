"""What the channel graph of :mod:`.graph` knows about a Keras layer: the layer classes by kind, the
activations (per element or not, ``f(0) == 0`` evaluated), the per-channel zero facts read off the current
weights (dead filters, BatchNormalization at inference), the MultiHeadAttention weights speedup cuts by whole
heads, and the multiply-accumulates per sample of attention and recurrent layers and the parameters counted as
torch counts them. No walking here: :mod:`.graph` translates each layer call with these."""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np

from ..core.graph import Node

__all__ = ["ELEMENTWISE_ACTIVATIONS", "bn_facts", "mha_macs", "rnn_macs", "to_numpy"]

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


# ---------------------------------------------------------------------------------- values
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


# ---------------------------------------------------------------------------------- attention, recurrent
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


#: normalization statistics are state, not parameters (torch keeps them as buffers): not counted
_STATISTICS = ("moving_mean", "moving_variance")


def _param_count(layer: Any) -> int:
    """Weights of ``layer`` as torch counts parameters: trainable or not, except BatchNorm's moving
    statistics (buffers on torch), so both backends report one number for the same model."""
    return sum(int(np.prod(w.shape)) for w in layer.weights
               if not any(str(getattr(w, "path", w.name)).endswith(s) for s in _STATISTICS))
