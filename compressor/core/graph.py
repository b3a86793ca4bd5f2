"""A backend-neutral channel graph: coupled channels, dependency groups, speedup plans, MAC/param counts.

Each backend translates a model into a :class:`Graph` (torch: the autograd graph of one forward; Keras:
the Functional graph) and nothing more; everything that reasons about channels is here, once.

Model
-----
Every node produces one tensor with ``channels`` channel *slots* (the channel axis: NCHW axis 1 on
torch convs, the last axis on Keras and on Linear/Dense inputs). Nodes relate the slots of their
inputs to the slots of their output by kind:

=============  =================================================================================
kind           output slot j is the same channel as ...
=============  =================================================================================
input          nothing (new channels; fixed: model inputs cannot lose channels)
output         (its input slots are fixed: model outputs keep their shape)
conv, linear   nothing: new channels (the layer's filters); input channels are *consumed*
embedding      nothing: new channels (the embedding dimension)
attention      nothing: new channels (context features, ``heads`` x ``head_dim``; removed only as
               whole heads); input channels are consumed
group_conv     nothing; inputs consumed and fixed, outputs fixed (grouped convs are never cut)
depthwise      input slot ``j // multiplier`` (attrs ``multiplier``, default 1)
norm           input slot j (per-channel affine norms: BatchNorm)
activation,    input slot j (attrs ``zero_preserving``: f(0) == 0, default True; sigmoid is not)
pool, identity
elementwise    slot j of every input with the same channel count (inputs with 1 channel broadcast);
               attrs ``zero``: 'all' (add: zero when all inputs are), 'any' (mul), 'none'
concat         input k slot ``j - offset_k`` (inputs in order along the channel axis)
split          input slot ``attrs['offset'] + j``
flatten        input slot ``j // positions`` ('channels_first', torch) or ``j % C`` ('channels_last',
               Keras); attrs ``positions`` = number of flattened positions per channel
other          nothing; inputs' and output's channels are fixed (never pruned through)
=============  =================================================================================

Equivalent slots form a *channel class*; removing a class removes that channel from every tensor
in it. A class is *fixed* if it touches an input, an output, an ``other`` node or a grouped conv, or a
norm that mixes channels (give such norms kind ``other``).

Speedup is exact by construction: a class is removed only when it is not fixed and its value is
identically zero wherever a layer mixes channels (conv/linear/attention inputs), found by a zero
analysis over per-node facts the backend reads off the weights: ``dead`` (output channel j is zero
whatever the input: a masked filter with a zero bias) and ``passes_zero`` (zero in -> zero out, per
channel: a depthwise filter or a norm with zero bias).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ModelError

__all__ = [
    "KINDS", "PRODUCERS", "Node", "Graph", "ChannelGroup", "SpeedupPlan", "channel_groups", "speedup_plan",
    "count_graph", "conv_macs", "linear_macs", "classify_reshape", "group_keep_classes", "class_scores", "member_keep",
    "removal_blockers",
]

#: every node kind the graph knows
KINDS = ("input", "output", "conv", "linear", "embedding", "attention", "group_conv", "depthwise", "norm",
         "activation", "pool", "identity", "elementwise", "concat", "split", "flatten", "other")
#: kinds whose output channels are new (the layer's own filters)
PRODUCERS = ("conv", "linear", "embedding", "attention")
#: kinds that mix their input channels (an input channel may be dropped only if it is zero there)
CONSUMERS = ("conv", "linear", "attention")
_SAME = ("norm", "activation", "pool", "identity")


@dataclass
class Node:
    """One op of the model. ``layer`` names the model layer owning its weights (None for plain ops)."""

    name: str
    kind: str
    inputs: list[str] = field(default_factory=list)
    channels: int = 0
    layer: str | None = None
    op: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)
    params: int = 0
    macs: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"node {self.name!r}: unknown kind {self.kind!r}; allowed: {list(KINDS)}")

    def describe(self) -> str:
        where = f" (layer {self.layer!r})" if self.layer else ""
        return f"{self.op or self.kind} {self.name!r}{where}"


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, a: int) -> int:
        p = self.parent
        while p[a] != a:
            p[a] = p[p[a]]
            a = p[a]
        return a

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


class Graph:
    """Nodes in topological order (every input listed before its consumer)."""

    def __init__(self, nodes: Iterable[Node]):
        self.nodes: list[Node] = list(nodes)
        self.by_name: dict[str, Node] = {}
        for n in self.nodes:
            if n.name in self.by_name:
                raise ValueError(f"duplicate node name {n.name!r}")
            for i in n.inputs:
                if i not in self.by_name:
                    raise ValueError(f"node {n.name!r}: input {i!r} is not an earlier node")
            self.by_name[n.name] = n
        self._classes: list[list[int]] | None = None

    # ------------------------------------------------------------------ slots and classes
    def _layout(self) -> None:
        self.offset: dict[str, int] = {}
        total = 0
        for n in self.nodes:
            self.offset[n.name] = total
            total += n.channels
        self.n_slots = total

    def slot(self, node: str, j: int) -> int:
        return self.offset[node] + j

    def input_slot_map(self, n: Node) -> list[tuple[str, list[int]]]:
        """For each input related to ``n``'s output: (input name, input slot of each output slot j)."""
        ins = [self.by_name[i] for i in n.inputs]
        c = n.channels
        k = n.kind
        if k in _SAME or k == "depthwise":
            if not ins:
                return []
            m = int(n.attrs.get("multiplier", 1)) if k == "depthwise" else 1
            src = ins[0]
            if src.channels * m != c:
                raise ModelError(f"{n.describe()}: {src.channels} input channels cannot give {c} output channels")
            return [(src.name, [j // m for j in range(c)])]
        if k == "elementwise":
            return [(i.name, list(range(c))) for i in ins if i.channels == c]
        if k == "concat":
            out, off = [], 0
            for i in ins:
                out.append((i.name, [None] * off + list(range(i.channels)) + [None] * (c - off - i.channels)))
                off += i.channels
            if off != c:
                raise ModelError(f"{n.describe()}: inputs have {off} channels in all, the output {c}")
            return out
        if k == "split":
            o = int(n.attrs.get("offset", 0))
            return [(ins[0].name, [o + j for j in range(c)])]
        if k == "flatten":
            p = int(n.attrs["positions"])
            cin = ins[0].channels
            if cin * p != c:
                raise ModelError(f"{n.describe()}: {cin} channels x {p} positions != {c}")
            if n.attrs.get("order", "channels_first") == "channels_first":
                return [(ins[0].name, [j // p for j in range(c)])]
            return [(ins[0].name, [j % cin for j in range(c)])]
        return []

    def classes(self) -> list[int]:
        """Class id (smallest slot of the class) of every slot."""
        if self._classes is None:
            self._layout()
            uf = _UnionFind(self.n_slots)
            for n in self.nodes:
                base = self.offset[n.name]
                for src, mapping in self.input_slot_map(n):
                    sb = self.offset[src]
                    for j, s in enumerate(mapping):
                        if s is not None:
                            uf.union(base + j, sb + s)
            # a layer called more than once has one set of weights: its calls share output and input channels
            first: dict[str, Node] = {}
            for n in self.nodes:
                if n.layer is None or n.kind in ("input", "output"):
                    continue
                f = first.setdefault(n.layer, n)
                if f is n:
                    continue
                if f.channels == n.channels:
                    for j in range(n.channels):
                        uf.union(self.offset[f.name] + j, self.offset[n.name] + j)
                if f.inputs and n.inputs:
                    a, b = self.by_name[f.inputs[0]], self.by_name[n.inputs[0]]
                    if a.channels == b.channels:
                        for j in range(a.channels):
                            uf.union(self.offset[a.name] + j, self.offset[b.name] + j)
            self._classes = [uf.find(s) for s in range(self.n_slots)]  # type: ignore[assignment]
        return self._classes  # type: ignore[return-value]

    def fixed_classes(self) -> set[int]:
        """Classes that may never be removed (they touch inputs, outputs, other ops, grouped convs)."""
        cls = self.classes()
        fixed: set[int] = set()
        for n in self.nodes:
            base = self.offset[n.name]
            if n.kind in ("input", "other", "group_conv"):
                fixed.update(cls[base + j] for j in range(n.channels))
            if n.kind in ("output", "other", "group_conv"):
                for i in n.inputs:
                    b = self.offset[i]
                    fixed.update(cls[b + j] for j in range(self.by_name[i].channels))
            if n.kind == "elementwise" and any(self.by_name[i].channels not in (n.channels, 1) for i in n.inputs):
                raise ModelError(f"{n.describe()}: inputs of {[self.by_name[i].channels for i in n.inputs]} "
                                 f"channels do not broadcast to {n.channels}")
        return fixed

    def blockers(self) -> dict[int, Node]:
        """For each fixed class, one node that fixes it (for error messages)."""
        cls = self.classes()
        out: dict[int, Node] = {}
        for n in self.nodes:
            base = self.offset[n.name]
            if n.kind in ("input", "other", "group_conv"):
                for j in range(n.channels):
                    out.setdefault(cls[base + j], n)
            if n.kind in ("output", "other", "group_conv"):
                for i in n.inputs:
                    b = self.offset[i]
                    for j in range(self.by_name[i].channels):
                        out.setdefault(cls[b + j], n)
        return out

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n)
        return out

    # ------------------------------------------------------------------ zero analysis
    def zero_slots(self) -> list[bool]:
        """Per slot: is that channel identically zero in the model as it stands (masks applied)?"""
        self.classes()
        zero = [False] * self.n_slots
        for n in self.nodes:
            base = self.offset[n.name]
            c = n.channels
            dead = n.attrs.get("dead")
            passes = n.attrs.get("passes_zero")
            maps = self.input_slot_map(n)
            for j in range(c):
                z = bool(dead[j]) if dead is not None else False
                if not z and maps and n.kind not in ("concat", "split", "flatten", "elementwise"):
                    src, mapping = maps[0]
                    if n.kind in ("norm", "depthwise"):
                        ok = bool(passes[j]) if passes is not None else False
                    else:
                        ok = bool(n.attrs.get("zero_preserving", True))
                    z = ok and zero[self.offset[src] + mapping[j]]
                elif not z and n.kind in ("concat", "split", "flatten"):
                    for src, mapping in maps:
                        if mapping[j] is not None:
                            z = zero[self.offset[src] + mapping[j]]
                elif not z and n.kind == "elementwise" and maps:
                    rule = n.attrs.get("zero", "all")
                    vals = [zero[self.offset[src] + mapping[j]] for src, mapping in maps]
                    if rule == "all":
                        z = len(maps) == len(n.inputs) and all(vals)
                    elif rule == "any":
                        z = any(vals)
                zero[base + j] = z
        return zero


# ---------------------------------------------------------------------------------- speedup plan
@dataclass
class SpeedupPlan:
    """What speedup keeps: ``keep[node]`` = kept output channel indices of every node whose channels
    shrink; ``heads[node]`` = kept heads of attention nodes; ``removed`` = number of classes removed."""

    keep: dict[str, list[int]]
    heads: dict[str, list[int]]
    removed: int
    graph: Graph
    notes: list[str] = field(default_factory=list)

    def out_keep(self, node: str) -> list[int] | None:
        return self.keep.get(node)

    def in_keep(self, node: str, k: int = 0) -> list[int] | None:
        return self.keep.get(self.graph.by_name[node].inputs[k])

    def layer_keep(self) -> dict[str, dict[str, list[int] | None]]:
        """Per model layer: ``{'out': kept output channels, 'in': kept input channels}`` (None = all)."""
        out: dict[str, dict[str, list[int] | None]] = {}
        for n in self.graph.nodes:
            if n.layer is None:
                continue
            entry = {"out": self.keep.get(n.name),
                     "in": self.keep.get(n.inputs[0]) if n.inputs else None}
            if n.kind == "attention":
                entry["heads"] = self.heads.get(n.name)
            if entry["out"] is None and entry["in"] is None and entry.get("heads") is None:
                continue
            out[n.layer] = entry
        return out


def speedup_plan(graph: Graph, strict: bool = True) -> SpeedupPlan:
    """Which channels can be removed without changing any output: classes that are not fixed and are
    zero wherever a layer mixes channels. Attention context channels go only as whole heads.

    ``strict``: a class that is zero at every consumer but fixed by an op the speedup cannot cut
    through (``other``, a grouped conv, a model output) raises :class:`ModelError` naming that op;
    with ``strict=False`` it is kept and listed in ``notes``.
    """
    cls = graph.classes()
    zero = graph.zero_slots()
    fixed = graph.fixed_classes()
    removable, consumed, consumed_nonzero, produced_dead = _zero_classes(graph, zero)
    notes: list[str] = []
    live = (produced_dead & consumed_nonzero) - fixed
    if live:
        notes.append(f"kept {len(live)} channel(s) whose filters are pruned but which are not zero where they are "
                     f"used (a norm's bias after the conv, or another branch of a residual add still writes "
                     f"them); prune with dependency_aware=True so coupled layers and norms are masked together")
    blocked = removable & fixed
    if blocked:
        blockers = graph.blockers()
        by_node: dict[str, int] = {}
        for c in blocked:
            by_node[blockers[c].describe()] = by_node.get(blockers[c].describe(), 0) + 1
        msg = "; ".join(f"{k}: {v} channel(s)" for k, v in sorted(by_node.items()))
        if strict:
            raise ModelError(
                f"speedup: pruned channels cannot be removed through {msg}. Such ops (model outputs, grouped "
                f"convolutions, layers of an unsupported kind) keep their channels: exclude the layers feeding "
                f"them from the config, prune with dependency_aware=True (it skips such groups), or pass "
                f"strict=False to keep those channels"
            )
        notes.append(f"kept pruned channels that cannot be removed: {msg}")
    removable -= fixed
    # attention: whole heads only
    heads: dict[str, list[int]] = {}
    for n in graph.nodes:
        if n.kind != "attention":
            continue
        h, d = int(n.attrs["heads"]), int(n.attrs["head_dim"])
        b = graph.offset[n.name]
        kept_heads = []
        for hh in range(h):
            slots = [cls[b + hh * d + t] for t in range(d)]
            if all(s in removable for s in slots):
                continue
            removable.difference_update(slots)
            kept_heads.append(hh)
        if len(kept_heads) < h:
            heads[n.name] = kept_heads
    keep: dict[str, list[int]] = {}
    for n in graph.nodes:
        b = graph.offset[n.name]
        kept = [j for j in range(n.channels) if cls[b + j] not in removable]
        if len(kept) < n.channels:
            if not kept:
                raise ModelError(f"speedup: every channel of {n.describe()} is pruned; keep at least one")
            keep[n.name] = kept
    return SpeedupPlan(keep=keep, heads=heads, removed=len(removable), graph=graph, notes=notes)


def _zero_classes(graph: Graph, zero: list[bool]) -> tuple[set[int], set[int], set[int], set[int]]:
    """``(removable, consumed, consumed_nonzero, produced_dead)`` classes under the zero analysis ``zero``:
    a class is removable (fixed or not) when every consumer sees zero in it and a producer made it zero."""
    cls = graph.classes()
    consumed_nonzero: set[int] = set()
    consumed: set[int] = set()
    for n in graph.nodes:
        if n.kind in CONSUMERS or n.kind in ("other", "group_conv", "output"):
            for i in n.inputs:
                b = graph.offset[i]
                for j in range(graph.by_name[i].channels):
                    c = cls[b + j]
                    consumed.add(c)
                    if not zero[b + j]:
                        consumed_nonzero.add(c)
    produced_dead: set[int] = set()
    for n in graph.nodes:
        dead = n.attrs.get("dead")
        if dead is None:
            continue
        b = graph.offset[n.name]
        produced_dead.update(cls[b + j] for j in range(n.channels) if dead[j])
    removable = {c for c in set(cls) if c in consumed and c not in consumed_nonzero and c in produced_dead}
    return removable, consumed, consumed_nonzero, produced_dead


def removal_blockers(graph: Graph, layers: Iterable[str]) -> dict[int, str]:
    """Why speedup could not remove channels of ``layers``: ``{class: reason}`` for every class carried by
    a producer, norm or depthwise node of ``layers`` that would NOT be removable even if every channel
    of every node of ``layers`` were pruned (filters zero, biases zero). The one place where "can the
    pruner choose this channel?" is decided, for both backends: reasons name the op and its layer.

    Reasons: the class is fixed (it reaches a model input or output, an ``other`` op, a grouped conv:
    the node is named), it is still nonzero where a layer consumes it (a layer of the class that is not
    in ``layers`` writes it, or an op turns zero into nonzero: both named), or no layer consumes it."""
    chosen = set(layers)
    owned = PRODUCERS + ("norm", "depthwise")
    nodes = []
    for n in graph.nodes:
        if n.layer in chosen and n.kind in owned:
            attrs = {**n.attrs, "dead": [True] * n.channels, "passes_zero": [True] * n.channels}
            n = Node(n.name, n.kind, list(n.inputs), n.channels, n.layer, n.op, attrs, n.params, n.macs)
        nodes.append(n)
    sim = Graph(nodes)
    cls = sim.classes()
    zero = sim.zero_slots()
    fixed = sim.fixed_classes()
    removable, consumed, consumed_nonzero, _ = _zero_classes(sim, zero)
    wanted: set[int] = set()
    for n in sim.nodes:
        if n.layer in chosen and n.kind in owned:
            b = sim.offset[n.name]
            wanted.update(cls[b + j] for j in range(n.channels))
    todo = wanted - (removable - fixed)
    if not todo:
        return {}
    out: dict[int, str] = {}
    blockers = sim.blockers()
    for c in todo:
        if c in fixed:
            out[c] = f"they reach {_where(sim, blockers[c])}, which speedup cannot cut"
        elif c not in consumed:
            out[c] = "no layer consumes them (speedup removes a channel where a layer reads it)"
    culprits: dict[int, str] = {}
    for n in sim.nodes:
        b = sim.offset[n.name]
        maps = sim.input_slot_map(n)
        for j in range(n.channels):
            c = cls[b + j]
            if c not in todo or c in out or c in culprits or zero[b + j]:
                continue
            if n.kind in owned and n.layer is not None and n.layer not in chosen:
                culprits[c] = (f"layer {n.layer!r} ({n.op or n.kind}) shares them but is not selected by the config, "
                               f"so they stay nonzero")
            elif any(m[j] is not None and zero[sim.offset[src] + m[j]] for src, m in maps):
                culprits[c] = f"{_where(sim, n)} does not keep zero channels zero (f(0) != 0)"
    for c in todo:
        if c not in out:
            out[c] = culprits.get(c, "they stay nonzero where a layer uses them")
    return out


def _where(graph: Graph, node: Node) -> str:
    """``node`` for a message: a layer by its name, a model output as such, an op by its name and the
    nearest layer before it."""
    if node.kind == "output":
        return "a model output"
    if node.layer is not None:
        return f"layer {node.layer!r} ({node.op or node.kind})"
    if node.kind == "input" and not node.inputs and node.op != "input":
        return f"the constant operand {node.op!r}"
    if node.kind == "input":
        return f"the model input {node.name!r}"
    seen, todo = set(), list(node.inputs)
    while todo:
        nm = todo.pop(0)
        if nm in seen:
            continue
        seen.add(nm)
        up = graph.by_name[nm]
        if up.layer is not None:
            return f"op {node.op or node.kind} (after layer {up.layer!r})"
        todo.extend(up.inputs)
    return f"op {node.op or node.kind}"


# ---------------------------------------------------------------------------------- dependency groups
@dataclass
class ChannelGroup:
    """Layers whose channels must be pruned together.

    ``members``: ``(layer, node kind, class index of each of the layer's output channels)``: producers
    (conv/linear/attention) and followers (norms, depthwise convs) whose channels are the group's.
    ``n`` classes, of which ``fixed`` (indices) may never be pruned. ``unit``: classes are pruned in
    aligned blocks of ``unit`` consecutive classes (an attention group: one block per head, ``unit`` =
    ``head_dim``; 1 otherwise). ``blocks``: per class, the producer it comes from (None: one block). A norm
    after a concatenation carries the channels of several producers, so their groups merge into one (its
    mask comes from one decision); the decision is still taken per block, ``floor(P_b * sparsity)`` of each
    block's ``P_b`` prunable classes, as if the producers were separate groups.
    """

    members: list[tuple[str, str, list[int]]]
    n: int
    fixed: list[int]
    unit: int = 1
    #: the graph's class id of each of the ``n`` classes (see :meth:`Graph.classes`)
    classes: list[int] = field(default_factory=list)
    blocks: list[int] | None = None

    @property
    def layers(self) -> list[str]:
        return [m[0] for m in self.members]

    def producers(self) -> list[tuple[str, str, list[int]]]:
        return [m for m in self.members if m[1] in PRODUCERS]


def channel_groups(graph: Graph) -> list[ChannelGroup]:
    """Coupled channel groups of every producer layer (conv / linear / attention / embedding), with
    the norms and depthwise convs that carry the same channels. Groups in graph order."""
    cls = graph.classes()
    fixed = graph.fixed_classes()
    # classes -> group via union of classes that share a producer (a layer's channels belong together)
    uf = _UnionFind(graph.n_slots)
    owners: list[tuple[Node, list[int]]] = []
    head_dim: dict[str, int] = {}
    for n in graph.nodes:
        if n.kind == "attention" and n.layer is not None:
            head_dim[n.layer] = int(n.attrs.get("head_dim", 1))
    for n in graph.nodes:
        if n.layer is None or n.kind not in PRODUCERS + ("norm", "depthwise"):
            continue
        b = graph.offset[n.name]
        cl = [cls[b + j] for j in range(n.channels)]
        owners.append((n, cl))
        if n.kind in PRODUCERS:
            for c in cl[1:]:
                uf.union(cl[0], c)
    # the producer (block) of each class, then one group per set of blocks a follower spans (a norm after a
    # concat): its channels must come from one decision
    block = {c: uf.find(c) for n, cl in owners if n.kind in PRODUCERS for c in cl}
    for n, cl in owners:
        if n.kind not in PRODUCERS:
            produced = [c for c in cl if c in block]
            for c in produced[1:]:
                uf.union(produced[0], c)
    groups: dict[int, tuple[list[tuple[str, str, list[int]]], dict[int, int]]] = {}
    order: list[int] = []
    for n, cl in owners:
        if not cl:
            continue
        produced = [c for c in cl if c in block]
        root = uf.find(produced[0] if produced else cl[0])
        if root not in groups:
            if n.kind not in PRODUCERS:
                continue  # a norm with no producer of its own (e.g. after the input)
            groups[root] = ([], {})
            order.append(root)
        members, index = groups[root]
        for c in cl:
            if c not in index:
                index[c] = len(index)
        members.append((n.layer, n.kind, [index[c] for c in cl]))  # type: ignore[arg-type]
    out = []
    for root in order:
        members, index = groups[root]
        fx = sorted(i for c, i in index.items() if c in fixed)
        unit = 1
        if any(kind == "attention" for _, kind, _ in members):
            # heads: only a group made of one attention layer's context channels, in order, is prunable
            layers = {layer for layer, _, _ in members}
            if len(layers) == 1 and all(kind == "attention" and _is_identity(ix, len(index)) for _, kind, ix in members):
                unit = head_dim[members[0][0]]
            else:
                fx = list(range(len(index)))
        ids = [0] * len(index)
        blocks = [0] * len(index)
        for c, i in index.items():
            ids[i] = c
            blocks[i] = block.get(c, -1)
        out.append(ChannelGroup(members=members, n=len(index), fixed=fx, unit=unit, classes=ids,
                                blocks=blocks if len(set(blocks)) > 1 else None))
    return out


def _is_identity(index: Sequence[int], n: int) -> bool:
    return len(index) == n and all(i == j for j, i in enumerate(index))


def class_scores(ops: Any, group: ChannelGroup, member_scores: dict[str, Any]) -> Any:
    """Group importance: per class, the sum of the scores of every member channel in that class.

    ``member_scores`` maps a member layer to a 1-d array of per-channel scores (members without scores
    add nothing). Stays on the device: a member whose channels are the classes in order is added as is,
    any other through a 0/1 scatter matrix."""
    total = None
    for layer, _kind, index in group.members:
        s = member_scores.get(layer)
        if s is None:
            continue
        if not _is_identity(index, group.n):
            rows = [[1.0 if index[j] == c else 0.0 for j in range(len(index))] for c in range(group.n)]
            s = ops.reshape(ops.matmul(ops.asarray(rows, like=s), ops.reshape(s, (-1, 1))), (-1,))
        total = s if total is None else total + s
    if total is None:
        raise ValueError(f"group of {group.layers} has no scored member")
    return total


def member_keep(ops: Any, keep: Any, group: ChannelGroup, layer: str) -> Any:
    """Per-channel keep-mask of member ``layer`` from the group's per-class keep-mask."""
    for name, _kind, index in group.members:
        if name == layer:
            if _is_identity(index, group.n):
                return keep
            cols = [[1.0 if index[j] == c else 0.0 for c in range(group.n)] for j in range(len(index))]
            k = ops.matmul(ops.asarray(cols, like=ops.cast(keep, "float32")), ops.reshape(ops.cast(keep, "float32"), (-1, 1)))
            return ops.greater(ops.reshape(k, (-1,)), 0.5)
    raise KeyError(layer)


def group_keep_classes(ops: Any, scores: Any, group: ChannelGroup, sparsity: float) -> Any:
    """Keep-mask over the group's classes: the ``floor(P * sparsity)`` lowest summed scores pruned among
    the ``P`` prunable (not fixed) classes, ties by class index. ``scores`` is a 1-d array of the
    group's summed class scores (see :func:`class_scores`); fixed classes are never pruned."""
    from .pruning import prune_count, smallest_k_mask

    n = group.n
    u = int(getattr(group, "unit", 1))
    if u > 1:
        return _block_keep(ops, scores, group, sparsity, u)
    blocks = getattr(group, "blocks", None)
    if blocks is not None:  # producers merged by a shared norm: one decision per producer, as if apart
        fixed = set(group.fixed)
        keep = None
        for b in sorted(set(blocks)):
            prunable = sum(1 for i in range(n) if blocks[i] == b and i not in fixed)
            k = prune_count(prunable, sparsity) if prunable >= 2 else 0
            if k == 0:
                continue
            off = ops.asarray([0.0 if blocks[i] == b and i not in fixed else float("inf") for i in range(n)], like=scores)
            kb = smallest_k_mask(ops, scores + off, k)
            keep = kb if keep is None else ops.logical_and(keep, kb)
        return ops.ones_like(scores, "bool") if keep is None else keep
    prunable = n - len(group.fixed)
    k = prune_count(prunable, sparsity) if prunable >= 2 else 0
    if group.fixed:
        big = ops.asarray([float("inf") if i in set(group.fixed) else 0.0 for i in range(n)], like=scores)
        scores = scores + big
    return smallest_k_mask(ops, scores, k)


def _block_keep(ops: Any, scores: Any, group: ChannelGroup, sparsity: float, u: int) -> Any:
    """:func:`group_keep_classes` in aligned blocks of ``u`` classes (attention heads): a block's score
    is the sum of its classes' scores; ``floor(B * sparsity)`` of the ``B`` prunable blocks go."""
    from .pruning import prune_count, smallest_k_mask

    n = group.n
    if n % u:
        raise ValueError(f"group of {group.layers}: {n} classes are not whole blocks of {u}")
    b = n // u
    fixed = {c // u for c in group.fixed}
    to_block = [[1.0 if c // u == k else 0.0 for c in range(n)] for k in range(b)]
    bs = ops.reshape(ops.matmul(ops.asarray(to_block, like=scores), ops.reshape(scores, (-1, 1))), (-1,))
    prunable = b - len(fixed)
    k = prune_count(prunable, sparsity) if prunable >= 2 else 0
    if fixed:
        bs = bs + ops.asarray([float("inf") if i in fixed else 0.0 for i in range(b)], like=bs)
    keep_b = ops.cast(smallest_k_mask(ops, bs, k), "float32")
    back = [[1.0 if c // u == k2 else 0.0 for k2 in range(b)] for c in range(n)]
    keep = ops.matmul(ops.asarray(back, like=keep_b), ops.reshape(keep_b, (-1, 1)))
    return ops.greater(ops.reshape(keep, (-1,)), 0.5)


# ---------------------------------------------------------------------------------- counting
def conv_macs(out_channels: int, in_channels: int, groups: int, kernel: int, positions: int) -> int:
    """Multiply-accumulates of a convolution: every output element reads ``in/groups * kernel`` inputs."""
    return int(out_channels) * int(positions) * (int(in_channels) // max(int(groups), 1)) * int(kernel)


def linear_macs(in_features: int, out_features: int, positions: int = 1) -> int:
    return int(in_features) * int(out_features) * int(positions)


def count_graph(graph: Graph) -> tuple[int, int, list[dict[str, Any]]]:
    """``(macs, params, per_layer)`` summed over the graph's nodes (as the backend counted them).

    FLOPs are counted as multiply-accumulates of conv, linear and attention matmuls; norms, activations,
    pooling and additions are not counted (NNI's convention). A layer used twice counts its MACs twice
    and its parameters once.
    """
    per_layer: dict[str, dict[str, Any]] = {}
    macs = 0
    for n in graph.nodes:
        macs += n.macs
        if n.layer is None:
            continue
        row = per_layer.setdefault(n.layer, {"name": n.layer, "type": n.op, "params": n.params, "macs": 0})
        row["macs"] += n.macs
    params = sum(r["params"] for r in per_layer.values())
    return macs, params, list(per_layer.values())


# ---------------------------------------------------------------------------------- reshapes
def classify_reshape(in_shape: Sequence[int], axis: int, out_shape: Sequence[int]) -> tuple[str, Any]:
    """How a reshape moves the channel axis ``axis`` of ``in_shape`` (batch included):

    - ``('identity', new_axis)``: the channel axis survives unsplit and unmerged (other axes may merge
      or split around it);
    - ``('flatten', (positions, order))``: the channel axis merges with the axes after it
      (``'channels_first'``) or before it, batch excluded (``'channels_last'``) into one axis;
    - ``('other', None)``: anything else (the channel axis is split, e.g. into attention heads).
    """
    ins, outs = list(map(int, in_shape)), list(map(int, out_shape))
    axis %= len(ins)
    c = ins[axis]
    before = 1
    for d in ins[:axis]:
        before *= d
    after = 1
    for d in ins[axis + 1:]:
        after *= d
    # find an output axis whose prefix product equals `before` and whose size is c
    prod = 1
    for k, d in enumerate(outs):
        if prod == before and d == c:
            return "identity", k
        if prod == before and d == c * after and after > 1:
            return "flatten", (after, "channels_first")
        prod *= d
    # channels-last flatten: batch stays, the spatial axes before the channel axis merge with it
    if axis == len(ins) - 1 and len(outs) >= 1 and ins and outs[0] == ins[0]:
        spatial = before // max(ins[0], 1)
        if len(outs) == 2 and outs[1] == spatial * c and spatial > 1:
            return "flatten", (spatial, "channels_last")
    return "other", None
