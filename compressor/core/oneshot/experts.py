"""Mixture-of-experts layers in a one-shot run.

A routed expert's layers are observed like any other layer: the backend's hooks see the tokens the router sent to
the expert and nothing else, so each expert gets its own GPTQ / SparseGPT Hessian and its own Wanda / AWQ channel
statistics. What is special is an expert that the calibration set hardly reaches: a backend marks the layers of
routed experts (:func:`mark_routed`, from its block finder), and a marked layer whose statistics hold fewer than
:data:`MIN_EXPERT_TOKENS` tokens is compressed without them (:func:`expert_fallback`):

* quantizers (GPTQ, AWQ): round to nearest on the layer's grid (AWQ with the identity scales, its own candidate
  ``alpha = 0`` without duo scaling), a pruner's zeros kept;
* pruners (Wanda, SparseGPT): magnitude pruning on the layer's pattern (Wanda's ranking with equal channel
  norms: the same per-row counts and N:M groups).

The layer's report row says so (``fallback``: 'rtn' / 'magnitude', ``tokens``: what it saw, ``expert``), and once
the run's last block is written, ONE warning lists the experts that fell back with their token counts
(:func:`warn_fallbacks`). An unmarked layer that saw nothing is still an error (it is probably not used by the
model's forward on this data)."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..matching import expand_op_types, type_names
from .protocol import LayerResult, LayerTask
from .quantize import rtn_quantize
from .sparse import wanda_mask

__all__ = ["MIN_EXPERT_TOKENS", "mark_routed", "routed_expert", "fallback_due", "expert_fallback", "warn_fallbacks",
           "ExpertSlice", "slice_config", "slice_tasks", "bank_results", "compressed_banks", "slice_mask",
           "record_slice", "snapshot_slice", "restore_slice", "slice_observers"]

#: a routed expert's layer that saw fewer calibration tokens than this is compressed without statistics
#: (:func:`expert_fallback`). 1: only an expert the calibration set never reached; raise it (module attribute) to
#: treat experts with a handful of tokens the same way (their Hessian has that rank)
MIN_EXPERT_TOKENS = 1

_ROUTED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def mark_routed(layer: Any, expert: str | None) -> None:
    """Mark ``layer`` (a task's handle, or the layer a handle wraps) as a layer of the routed expert ``expert`` (its
    path, e.g. ``model.layers.3.mlp.experts.5``); ``None`` removes the mark. Called by a backend's block finder."""
    if expert is None:
        _ROUTED.pop(layer, None)
    else:
        _ROUTED[layer] = expert


def routed_expert(task: LayerTask) -> str | None:
    """The routed expert ``task``'s layer belongs to (:func:`mark_routed` of its handle, or of the layer the handle
    wraps: its ``layer`` / ``module`` attribute), or None."""
    h = task.handle
    for obj in (h, getattr(h, "layer", None), getattr(h, "module", None)):
        if obj is None:
            continue
        try:
            found = _ROUTED.get(obj)
        except TypeError:  # an object that cannot be weakly referenced is never marked
            continue
        if found is not None:
            return found
    return None


def fallback_due(task: LayerTask, stats: Any) -> bool:
    """True when ``task``'s layer is a routed expert's and its statistics ``stats`` (None: a method without
    statistics) hold fewer than :data:`MIN_EXPERT_TOKENS` tokens: :func:`expert_fallback` compresses it."""
    return stats is not None and stats.count < MIN_EXPERT_TOKENS and routed_expert(task) is not None


def expert_fallback(method: Any, task: LayerTask, weight: np.ndarray, mask: np.ndarray | None,
                    stats: Any) -> LayerResult | None:
    """The result for a routed expert's layer that saw fewer than :data:`MIN_EXPERT_TOKENS` tokens (see the module
    docstring), or None: the layer is not a routed expert's, has enough tokens, or the method reads no statistics."""
    if not fallback_due(task, stats):
        return None
    info = {"tokens": int(stats.count), "expert": routed_expert(task)}
    weight = np.asarray(weight, np.float64)
    if getattr(method, "kind", "pruner") == "quantizer":
        w = weight if mask is None else np.where(mask, weight, 0.0)
        q = rtn_quantize(w, task.quant_spec(type(method).__name__))
        scales = np.ones(weight.shape[1]) if getattr(method, "name", "") == "awq" else None
        return LayerResult(weight=q.dequantized, mask=mask, quantized=q, scales=scales,
                           info={"fallback": "rtn", **info})
    pattern = task.config.get("sparse_pattern")
    sparsity = None if pattern is not None else float(task.config["sparsity"])
    keep = wanda_mask(weight, np.ones(weight.shape[1]), sparsity, pattern)
    if mask is not None:
        keep &= mask
    return LayerResult(weight=np.where(keep, weight, 0.0), mask=keep, info={"fallback": "magnitude", **info})


