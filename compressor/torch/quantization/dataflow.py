"""Who reads which tensor, found by RUNNING the model once (no tracing): the fallback of :mod:`.bn_fold`'s
pair / ReLU / range-sharing searches for models ``torch.fx`` cannot trace (Hugging Face models, anything
with data-dependent Python control flow).

One eager forward on an example input, in eval mode under ``torch.no_grad()``, with forward hooks on every
module (calls, their first input and their output) and a ``TorchFunctionMode`` (every torch function and
tensor method called outside the modules' internals). A tensor is keyed by its identity and version
counter, so an in-place op (``relu_``) makes a new value. The *readers* of a value are the units that use it
next to where it was produced: a call of a child module of the producer's parent (``self.bn(y)``) or a
function called in the parent's own forward (``torch.relu(y)``, ``y + x``). Calls that return no tensor
(``y.shape``, ``y.dim()``) are metadata and not counted. Conservative by construction: a value also read by
anything else (a residual add, a second module) has several readers, so it is never folded through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def _leaves(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _leaves(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _leaves(v)]
    return []


def _key(t: torch.Tensor) -> tuple[int, int]:
    return id(t), t._version


@dataclass(eq=False)
class Call:
    """One module call (``module`` set: its name) or one torch function call (``func`` set)."""

    parent: Call | None
    module: str | None = None
    func: Any = None
    inputs: list[tuple[int, int]] = field(default_factory=list)
    outputs: list[tuple[int, int]] = field(default_factory=list)
    kind: str | None = None  # what ``record_flow(classify=...)`` said about a function call

    def chain(self) -> list[Call]:
        out, c = [], self
        while c is not None:
            out.append(c)
            c = c.parent
        return out[::-1]


class Flow:
    """The recorded forward: module calls (``calls[name]``: every call of that module), function calls, which
    unit produced each value and who read it."""

    def __init__(self) -> None:
        self.calls: dict[str, list[Call]] = {}
        self.funcs: list[Call] = []
        self.made_by_module: dict[tuple[int, int], list[Call]] = {}  # value -> module calls that returned it
        self.made_by_func: dict[tuple[int, int], Call] = {}
        self.outputs: set[tuple[int, int]] = set()
        self._keep: list[Any] = []  # keeps every seen tensor alive, so ids stay unique

    def reads(self, value: tuple[int, int], producer: Call) -> list[Call]:
        """The function calls reading ``value`` outside the subtree of the module call ``producer``."""
        return [c for c in self.funcs if value in c.inputs and producer not in c.chain()]


class _Recorder(TorchFunctionMode):
    def __init__(self, flow: Flow, classify: Any = None):
        super().__init__()
        self.flow = flow
        self.classify = classify
        self.stack: list[Call] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        ins = [_key(t) for t in _leaves((args, kwargs))]
        out = func(*args, **kwargs)
        outs = _leaves(out)
        if outs:  # metadata reads (shape, dim, dtype, ...) return no tensor: not a use of the values
            call = Call(self.stack[-1] if self.stack else None, func=func, inputs=ins, outputs=[_key(t) for t in outs])
            if self.classify is not None:
                call.kind = self.classify(func, args, kwargs)
            self.flow.funcs.append(call)
            self.flow._keep.extend((args, kwargs, outs))
            for k in call.outputs:
                self.flow.made_by_func[k] = call
        return out


def record_flow(model: nn.Module, args: tuple, kwargs: dict[str, Any], classify: Any = None) -> Flow:
    """Run ``model(*args, **kwargs)`` once (eval mode, no gradients; train/eval modes restored) and record it;
    ``classify(func, args, kwargs)``, when given, sets each function call's ``kind``."""
    flow = Flow()
    recorder = _Recorder(flow, classify)
    names = {m: n for n, m in model.named_modules()}
    handles = []

    def pre(module: nn.Module, a: tuple, kw: dict) -> None:
        call = Call(recorder.stack[-1] if recorder.stack else None, module=names[module],
                    inputs=[_key(t) for t in _leaves(a[:1])])
        flow._keep.append(a)
        flow.calls.setdefault(call.module, []).append(call)
        recorder.stack.append(call)

    def post(module: nn.Module, a: tuple, kw: dict, out: Any) -> None:
        call = recorder.stack.pop()
        call.outputs = [_key(t) for t in _leaves(out)]
        flow._keep.append(out)
        for k in call.outputs:
            flow.made_by_module.setdefault(k, []).append(call)

    for m in names:
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    modes = {m: m.training for m in names}
    try:
        model.eval()
        with torch.no_grad(), recorder:
            out = model(*args, **kwargs)
        flow.outputs = {_key(t) for t in _leaves(out)}
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return flow


def single_output(flow: Flow, name: str) -> tuple[Call, tuple[int, int]] | None:
    """The one call of module ``name`` and its one output value (None if called != 1 times or not one tensor)."""
    calls = flow.calls.get(name, [])
    if len(calls) != 1 or len(calls[0].outputs) != 1:
        return None
    return calls[0], calls[0].outputs[0]


def only_reader(flow: Flow, name: str) -> Call | None:
    """The one unit that reads module ``name``'s output: a module call whose subtree holds every read, or a
    single function call. None when there are several (a residual add, a second user), none, or the output is
    also a model output."""
    found = single_output(flow, name)
    if found is None:
        return None
    call, value = found
    if value in flow.outputs:
        return None
    reads = flow.reads(value, call)
    if not reads:
        return None
    if len(reads) == 1 and any(reads[0].parent is c for c in call.chain()[:-1]):
        return reads[0]  # one function call, in the producer's scope or above it (the value was returned up)
    # the outermost module call below the producer's parent that holds every read and takes the value
    common = reads[0].chain()[:-1]
    for c in reads[1:]:
        chain = c.chain()[:-1]
        n = 0
        while n < min(len(common), len(chain)) and common[n] is chain[n]:
            n += 1
        common = common[:n]
    for unit in reversed(common):
        if unit.module is not None and unit.inputs[:1] == [value]:
            return unit
    return None
