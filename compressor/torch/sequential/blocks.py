"""A model's decoder blocks and the calls they receive: finding the blocks without naming a model family
(:func:`find_blocks`), the experts and routers of its mixture-of-experts modules (:func:`find_experts`,
:func:`find_routers`), one recorded block call (:class:`_Input`: its arguments, the hidden state swapped in), what
an observing hook hands to core (host rows), and merging a block's calls into fewer, larger ones."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...core.errors import ModelError
from ...core.oneshot.experts import mark_routed
from ..layout import in_out_features
from ..modules import is_wrapper
from .expert_banks import supported


def _contains(module: nn.Module, ids: set[int]) -> bool:
    return any(id(m) in ids for m in module.modules())


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@dataclass
class ExpertSet:
    """The routed experts of one mixture-of-experts module ``parent``: ``path`` is an ``nn.ModuleList`` of ``count``
    expert modules (``fused`` False) or one module holding each expert's weights as slice ``[e]`` of its 3-D
    parameters (``fused`` True: ``params``, e.g. transformers 5's ``gate_up_proj`` / ``down_proj``); ``routers``: the
    modules beside it that score the experts (output width ``count``); ``gates``: the Linear layers beside it
    with ONE output (a scalar gate per token, e.g. on a shared expert)."""

    parent: str
    path: str
    count: int
    fused: bool
    routers: list[str] = field(default_factory=list)
    gates: list[str] = field(default_factory=list)
    params: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)


def _router_width(module: nn.Module) -> int | None:
    """The output width of a module that could score experts: a Linear-like layer's ``out_features`` (wrapped or
    not), or the first axis of the 2-D ``weight`` of a leaf module that is not an embedding (a router holding its
    ``[num_experts, hidden]`` matrix as a parameter)."""
    io = in_out_features(module)
    if io is not None:
        return int(io[1])
    if isinstance(module, nn.Embedding) or is_wrapper(module) or next(module.children(), None) is not None:
        return None
    w = module._parameters.get("weight")
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _fused_count(module: nn.Module) -> int | None:
    """The number of experts of a module holding them as 3-D parameters ``[experts, ...]`` of its own (every such
    parameter with the same first axis, at least 2), else None."""
    shapes = [tuple(p.shape) for p in module._parameters.values() if isinstance(p, torch.Tensor) and p.dim() == 3]
    if not shapes or len({s[0] for s in shapes}) != 1 or shapes[0][0] < 2:
        return None
    return int(shapes[0][0])


def find_experts(model: nn.Module) -> list[ExpertSet]:
    """The routed experts of ``model``'s mixture-of-experts modules, without naming a model family: a module's
    child that is an ``nn.ModuleList`` of ``E >= 2`` modules of one class (or a module holding 3-D parameters
    ``[E, ...]``), next to a child that scores ``E`` experts (a Linear layer with ``E`` outputs, or a router module
    whose 2-D ``weight`` has ``E`` rows) is the expert set; that scorer is its router. The router must be a direct
    child of the module holding the experts (as in Mixtral, Qwen-MoE, DeepSeek and hand-written MoE layers)."""
    out: list[ExpertSet] = []
    for path, m in model.named_modules():
        if is_wrapper(m):
            continue
        children = list(m.named_children())
        for name, c in children:
            if isinstance(c, nn.ModuleList):
                count = len(c) if len(c) >= 2 and len({type(x) for x in c}) == 1 else None
                fused = False
            else:
                count, fused = _fused_count(c), True
            if count is None:
                continue
            routers = [_join(path, n) for n, r in children if r is not c and _router_width(r) == count]
            if not routers:
                continue
            gates = [_join(path, n) for n, g in children
                     if g is not c and in_out_features(g) is not None and in_out_features(g)[1] == 1]
            params = ([(n, tuple(p.shape)) for n, p in c._parameters.items()
                       if isinstance(p, torch.Tensor) and p.dim() == 3] if fused else [])
            out.append(ExpertSet(path, _join(path, name), count, fused, routers, gates, params))
    return out


def find_routers(model: nn.Module) -> list[str]:
    """The paths of the routers and scalar gates of ``model``'s mixture-of-experts modules (:func:`find_experts`):
    the layers a one-shot run leaves float unless they are named (as llmcompressor and vLLM expect)."""
    return [p for e in find_experts(model) for p in e.routers + e.gates]


def _mark_routed_layers(experts: list[ExpertSet], model: nn.Module, selected: list[nn.Module]) -> None:
    """Mark each selected layer inside a routed expert of a module list with that expert's path (core's
    :func:`~compressor.core.oneshot.experts.mark_routed`: its fallback when the expert sees too few tokens);
    every other selected layer unmarked."""
    label: dict[int, str] = {}
    for e in experts:
        if e.fused:
            continue
        for k, member in enumerate(model.get_submodule(e.path)):
            for m in member.modules():
                label[id(m)] = f"{e.path}.{k}"
    for w in selected:
        mark_routed(w, label.get(id(w)))


def _warn_fused(experts: list[ExpertSet], model: nn.Module, blocks: list[tuple[str, nn.Module]],
                selected: list[nn.Module]) -> None:
    """One warning naming the fused expert parameters (3-D, one slice per expert) of the mixture-of-experts
    modules in the blocks that hold selected layers whose per-expert computation is not known
    (:func:`~.expert_banks.supported`: transformers' experts banks are, and are compressed slice by slice), so
    these stay as they are."""
    ids = {id(m) for m in selected}
    scopes = [(n, b) for n, b in blocks if _contains(b, ids)] or ([("", model)] if ids else [])
    fused = [e for e in experts if e.fused and not supported(model.get_submodule(e.path))
             and any(not n or e.path.startswith(n + ".") for n, _ in scopes)]
    if not fused:
        return
    total = sum(p.numel() for _, b in scopes for p in b.parameters() if p.dim() >= 2)
    held = sum(p.numel() for e in fused for p in model.get_submodule(e.path)._parameters.values()
               if isinstance(p, torch.Tensor) and p.dim() == 3)
    share = f"; {100.0 * held / total:.0f} % of the weights of the blocks" if total else ""
    shapes = ", ".join(f"{n} {list(s)}" for n, s in fused[0].params)
    more = f" and {len(fused) - 1} more like it" if len(fused) > 1 else ""
    warnings.warn(f"one-shot calibration: the routed experts of {len(fused)} mixture-of-experts module(s) are fused "
                  f"3-D parameters ({fused[0].path}: {shapes}{more}{share}) and are NOT compressed: the one-shot methods "
                  f"compress Linear layers (one 2-D weight each); only the model's Linear layers are", stacklevel=3)


def float64_exempt(block: nn.Module) -> list[nn.Module]:
    """The modules of ``block`` a float64 pass must leave in the model's dtype: fused experts (3-D parameters
    :func:`find_experts` finds), whose grouped matrix products (transformers 5's ``grouped_mm`` experts kernel)
    take no float64: :func:`model_dtype_hooks` runs them in their own dtype inside the float64 pass (the
    statistics of their expert slices, :mod:`.expert_banks`, are then float32 rows)."""
    return [block.get_submodule(e.path) for e in find_experts(block) if e.fused]


def model_dtype_hooks(module: nn.Module) -> list[Any]:
    """Hooks that run ``module`` in the dtype of its own floating parameters when it is called with other floating
    tensors (a float64 pass): its floating tensor arguments are cast to that dtype, its floating tensor output(s)
    back to the dtype of its first floating argument. Returns the hook handles (remove them after the pass). The
    module's parameters must not be swapped for float64 copies meanwhile."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        return []
    own = dtypes.pop()
    called: list[torch.dtype] = []

    def cast(v: Any, dtype: torch.dtype) -> Any:
        if torch.is_tensor(v):
            return v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v
        if isinstance(v, (tuple, list)):
            return type(v)(cast(x, dtype) for x in v)
        if isinstance(v, dict):
            return {k: cast(x, dtype) for k, x in v.items()}
        return v

    def first_float(v: Any) -> torch.dtype | None:
        if torch.is_tensor(v):
            return v.dtype if v.is_floating_point() else None
        if isinstance(v, (tuple, list)):
            return next((d for x in v if (d := first_float(x)) is not None), None)
        if isinstance(v, dict):
            return first_float(list(v.values()))
        return None

    def pre(mod: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        called.append(first_float((args, kwargs)) or own)
        return cast(args, own), cast(kwargs, own)

    def post(mod: nn.Module, args: tuple, kwargs: dict[str, Any], out: Any) -> Any:
        return cast(out, called.pop())

    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post, with_kwargs=True)]


