"""Batch-norm folding for QAT: Conv2d -> BatchNorm2d pairs train with the BN folded into the weight.

Pairs are found with ``torch.fx`` (a Conv2d whose only user is a BatchNorm2d of matching width). For a
quantized conv of such a pair the BN moves into the wrapper (``<conv>.bn_module``) and its old place in
the model becomes ``nn.Identity``. Training forward (Jacob et al. 2018, sec. 3.2; the form torch.ao's
ConvBn uses):

    f = gamma / sqrt(running_var + eps)             # per output channel
    y = conv(x, fakequant(w * f)) / f + b           # quantize the folded weight
    y = bn(y)                                       # batch statistics in training, running in eval

In eval this equals ``conv(x, fakequant(w * f)) + beta + (b - mean) * f``, which is what export writes:
the conv gets the folded quantized weight (and a zero bias), the BN becomes an identity that adds the
folded bias (gamma 1, beta = folded bias, mean 0, var 1 - eps), so the file loads into the original class.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core.errors import ConfigError

_LAST_FLOW: list[Any] = []


def _trace(model: nn.Module, what: str, way_out: str, example: tuple | None = None) -> Any:
    """The model's ``torch.fx`` graph; when fx cannot trace it and ``example`` (``(args, kwargs)`` of one
    forward) is given, a :class:`~.dataflow.Flow` recorded by running the model on it instead."""
    import torch.fx

    try:
        return torch.fx.symbolic_trace(model).graph
    except Exception as e:  # noqa: BLE001  (fx raises many kinds)
        reason = f"{type(e).__name__}: {e}"
    if example is not None:
        from .dataflow import record_flow

        args, kwargs = example
        key = (id(model), tuple(id(m) for m in model.modules()),
               tuple(id(t) for t in (*args, *kwargs.values())), tuple(kwargs))
        if _LAST_FLOW and _LAST_FLOW[0] == key:
            return _LAST_FLOW[2]  # the same model and input: the searches of one quantizer share one run
        try:
            flow = record_flow(model, args, kwargs)
            _LAST_FLOW[:] = [key, (model, args, kwargs), flow]  # (keeps the keyed objects alive: ids stay valid)
            return flow
        except Exception as e:  # noqa: BLE001  (the user's model failed on the example input)
            raise ConfigError(f"{what}: the model cannot be traced with torch.fx ({reason}) and failed on "
                              f"dummy_input ({type(e).__name__}: {e}); {way_out}") from None
    raise ConfigError(f"{what}: the model cannot be traced with torch.fx ({reason}); pass dummy_input= (an "
                      f"example model input: the model is then run once instead) or {way_out}") from None


def _is_flow(graph: Any) -> bool:
    from .dataflow import Flow

    return isinstance(graph, Flow)


def _flow_pairs(flow: Any, modules: dict[str, nn.Module]) -> dict[str, str]:
    from .dataflow import only_reader

    pairs: dict[str, str] = {}
    for name, conv in modules.items():
        if not isinstance(conv, nn.Conv2d):
            continue
        reader = only_reader(flow, name)
        if reader is None or reader.module is None or len(flow.calls.get(reader.module, [])) != 1:
            continue
        bn = modules.get(reader.module)
        if isinstance(bn, nn.BatchNorm2d) and bn.num_features == conv.out_channels and bn.track_running_stats:
            pairs[name] = reader.module
    return pairs


def _pairs(graph: Any, modules: dict[str, nn.Module]) -> dict[str, str]:
    if _is_flow(graph):
        return _flow_pairs(graph, modules)
    pairs: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), nn.Conv2d):
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].op != "call_module":
            continue
        bn = modules.get(users[0].target)
        conv = modules[node.target]
        if isinstance(bn, nn.BatchNorm2d) and bn.num_features == conv.out_channels and bn.track_running_stats:
            pairs[node.target] = users[0].target
    return pairs


def find_conv_bn_pairs(model: nn.Module, example: tuple | None = None) -> dict[str, str]:
    """``{conv name: bn name}`` for every Conv2d whose output feeds only a BatchNorm2d (called once each).
    ``example``: ``(args, kwargs)`` of one forward, used when ``torch.fx`` cannot trace the model."""
    graph = _trace(model, "bn_fold", "use bn_fold=False", example)
    return _pairs(graph, dict(model.named_modules()))


_RELU_FUNCTIONS = (torch.relu, torch.relu_, torch.nn.functional.relu, torch.nn.functional.relu_)


def _is_relu(node: Any, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return type(modules.get(node.target)) is nn.ReLU
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS
    return node.op == "call_method" and node.target in ("relu", "relu_")


_RELU6_FUNCTIONS = (torch.nn.functional.relu6,)


def _is_relu6(node: Any, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        m = modules.get(node.target)
        return type(m) is nn.ReLU6 or (type(m) is nn.Hardtanh and (m.min_val, m.max_val) == (0.0, 6.0))
    return node.op == "call_function" and node.target in _RELU6_FUNCTIONS


def find_relu_followers(model: nn.Module, folded: bool, example: tuple | None = None) -> set[str]:
    """Names of the modules whose output feeds only a ReLU (``nn.ReLU``, ``torch.relu``, ``F.relu``,
    ``.relu()``). With ``folded``, a Conv2d -> BatchNorm2d pair counts by the BN's output (the folded
    wrapper runs the BN itself)."""
    return {k for k, v in find_fused_activations(model, folded, example).items() if v is True}


def find_fused_activations(model: nn.Module, folded: bool, example: tuple | None = None) -> dict[str, Any]:
    """``{module: True}`` for the modules whose output feeds only a ReLU (see :func:`find_relu_followers`),
    ``{module: 'relu6'}`` for those feeding only a ReLU6 (``nn.ReLU6``, ``F.relu6``, ``nn.Hardtanh(0, 6)``):
    their output range is observed after the activation, so it starts at 0 (and ends by 6) and onnxruntime
    drops the Relu / Clip between the integer kernels."""
    graph = _trace(model, "fuse_relu", "use fuse_relu=False", example)
    modules = dict(model.named_modules())
    pairs = _pairs(graph, modules) if folded else {}
    if _is_flow(graph):
        return _flow_relu_followers(graph, modules, pairs)
    found: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        users = list(node.users)
        if node.target in pairs and len(users) == 1:
            users = list(users[0].users)
        if len(users) == 1 and _is_relu(users[0], modules):
            found[node.target] = True
        elif len(users) == 1 and _is_relu6(users[0], modules):
            found[node.target] = "relu6"
    return found


def _flow_relu_followers(flow: Any, modules: dict[str, nn.Module], pairs: dict[str, str]) -> dict[str, Any]:
    from .dataflow import only_reader

    found: dict[str, Any] = {}
    for name in modules:
        if not name:
            continue
        reader = only_reader(flow, pairs.get(name, name))
        if reader is None:
            continue
        if reader.module is not None:
            m = modules.get(reader.module)
            if type(m) is nn.ReLU:
                found[name] = True
            elif type(m) is nn.ReLU6 or (type(m) is nn.Hardtanh and (m.min_val, m.max_val) == (0.0, 6.0)):
                found[name] = "relu6"
        elif reader.func in _RELU_FUNCTIONS or reader.func in (torch.Tensor.relu, torch.Tensor.relu_):
            found[name] = True
        elif reader.func in _RELU6_FUNCTIONS:
            found[name] = "relu6"
    return found


class BNFolding:
    """The folding state of one QAT_Quantizer (pairs, and which wrappers own which BN)."""

    def __init__(self, model: nn.Module, example: tuple | None = None):
        self.model = model
        self.pairs = find_conv_bn_pairs(model, example)
        self._modules = dict(model.named_modules())
        self._owned: dict[str, nn.BatchNorm2d] = {}  # conv (wrapper) name -> bn

    def has(self, wrapper: Any) -> bool:
        return wrapper.name in self._owned

    def attach(self, wrapper: Any) -> None:
        """Give a Conv2d wrapper its BN (before the model changes) if it heads a pair and quantizes weights."""
        bn_name = self.pairs.get(wrapper.name)
        if bn_name is None or "weight" not in wrapper.quant_types or wrapper.layer is not self._modules.get(wrapper.name):
            return
        bn = self._modules[bn_name]
        wrapper.bn_module = bn
        wrapper.bn_name = bn_name
        wrapper.weight_forward = folded_forward
        self._owned[wrapper.name] = bn

    def _slots(self, target: nn.Module) -> list[tuple[nn.Module, str]]:
        return [(p, a) for p in self.model.modules() for a, c in p._modules.items() if c is target]

    def install(self, wrappers: list[Any]) -> None:
        """Replace each owned BN by nn.Identity in the model (the wrapper now runs it)."""
        for w in wrappers:
            if self.has(w):
                for parent, attr in self._slots(w.bn_module):
                    if parent is not w:
                        setattr(parent, attr, _FoldedBN(w.bn_name))

    def uninstall(self, wrappers: list[Any]) -> None:
        """Put the BNs back in their places (for export / unwrapping)."""
        for w in wrappers:
            if self.has(w):
                for parent, attr, child in [(p, a, c) for p in self.model.modules() for a, c in p._modules.items()]:
                    if isinstance(child, _FoldedBN) and child.bn_name == w.bn_name:
                        setattr(parent, attr, w.bn_module)

    @torch.no_grad()
    def export_weight(self, quantizer: Any, wrapper: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Folded, quantized weight and folded bias (running statistics)."""
        f = fold_factor(wrapper.bn_module)
        w = quantizer._quantize("weight", wrapper.weight * f.reshape(-1, 1, 1, 1), wrapper).detach()
        bn = wrapper.bn_module
        b = wrapper.bias if wrapper.bias is not None else torch.zeros_like(bn.running_mean)
        return w, bn.bias + (b - bn.running_mean) * f

    @staticmethod
    @torch.no_grad()
    def identity_state(bn: nn.BatchNorm2d, bias: torch.Tensor) -> dict[str, torch.Tensor]:
        """BN state that makes it add ``bias`` in eval mode (and nothing else)."""
        return {
            "weight": torch.ones_like(bn.weight), "bias": bias.detach().clone(),
            "running_mean": torch.zeros_like(bn.running_mean),
            "running_var": torch.full_like(bn.running_var, 1.0 - bn.eps),
        }


