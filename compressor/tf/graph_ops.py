"""How keras.ops calls in a Functional graph carry channels, for the walk of :mod:`.graph`: ``x + 3``,
``x * (1 / 6)``, ``keras.ops.relu6(x)`` (hard-sigmoid / hard-swish written as functions) are activations when
they act per element (``f(0) == 0`` evaluated on zeros), a binary op on two tensors is ``elementwise``, any
other op stays ``other`` (core never cuts through it)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from ..core.graph import Node
from .graph_layers import _channels, to_numpy

__all__ = ["ELEMENTWISE_OPS", "BINARY_OPS"]

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
