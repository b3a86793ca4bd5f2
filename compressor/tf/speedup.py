"""Speedup of pruned Keras models: a new, smaller plain Keras model without the pruned channels.

:func:`speedup_model` copies the model (the user's model and pruner are never modified), applies the
masks to the copy, translates it into the neutral channel graph (:func:`compressor.tf.graph.build_graph`)
and asks :func:`compressor.core.graph.speedup_plan` which channels go -- all channel reasoning (coupled
channels across adds, concats, depthwise convs, norms, flattens; the zero analysis that makes the result
exact) is core's. Only then is anything built: the model is cloned from its config with smaller
``filters`` / ``units`` / ``output_dim`` / ``target_shape``, and every layer gets its weights sliced.

The result is an ordinary Keras model (the user's layer classes and names, no compressor objects): it
saves as ``.keras``, reloads without compressor, converts to TFLite, and trains. Channels that are not
all zero stay: fine-grained (element-wise) masks are left in place as zero weights.

:func:`count_flops_params` counts multiply-accumulates (conv / dense MACs per sample, NNI's convention)
and parameters of a Functional or Sequential model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from ..core.errors import ConfigError, ModelError
from ..core.graph import count_graph, speedup_plan
from . import layout
from .compressor import Compressor, iter_layers
from .graph import build_graph, is_graph_model, walkable
from .graph_layers import to_numpy
from .pruning.export import zero_masked

__all__ = ["speedup_model", "count_flops_params", "SpeedupReport"]


# ---------------------------------------------------------------------------------- report
@dataclass
class SpeedupReport:
    """What :func:`speedup_model` did.

    ``rows``: one dict per layer whose channels, parameters or MACs changed: ``name`` (layer path),
    ``type``, ``out_before`` / ``out_after`` and ``in_before`` / ``in_after`` (channels of its first
    call), ``params_before`` / ``params_after``, ``macs_before`` / ``macs_after``. Totals: ``macs_before``,
    ``macs_after``, ``params_before``, ``params_after``; ``removed``: number of channel classes removed;
    ``notes``: the plan's notes (channels kept under ``strict=False``) and the fine-grained zeros left.
    ``str(report)`` is a table.
    """

    rows: list[dict[str, Any]]
    macs_before: int
    macs_after: int
    params_before: int
    params_after: int
    removed: int
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"{'layer':<40} {'type':<20} {'out':>11} {'in':>11} {'params':>21} {'MACs':>25}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(
                f"{r['name'][:40]:<40} {r['type'][:20]:<20} {r['out_before']:>5}->{r['out_after']:<5} "
                f"{r['in_before']:>5}->{r['in_after']:<5} {r['params_before']:>10}->{r['params_after']:<10} "
                f"{r['macs_before']:>12}->{r['macs_after']:<12}")
        lines.append(f"total: params {self.params_before} -> {self.params_after}, MACs {self.macs_before} -> "
                     f"{self.macs_after}, {self.removed} channel class(es) removed")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


# ---------------------------------------------------------------------------------- masks and copies
def _normalize_masks(masks: Any) -> dict[str, dict[str, np.ndarray]]:
    """``{path: {'weight': bool, 'bias': bool}}`` from a ``.npz`` path or a dict (nested like
    :func:`~compressor.tf.pruning.export.load_masks` gives, or flat like the ``.npz``: ``'path'`` and
    ``'path:bias'``)."""
    from .pruning.export import BIAS_SUFFIX, load_masks

    if isinstance(masks, (str, os.PathLike)):
        return load_masks(os.fspath(masks))
    if not isinstance(masks, dict):
        raise ConfigError(f"masks must be a dict or the path of a .npz mask file, got {type(masks).__name__}")
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, value in masks.items():
        if isinstance(value, dict):
            bad = set(value) - {"weight", "bias"}
            if bad:
                raise ConfigError(f"masks[{key!r}]: keys must be 'weight' / 'bias', got {sorted(bad)}")
            out.setdefault(key, {}).update({k: np.asarray(v).astype(bool) for k, v in value.items()})
        elif key.endswith(BIAS_SUFFIX):
            out.setdefault(key[: -len(BIAS_SUFFIX)], {})["bias"] = np.asarray(value).astype(bool)
        else:
            out.setdefault(key, {})["weight"] = np.asarray(value).astype(bool)
    return out


def _pruner_masks(pruner: Any) -> dict[str, dict[str, np.ndarray]]:
    pruner._refresh_ready()
    out: dict[str, dict[str, np.ndarray]] = {}
    for w in pruner.get_modules_wrapper():
        if not w.ready:
            continue
        out[w.name] = {"weight": np.asarray(w.weight_mask.numpy(), bool)}
        if w.bias_mask is not None:
            out[w.name]["bias"] = np.asarray(w.bias_mask.numpy(), bool)
    return out


def _input_tensors(model: Any) -> Any:
    """Fresh inputs with the model's input layer names (so signatures keep their names)."""
    return keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t._keras_history.operation.name),
        model.input)