class _FoldedBN(nn.Identity):
    """Placeholder left where a folded BatchNorm2d was (the conv's wrapper runs it)."""

    def __init__(self, bn_name: str):
        super().__init__()
        self.bn_name = bn_name

    def extra_repr(self) -> str:
        return f"folded into the preceding conv: {self.bn_name!r}"


def fold_factor(bn: nn.BatchNorm2d) -> torch.Tensor:
    """``gamma / sqrt(running_var + eps)`` per channel."""
    gamma = bn.weight if bn.weight is not None else torch.ones_like(bn.running_var)
    return gamma / torch.sqrt(bn.running_var + bn.eps)


def folded_forward(wrapper: Any, inputs: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """Conv with the BN-folded fake-quantized weight, unscaled, then the BN itself."""
    bn = wrapper.bn_module
    f = fold_factor(bn)
    qw = wrapper.quantizer._quantize("weight", wrapper.weight * f.reshape(-1, 1, 1, 1), wrapper)
    y = wrapper.layer._conv_forward(inputs[0], qw, None) / f.reshape(1, -1, 1, 1)
    if wrapper.bias is not None:
        y = y + wrapper.bias.reshape(1, -1, 1, 1)
    return bn(y)


#: modules / functions / methods through which values on a quantization grid stay on that grid
_GRID_MODULES = (nn.ReLU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
                 nn.AdaptiveMaxPool3d, nn.Flatten, nn.Identity)
_GRID_FUNCTIONS = (*_RELU_FUNCTIONS, torch.flatten, torch.reshape, torch.nn.functional.pad, torch.nn.functional.max_pool1d,
                   torch.nn.functional.max_pool2d, torch.nn.functional.max_pool3d)
_GRID_METHODS = ("relu", "relu_", "view", "reshape", "flatten", "contiguous", "pad")  # pad: zeros are on every grid


def _grid_preserving(node: Any, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return type(modules.get(node.target)) in _GRID_MODULES
    if node.op == "call_function":
        return node.target in _GRID_FUNCTIONS
    return node.op == "call_method" and node.target in _GRID_METHODS


def find_input_sources(model: nn.Module, folded: bool, example: tuple | None = None) -> dict[str, str]:
    """``{module: producer module}`` where ``module``'s first input is ``producer``'s output passed only through
    grid-preserving ops (ReLU, max pooling, flatten / view / reshape, identity). With ``folded``, a
    Conv2d -> BatchNorm2d pair's BN output counts as the conv's (the folded wrapper produces it)."""
    graph = _trace(model, "share_ranges", "use share_ranges=False", example)
    modules = dict(model.named_modules())
    bn_of = {bn: conv for conv, bn in _pairs(graph, modules).items()} if folded else {}
    if _is_flow(graph):
        return _flow_input_sources(graph, modules, bn_of)
    sources: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_module" or not node.args or not hasattr(node.args[0], "op"):
            continue
        src = node.args[0]
        while src.op != "call_module" or type(modules.get(src.target)) in _GRID_MODULES:
            if not _grid_preserving(src, modules) or not src.args or not hasattr(src.args[0], "op"):
                break
            src = src.args[0]
        if src.op == "call_module" and type(modules.get(src.target)) not in _GRID_MODULES:
            sources[node.target] = bn_of.get(src.target, src.target)
    return sources



def _flow_input_sources(flow: Any, modules: dict[str, nn.Module], bn_of: dict[str, str]) -> dict[str, str]:
    sources: dict[str, str] = {}
    for name, calls in flow.calls.items():
        if not name or len(calls) != 1 or not calls[0].inputs:
            continue
        value, src = calls[0].inputs[0], None
        for _ in range(10_000):
            made = [c for c in flow.made_by_module.get(value, []) if c is not calls[0]]
            if made:  # innermost module that returned the value
                inner = made[0]
                if type(modules.get(inner.module)) not in _GRID_MODULES:
                    src = inner.module
                    break
                if not inner.inputs:
                    break
                value = inner.inputs[0]
                continue
            func = flow.made_by_func.get(value)
            if func is None or not func.inputs or not (
                    func.func in _GRID_FUNCTIONS or getattr(func.func, "__name__", None) in _GRID_METHODS):
                break
            value = func.inputs[0]
        if src is not None and len(flow.calls.get(src, [])) == 1:
            sources[name] = bn_of.get(src, src)
    return sources
