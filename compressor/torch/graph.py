"""Translate a PyTorch model into the backend-neutral channel graph of :mod:`compressor.core.graph`.

:func:`build_graph` runs ONE forward pass (eval mode, float inputs cloned and requiring grad, every float
parameter temporarily requiring grad) with hooks on the layers that own parameters, then walks the
autograd graph (``grad_fn.next_functions``) back from every tensor of the output. A ``grad_fn`` that is
the output of a hooked layer becomes that layer's node (its inputs are the tensors the layer received;
the walk does not descend into the layer); every other ``grad_fn`` becomes an op node classified by its
class name. Python control flow does not matter: only what the forward really computed is seen.

Each tensor keeps a channel axis (conv outputs: axis 1, Linear/Embedding outputs: the last axis; reshapes,
permutes, slices and reductions move it). Whatever cannot be classified becomes kind ``other`` (core then
never cuts channels through it, the safe answer). Nothing here reasons about channels: that is core's job.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..core.errors import ModelError
from ..core.graph import Graph, Node, classify_reshape, conv_macs, linear_macs
from .families import is_in_out_linear
from .layout import is_grn
from .modules import innermost_module, is_wrapper

__all__ = ["build_graph", "module_kind", "attention_spec"]

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


def module_kind(module: nn.Module) -> tuple[str, dict[str, Any]]:
    """Graph kind (and attrs) of a layer that owns parameters."""
    if isinstance(module, nn.modules.conv._ConvNd):
        if module.transposed:
            return "other", {}
        if module.groups == 1:
            return "conv", {}
        if module.groups == module.in_channels and module.out_channels % module.in_channels == 0:
            return "depthwise", {"multiplier": module.out_channels // module.in_channels}
        return "group_conv", {}
    if isinstance(module, nn.Linear) or _is_hf_conv1d(module):
        return "linear", {}
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "norm", {}
    if is_grn(module):  # per channel (channels last); the channel mean is kept by speedup (see _slice_grn)
        return "norm", {"channels_last": True}
    if isinstance(module, nn.Embedding):
        return "embedding", {}
    return "other", {}


#: (query, key, value, output projection or None) child names of the attention modules recognised
_ATTENTION_CHILDREN = (("query", "key", "value", None), ("q_proj", "k_proj", "v_proj", "o_proj"),
                       ("q_proj", "k_proj", "v_proj", "out_proj"))


def attention_spec(module: nn.Module) -> dict[str, Any] | None:
    """Heads of a self-attention module speedup can cut, or None.

    Recognised (HF transformers style, any class): ``query``/``key``/``value`` nn.Linear children with
    ``num_attention_heads`` and ``attention_head_size`` (BertSelfAttention, ...: the output is the
    context, ``heads * head_dim`` features, the output projection is another module), or
    ``q_proj``/``k_proj``/``v_proj`` + ``o_proj``/``out_proj`` nn.Linear children with
    ``num_attention_heads`` (or ``num_heads``) and ``head_dim`` (ViTAttention, ...: the output
    projection is inside). Query, key and value must all have ``heads * head_dim`` outputs (no grouped
    key/value heads) and cross-attention modules are left alone. ``torch.nn.MultiheadAttention`` is not
    recognised (its fused in-projection stays an ``other`` layer).

    Returns ``{'q', 'k', 'v', 'o'}`` (child names; ``'o'`` None when the projection is outside),
    ``heads``, ``head_dim``, and ``heads_attr`` / ``dim_attr`` (the attribute names read)."""
    m = innermost_module(module)
    if isinstance(m, (nn.Linear, nn.MultiheadAttention)) or "Cross" in type(m).__name__ \
            or getattr(m, "is_cross_attention", False):
        return None
    children = m._modules
    for q, k, v, o in _ATTENTION_CHILDREN:
        if q not in children or k not in children or v not in children or (o is not None and o not in children):
            continue
        if o is None:
            heads_attr, dim_attr = "num_attention_heads", "attention_head_size"
        else:
            heads_attr = "num_attention_heads" if hasattr(m, "num_attention_heads") else "num_heads"
            dim_attr = "head_dim"
        h, d = getattr(m, heads_attr, None), getattr(m, dim_attr, None)
        if not isinstance(h, int) or not isinstance(d, int) or h < 1 or d < 1:
            return None
        lins = [innermost_module(children[c]) for c in (q, k, v) + ((o,) if o else ())]
        if not all(type(x) is nn.Linear for x in lins):
            return None
        if any(x.out_features != h * d for x in lins[:3]) or len({x.in_features for x in lins[:3]}) != 1:
            return None
        if o is not None and lins[3].in_features != h * d:
            return None
        return {"q": q, "k": k, "v": v, "o": o, "heads": h, "head_dim": d,
                "heads_attr": heads_attr, "dim_attr": dim_attr}
    return None


def _is_hf_conv1d(module: nn.Module) -> bool:
    """A Linear stored ``[in, out]`` (HF ``Conv1D``; declared by a model-family plug-in)."""
    return is_in_out_linear(module)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensor leaves of a (nested) tensor / tuple / list / dict / ModelOutput, in order."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _prod(xs: Iterable[int]) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


# ---------------------------------------------------------------------------------- zero facts
@torch.no_grad()
def _facts(kind: str, m: nn.Module) -> dict[str, Any]:
    if kind == "attention":  # context channel j is zero when value output j is (a zero row, zero bias)
        return _facts("linear", innermost_module(m._modules[attention_spec(m)["v"]]))
    if kind in ("conv", "depthwise", "linear", "embedding"):
        w = m.weight.detach()
        if kind == "embedding":
            w = w.t()
        elif _is_hf_conv1d(m):
            w = w.t()  # stored [in, out]
        alive = (w.reshape(w.shape[0], -1) != 0).any(1)
        b = getattr(m, "bias", None)
        bias_zero = (b.detach() == 0) if torch.is_tensor(b) else torch.ones_like(alive)
        out = {"dead": ((~alive) & bias_zero).tolist()}
        if kind == "depthwise":
            out["passes_zero"] = bias_zero.tolist()
        return out
    if kind == "norm" and is_grn(m):  # x + gamma * x * N + beta: never zero whatever x; zero in -> beta out
        beta = m.bias.detach().reshape(-1).float().cpu()
        return {"dead": [False] * beta.numel(), "passes_zero": (beta == 0).tolist()}
    if kind == "norm":
        n = m.num_features
        gamma = m.weight.detach() if m.weight is not None else torch.ones(n)
        beta = m.bias.detach() if m.bias is not None else torch.zeros(n)
        gamma, beta = gamma.float().cpu(), beta.float().cpu()
        dead = (gamma == 0) & (beta == 0)
        if m.running_mean is not None and m.track_running_stats:
            shift = beta - m.running_mean.detach().float().cpu() * gamma / torch.sqrt(
                m.running_var.detach().float().cpu() + m.eps)
        else:  # batch statistics: a zero channel normalises to beta
            shift = beta
        return {"dead": dead.tolist(), "passes_zero": ((shift == 0) | dead).tolist()}
    return {}


def _rnn_macs(m: nn.RNNBase, out_shape: tuple[int, ...]) -> int:
    """Per sample: ``T * sum over layers and directions of gates * H * (in + H_r)`` (+ ``T * P * H`` per
    layer and direction for an LSTM projection), gates = 4 (LSTM), 3 (GRU), 1 (RNN); ``in`` = the input
    size for layer 0, ``dirs * H_r`` after; ``H_r`` = ``proj_size`` or ``hidden_size``."""
    gates = {"LSTM": 4, "GRU": 3}.get(m.mode, 1)
    if len(out_shape) == 3:
        steps = out_shape[1] if m.batch_first else out_shape[0]
    else:
        steps = out_shape[0] if out_shape else 1
    h = m.hidden_size
    proj = getattr(m, "proj_size", 0) or 0
    hr = proj or h
    dirs = 2 if m.bidirectional else 1
    total = 0
    for layer in range(m.num_layers):
        fin = m.input_size if layer == 0 else dirs * hr
        total += dirs * (gates * h * (fin + hr) + (proj * h if proj else 0))
    return int(steps) * total


def _mha_macs(m: nn.MultiheadAttention, in_shapes: list[tuple[int, ...]]) -> int:
    """Per sample: projections ``L*E*E + S*kdim*E + S*vdim*E + L*E*E`` plus the two attention matmuls
    ``Q @ K^T`` and ``attn @ V``, ``L*S*E`` each (``L``, ``S``: query and key lengths)."""
    if len(in_shapes) < 2:
        return 0
    q, k = in_shapes[0], in_shapes[1]
    axis = 1 if (m.batch_first and len(q) == 3) else 0
    seq_l, seq_s, e = int(q[axis]), int(k[axis]), m.embed_dim
    return seq_l * e * e + seq_s * (m.kdim + m.vdim) * e + 2 * seq_l * seq_s * e + seq_l * e * e


def _macs(kind: str, m: nn.Module, out_shape: tuple[int, ...], in_shapes: list | None = None) -> int:
    if isinstance(m, nn.RNNBase):
        return _rnn_macs(m, out_shape)
    if isinstance(m, nn.MultiheadAttention):
        return _mha_macs(m, in_shapes or [])
    if kind in ("conv", "depthwise", "group_conv"):
        nd = len(m.kernel_size)
        spatial = out_shape[-nd:] if len(out_shape) >= nd else ()
        return conv_macs(m.out_channels, m.in_channels, m.groups, _prod(m.kernel_size), _prod(spatial))
    if kind == "linear":
        if _is_hf_conv1d(m):
            fin, fout = m.weight.shape[0], m.weight.shape[1]
        else:
            fin, fout = m.in_features, m.out_features
        batch = out_shape[0] if len(out_shape) >= 2 else 1
        positions = _prod(out_shape) // max(fout, 1) // max(batch, 1)
        return linear_macs(fin, fout, positions)
    return 0


# ---------------------------------------------------------------------------------- the tracer
class _Builder:
    def __init__(self, model: nn.Module):
        self.model = model
        self.nodes: list[Node] = []
        self.info: dict[str, tuple[tuple[int, ...], int | None]] = {}  # node -> (shape, channel axis)
        self.names: set[str] = set()
        self.done: dict[Any, str | None] = {}
        self.leaves: dict[int, tuple[str, torch.Tensor]] = {}  # id(tensor) -> input node name
        self.params: dict[int, str] = {}
        self.mod_out: dict[Any, tuple[dict[str, Any], int]] = {}
        self.layer_modules: dict[str, nn.Module] = {}
        self.calls: dict[str, int] = {}
        self.pad_values: dict[int, tuple[Any, float]] = {}  # id(grad_fn) -> (grad_fn, constant pad value)
        self.operand_shapes: dict[int, tuple[Any, list]] = {}  # id(grad_fn) -> (grad_fn, shapes of add/sub/mul/div operands)
        self.op_macs: dict[int, tuple[Any, int]] = {}  # id(grad_fn) -> (grad_fn, MACs of a matmul / attention op)
        self.batch = 1

    # -------------------------------------------------------------- helpers
    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self.names:
            name = f"{base}#{k}"
            k += 1
        self.names.add(name)
        return name

    def add(self, name: str, kind: str, inputs: list[str], shape: tuple[int, ...], axis: int | None,
            **kw: Any) -> str:
        shape = tuple(int(s) for s in shape)
        channels = shape[axis] if axis is not None and shape else 1
        if kind in ("input", "output", "other") and axis is None:
            channels = 1
        self.nodes.append(Node(name, kind, list(inputs), channels, **kw))
        self.info[name] = (shape, axis)
        return name

    @staticmethod
    def tensor_key(t: torch.Tensor) -> Any:
        if t.grad_fn is not None:
            return (t.grad_fn, t.output_nr)
        if t.requires_grad:
            return ("leaf", id(t))
        return None

    @staticmethod
    def edge_key(fn: Any, nr: int) -> Any:
        if fn is None:
            return None
        if type(fn).__name__ == "AccumulateGrad":
            return ("leaf", id(fn.variable))
        return (fn, nr)

    def default_axis(self, shape: tuple[int, ...]) -> int | None:
        return len(shape) - 1 if shape else None

    # -------------------------------------------------------------- walk
    def children(self, key: Any) -> list[Any]:
        if key[0] == "leaf":
            return []
        if key in self.mod_out:
            rec, _ = self.mod_out[key]
            return [k for k in rec["in_keys"] if k is not None]
        fn = key[0]
        return [k for k in (self.edge_key(f, n) for f, n in fn.next_functions) if k is not None]

    def resolve(self, key: Any) -> str | None:
        stack = [(key, False)]
        while stack:
            k, expanded = stack.pop()
            if k in self.done:
                continue
            if not expanded:
                stack.append((k, True))
                stack.extend((c, False) for c in self.children(k) if c not in self.done)
            else:
                self.done[k] = self.make(k)
        return self.done[key]

    def make(self, key: Any) -> str | None:
        if key[0] == "leaf":
            hit = self.leaves.get(key[1])
            return hit[0] if hit else None  # parameters and other leaves are constants
        if key in self.mod_out:
            return self.make_module(key)
        return self.make_op(*key)

    # -------------------------------------------------------------- layers
    def make_module(self, key: Any) -> str:
        rec, idx = self.mod_out[key]
        if "node" not in rec:
            self.make_layer(rec)
        if idx == 0:
            return rec["node"]
        shape = rec["out_shapes"][idx]
        return self.add(self.unique(f"{rec['node']}:{idx}"), "other", [rec["node"]], shape,
                        self.default_axis(shape), op=rec["op"])

    def make_attention(self, rec: dict[str, Any], spec: dict[str, Any]) -> bool:
        """An attention module as one ``attention`` node (+ a ``linear`` node for an inner output
        projection); False when its input is not what it should be (it is then an ``other`` layer)."""
        path, leaf = rec["path"], rec["leaf"]
        ins = [self.done.get(k) if k is not None else None for k in rec["in_keys"]]
        graph_ins = [i for i in ins if i is not None]
        first = ins[0] if ins else None
        out_shape = tuple(rec["out_shapes"][0])
        h, d = spec["heads"], spec["head_dim"]
        q = innermost_module(leaf._modules[spec["q"]])
        if first is None or len(out_shape) < 2 or self.calls.get(path):
            return False
        shape, axis = self.info[first]
        if axis != len(shape) - 1 or shape[-1] != q.in_features:
            return False
        o = innermost_module(leaf._modules[spec["o"]]) if spec["o"] else None
        width = o.out_features if o is not None else h * d
        if out_shape[-1] != width:
            return False
        self.calls[path] = 1
        ctx_shape = (*out_shape[:-1], h * d)
        positions = _prod(ctx_shape[1:-1]) if len(ctx_shape) > 2 else 1
        seq = int(ctx_shape[-2]) if len(ctx_shape) > 2 else 1
        params = sum(p.numel() for c in (spec["q"], spec["k"], spec["v"]) for p in leaf._modules[c].parameters())
        macs = 3 * linear_macs(q.in_features, h * d, positions) + 2 * seq * positions * h * d
        base = path if path else "model"
        name = self.unique(base)
        self.layer_modules[path] = leaf
        node = self.add(name, "attention", [first], ctx_shape, len(ctx_shape) - 1, layer=path,
                        op=type(leaf).__name__, attrs={"heads": h, "head_dim": d, **_facts("attention", leaf)},
                        params=params, macs=macs)
        extra = [i for i in graph_ins if i != first]
        if extra:  # e.g. a mask that needs grad: its channels stay (never sliced)
            self.add(self.unique(f"{name}:inputs"), "other", extra, (1,), None, op=type(leaf).__name__)
        if o is not None:
            opath = f"{path}.{spec['o']}" if path else spec["o"]
            self.layer_modules[opath] = o
            node = self.add(self.unique(opath), "linear", [node], out_shape, len(out_shape) - 1, layer=opath,
                            op=type(o).__name__, attrs=_facts("linear", o),
                            params=sum(p.numel() for p in o.parameters()),
                            macs=linear_macs(o.in_features, o.out_features, positions))
        rec["node"] = node
        return True

    def make_layer(self, rec: dict[str, Any]) -> None:
        path, leaf = rec["path"], rec["leaf"]
        spec = attention_spec(leaf)
        if spec is not None and self.make_attention(rec, spec):
            return
        kind, attrs = module_kind(leaf)
        ins = [self.done.get(k) if k is not None else None for k in rec["in_keys"]]
        graph_ins = [i for i in ins if i is not None]
        first = ins[0] if ins else None
        out_shape = rec["out_shapes"][0]
        if len(rec["out_shapes"]) > 1 and kind != "other":
            kind, attrs = "other", {}
        # the layer must see its channels on the axis we track; otherwise it is an op we cannot cut
        if kind == "norm" and attrs.get("channels_last"):  # GRN: channels on the last axis
            ok = first is not None and self.info[first][1] == len(self.info[first][0]) - 1 \
                and self.info[first][0][-1] == leaf.weight.shape[-1] and tuple(out_shape) == self.info[first][0]
            if not ok:
                kind, attrs = "other", {}
            out_axis = len(out_shape) - 1
        elif kind in ("conv", "depthwise", "group_conv", "norm"):
            expect = leaf.in_channels if kind != "norm" else leaf.num_features
            ok = first is not None and self.info[first][1] == (1 if len(self.info[first][0]) > 1 else 0) \
                and self.info[first][0][self.info[first][1]] == expect
            ok = ok or (kind == "conv" and first is not None and self.is_input(first))
            if not ok and kind != "group_conv":
                kind, attrs = "other", {}
            out_axis = 1 if len(out_shape) > 1 else 0
        elif kind == "linear":
            fin = leaf.weight.shape[0] if _is_hf_conv1d(leaf) else leaf.in_features
            ok = first is not None and self.info[first][1] == len(self.info[first][0]) - 1 \
                and self.info[first][0][-1] == fin
            ok = ok or (first is not None and self.is_input(first))  # model inputs keep their channels anyway
            if not ok:
                kind, attrs = "other", {}
            out_axis = len(out_shape) - 1
        elif kind == "embedding":
            out_axis = len(out_shape) - 1
        if kind == "other":
            out_axis = self.default_axis(out_shape)
            if first is not None and self.info[first][0] == tuple(out_shape):
                out_axis = self.info[first][1]
        inputs = graph_ins if kind == "other" else ([first] if first is not None else [])
        if kind == "embedding":
            inputs = []
        attrs = {**attrs, **_facts(kind, leaf)}
        params = sum(p.numel() for p in leaf.parameters())
        base = path if path else "model"
        n = self.calls.get(path, 0)
        self.calls[path] = n + 1
        name = self.unique(base if n == 0 else f"{base}#call{n}")
        self.layer_modules[path] = leaf
        rec["node"] = self.add(name, kind, inputs, out_shape, out_axis, layer=path, op=type(leaf).__name__,
                               attrs=attrs, params=params, macs=_macs(kind, leaf, out_shape, rec.get("in_shapes")))

    # -------------------------------------------------------------- ops
    def make_op(self, fn: Any, nr: int) -> str:
        name = self._make_op(fn, nr)
        seen = self.op_macs.get(id(fn))
        if seen is not None and seen[0] is fn and nr == 0:  # a matmul / attention op: per sample
            self.nodes[-1].macs += seen[1] // max(self.batch, 1)
        return name

    def _make_op(self, fn: Any, nr: int) -> str:
        """The node of autograd function ``fn`` (output ``nr``): how channels pass through it, decided by the
        op's family (:data:`_OP_RULES`); ``'other'`` when its channels cannot be followed."""
        op = type(fn).__name__
        try:
            out_shape = tuple(int(s) for s in fn._input_metadata[nr].shape)
        except Exception:  # pragma: no cover - no metadata: nothing we can say about channels
            out_shape = ()
        operands = []  # (position, node name or None, edge key)
        for pos, (f, n) in enumerate(fn.next_functions):
            k = self.edge_key(f, n)
            operands.append((pos, self.done.get(k) if k is not None else None, k))
        graph_ins = [name for _, name, _ in operands if name is not None]
        st = _OpStep(self, fn, op, self.unique(op), out_shape, operands, graph_ins)
        if not graph_ins or st.axis is None:
            return st.other()
        for rule in _OP_RULES:
            made = rule(st)
            if made is not None:
                return made
        return st.other()

    def const(self, shape: tuple[int, ...] | None, out_shape: tuple[int, ...], out_axis: int, label: str) -> str:
        """A constant operand (a parameter or a tensor that needs no grad) of an elementwise op."""
        c = out_shape[out_axis]
        if shape is not None:
            d = out_axis - (len(out_shape) - len(shape))
            c = int(shape[d]) if d >= 0 else 1
        name = self.unique(label)
        self.nodes.append(Node(name, "input", [], c, op=label))
        self.info[name] = ((c,), 0)
        return name

    def binary(self, fn: Any, op: str, name: str, operands: list, out_shape: tuple[int, ...]) -> str:
        R = len(out_shape)
        graph = [(pos, nm) for pos, nm, _ in operands if nm is not None]
        out_axis = None
        for _, nm in graph:
            s, a = self.info[nm]
            if a is not None and len(s) <= R:
                oa = a + R - len(s)
                if s[a] == out_shape[oa] and (s[a] > 1 or all(self.info[g][0] == s for _, g in graph)):
                    out_axis = oa
                    break
        if out_axis is None:
            return self.add(name, "other", [nm for _, nm in graph], out_shape, self.default_axis(out_shape), op=op)
        C = out_shape[out_axis]
        # shapes of the constant operands (a Python number is a 0-d tensor: it broadcasts), as recorded by the
        # trace: the recorded operands less one of each graph operand's shape
        const_shapes: list[tuple[int, ...]] = []
        seen = self.operand_shapes.get(id(fn))
        if seen is not None and seen[0] is fn:
            const_shapes = list(seen[1])
            for _, nm in graph:
                if self.info[nm][0] in const_shapes:
                    const_shapes.remove(self.info[nm][0])
        inputs = []
        for pos, nm, key in operands:
            if nm is not None:
                s, a = self.info[nm]
                d = out_axis - (R - len(s))
                size = s[d] if d >= 0 else 1
                related = a == d and size == C
                broadcast = size == 1 and (self.nodes_channels(nm) != C or C == 1)
                if not (related or broadcast):
                    return self.add(name, "other", [g for _, g in graph], out_shape, self.default_axis(out_shape), op=op)
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
                label = self.params.get(key[1], "parameter") if key is not None and key[0] == "leaf" else "constant"
                inputs.append(self.const(shape, out_shape, out_axis, f"{label} ({op})" if label == "constant" else label))
        zero = _BINARY[op]
        if op == "DivBackward0" and operands[1][1] is not None:
            zero = "none"  # a zero denominator is not a zero
        return self.add(name, "elementwise", inputs, out_shape, out_axis, op=op, attrs={"zero": zero})

    def is_input(self, nm: str) -> bool:
        return any(n.name == nm and n.kind == "input" for n in self.nodes[:len(self.leaves)])

    def nodes_channels(self, nm: str) -> int:
        s, a = self.info[nm]
        return s[a] if a is not None and s else 1

    def cat(self, fn: Any, op: str, name: str, operands: list, out_shape: tuple[int, ...]) -> str:
        graph = [nm for _, nm, _ in operands if nm is not None]
        R = len(out_shape)
        dim = int(fn._saved_dim) % R
        axes = {self.info[nm][1] for nm in graph}
        ok = len(graph) == len(operands) and len(axes) == 1 and all(len(self.info[nm][0]) == R for nm in graph)
        axis = axes.pop() if ok else None
        if not ok or axis is None:
            return self.add(name, "other", graph, out_shape, self.default_axis(out_shape), op=op)
        if dim == axis:
            return self.add(name, "concat", graph, out_shape, axis, op=op)
        if any(self.info[nm][0][axis] != out_shape[axis] for nm in graph):
            return self.add(name, "other", graph, out_shape, self.default_axis(out_shape), op=op)
        return self.add(name, "elementwise", graph, out_shape, axis, op=op, attrs={"zero": "all"})