def find_blocks(model: nn.Module, targets: Sequence[str] | None, selected: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The model's blocks in execution (definition) order: modules whose class name is in ``targets``
    (outermost ones), or, without targets, the children of an ``nn.ModuleList`` whose children all have one class
    and which holds a module of ``selected``: the longest such list (ties: the first one) that is neither

    * the routed experts of a mixture-of-experts module (:func:`find_experts`: they are called on the tokens the
      router picks, not one after the other on the previous one's output), nor
    * inside a member of another such list of two or more members (the outermost repeated list is the decoder:
      ``model.layers``, not a list nested in its layers).

    Also marks the selected layers of routed experts for core (:func:`_mark_routed_layers`) and warns once about
    fused expert parameters that stay uncompressed (:func:`_warn_fused`)."""
    selected = list(selected)
    ids = {id(m) for m in selected}
    experts = find_experts(model)
    _mark_routed_layers(experts, model, selected)
    if targets:
        names = set(targets)
        found: list[tuple[str, nn.Module]] = []
        for name, m in model.named_modules():
            if type(m).__name__ in names and not any(name.startswith(f + ".") for f, _ in found):
                found.append((name, m))
        _warn_fused(experts, model, found, selected)
        return found
    expert_lists = {e.path for e in experts if not e.fused}
    lists: list[tuple[str, nn.Module]] = []  # lists of one class holding a selected layer (expert lists included)
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or not len(m):
            continue
        children = list(m.children())
        if len({type(c) for c in children}) == 1 and any(_contains(c, ids) for c in children):
            lists.append((name, m))

    def nested(name: str) -> bool:  # inside a member of another list of 2+ members
        return any(len(o) >= 2 and o_name != name and (not o_name or name.startswith(o_name + "."))
                   for o_name, o in lists)

    best: list[tuple[str, nn.Module]] = []
    for name, m in lists:
        if len(m) > len(best) and name not in expert_lists and not nested(name):
            best = [(_join(name, n), c) for n, c in m.named_children()]
    _warn_fused(experts, model, best, selected)
    return best


class _Stop(Exception):
    """Raised by the pre-hook on block 0 once its inputs are stored."""


class _Input:
    """One calibration batch at a block: ``args`` / ``kwargs`` of the call, where the hidden state is, and
    the keep-mask of real (not padded) tokens, if known."""

    __slots__ = ("args", "kwargs", "where", "keep")

    def __init__(self, args: tuple, kwargs: dict[str, Any], where: tuple[str, Any], keep: torch.Tensor | None):
        self.args, self.kwargs, self.where, self.keep = args, kwargs, where, keep

    def hidden(self) -> Any:
        kind, key = self.where
        return self.args[key] if kind == "arg" else self.kwargs[key]

    def hidden_of_call(self, key: Any) -> Any:
        return self.args[key] if key == 0 else self.kwargs[key]

    def with_hidden(self, h: torch.Tensor) -> _Input:
        kind, key = self.where
        if kind == "arg":
            return _Input((*self.args[:key], h, *self.args[key + 1:]), self.kwargs, self.where, self.keep)
        return _Input(self.args, {**self.kwargs, key: h}, self.where, self.keep)


def _hidden_of(output: Any) -> torch.Tensor:
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    try:
        h = output[0]  # a ModelOutput
    except (TypeError, KeyError, IndexError):
        h = None
    if torch.is_tensor(h):
        return h
    raise ModelError(f"one-shot calibration: a block returned {type(output).__name__}; expected the hidden state "
                     f"(a tensor) or a tuple whose first element is it")


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # an inference tensor (torch.inference_mode) has no version counter
        return -1


def _dedupe(v: Any, prev: Any) -> Any:
    """``prev`` where ``v`` holds the same tensors (same shape, dtype, device, values) as ``prev``, else ``v``:
    the block inputs of every batch then share one causal mask / one rotary table instead of one per batch
    (they are read only)."""
    if torch.is_tensor(v):
        same = (torch.is_tensor(prev) and v.shape == prev.shape and v.dtype == prev.dtype and v.device == prev.device
                and bool(torch.equal(v, prev)))
        return prev if same else v
    if isinstance(v, tuple) and isinstance(prev, tuple) and len(v) == len(prev) and v:
        out = tuple(_dedupe(a, b) for a, b in zip(v, prev))
        return prev if all(a is b for a, b in zip(out, prev)) else out
    return v


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (views of one tensor share it)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return id(t)


def _keep_mask(kwargs: dict[str, Any]) -> torch.Tensor | None:
    m = kwargs.get("attention_mask")
    if torch.is_tensor(m) and m.dim() == 2 and not m.is_floating_point():
        return m != 0
    return None


_NUMPY_DTYPES = {torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
                 torch.int64, torch.bool}


def _host(t: torch.Tensor) -> Any:
    """``t`` on the host: a numpy array (a view of a CPU tensor, no copy) or, for dtypes numpy lacks, a CPU copy."""
    t = t.detach()
    if t.dtype in _NUMPY_DTYPES:
        return t.to("cpu").numpy()
    return t.to("cpu", copy=True)


#: the most tokens (rows x sequence) one merged AWQ parent call takes (:func:`_merged_calls`). On the trained byte-level
#: Llama (256-token windows, one thread) 1024 and 256 (= no merging of its windows) took the same CPU time, full
#: search 101.8 vs 101.5 s, default search 31.1 vs 30.3 s, and 256 peaked 60 / 24 MiB lower (the merged batch's
#: attention scores); 8192 was no faster than 1024 and took ~400 MiB more. Shorter sequences are still merged.
MERGE_TOKENS = 256


def _hidden_key(c: _Input) -> Any:
    """Where a recorded module call's hidden state is: 0 (first positional) or the ``hidden_states`` keyword."""
    if c.args and torch.is_tensor(c.args[0]):
        return 0
    if torch.is_tensor(c.kwargs.get("hidden_states")):
        return "hidden_states"
    return None


def _same_rest(a: Any, b: Any, rows: int) -> bool:
    """``a`` and ``b`` (an argument of two calls, not the hidden state) are the same object (recorded calls share
    their repeated masks / rotary tables) or equal plain values, and hold no tensor with a batch axis of
    ``rows`` > 1 (a per-sequence tensor would not broadcast over a merged batch)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return a is b and not (rows > 1 and a.dim() >= 2 and a.shape[0] == rows)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_rest(x, y, rows) for x, y in zip(a, b))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - a value without a usable ==: not mergeable
        return False


def _mergeable(head: _Input, c: _Input, key: Any) -> bool:
    h0, h1 = (head.args[0], c.args[0]) if key == 0 else (head.kwargs[key], c.kwargs[key])
    if (_hidden_key(c) != key or h0.shape[1:] != h1.shape[1:] or h0.dtype != h1.dtype or h0.device != h1.device
            or len(head.args) != len(c.args) or head.kwargs.keys() != c.kwargs.keys()
            or (head.keep is None) != (c.keep is None)):
        return False
    rows = max(int(h0.shape[0]), int(h1.shape[0]))
    first = 1 if key == 0 else 0
    return (all(_same_rest(a, b, rows) for a, b in zip(head.args[first:], c.args[first:]))
            and all(_same_rest(head.kwargs[k], c.kwargs[k], rows) for k in head.kwargs if k != key))


def _concat(group: list[_Input], key: Any) -> _Input:
    head = group[0]
    hs = [c.args[0] if key == 0 else c.kwargs[key] for c in group]
    h = torch.cat(hs, dim=0)
    keep = None if head.keep is None else torch.cat([c.keep for c in group], dim=0)
    if key == 0:
        return _Input((h, *head.args[1:]), head.kwargs, ("arg", 0), keep)
    return _Input(head.args, {**head.kwargs, key: h}, ("kw", key), keep)


def _merged_calls(module: nn.Module, calls: list[_Input]) -> list[_Input]:
    """AWQ runs each parent module once per grid point on every recorded call: consecutive calls that differ only
    in their hidden state (the usual case: one calibration batch per call, shared masks / rotary tables) are
    concatenated on the batch axis into calls of up to :data:`MERGE_TOKENS` tokens, so the module runs a few large
    batches instead of many short ones. Checked once on the first
    merged call against the separate calls (same outputs to float32 rounding); any difference or error keeps
    the calls as recorded."""
    key = _hidden_key(calls[0]) if calls else None
    if key is None or len(calls) < 2:
        return calls
    groups: list[list[_Input]] = []
    tokens = 0
    for c in calls:
        h = c.hidden_of_call(key) if _hidden_key(c) == key else None
        n = 0 if h is None else int(h.numel() // max(int(h.shape[-1]), 1))
        if groups and h is not None and tokens + n <= MERGE_TOKENS and _mergeable(groups[-1][0], c, key):
            groups[-1].append(c)
            tokens += n
        else:
            groups.append([c])
            tokens = n
    if all(len(g) == 1 for g in groups):
        return calls
    try:
        with torch.no_grad():
            first = next(g for g in groups if len(g) > 1)
            cat = _concat(first, key)
            merged = _hidden_of(module(*cat.args, **cat.kwargs))
            alone = torch.cat([_hidden_of(module(*c.args, **c.kwargs)) for c in first], dim=0)
        ok = merged.shape == alone.shape and bool(torch.allclose(merged, alone, rtol=1e-4, atol=1e-5))
    except Exception:  # noqa: BLE001 - a module that cannot take the merged batch: keep the calls as recorded
        ok = False
    if not ok:
        return calls
    calls.clear()  # drop the separate calls group by group as they are merged (no second copy of all of them)
    out = []
    for i, g in enumerate(groups):
        groups[i] = []
        out.append(_concat(g, key) if len(g) > 1 else g[0])
        del g
    return out


def _widened(v: Any, hidden: Any, shared: dict[int, tuple[torch.Tensor, int, torch.Tensor]]) -> Any:
    """``v`` (tensors in tuples / lists / dicts) with its floating tensors widened to float64: ``hidden`` anew,
    the others once, kept in ``shared`` by identity and version (a block's calls share the attention mask and
    the rotary tables)."""
    if torch.is_tensor(v):
        if not v.is_floating_point() or v.dtype == torch.float64:
            return v
        if v is hidden:
            return v.to(torch.float64)
        got = shared.get(id(v))
        if got is None or got[0] is not v or got[1] != _version(v):
            got = shared[id(v)] = (v, _version(v), v.to(torch.float64))
        return got[2]
    if isinstance(v, tuple):
        return tuple(_widened(x, hidden, shared) for x in v)
    if isinstance(v, list):
        return [_widened(x, hidden, shared) for x in v]
    if isinstance(v, dict):
        return {k: _widened(x, hidden, shared) for k, x in v.items()}
    return v

