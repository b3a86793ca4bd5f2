"""AWQ as a one-shot method: the scales' grid search per layer or per group of layers that read one input, scored
on the output of the group's parent module (or the block), then the clipping search and round to nearest; the
block search drives the backend (candidate weights, recorded parent calls) and keeps its copies on disk."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ModelError
from .arrays import row_chunks
from .awq import (
    AWQ_N_GRID,
    AwqSearch,
    awq_clip_search,
    awq_effective,
    awq_quantize,
    awq_search,
    awq_weight_mean,
)
from .codes import QuantSpec
from .config import AWQ_CLIP_SKIP, AWQ_SEARCH_SAMPLES
from .experts import fallback_due
from .memory import Undo, _compact, _Spill, release_freed_heap
from .method import OneShotMethod
from .protocol import LayerResult, LayerTask, OneShotBackend
from .statistics import GramAccumulator
from .steps import _check_seen, commit_layer, compress_layers, compute_layer


def search_subset(inputs: list[Any], samples: int | None) -> list[Any]:
    """``samples`` entries of ``inputs`` spread evenly over it (first and last included), in order; all of them
    when ``samples`` is None or not smaller than ``len(inputs)``."""
    n = len(inputs)
    if samples is None or samples >= n:
        return list(inputs)
    if samples == 1:
        return [inputs[0]]
    idx = sorted({int(round(i * (n - 1) / (samples - 1))) for i in range(samples)})
    return [inputs[i] for i in idx]


def search_inputs(backend: Any, inputs: list[Any], samples: int | None) -> list[Any]:
    """The block inputs AWQ's grid is scored on: ``samples`` calibration SEQUENCES spread evenly over the whole
    set (:func:`search_subset` of the sequence indices across all batches), taken out of their batches with the
    backend's ``take_rows(input, rows)`` (``batch_rows(input)``: the sequences of one input); a backend that cannot
    split a batch (``batch_rows`` None) gets whole batches (:func:`search_subset` of the batches). The same sequences on every backend."""
    if samples is None:
        return list(inputs)
    counts = [backend.batch_rows(i) for i in inputs]
    coll = backend.collective
    if any(c is None for c in counts):
        if coll.world > 1:
            raise ModelError("AWQ over several processes needs a backend that can split a batch into sequences")
        return search_subset(inputs, samples)
    # over several processes: the sequences picked from ALL of them (the same as one process picks), each
    # process scoring its own
    first, total = coll.sequence_range(sum(counts))
    if samples >= total:
        return list(inputs)
    picks = [p - first for p in search_subset(list(range(total)), samples)]
    out, start = [], 0
    for inp, n in zip(inputs, counts):
        local = [p - start for p in picks if start <= p < start + n]
        if local:
            out.append(inp if len(local) == n else backend.take_rows(inp, local))
        start += n
    return out


class AwqMethod(OneShotMethod):
    """AWQ (Lin et al. 2023): per-input-channel scales ``s = mean|X|^alpha`` (duo scaling: divided by the
    weights' normalised magnitude ``^(1 - alpha)``), ``alpha`` from a grid in ``[0, 1]`` with the identity (plain RTN)
    as one candidate (:func:`~compressor.core.oneshot.awq_candidates`, llmcompressor 0.14's grid), then round to nearest
    of ``W s``; the layer keeps ``Q(W s) / s`` (it computes what the reference computes after folding ``1 / s``
    into whatever produces its input, and needs no folding).

    ``awq_search: 'block'`` (default, as AutoAWQ / llmcompressor): the layers of a block that read the very same
    input (q / k / v, gate / up; found by the backend) form one group with ONE ``s`` from their shared input
    statistics (``w_mean`` over their stacked weights); its ``alpha`` minimises the mean squared error of the
    output of the group's PARENT, the smallest module of the block that holds its layers (self_attn for
    q / k / v, mlp for gate / up, as AutoAWQ / llmcompressor), vs the parent before quantization: the parent's
    inputs are recorded in one run of the float block, its float output computed once, then ONE parent run per
    grid point (the backend's ``awq_parent`` / ``record_calls`` / ``module_output``). Where the parent is the
    block itself (or the backend cannot run a sub-module), the block's output is the loss (groups in execution
    order, the ones before already quantized). A layer alone in its group (o_proj, down_proj) is searched on its own
    output error ``tr(D H D^T)``, ``D = W - Q(W s) / s`` (exactly ``||X W^T - X W'^T||^2`` from the Gram
    matrix: the reference's loss for a group whose parent module is the layer itself).
    ``awq_search: 'layer'``: every layer alone, on its own output error.

    Then, with ``apply_clip`` (default True, as AutoAWQ; llmcompressor 0.14 has no clipping), each layer's
    scaled weight ``W s`` gets a clipping range per output row and group (:func:`~compressor.core.oneshot.awq_clip_search`:
    the ratio of the group's largest magnitude, 1.0 down to 0.55, that minimises the group's output error on the
    Gram matrix of ``X / s``), except the attention query / key projections (:meth:`clips`); the report's
    ``clipped`` is the share of groups whose range was cut."""

    name = "awq"
    kind = "quantizer"

    @staticmethod
    def block_search(task: LayerTask) -> bool:
        return task.config.get("awq_search", "block") == "block"

    def compress_block(self, backend: OneShotBackend, block: Any, inputs: list[Any], tasks: list[LayerTask],
                       accs: dict[str, GramAccumulator], rows: list[dict[str, Any]], name: str, undo: Undo) -> None:
        if any(self.block_search(t) for t in tasks):
            _awq_block(backend, self, block, inputs, tasks, accs, rows, name, undo)
        else:
            compress_layers(backend, self, tasks, accs, rows, name, undo)

    def compress(self, task, weight, mask, stats):
        c = task.config
        spec = task.quant_spec("AwqQuantizer")
        w = weight if mask is None else np.where(mask, weight, 0.0)
        h = stats.gram
        duo = c.get("duo_scaling", True)
        w_mean = awq_weight_mean(w, spec.group_size) if duo is not False else None

        def loss(s: np.ndarray) -> float:
            d = w - awq_effective(w, s, spec)
            return float(np.sum((d @ h) * d))

        found = awq_search(stats.abs_mean(), loss, c.get("n_grid", AWQ_N_GRID), w_mean, duo)
        return self.result(task, w, mask, found.scales, spec, self.info(found), h)

    @staticmethod
    def info(found: AwqSearch) -> dict[str, Any]:
        """The report's numbers for one search: the chosen ``alpha``, whether duo-scaled, its loss."""
        return {"alpha": found.alpha, "duo": found.duo, "error": min(v for *_, v in found.losses)}

    @staticmethod
    def clips(task: LayerTask) -> bool:
        """Whether ``task``'s weights get AWQ's clipping search: ``apply_clip`` (default True), except for the
        attention query / key projections, whose error the per-group output error does not measure (their
        outputs go through the softmax): AutoAWQ leaves them unclipped by name, and so does this rule, on the
        layer's last name component (``q_proj``, ``k_proj``, ``query``, ``key``, a fused ``qkv`` / ``c_attn`` /
        ``query_key_value``)."""
        if not task.config.get("apply_clip", True):
            return False
        leaf = task.name.replace("/", ".").rsplit(".", 1)[-1].lower()
        return not (leaf.startswith(("q_", "k_")) or leaf in AWQ_CLIP_SKIP or "qkv" in leaf)

    def result(self, task: LayerTask, w: np.ndarray, mask: np.ndarray | None, scales: np.ndarray,
               spec: QuantSpec, info: dict[str, Any], gram: np.ndarray) -> LayerResult:
        clip = awq_clip_search(w, gram, scales, spec) if self.clips(task) else None
        a = awq_quantize(w, scales, spec, clip, keep_dequantized=False)
        eff = a.effective
        if mask is not None:
            np.copyto(eff, 0.0, where=~mask)
        if clip is not None:  # share of groups whose range was cut
            starts = np.arange(0, w.shape[1], a.quantized.group_size)
            cut = sum(int(np.count_nonzero(clip[r] < np.maximum.reduceat(np.abs(w[r] * scales[None, :]), starts,
                                                                          axis=1)))
                      for r in row_chunks(*w.shape))
            info = {**info, "clipped": cut / clip.size}
        return LayerResult(weight=eff, mask=mask, quantized=a.quantized, scales=a.scales, info=info)

    def search_group(self, tasks: list[LayerTask], weights: list[tuple[np.ndarray, np.ndarray | None]],
                     stats: GramAccumulator, block_loss: Callable[[Mapping[str, np.ndarray]], float]
                     ) -> Iterator[LayerResult]:
        """One ``alpha`` for ``tasks`` (layers that read one input, statistics ``stats``): ``block_loss({layer:
        candidate effective weight})`` is the block's output error with those weights. Returns one result per
        task (the group's ``alpha`` and loss in ``info``), computed as the iterator is consumed."""
        c = tasks[0].config
        specs = [t.quant_spec("AwqQuantizer") for t in tasks]
        ws = [w if m is None else np.where(m, w, 0.0) for w, m in weights]
        duo = c.get("duo_scaling", True)
        w_mean = (awq_weight_mean(ws, specs[0].group_size)
                  if duo is not False else None)

        def candidate(i: int, s: np.ndarray) -> np.ndarray:
            eff = awq_effective(ws[i], s, specs[i])
            m = weights[i][1]
            return eff if m is None else np.where(m, eff, 0.0)

        def loss(s: np.ndarray) -> float:
            # each layer's candidate weight is computed when block_loss reads it, and not kept: one at a time
            return block_loss(_Lazy({t.name: (lambda i=i: candidate(i, s)) for i, t in enumerate(tasks)}))

        found = awq_search(stats.abs_mean(), loss, c.get("n_grid", AWQ_N_GRID), w_mean, duo)
        info = {**self.info(found), "group": tasks[0].name}
        # one at a time, as they are written (a group's results side by side: several weight-sized arrays each)
        return (self.result(t, w, m, found.scales, spec, dict(info), stats.gram)
                for t, w, (_, m), spec in zip(tasks, ws, weights, specs))


class _Lazy(Mapping):
    """A read-only mapping whose values are computed by their zero-argument functions on every read, not stored."""

    def __init__(self, makers: dict[str, Callable[[], Any]]):
        self._makers = makers

    def __getitem__(self, key: str) -> Any:
        return self._makers[key]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


def _output_error(outs: Iterable[Any], ref: Sequence[np.ndarray], coll: Any = None) -> float:
    """Mean squared difference of a block's (or module's) outputs from the reference ones, accumulated in float64
    over chunks of rows (no float64 copy of a whole output: the outputs may be float32). ``outs`` may be a
    generator (the backends' ``module_output`` / ``block_output`` are): one output alive at a time."""
    total, n = 0.0, 0
    for o, r in zip(outs, ref):
        o = np.asarray(o)
        r = np.asarray(r)
        if o.shape != r.shape:
            raise ModelError(f"AWQ: an output of shape {o.shape} differs from its reference's {r.shape} (the "
                             f"module must compute the same shapes on every run)")
        last = o.shape[-1] if o.ndim else 1
        o2, r2 = o.reshape(-1, last), r.reshape(-1, last)
        step = max(1, (1 << 16) // max(last, 1))
        for i in range(0, o2.shape[0], step):
            d = o2[i:i + step].astype(np.float64) - r2[i:i + step]
            total += float(np.einsum("ij,ij->", d, d))
        n += o.size
    if coll is not None and coll.world > 1:  # every process's outputs: the error over all the sequences
        total, n = coll.sum_values([total, n])
    return total / max(n, 1)


def _awq_parent_modules(backend: OneShotBackend, block: Any, groups: list[list[LayerTask]]) -> list[Any]:
    """Per group: the smallest module of the block that holds the group's layers (self_attn for q / k / v, mlp for
    gate / up): AWQ's loss is that module's output, as AutoAWQ / llmcompressor take it. ``None``: the block
    itself (no such module, or a backend that cannot run a sub-module: the default ``awq_parent``)."""
    return [backend.awq_parent(block, g) for g in groups]


def _record_float(backend: OneShotBackend, block: Any, inputs: list[Any], module: Any,
                  done: list[tuple[LayerTask, Any, Any]], spill: _Spill) -> Any:
    """``module``'s recorded calls in one run of the FLOAT block (the layers of the block already compressed,
    ``done``: ``(task, float weight, compressed weight)``, both as ``spill`` keeps them: they are read back one
    layer at a time, run with their float weights for it and get their compressed ones back): each parent is
    recorded just before its group is searched, so one parent's inputs are in memory at a time, and they are
    what recording all parents in one float run gives."""
    for t, w_float, _ in done:
        backend.set_weight(t, spill.get(w_float))
    try:
        calls = backend.record_calls(block, inputs, [module])[0]
    finally:
        for t, _, w_done in done:
            backend.set_weight(t, spill.get(w_done))
    release_freed_heap()  # the recording run's (and a backend's merging of the calls) transient buffers
    if not calls and inputs:
        raise ModelError(f"AWQ: module {getattr(module, 'name', type(module).__name__)!r}, which holds layers of "
                         f"block {block!r}, was not called when the block ran on the calibration inputs")
    return calls


def _awq_block(backend: OneShotBackend, method: AwqMethod, block: Any, inputs: list[Any], tasks: list[LayerTask],
               accs: dict[str, GramAccumulator], rows: list[dict[str, Any]], name: str, undo: Undo) -> None:
    """AWQ with ``awq_search: 'block'``: the layers sharing an accumulator (one input) are one group, searched
    on the output of the smallest module that holds them (see :class:`AwqMethod`); a layer alone is searched on
    its own output error."""
    groups: dict[int, list[LayerTask]] = {}
    for t in tasks:
        # an expert too few tokens reached is compressed alone (its fallback), not searched in a group
        groups.setdefault(id(accs[t.name]) if method.block_search(t) and not fallback_due(t, accs[t.name]) else id(t),
                          []).append(t)
    multi = [g for g in groups.values() if len(g) > 1]
    if not multi:
        compress_layers(backend, method, tasks, accs, rows, name, undo)
        return
    set_weight = backend.set_weight
    # the grid is scored on a subset of the calibration batches (``search_samples``); statistics use all
    inputs = search_inputs(backend, inputs, tasks[0].config.get("search_samples", AWQ_SEARCH_SAMPLES))
    parents = dict(zip(map(id, multi), _awq_parent_modules(backend, block, multi)))
    run = backend.block_output
    block_ref: list[Any] = []
    # a layer's float and compressed copies are kept only where a later group records its parent on the float block
    order = list(groups.values())
    records = [len(g) > 1 and parents[id(g)] is not None for g in order]  # records its parent on the float block
    keep = {t.name for i, g in enumerate(order) for t in g if any(records[i + 1:])}
    # a layer searched alone (o / down projection) reads only its own float weight, which nothing changes before its
    # turn, and its statistics from the observing pass: its result is computed now and written at its turn (the
    # same result, the same order), so its Gram matrix (the down projection's: 18 MiB at width 1536, against 6 MiB
    # for the result) is gone before the parent searches record their inputs
    early: dict[str, LayerResult] = {}
    for g in order:
        if len(g) == 1:
            early[g[0].name] = compute_layer(backend, method, g[0], accs.get(g[0].name))
            accs.pop(g[0].name, None)
            release_freed_heap()
    # the copies go to a temporary file (read back one layer at a time by _record_float), not the heap
    spill = _Spill()
    floats = {t.name: spill.put(_compact(backend.read_weight(t)[0])) for t in tasks if t.name in keep}
    done: list[tuple[LayerTask, Any, Any]] = []  # compressed so far: (task, float, compressed), spilled

    def compressed(ts: list[LayerTask]) -> None:
        done.extend((t, floats.pop(t.name), spill.put(_compact(backend.read_weight(t)[0])))
                    for t in ts if t.name in keep)

    try:
        for gi, group in enumerate(order):
            if len(group) == 1:
                commit_layer(backend, method, group[0], early.pop(group[0].name), rows, name, undo)
                compressed(group)
                release_freed_heap()
                continue
            stats = accs[group[0].name]
            _check_seen(method, group[0], stats)
            weights = []
            for t in group:
                w, m = backend.read_weight(t)
                weights.append((_compact(w), m))  # float32 where exact: the search reads it a chunk of rows at a time
                undo.before(t)
            parent = parents[id(group)]
            if parent is None:  # the whole block's output vs the block before quantization
                if not block_ref:
                    block_ref.append(list(run(block, inputs)))

                def forward(run: Any = run) -> Iterable[Any]:
                    return run(block, inputs)
                ref = block_ref[0]
            else:  # the parent module's output on its recorded (float-block) inputs: one module run per alpha
                module, calls = parent, _record_float(backend, block, inputs, parent, done, spill)
                if not any(records[gi + 1:]):
                    done.clear()  # no later group records on the float block: the copies are not read again

                def forward(module: Any = module, calls: Any = calls) -> Iterable[Any]:
                    return backend.module_output(module, calls)
                ref = list(forward())
            release_freed_heap()  # the module runs' transients, interleaved with the kept references

            def block_loss(cand: Mapping[str, np.ndarray], group: list[LayerTask] = group, forward: Any = forward,
                           ref: Any = ref) -> float:
                for t in group:
                    set_weight(t, cand[t.name])
                err = _output_error(forward(), ref, backend.collective)
                release_freed_heap()
                return err

            results = method.search_group(group, weights, stats, block_loss)
            del ref, forward, block_loss
            if parent is not None:
                del calls
            for t, r in zip(group, results):
                commit_layer(backend, method, t, r, rows, name, undo)  # (its undo copy was taken above)
                del r  # before the next result is computed
            for t in group:  # the group's statistics are not read again
                accs.pop(t.name, None)
            del stats, results
            compressed(group)
            release_freed_heap()
    finally:
        spill.close()