def _clone(model: Any, clone_function: Any = None, input_tensors: Any = None) -> Any:
    """``clone_model``; with a ``clone_function`` (which must handle nested models) not recursive."""
    kwargs: dict[str, Any] = {"recursive": clone_function is None}
    if clone_function is not None:
        kwargs["clone_function"] = clone_function
    if input_tensors is not None:
        kwargs["input_tensors"] = input_tensors
    elif not isinstance(model, keras.Sequential):
        kwargs["input_tensors"] = _input_tensors(model)
    return keras.models.clone_model(model, **kwargs)


def _own_variables(layer: Any) -> list[Any]:
    return list(getattr(layer, "_trainable_variables", [])) + list(getattr(layer, "_non_trainable_variables", []))


def _has_children(layer: Any) -> bool:
    return bool(list(layer._flatten_layers(include_self=False, recursive=False)))


def _set_weights(new_model: Any, weights_of: Any) -> None:
    """Give every layer of ``new_model`` the weights ``weights_of(path)`` returns (leaf layers), or its own
    variables copied (containers with variables of their own)."""
    for path, layer in iter_layers(new_model):
        if not _has_children(layer):
            if layer.weights:
                layer.set_weights(weights_of(path, None))
            continue
        own = _own_variables(layer)
        if own:
            for var, value in zip(own, weights_of(path, "own")):
                var.assign(value)


def _copy(model: Any, masks: dict[str, dict[str, np.ndarray]]) -> Any:
    """A plain copy of ``model`` (same config and weights) with ``masks`` applied; the model is untouched."""
    old = dict(iter_layers(model))
    copy = _clone(model)

    def weights_of(path: str, what: Any) -> list[Any]:
        src = old[path]
        if what == "own":
            return [v.numpy() for v in _own_variables(src)]
        return src.get_weights()

    _set_weights(copy, weights_of)
    zero_masked(copy, masks)
    return copy


# ---------------------------------------------------------------------------------- slicing, per layer type
_CONV = ("Conv1D", "Conv2D", "Conv3D", "Convolution1D", "Convolution2D", "Convolution3D")


def _idx(keep: Any, n: int) -> Any:
    return np.arange(n) if keep is None else np.asarray(keep, dtype=np.int64)


def _slice_kernel_bias(layer: Any, entry: dict[str, Any], out_key: str) -> tuple[dict[str, Any], list[Any]]:
    """Conv / Dense / linear EinsumDense: kernel ``[..., in, out]``, bias ``[out]``."""
    ws = layer.get_weights()
    kernel = next(w for w in ws if w.ndim >= 2)
    i = _idx(entry.get("in"), kernel.shape[-2])
    o = _idx(entry.get("out"), kernel.shape[-1])
    new = []
    for w in ws:
        new.append(np.take(np.take(w, i, axis=-2), o, axis=-1) if w.ndim >= 2 else w[o])
    if out_key == "output_shape":
        shape = layer.get_config()["output_shape"]
        shape = [len(o)] if isinstance(shape, int) else [*list(shape)[:-1], len(o)]
        return {"output_shape": shape if len(shape) > 1 else shape[0]}, new
    return {out_key: len(o)}, new