def _last_block(backend: Any) -> str | None:
    try:
        blocks = list(backend.blocks())
    except Exception:  # noqa: BLE001 - a backend that cannot say
        return None
    return blocks[-1][0] if blocks else ""


def _block_size(backend: Any, block: str) -> int | None:
    """How many layers block ``block`` (a path; '' = outside every block) has in ``backend``, or None if unknown."""
    try:
        if block == "":
            return len(backend.block_layers(None))
        found = next((b for name, b in backend.blocks() if name == block), None)
        return None if found is None else len(backend.block_layers(found))
    except Exception:  # noqa: BLE001 - a backend that cannot say
        return None


def warn_fallbacks(backend: Any, method: Any, rows: list[dict[str, Any]], block: str) -> None:
    """Called after each row is committed (``rows``: the run's rows so far, this one last). Once the last layer of
    the run's last block is written, ONE warning names the routed experts of the whole run that fell back
    (:func:`expert_fallback`, rows with ``fallback``) with their token counts; the layers outside the blocks
    (``block`` '', compressed after them) get their own. Where the backend cannot say which block is last or how
    many layers it has, each fallback row is warned about as it comes."""
    if not rows or rows[-1].get("block") != block:
        return
    name = getattr(method, "name", None)
    last = _last_block(backend)
    size = _block_size(backend, block) if last is not None else None
    if last is None or size is None:  # warned row by row
        if "fallback" in rows[-1]:
            _warn(name, "", rows[-1:])
        return
    if block not in ("", last):
        return
    tail = 0
    for r in reversed(rows):
        if r.get("block") != block or r.get("method") != name:
            break
        tail += 1
    if tail != size:
        return
    mine = rows[len(rows) - tail:] if block == "" else [r for r in rows if r.get("method") == name and r.get("block")]
    fell = [r for r in mine if "fallback" in r]
    if fell:
        _warn(name, " outside the blocks" if block == "" and last else "", fell)


def _warn(name: Any, where: str, fell: list[dict[str, Any]]) -> None:
    experts: dict[str, int] = {}
    for r in fell:
        label = r.get("expert") or r["layer"]
        experts[label] = max(experts.get(label, 0), int(r["tokens"]))
    how = "round to nearest" if fell[0]["fallback"] == "rtn" else "magnitude pruning"
    listed = ", ".join(f"{e} ({n} token{'s' if n != 1 else ''})" for e, n in experts.items())
    few = "no calibration token" if MIN_EXPERT_TOKENS == 1 else f"fewer than {MIN_EXPERT_TOKENS} calibration tokens"
    warnings.warn(f"{name}: {len(experts)} routed expert(s){where} saw {few} and were compressed without statistics "
                  f"({how}, {len(fell)} layer(s)): {listed}; more (or more varied) calibration data reaches them",
                  stacklevel=4)


# ------------------------------------------------------------------------------------------------ expert banks
# A routed-expert BANK holds every expert's weights as slice ``[e]`` of 3-D weights (transformers 5's fused
# ``gate_up_proj`` / ``down_proj``, keras-hub's ``MixtralMoeExperts``). Both backends compress it the same way: each
# expert's slice of each weight is a layer (a task whose handle is an :class:`ExpertSlice`), observed on the tokens
# its router sent to the expert, written back into the 3-D weight; what a run made of each slice (mask, codes) is
# kept here per bank for export. The backends supply the tensor access and the per-expert loop that feeds the
# observers; the selection, naming, result keeping and undo copies are these.

#: bank -> {slice name: LayerResult of the last one-shot run that wrote the slice}
_BANK_RESULTS: weakref.WeakKeyDictionary[Any, dict[str, LayerResult]] = weakref.WeakKeyDictionary()


class ExpertSlice:
    """Expert ``expert``'s slice of the 3-D weight ``param`` of the bank ``bank`` (at ``path``): a task's handle,
    named ``<path><sep><expert><sep><param>``. A backend subclass gives the tensor access: :meth:`read` /
    :meth:`assign` in core's canonical ``[out, in]`` layout, :meth:`stored` / :meth:`put_back` as stored."""

    #: the path separator of the backend's layer names
    sep = "."

    def __init__(self, bank: Any, path: str, param: str, expert: int):
        self.bank, self.path, self.param, self.expert = bank, path, param, expert
        self.name = f"{path}{self.sep}{expert}{self.sep}{param}"

    def read(self) -> np.ndarray:
        """The slice, canonical ``[out, in]`` float64."""
        raise NotImplementedError

    def in_features(self) -> int:
        """The canonical slice's axis 1 (override to avoid :meth:`read`'s copy)."""
        return int(self.read().shape[1])

    def assign(self, weight: Any) -> None:
        """Write a canonical ``[out, in]`` weight into the slice (the model computes with it at once)."""
        raise NotImplementedError

    def stored(self) -> Any:
        """A host copy of the slice as stored (for :meth:`put_back`)."""
        raise NotImplementedError

    def put_back(self, stored: Any) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def slice_config(config_list: Sequence[dict[str, Any]], default_types: Any, type_name: str,
                 names: set[str]) -> dict[str, Any] | None:
    """The entry of ``config_list`` a bank slice takes: the slice is matched as a layer of type ``type_name`` (the
    backend's ``Linear`` / ``Dense``) that ``op_names`` may name by any of ``names`` (the bank, ``<bank>/<param>``,
    ``<bank>/<e>/<param>``); the last matching entry wins, an excluding one gives None."""
    wanted = type_names(type_name)
    chosen = None
    for entry in config_list:
        if "op_types" in entry and not (wanted & expand_op_types(entry["op_types"], default_types)):
            continue
        if "op_names" in entry and not names & set(entry["op_names"]):
            continue
        chosen = entry
    return None if chosen is None or chosen.get("exclude", False) else chosen


