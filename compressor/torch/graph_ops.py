"""How PyTorch's autograd ops carry channels, for the walk of :mod:`.graph`: one rule per family of ops
(activations, constant pads, element-wise joins and concatenations, splits and slices, views, axis moves,
reductions and pools) turns one ``grad_fn`` into a node of the neutral graph, or answers None (not its
family). An op no rule takes, or whose channels a rule cannot follow, becomes ``other``: core never cuts
through it. The rules read and extend the walk's builder (``b``: the nodes so far, each node's shape and
channel axis, what the trace recorded about pads and operand shapes)."""

from __future__ import annotations

from typing import Any

import torch

from ..core.graph import Node, classify_reshape
from .graph_layers import _prod

# activations by grad_fn name: zero_preserving (f(0) == 0)
_ACTIVATIONS = {
    "ReluBackward0": True, "GeluBackward0": True, "SiluBackward0": True, "HardswishBackward0": True,
    "TanhBackward0": True, "LeakyReluBackward0": True, "EluBackward0": True, "MishBackward0": True,
    "NegBackward0": True, "AbsBackward0": True, "SigmoidBackward0": False, "HardsigmoidBackward0": False,
    "ExpBackward0": False, "SoftplusBackward0": False, "ErfBackward0": True, "CeluBackward0": True,
    "SqrtBackward0": True, "SinBackward0": True, "SinhBackward0": True, "AsinhBackward0": True,
    "AtanBackward0": True, "Expm1Backward0": True, "Log1PBackward0": True, "SignBackward0": True,
    "SgnBackward0": True, "ErfinvBackward0": True, "SoftshrinkBackward0": True, "HardshrinkBackward0": True,
    "RreluWithNoiseBackward0": True, "LogSigmoidBackward0": False, "CosBackward0": False,
    "RsqrtBackward0": False, "ReciprocalBackward0": False, "LogBackward0": False, "ErfcBackward0": False,
    "ThresholdBackward0": False, "PowBackward2": False,
    # scalar operands: x * s, x / s keep zeros; x + s, x - s, s - x do not
    "MulBackward1": True, "DivBackward1": True, "AddBackward1": False, "SubBackward1": False,
    "RsubBackward1": False,
}
_IDENTITY = {"CloneBackward0", "ToCopyBackward0", "AliasBackward0", "NativeDropoutBackward0",
             "FeatureDropoutBackward0", "LiftFreshBackward0"}