def _slice_conv(layer: Any, entry: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    groups = int(getattr(layer, "groups", 1) or 1)
    if groups > 1:  # depthwise written as Conv(groups=C): kernel [k..., 1, C * m], one group per input channel
        ws = layer.get_weights()
        o = _idx(entry.get("out"), int(layer.filters))
        i = _idx(entry.get("in"), groups)
        return {"filters": len(o), "groups": len(i)}, [np.take(w, o, axis=-1) if w.ndim >= 2 else w[o] for w in ws]
    return _slice_kernel_bias(layer, entry, "filters")


def _slice_dense(layer: Any, entry: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    return _slice_kernel_bias(layer, entry, "units")


def _slice_einsum(layer: Any, entry: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    return _slice_kernel_bias(layer, entry, "output_shape")


def _slice_depthwise(layer: Any, entry: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """Depthwise kernel ``[k..., in, mult]`` sliced on ``in``; bias ``[in * mult]`` by the kept outputs."""
    ws = layer.get_weights()
    kernel = next(w for w in ws if w.ndim >= 2)
    i = _idx(entry.get("in"), kernel.shape[-2])
    o = _idx(entry.get("out"), kernel.shape[-2] * kernel.shape[-1])
    return {}, [np.take(w, i, axis=-2) if w.ndim >= 2 else w[o] for w in ws]


def _slice_separable(layer: Any, entry: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """SeparableConv: depthwise kernel ``[k..., in, m]`` sliced on ``in``; pointwise kernel ``[1.., in * m, out]``
    on the rows of the kept inputs (``c * m + j``) and on ``out``; bias ``[out]``."""
    dw, pw, *bias = layer.get_weights()
    m = dw.shape[-1]
    i = _idx(entry.get("in"), dw.shape[-2])
    o = _idx(entry.get("out"), pw.shape[-1])
    rows = (i[:, None] * m + np.arange(m)[None, :]).reshape(-1)
    return {"filters": len(o)}, [np.take(dw, i, axis=-2), np.take(np.take(pw, rows, axis=-2), o, axis=-1),
                                 *[b[o] for b in bias]]


def _slice_vectors(layer: Any, entry: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """BatchNormalization: gamma, beta, moving mean and variance, all per output channel."""
    return {}, [w[_idx(entry.get("out"), w.shape[0])] for w in layer.get_weights()]


def _slice_embedding(layer: Any, entry: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    (emb, *rest) = layer.get_weights()
    o = _idx(entry.get("out"), emb.shape[-1])
    return {"output_dim": len(o)}, [emb[:, o], *rest]


def _slice_reshape(layer: Any, entry: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    target = list(layer.get_config()["target_shape"])
    if entry.get("out") is not None and target[-1] != -1:
        target[-1] = len(entry["out"])
    return {"target_shape": tuple(target)}, layer.get_weights()


def _slice_mha(layer: Any, entry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """MultiHeadAttention: kept heads (``entry['heads']``, from the context channels kept) on the heads
    axis of the query / key / value kernels ``[in, heads, dim]`` and biases ``[heads, dim]`` and of the
    output kernel ``[heads, dim, out]``; kept input features (``entry['in']``) on the input axis of the
    query / key / value kernels. Returns the config changes and the weights of each sub-layer (by name)."""
    h = int(layer._num_heads)
    heads = entry.get("heads")
    hk = _idx(heads, h)
    subs: dict[str, list[Any]] = {}
    for sub in (layer._query_dense, layer._key_dense, layer._value_dense):
        kernel, *bias = sub.get_weights()
        kernel = np.take(kernel, hk, axis=1)
        if entry.get("in") is not None:
            kernel = np.take(kernel, _idx(entry["in"], kernel.shape[0]), axis=0)
        subs[sub.name] = [kernel, *[np.take(b, hk, axis=0) for b in bias]]
    out = layer._output_dense
    kernel, *bias = out.get_weights()
    subs[out.name] = [np.take(kernel, hk, axis=0), *bias]
    cfg: dict[str, Any] = {"num_heads": len(hk)}
    if layer.get_config().get("output_shape") is None:
        cfg["output_shape"] = int(kernel.shape[-1])  # the output width no longer follows the query's
    return cfg, subs


#: class name -> slicer(layer, {'out': kept, 'in': kept}) -> (config changes, new weights)
SLICERS = {
    **{c: _slice_conv for c in _CONV},
    "Dense": _slice_dense,
    "EinsumDense": _slice_einsum,
    "DepthwiseConv1D": _slice_depthwise,
    "DepthwiseConv2D": _slice_depthwise,
    "SeparableConv1D": _slice_separable,
    "SeparableConv2D": _slice_separable,
    "BatchNormalization": _slice_vectors,
    "Embedding": _slice_embedding,
    "Reshape": _slice_reshape,
}


# ---------------------------------------------------------------------------------- public API
def _is_pruner(obj: Any) -> bool:
    """A :class:`~compressor.tf.TfPruner` (told by the base class's ``_kind``: speedup sits above the pruners
    and must not import them)."""
    return isinstance(obj, Compressor) and getattr(obj, "_kind", None) == "pruner"


def _resolve(model_or_pruner: Any, masks: Any) -> tuple[Any, dict[str, dict[str, np.ndarray]]]:
    if _is_pruner(model_or_pruner):
        if masks is not None:
            raise ConfigError("speedup_model: pass either a pruner (its masks are used) or a model and masks")
        return model_or_pruner.model, _pruner_masks(model_or_pruner)
    if not isinstance(model_or_pruner, keras.layers.Layer):
        raise ModelError(f"speedup_model expects a Keras model or a TfPruner, got {type(model_or_pruner).__name__}")
    return model_or_pruner, ({} if masks is None else _normalize_masks(masks))


def count_flops_params(model: Any) -> tuple[int, int, list[dict[str, Any]]]:
    """``(macs, params, per_layer)`` of a Functional or Sequential Keras model (or a pruner's model).

    MACs are the multiply-accumulates of one sample through conv, depthwise, dense and einsum layers,
    recurrent layers (SimpleRNN / GRU / LSTM: ``T * gates * (d * u + u * u)``, gates 1 / 3 / 4, see
    :func:`compressor.tf.graph.rnn_macs`) and MultiHeadAttention (its four projections plus ``Q @ K^T``
    and ``attention @ V``: ``h * Tq * Tk * (dk + dv)``, see :func:`compressor.tf.graph.mha_macs`); norms,
    activations, softmax, pooling, additions are not counted; params are the weights of every layer in
    the graph once, BatchNorm moving statistics excluded (as torch, where they are buffers). ``per_layer``: ``{'name', 'type', 'params', 'macs'}`` per layer path.
    Spatial sizes unknown at build time count as 1.
    """
    if _is_pruner(model):
        model = model.model
    graph, _ = build_graph(model)
    return count_graph(graph)


def speedup_model(model_or_pruner: Any, masks: Any = None, strict: bool = True,
                  return_report: bool = False) -> Any:
    """A NEW plain Keras model without the pruned channels; the input model (and pruner) is untouched.

    ``model_or_pruner``: a :class:`~compressor.tf.TfPruner` (its model with its current masks applied),
    or a Functional / Sequential Keras model whose pruned weights are zero, optionally with ``masks``
    to apply first: a dict (``{layer path: {'weight': mask, 'bias': mask}}`` or the flat
    ``{'path': mask, 'path:bias': mask}``) or the ``.npz`` path written by ``pruner.export_masks`` /
    ``export_model(mask_path=...)``.

    A channel goes only when removing it cannot change any output (it is zero wherever a layer mixes
    channels; coupled channels go together). ``strict``: when pruned channels cannot be removed because
    an op keeps them (a model output, an unsupported layer, a grouped conv), raise
    :class:`~compressor.core.errors.ModelError` naming it; with ``strict=False`` keep them (listed in the
    report's notes). Subclassed models raise ModelError (rebuild them with the Functional API).

    Returns the model, or ``(model, SpeedupReport)`` with ``return_report=True``.
    """
    for flag, value in (("strict", strict), ("return_report", return_report)):
        if not isinstance(value, bool):
            raise ConfigError(f"speedup_model: {flag} must be True or False, got {value!r}")
    model, mask_dict = _resolve(model_or_pruner, masks)
    walkable(model)  # subclassed models fail here, before anything is copied
    if not is_graph_model(model):  # pragma: no cover - walkable raised
        raise ModelError(f"{type(model).__name__} is not a Functional or Sequential model")
    src = _copy(model, mask_dict)
    graph, layers = build_graph(src)
    plan = speedup_plan(graph, strict=strict)
    # everything is decided: now slice and build
    changes: dict[str, dict[str, Any]] = {}
    weights: dict[str, list[Any]] = {}
    for path, entry in plan.layer_keep().items():
        layer = layers[path]
        cls = type(layer).__name__
        if isinstance(layer, keras.layers.MultiHeadAttention) and "heads" in entry:
            changes[path], subs = _slice_mha(layer, entry)
            weights.update({f"{path}/{sub}": w for sub, w in subs.items()})
            continue
        slicer = SLICERS.get(cls)
        if slicer is None:
            if layer.weights:
                raise ModelError(f"speedup: channels of {cls} layer {path!r} change but compressor cannot slice "
                                 f"its weights")  # core keeps 'other' layers fixed, so this is a backend gap
            continue
        changes[path], weights[path] = slicer(layer, entry)
    src_paths = {id(layer): path for path, layer in iter_layers(src)}
    src_layers = dict(iter_layers(src))

    nested_inputs = getattr(graph, "nested_inputs", {})

    def channels(node: str) -> int:
        kept = plan.keep.get(node)
        return len(kept) if kept is not None else graph.by_name[node].channels

    def clone_function(layer: Any) -> Any:
        if is_graph_model(layer):  # nested model: rebuilt on inputs of its new shapes
            inner = walkable(layer)
            feeders = nested_inputs.get(id(layer))
            if feeders is None:
                return _clone(layer, clone_function)
            tensors = [keras.Input(batch_shape=(*t.shape[:-1], channels(f)), dtype=t.dtype,
                                   name=t._keras_history.operation.name) for t, f in zip(inner.inputs, feeders)]
            if isinstance(layer, keras.Sequential):
                return _clone(layer, clone_function, tensors[0])
            return _clone(layer, clone_function, keras.tree.pack_sequence_as(layer.input, tensors))
        cfg = layer.get_config()
        cfg.update(changes.get(src_paths.get(id(layer)), {}))
        return layer.__class__.from_config(cfg)

    new = _clone(src, clone_function)

    def weights_of(path: str, what: Any) -> list[Any]:
        if what == "own":
            return [v.numpy() for v in _own_variables(src_layers[path])]
        return weights[path] if path in weights else src_layers[path].get_weights()

    _set_weights(new, weights_of)
    if return_report:
        return new, _report(graph, new, plan, mask_dict)
    return new


def _report(graph: Any, new: Any, plan: Any, masks: dict[str, Any]) -> SpeedupReport:
    macs0, params0, rows0 = count_graph(graph)
    g1, new_layers = build_graph(new)
    macs1, params1, rows1 = count_graph(g1)
    after = {r["name"]: r for r in rows1}

    def chans(g: Any) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for n in g.nodes:
            if n.layer is not None and n.layer not in out:
                out[n.layer] = (n.channels, g.by_name[n.inputs[0]].channels if n.inputs else 0)
        return out

    c0, c1 = chans(graph), chans(g1)
    rows = []
    for r in rows0:
        name = r["name"]
        a = after.get(name, r)
        row = {"name": name, "type": r["type"], "out_before": c0[name][0], "out_after": c1.get(name, c0[name])[0],
               "in_before": c0[name][1], "in_after": c1.get(name, c0[name])[1], "params_before": r["params"],
               "params_after": a["params"], "macs_before": r["macs"], "macs_after": a["macs"]}
        if (row["out_before"], row["in_before"], row["params_before"], row["macs_before"]) != (
                row["out_after"], row["in_after"], row["params_after"], row["macs_after"]):
            rows.append(row)
    notes = list(plan.notes)
    zeros, where = 0, []
    for name in masks:
        layer = new_layers.get(name)
        w = layout.weight_of(layer) if layer is not None else None
        if w is None:
            continue
        z = int(np.sum(to_numpy(w) == 0))
        if z:
            zeros += z
            where.append(name)
    if zeros:
        notes.append(f"fine-grained masks left in place: {zeros} zero weight(s) remain in {len(where)} layer(s) "
                     f"({', '.join(where[:8])}{', ...' if len(where) > 8 else ''}); speedup removes whole channels")
    return SpeedupReport(rows=rows, macs_before=macs0, macs_after=macs1, params_before=params0,
                         params_after=params1, removed=plan.removed, notes=notes)