def slice_tasks(config_list: Sequence[dict[str, Any]], default_types: Any, type_name: str,
                banks: Iterable[tuple[Any, str, Sequence[str], int]],
                make: Callable[[Any, str, str, int], ExpertSlice]) -> list[LayerTask]:
    """One task per expert and weight of each bank ``(bank, path, weight names, experts)`` that the config list
    selects (:func:`slice_config`), weight by weight, expert by expert; ``make(bank, path, param, e)`` builds the
    handle, marked as its routed expert's (``<path><sep><e>``) for the fallback (:func:`expert_fallback`)."""
    tasks: list[LayerTask] = []
    for bank, path, params, count in banks:
        for param in params:
            for e in range(count):
                h = make(bank, path, param, e)
                cfg = slice_config(config_list, default_types, type_name,
                                   {path, f"{path}{h.sep}{param}", h.name})
                if cfg is None:
                    continue
                mark_routed(h, f"{path}{h.sep}{e}")
                tasks.append(LayerTask(h.name, cfg, h.in_features(), h))
    return tasks


def bank_results(bank: Any) -> dict[str, LayerResult]:
    """``{slice name: LayerResult}`` of the slices of ``bank`` a one-shot run wrote (mask, codes, AWQ scales; the
    weight is in the bank, not here)."""
    return _BANK_RESULTS.setdefault(bank, {})


def compressed_banks(banks: Iterable[tuple[str, Any]]) -> list[tuple[str, Any, dict[str, LayerResult]]]:
    """``(path, bank, results)`` of the banks of ``banks`` (``(path, layer)`` pairs) a one-shot run wrote."""
    return [(p, b, got) for p, b in banks if (got := _BANK_RESULTS.get(b))]


def slice_mask(h: ExpertSlice) -> np.ndarray | None:
    """The keep-mask an earlier run gave the slice (a pruner's; canonical), or None."""
    got = bank_results(h.bank).get(h.name)
    return None if got is None or got.mask is None or got.mask.all() else got.mask


def record_slice(h: ExpertSlice, result: LayerResult) -> None:
    """Keep ``result`` (its weight is in the bank already) for export; a result without a mask (a quantizer's on an
    unpruned slice) keeps the slice's earlier mask."""
    kept = bank_results(h.bank)
    prev = kept.get(h.name)
    if result.mask is None and prev is not None and prev.mask is not None:
        result = LayerResult(result.weight, prev.mask, result.quantized, result.scales, result.info)
    # no float copy of the weight (it is in the bank): the mask (1 byte a weight) and the codes, as a wrapper keeps
    q = None if result.quantized is None else dataclasses.replace(result.quantized, dequantized=None)
    kept[h.name] = LayerResult(np.empty((0, 0)), result.mask, q, result.scales, dict(result.info))


def snapshot_slice(h: ExpertSlice) -> dict[str, Any]:
    """What writing the slice changes (the backend's ``snapshot``): the slice as stored and its recorded result."""
    return {"weight": h.stored(), "result": bank_results(h.bank).get(h.name)}


def restore_slice(h: ExpertSlice, saved: dict[str, Any]) -> None:
    h.put_back(saved["weight"])
    if saved["result"] is None:
        bank_results(h.bank).pop(h.name, None)
    else:
        bank_results(h.bank)[h.name] = saved["result"]


def slice_observers(tasks: Iterable[LayerTask], observe: dict[str, Callable[[Any], None]]
                    ) -> list[tuple[Any, dict[tuple[int, str], str]]]:
    """Per bank holding an observed slice of ``tasks``: ``(bank, {(expert, param): slice name})``, the names
    ``observe`` has a function for. The backend's per-expert loop hands expert ``e``'s input rows of weight
    ``param`` to ``observe[names[(e, param)]]``."""
    banks: dict[int, tuple[Any, dict[tuple[int, str], str]]] = {}
    for t in tasks:
        h = t.handle
        if isinstance(h, ExpertSlice) and t.name in observe:
            banks.setdefault(id(h.bank), (h.bank, {}))[1][(h.expert, h.param)] = t.name
    return list(banks.values())
