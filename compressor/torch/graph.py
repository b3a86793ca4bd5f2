"""Translate a PyTorch model into the backend-neutral channel graph of :mod:`compressor.core.graph`.

:func:`build_graph` runs ONE forward pass (eval mode, float inputs cloned and requiring grad, every float
parameter temporarily requiring grad) with hooks on the layers that own parameters, then walks the
autograd graph (``grad_fn.next_functions``) back from every tensor of the output. A ``grad_fn`` that is
the output of a hooked layer becomes that layer's node (its inputs are the tensors the layer received;
the walk does not descend into the layer); every other ``grad_fn`` becomes an op node classified by its
class name. Python control flow does not matter: only what the forward really computed is seen. What a layer
is (its kind, zero facts and MACs) is :mod:`.graph_layers`'s; how each autograd op carries channels,
:mod:`.graph_ops`'s rules.

Each tensor keeps a channel axis (conv outputs: axis 1, Linear/Embedding outputs: the last axis; reshapes,
permutes, slices and reductions move it). Whatever cannot be classified becomes kind ``other`` (core then
never cuts channels through it, the safe answer). Nothing here reasons about channels: that is core's job.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.errors import ModelError
from ..core.graph import Graph, Node, linear_macs
from .graph_layers import (
    _MATMULS,
    _facts,
    _is_hf_conv1d,
    _macs,
    _matmul_macs,
    _prod,
    attention_spec,
    module_kind,
)
from .graph_ops import _BINARY, _OP_RULES, _OpStep
from .modules import innermost_module, is_wrapper

__all__ = ["build_graph", "module_kind", "attention_spec"]


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Tensor leaves of a (nested) tensor / tuple / list / dict / ModelOutput, in order."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []


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

    def is_input(self, nm: str) -> bool:
        return any(n.name == nm and n.kind == "input" for n in self.nodes[:len(self.leaves)])


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