_VIEWS = {"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0", "UnsqueezeBackward0",
          "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "FlattenBackward0", "_UnsafeViewBackward0"}
_BINARY = {"AddBackward0": "all", "SubBackward0": "all", "MulBackward0": "any", "DivBackward0": "any"}
_REDUCE = {"MeanBackward1", "SumBackward1", "AmaxBackward0", "AminBackward0"}


# ---------------------------------------------------------------------------------- joins
def _const(b: Any, shape: tuple[int, ...] | None, out_shape: tuple[int, ...], out_axis: int, label: str) -> str:
    """A constant operand (a parameter or a tensor that needs no grad) of an elementwise op."""
    c = out_shape[out_axis]
    if shape is not None:
        d = out_axis - (len(out_shape) - len(shape))
        c = int(shape[d]) if d >= 0 else 1
    name = b.unique(label)
    b.nodes.append(Node(name, "input", [], c, op=label))
    b.info[name] = ((c,), 0)
    return name


def _binary(b: Any, fn: Any, op: str, name: str, operands: list, out_shape: tuple[int, ...]) -> str:
    """An add / sub / mul / div: ``elementwise`` when every operand in the graph has the output's channels on
    one axis (or broadcasts over them), its other operands constant ``input`` nodes; else ``other``."""
    R = len(out_shape)
    graph = [(pos, nm) for pos, nm, _ in operands if nm is not None]
    out_axis = None
    for _, nm in graph:
        s, a = b.info[nm]
        if a is not None and len(s) <= R:
            oa = a + R - len(s)
            if s[a] == out_shape[oa] and (s[a] > 1 or all(b.info[g][0] == s for _, g in graph)):
                out_axis = oa
                break
    if out_axis is None:
        return b.add(name, "other", [nm for _, nm in graph], out_shape, b.default_axis(out_shape), op=op)
    C = out_shape[out_axis]
    # shapes of the constant operands (a Python number is a 0-d tensor: it broadcasts), as recorded by the
    # trace: the recorded operands less one of each graph operand's shape
    const_shapes: list[tuple[int, ...]] = []
    seen = b.operand_shapes.get(id(fn))
    if seen is not None and seen[0] is fn:
        const_shapes = list(seen[1])
        for _, nm in graph:
            if b.info[nm][0] in const_shapes:
                const_shapes.remove(b.info[nm][0])
    inputs = []
    for pos, nm, key in operands:
        if nm is not None:
            s, a = b.info[nm]
            d = out_axis - (R - len(s))
            size = s[d] if d >= 0 else 1
            related = a == d and size == C
            broadcast = size == 1 and (_channels_of(b, nm) != C or C == 1)
            if not (related or broadcast):
                return b.add(name, "other", [g for _, g in graph], out_shape, b.default_axis(out_shape), op=op)
            inputs.append(nm)
        else:
            shape = None
            saved = {0: "_saved_self", 1: "_saved_other"}.get(pos)
            if saved and op in ("MulBackward0", "DivBackward0"):
                try:
                    t = getattr(fn, saved)
                    shape = tuple(t.shape) if torch.is_tensor(t) else None
                except Exception:
                    shape = None
            if shape is None and const_shapes:
                shape = const_shapes.pop(0)
            label = b.params.get(key[1], "parameter") if key is not None and key[0] == "leaf" else "constant"
            inputs.append(_const(b, shape, out_shape, out_axis, f"{label} ({op})" if label == "constant" else label))
    zero = _BINARY[op]
    if op == "DivBackward0" and operands[1][1] is not None:
        zero = "none"  # a zero denominator is not a zero
    return b.add(name, "elementwise", inputs, out_shape, out_axis, op=op, attrs={"zero": zero})


def _channels_of(b: Any, nm: str) -> int:
    """The channel count of node ``nm`` (1 without a channel axis)."""
    s, a = b.info[nm]
    return s[a] if a is not None and s else 1


def _cat(b: Any, fn: Any, op: str, name: str, operands: list, out_shape: tuple[int, ...]) -> str:
    """A concatenation: ``concat`` along the channel axis, ``elementwise`` (zero ``'all'``) along another one
    (channel j of the output is channel j of every input); else ``other``."""
    graph = [nm for _, nm, _ in operands if nm is not None]
    R = len(out_shape)
    dim = int(fn._saved_dim) % R
    axes = {b.info[nm][1] for nm in graph}
    ok = len(graph) == len(operands) and len(axes) == 1 and all(len(b.info[nm][0]) == R for nm in graph)
    axis = axes.pop() if ok else None
    if not ok or axis is None:
        return b.add(name, "other", graph, out_shape, b.default_axis(out_shape), op=op)
    if dim == axis:
        return b.add(name, "concat", graph, out_shape, axis, op=op)
    if any(b.info[nm][0][axis] != out_shape[axis] for nm in graph):
        return b.add(name, "other", graph, out_shape, b.default_axis(out_shape), op=op)
    return b.add(name, "elementwise", graph, out_shape, axis, op=op, attrs={"zero": "all"})


# ---------------------------------------------------------------------------------- op rules (one per family)
class _OpStep:
    """One autograd op being turned into a node: its name, output shape, operands and first graph input."""

    def __init__(self, b: Any, fn: Any, op: str, name: str, out_shape: tuple[int, ...], operands: list,
                 graph_ins: list[str]):
        self.b, self.fn, self.op, self.name, self.out_shape = b, fn, op, name, out_shape
        self.operands, self.graph_ins = operands, graph_ins
        self.src = graph_ins[0] if graph_ins else None
        self.in_shape, self.axis = b.info[self.src] if self.src is not None else ((), None)

    def other(self) -> str:
        return self.b.add(self.name, "other", self.graph_ins, self.out_shape, self.b.default_axis(self.out_shape),
                          op=self.op)

    def same(self, kind: str, new_axis: int | None = None, **attrs: Any) -> str:
        """A node with the input's channels on ``new_axis`` (default: the input's channel axis)."""
        if new_axis is None:
            new_axis = self.axis
        in_channels = self.in_shape[self.axis] if self.axis is not None else -1
        if new_axis is None or not self.out_shape or self.out_shape[new_axis] != in_channels:
            return self.other()
        return self.b.add(self.name, kind, [self.src], self.out_shape, new_axis, op=self.op, attrs=attrs)

    def dim(self) -> int:
        return int(self.fn._saved_dim) % len(self.in_shape)


def _rule_activation(st: _OpStep) -> str | None:
    """Element-wise activations, clamps and powers: channels pass; ``zero_preserving`` says whether f(0) = 0."""
    fn, op = st.fn, st.op
    if op in _ACTIVATIONS and len(st.graph_ins) == 1:
        zp = _ACTIVATIONS[op]
    elif op in ("HardtanhBackward0", "ClampBackward1"):
        lo = getattr(fn, "_saved_min_val", getattr(fn, "_saved_min", None))
        hi = getattr(fn, "_saved_max_val", getattr(fn, "_saved_max", None))
        zp = (lo is None or float(lo) <= 0) and (hi is None or float(hi) >= 0)
    elif op == "PowBackward0":
        e = getattr(fn, "_saved_exponent", None)
        zp = e is not None and float(e) > 0
    elif op in _IDENTITY and len(st.graph_ins) == 1:
        return st.same("identity") if st.out_shape == st.in_shape else st.other()
    else:
        return None
    return st.same("activation", zero_preserving=zp) if st.out_shape == st.in_shape else st.other()


def _rule_pad(st: _OpStep) -> str | None:
    """Constant padding of other axes passes channels (zero-preserving only for a traced pad value of 0)."""
    if st.op != "ConstantPadNdBackward0":
        return None
    pad = list(getattr(st.fn, "_saved_pad", []))
    touched = {len(st.in_shape) - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    # autograd does not keep the pad value: the trace records it (_PadValues); unknown = not trusted
    seen = st.b.pad_values.get(id(st.fn))
    zero = seen is not None and seen[0] is st.fn and seen[1] == 0
    return st.other() if st.axis in touched else st.same("activation", zero_preserving=zero)


def _rule_join(st: _OpStep) -> str | None:
    """Binary element-wise ops and concatenations (their own builders)."""
    if st.op in _BINARY:
        return _binary(st.b, st.fn, st.op, st.name, st.operands, st.out_shape)
    if st.op == "CatBackward0":
        return _cat(st.b, st.fn, st.op, st.name, st.operands, st.out_shape)
    return None


_SPLITS = ("SplitBackward0", "SplitWithSizesBackward0", "UnsafeSplitBackward0", "UnsafeSplitWithSizesBackward0")


def _rule_split_slice(st: _OpStep) -> str | None:
    """Splits / slices of another axis pass channels; of the channel axis they are in the model's code,
    which speedup cannot edit (a full-width slice is an identity)."""
    if st.op in _SPLITS:
        return st.same("identity") if st.dim() != st.axis else st.other()
    if st.op == "SliceBackward0":
        if st.dim() != st.axis or st.out_shape[st.axis] == st.in_shape[st.dim()]:
            return st.same("identity")
        return st.other()
    return None


def _rule_view(st: _OpStep) -> str | None:
    """Reshapes that keep the channel axis whole, or flatten it with the positions after / before it."""
    if st.op not in _VIEWS:
        return None
    in_shape, axis, out_shape = st.in_shape, st.axis, st.out_shape
    how, arg = classify_reshape(in_shape, axis, out_shape)
    if how == "identity":
        return st.same("identity", int(arg))
    if how != "flatten":
        return st.other()
    positions, order = arg
    if order == "channels_first":
        before = _prod(in_shape[:axis])
        prod, new_axis = 1, None
        for k, d in enumerate(out_shape):
            if prod == before and d == in_shape[axis] * positions:
                new_axis = k
                break
            prod *= d
    else:
        new_axis = 1
    if new_axis is None:
        return st.other()
    return st.b.add(st.name, "flatten", [st.src], out_shape, new_axis, op=st.op,
                    attrs={"positions": positions, "order": order})


def _rule_axes(st: _OpStep) -> str | None:
    """Permutes, transposes and expands move the channel axis."""
    fn, op, n = st.fn, st.op, len(st.in_shape)
    if op == "PermuteBackward0":
        dims = [int(d) % n for d in fn._saved_dims]
        return st.same("identity", dims.index(st.axis))
    if op in ("TransposeBackward0", "TBackward0"):
        d0, d1 = (int(fn._saved_dim0), int(fn._saved_dim1)) if op == "TransposeBackward0" else (0, 1)
        d0, d1 = d0 % n, d1 % n
        return st.same("identity", d1 if st.axis == d0 else d0 if st.axis == d1 else st.axis)
    if op == "ExpandBackward0":
        return st.same("identity", st.axis + len(st.out_shape) - n)
    return None


def _rule_reduce_pool(st: _OpStep) -> str | None:
    """Reductions over other axes and pooling / upsampling of the spatial axes keep channels."""
    op, in_shape, axis = st.op, st.in_shape, st.axis
    if op in _REDUCE:
        dims = getattr(st.fn, "_saved_dim", None)
        dims = [int(d) % len(in_shape) for d in (dims if dims is not None else [])]
        if not dims or axis in dims:
            return st.other()
        keep = bool(getattr(st.fn, "_saved_keepdim", False))
        return st.same("pool", axis if keep else axis - sum(d < axis for d in dims))
    if "Pool" in op or "Upsample" in op:
        nd = 3 if "3D" in op or "3d" in op else 1 if "1D" in op or "1d" in op else 2
        if len(in_shape) - axis > nd and len(st.out_shape) == len(in_shape):
            return st.same("pool")
        return st.other()
    return None


#: how each family of autograd ops carries channels, tried in order (None: not this family)
_OP_RULES = (_rule_activation, _rule_pad, _rule_join, _rule_split_slice, _rule_view, _rule_axes, _rule_reduce_pool)