# ---------------------------------------------------------------------------------- op rules (one per family)
class _OpStep:
    """One autograd op being turned into a node: its name, output shape, operands and first graph input."""

    def __init__(self, b: _Builder, fn: Any, op: str, name: str, out_shape: tuple[int, ...], operands: list,
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
        return st.b.binary(st.fn, st.op, st.name, st.operands, st.out_shape)
    if st.op == "CatBackward0":
        return st.b.cat(st.fn, st.op, st.name, st.operands, st.out_shape)
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


def _layers_to_hook(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Compressor wrappers and leaf layers owning parameters; nothing inside a wrapper."""
    out, inside = [], []
    for path, m in model.named_modules():
        if any(path.startswith(p + ".") for p in inside):
            continue
        if attention_spec(m) is not None:  # one node: its projections are not traced one by one
            out.append((path, m))
            inside.append(path)
        elif is_wrapper(m) or isinstance(m, nn.MultiheadAttention):  # MHA: one layer (its out_proj module never runs)
            out.append((path, m))
            inside.append(path)
        elif not m._modules and (m._parameters or isinstance(m, nn.modules.batchnorm._BatchNorm)):
            out.append((path, m))
    return out


def _prepare_inputs(dummy_input: Any) -> tuple[tuple, dict, list[tuple[str, torch.Tensor]]]:
    def prep(t: Any) -> Any:
        if torch.is_tensor(t) and t.is_floating_point():
            return t.detach().clone().requires_grad_(True)
        return t

    if torch.is_tensor(dummy_input):
        args, kwargs = (prep(dummy_input),), {}
    elif isinstance(dummy_input, (tuple, list)):
        args, kwargs = tuple(prep(t) for t in dummy_input), {}
    elif isinstance(dummy_input, dict):
        args, kwargs = (), {k: prep(v) for k, v in dummy_input.items()}
    else:
        raise ModelError(f"dummy_input must be a tensor, a tuple of tensors or a dict of keyword tensors, "
                         f"not {type(dummy_input).__name__}")
    named = [("input" if len(args) == 1 and not kwargs else f"input_{i}", t) for i, t in enumerate(args)]
    named += [(k, t) for k, t in kwargs.items()]
    return args, kwargs, [(n, t) for n, t in named if torch.is_tensor(t) and t.requires_grad]


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.bmm,
            torch.Tensor.bmm, torch.mm, torch.Tensor.mm, torch.nn.functional.scaled_dot_product_attention)


def _matmul_macs(func: Any, args: tuple, kwargs: dict) -> int:
    """MACs of one matmul (``[..., n, k] @ [..., k, m]``: ``batch * n * k * m``, batch dims broadcast) or
    of ``scaled_dot_product_attention`` (``Q @ K^T`` and ``attn @ V``: ``batch * L * S * (E + Ev)``; with
    grouped-query attention, fewer key/value heads than query heads (``enable_gqa``, Llama), each key/value
    head serves ``Hq / Hkv`` query heads: batch counts the query heads)."""
    ts = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
    if func is torch.nn.functional.scaled_dot_product_attention:
        if len(ts) < 3:
            return 0
        q, k, v = ts[0].shape, ts[1].shape, ts[2].shape
        qb, kb = list(q[:-2]), list(k[:-2])
        if qb and kb and kb[-1] and qb[-1] % kb[-1] == 0:  # grouped-query attention: key heads repeat
            kb[-1] = qb[-1]
        batch = torch.broadcast_shapes(tuple(qb), tuple(kb)).numel()
        return int(batch * q[-2] * k[-2] * (q[-1] + v[-1]))
    if len(ts) < 2:
        return 0
    a, b = ts[0].shape, ts[1].shape
    if func is torch.Tensor.__rmatmul__:
        a, b = b, a
    if len(a) == 0 or len(b) == 0:
        return 0
    n, k = (a[-2] if len(a) > 1 else 1), a[-1]
    m = b[-1] if len(b) > 1 else 1
    batch = torch.broadcast_shapes(a[:-2], b[:-2]).numel() if len(a) > 2 or len(b) > 2 else 1
    return int(batch * n * k * m)


class _PadValues(torch.overrides.TorchFunctionMode):
    """Records what the autograd graph does not keep, keyed by the result's grad_fn: the value of every
    constant pad of the traced forward (``F.pad`` / ``constant_pad_nd``: a zero pad keeps a zero channel
    zero, HF MobileNetV2's TF-style padding; any other value does not), and the operand shapes of every
    add / sub / mul / div (``x + 3`` broadcasts a scalar; a per-channel constant does not)."""

    def __init__(self, out: dict[int, tuple[Any, float]], shapes: dict[int, tuple[Any, list]] | None = None,
                 macs: dict[int, tuple[Any, int]] | None = None):
        super().__init__()
        self.out = out
        self.shapes = shapes if shapes is not None else {}
        self.macs = macs if macs is not None else {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in (torch.nn.functional.pad, torch.constant_pad_nd) and isinstance(result, torch.Tensor):
            mode = kwargs.get("mode", args[2] if len(args) > 2 and func is torch.nn.functional.pad else "constant")
            value = kwargs.get("value", args[3] if len(args) > 3 and func is torch.nn.functional.pad
                               else (args[2] if len(args) > 2 and func is torch.constant_pad_nd else 0.0))
            fn = result.grad_fn
            if mode == "constant" and fn is not None:
                self.out[id(fn)] = (fn, float(0.0 if value is None else value))
        elif isinstance(result, torch.Tensor) and result.grad_fn is not None and func in _MATMULS:
            n = _matmul_macs(func, args, kwargs)
            if n:
                self.macs[id(result.grad_fn)] = (result.grad_fn, n)
        elif isinstance(result, torch.Tensor) and type(result.grad_fn).__name__ in _BINARY:
            self.shapes[id(result.grad_fn)] = (result.grad_fn, [tuple(int(d) for d in a.shape) if torch.is_tensor(a)
                                                                else () for a in args[:2]])
        return result


def _add_inputs(b: _Builder, args: tuple, kwargs: dict, inputs: list[tuple[str, torch.Tensor]]) -> None:
    """Step 1: one ``input`` node per input tensor (channels on axis 1, or 0 for a vector)."""
    for name, t in inputs:
        shape = tuple(t.shape)
        nm = b.unique(name)
        b.add(nm, "input", [], shape, (1 if len(shape) > 1 else 0) if shape else None, op="input")
        b.leaves[id(t)] = (nm, t)
        b.done[("leaf", id(t))] = nm
    for first in (_tensors(args) + _tensors(kwargs))[:1]:
        b.batch = int(first.shape[0]) if first.dim() > 1 else 1  # MACs are per sample


def _record_layers(b: _Builder, model: nn.Module, stack: list) -> list[Any]:
    """Step 2: hooks that record each layer call's input / output tensors (the layer nodes of the walk)."""

    def pre_hook(path: str):
        def hook(mod: nn.Module, a: tuple, kw: dict) -> None:
            leaf = innermost_module(mod)
            ins = _tensors(a) + _tensors(kw)
            stack.append({"path": path, "module": mod, "leaf": leaf, "op": type(leaf).__name__,
                          "in_keys": [b.tensor_key(t) for t in ins], "in_shapes": [tuple(t.shape) for t in ins]})
        return hook

    def post_hook(mod: nn.Module, a: tuple, kw: dict, output: Any) -> None:
        rec = stack.pop()
        outs = _tensors(output)
        rec["out_shapes"] = [tuple(t.shape) for t in outs]
        rec["outs"] = outs  # keep the grad_fns alive until the walk
        for i, t in enumerate(outs):
            k = b.tensor_key(t)
            if k is None or k in rec["in_keys"] or k in b.mod_out:
                continue  # a pass-through of an input
            b.mod_out[k] = (rec, i)

    handles = []
    for path, m in _layers_to_hook(model):
        handles.append(m.register_forward_pre_hook(pre_hook(path), with_kwargs=True))
        handles.append(m.register_forward_hook(post_hook, with_kwargs=True))
    return handles


def _run_forward(b: _Builder, model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Step 3: one forward with autograd on (eval mode), the pad values / operand shapes / MACs traced."""
    with torch.enable_grad(), _PadValues(b.pad_values, b.operand_shapes, b.op_macs):
        try:
            return model(*args, **kwargs)
        except Exception as e:
            shapes = [str(tuple(t.shape)) for t in _tensors(args) + _tensors(kwargs)]
            raise ModelError(f"tracing the model failed: its forward raised {type(e).__name__} on dummy_input "
                             f"[{', '.join(shapes)}]: {e}. Pass an input the model accepts (shape and dtype as in "
                             f"training; a tuple for several arguments, a dict for keyword arguments)") from e


def _add_outputs(b: _Builder, output: Any) -> None:
    """Step 4: walk back from each output tensor (building every node on the way) and add ``output`` nodes."""
    ends = []
    for t in _tensors(output):
        k = b.tensor_key(t)
        if k is not None:
            ends.append((b.resolve(k), t))
    for i, (src, _t) in enumerate(ends):
        if src is None:
            continue
        shape, axis = b.info[src]
        b.add(b.unique(f"output_{i}" if len(ends) > 1 else "output"), "output", [src], shape, axis, op="output")


def build_graph(model: nn.Module, dummy_input: Any) -> tuple[Graph, dict[str, nn.Module]]:
    """The channel graph of ``model`` on ``dummy_input`` (a tensor, a tuple of positional tensors or a
    dict of keyword tensors), and ``{layer path: innermost leaf module}`` for every layer node.

    The model is traced in eval mode; its training flags, parameters' ``requires_grad`` and buffers are
    as before afterwards (BatchNorm statistics are not updated)."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"build_graph needs an nn.Module, not {type(model).__name__}")
    b = _Builder(model)
    b.params = {id(p): n for n, p in model.named_parameters()}
    args, kwargs, inputs = _prepare_inputs(dummy_input)
    _add_inputs(b, args, kwargs, inputs)
    training = {m: m.training for m in model.modules()}
    grads = {p: p.requires_grad for p in model.parameters()}
    handles: list[Any] = []
    try:
        handles = _record_layers(b, model, [])
        model.eval()
        for p in grads:
            if p.is_floating_point():
                p.requires_grad_(True)
        _add_outputs(b, _run_forward(b, model, args, kwargs))
    finally:
        for h in handles:
            h.remove()
        for m, flag in training.items():
            m.training = flag
        for p, flag in grads.items():
            p.requires_grad_(flag)
    return Graph(b.nodes), dict(b.layer_modules)
