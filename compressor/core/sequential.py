"""The sequential one-shot driver (issue 25): calibrate a model block by block, compress each block's
layers from their recorded input statistics, feed the compressed block's outputs to the next block.

Written once for both backends. A backend supplies an adapter (:class:`OneShotBackend`: find the blocks,
capture the first block's inputs, run one block on cached inputs while reporting each selected layer's
input, read and write a layer's weight); a method (:class:`OneShotMethod`: Wanda, SparseGPT, GPTQ, RTN,
AWQ, from :mod:`compressor.core.oneshot`) turns a layer's weight and statistics into its compressed
form. :func:`run_sequential` is the loop, as SparseGPT / GPTQ describe it:

1. run the calibration batches through the model up to the first block and keep the block's inputs;
2. for each block: run it on the cached inputs with each selected layer's input recorded into a
   :class:`~compressor.core.oneshot.GramAccumulator` (float64); compress the block's layers; run the
   COMPRESSED block again on the same inputs: its outputs are the next block's inputs (so later blocks
   calibrate on what the compressed model really computes);
3. selected layers outside every block (or all layers, for a model without repeated blocks) are
   compressed after that, from one pass of the whole (already compressed) model.

Memory: the inputs of one block at a time (plus one accumulator per layer of that block), never the
whole model's activations. No tracing: adapters use forward hooks (torch) / wrapped ``call`` (Keras).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import oneshot as os1
from .config import KeySpec, _bool, _choice, _fraction, _int_at_least, _is_int
from .errors import ConfigError, ModelError
from .sparse_pattern import parse_sparse_pattern

__all__ = ["LayerTask", "LayerResult", "OneShotBackend", "OneShotMethod", "WandaMethod", "SparseGPTMethod",
           "GptqMethod", "RtnMethod", "AwqMethod", "OneShotReport", "ONESHOT_KEYS", "search_subset", "search_inputs", "QUANT_SCHEME_KEY", "ONESHOT_SKIP_HINT", "weight_only_config", "run_sequential", "quant_spec_of", "FORWARD_DTYPES", "forward_in_float64"]


# ------------------------------------------------------------------------------------------------ config
def _group_size(v: Any) -> int | None:
    if v is None or (_is_int(v) and (v == -1 or v >= 1)):
        return None if v is None or v == -1 else int(v)
    raise ValueError


def _search_samples(v: Any) -> int | None:
    if v is None or (_is_int(v) and v >= 1):
        return None if v is None else int(v)
    raise ValueError


def _duo_scaling(v: Any) -> bool | str:
    if isinstance(v, bool) or v == "both":
        return v
    raise ValueError


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
    backend's ``take_rows(input, rows)`` (``batch_rows(input)``: the sequences of one input); a backend without
    them gets whole batches (:func:`search_subset` of the batches). The same sequences on every backend."""
    if samples is None:
        return list(inputs)
    rows_of, take = getattr(backend, "batch_rows", None), getattr(backend, "take_rows", None)
    if rows_of is None or take is None:
        return search_subset(inputs, samples)
    counts = [int(rows_of(i)) for i in inputs]
    total = sum(counts)
    if samples >= total:
        return list(inputs)
    picks = search_subset(list(range(total)), samples)
    out, start = [], 0
    for inp, n in zip(inputs, counts):
        local = [p - start for p in picks if start <= p < start + n]
        if local:
            out.append(inp if len(local) == n else take(inp, local))
        start += n
    return out


#: ``awq_search``: where AWQ's alpha is chosen (see :class:`AwqMethod`)
AWQ_SEARCHES = ("block", "layer")
#: ``search_samples`` when the config does not say (None: every calibration sequence). 16 sequences, spread over
#: the set: on the trained byte-level Llama of examples/RESULTS.md (128 calibration windows) the same perplexity as
#: all 128 over 3 seeds (mean 8.6723 vs 8.6720 with clipping) at a quarter of the time and an eighth of the search's
#: recorded inputs; ``search_samples: None`` is the reference's full search
AWQ_SEARCH_SAMPLES: int | None = 16
#: last name components of the layers AWQ's clipping search leaves alone (attention query / key projections,
#: as AutoAWQ's name rule; names starting with ``q_`` / ``k_`` or holding ``qkv`` too)
AWQ_CLIP_SKIP = frozenset({"q", "k", "query", "key", "c_attn", "query_key_value", "wq", "wk"})
#: ``quant_range``: the symmetric code range (``narrow``: the project's convention; ``full``: compressed-tensors')
QUANT_RANGES = ("narrow", "full")


#: ``calibrate(forward_dtype=...)``: the dtype the blocks run in while their layers' input statistics are recorded
#: and their (compressed) outputs handed to the next block
FORWARD_DTYPES = ("auto", "float64", "model")


def forward_in_float64(value: Any, what: str, on_cpu: bool) -> bool:
    """Whether ``calibrate(forward_dtype=value)`` runs those block passes in float64 (the weights and inputs
    widened exactly, the block's own casts kept: e.g. Hugging Face's RMSNorm and eager softmax still compute in
    float32): ``'float64'`` always, ``'model'`` never (the model's own dtype, as llmcompressor), ``'auto'``
    (default) on CPU only. Why: two frameworks' float32 forwards differ in the last bits (their GEMM, softmax
    and norm kernels sum in other orders); GPTQ's rounding and SparseGPT's N:M / threshold choices flip near
    ties, the error feedback carries each flip along its row, and the same weights and data gave perplexities
    up to 5.6e-3 apart on PyTorch and Keras (examples/RESULTS.md); in float64 they agree to 1e-8. On a CPU the
    cost is the float64 GEMMs of those passes (AWQ's search and the rest keep the model's dtype); on an
    accelerator float64 is slow, hence the model's dtype there."""
    if not isinstance(value, str) or value not in FORWARD_DTYPES:
        raise ConfigError(f"{what}: forward_dtype must be one of {list(FORWARD_DTYPES)} ('auto': float64 on CPU, "
                          f"the model's dtype on an accelerator; 'float64'; 'model': the model's own dtype), "
                          f"got {value!r}")
    return value == "float64" or (value == "auto" and on_cpu)


#: the config keys of the one-shot methods (each compressor lists the ones it takes in ``config_keys``)
ONESHOT_KEYS: dict[str, KeySpec] = {s.name: s for s in [
    KeySpec("group_size", _group_size, "a positive int (input columns per quantization group) or -1 / None "
                                       "(one group per output channel)"),
    KeySpec("damp", _fraction(0.0, 1.0), "a number in [0, 1): the fraction of mean(diag(H)) added to the Hessian's diagonal"),
    KeySpec("block_size", _int_at_least(1), "an int >= 1 (columns per lazy OBS update block, default 128)"),
    KeySpec("act_order", _bool, "True or False (GPTQ: sweep columns by decreasing Hessian diagonal)"),
    KeySpec("mask_scope", _choice(os1.MASK_SCOPES), f"one of {list(os1.MASK_SCOPES)} (SparseGPT: where the "
                                                      f"per-block pruning threshold is taken)"),
    KeySpec("n_grid", _int_at_least(1), "an int >= 1 (AWQ: points of the search grid, default 20)"),
    KeySpec("duo_scaling", _duo_scaling, "True, False or 'both' (AWQ: True (default): the identity, "
                                                         "then exponents in [0, 1] scaling by activation and weight "
                                                         "statistics; False: activation statistics only; 'both': "
                                                         "half the grid each way)"),
    KeySpec("awq_search", _choice(AWQ_SEARCHES), f"one of {list(AWQ_SEARCHES)} (AWQ: 'block' (default) searches one "
                                                 f"alpha per group of layers that read the same input, on the block's "
                                                 f"output error; 'layer': each layer alone, on its own output error)"),
    KeySpec("apply_clip", _bool, "True or False (AWQ: True (default): after the scales, search a clipping range "
                                 "per group of the scaled weight on the output error, as AutoAWQ; query / key "
                                 "projections are not clipped)"),
    KeySpec("search_samples", _search_samples, "an int >= 1 or None (AWQ, awq_search 'block': how many calibration "
                                                "sequences, spread evenly over the set, the alpha grid is scored on; "
                                                f"default {AWQ_SEARCH_SAMPLES}; None: all of them. The statistics "
                                                "always use every sequence)"),
    KeySpec("quant_range", _choice(QUANT_RANGES), f"one of {list(QUANT_RANGES)} (symmetric weight grid: 'narrow' "
                                                  f"(default) [-(2^(b-1)-1), 2^(b-1)-1], e.g. int4 [-7, 7]; 'full' "
                                                  f"[-2^(b-1), 2^(b-1)-1], e.g. int4 [-8, 7] as compressed-tensors "
                                                  f"and Keras int4)"),
]}

QUANT_SCHEMES = {"per_channel_symmetric": True, "per_tensor_symmetric": True, "symmetric": True,
                 "per_channel_affine": False, "per_tensor_affine": False, "affine": False}


def _weight_scheme(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) != {"weight"}:
            raise ValueError
        return {"weight": _weight_scheme(v["weight"])}
    if v not in QUANT_SCHEMES:
        raise ValueError
    return v


#: ``quant_scheme`` of the weight-only one-shot quantizers (listed in their ``config_keys``)
QUANT_SCHEME_KEY = KeySpec("quant_scheme", _weight_scheme, f"one of {sorted(QUANT_SCHEMES)} (weights; default "
                                                           f"'symmetric') or {{'weight': one of them}}")


#: what the one-shot compressors say about the weighted layers 'default' leaves out (embeddings, norms, ...)
ONESHOT_SKIP_HINT = ("the one-shot methods compress Linear-like layers only (Linear / HF Conv1D, Dense / EinsumDense); "
                     "the others stay as they are")


def weight_only_config(config_list: Any) -> Any:
    """Entries without ``quant_types`` quantize weights (``quant_bits: 4`` means ``{'weight': 4}``); the
    input is not modified (anything but a list is returned as is, for the validator to refuse)."""
    if not isinstance(config_list, (list, tuple)):
        return config_list
    return [{**e, "quant_types": ["weight"]} if isinstance(e, Mapping) and "quant_types" not in e else e
            for e in config_list]


def quant_spec_of(config: dict[str, Any], what: str) -> os1.QuantSpec:
    """The weight grid of a one-shot quantizer's normalised config entry: ``quant_bits['weight']`` (2..8),
    ``quant_scheme`` (symmetric / affine; default symmetric), ``group_size`` (default: per channel),
    ``quant_range`` (symmetric codes: 'narrow' (default) or 'full'; affine codes always use all ``2^b`` values)."""
    bits = config.get("quant_bits", {}).get("weight")
    if bits is None:
        raise ConfigError(f"{what}: config entry {config.get('op_types') or config.get('op_names')} has no weight "
                          f"bits; give quant_bits: 4 (or {{'weight': 4}})")
    scheme = config.get("quant_scheme", "symmetric")
    if isinstance(scheme, dict):
        scheme = scheme.get("weight", "symmetric")
    if scheme not in QUANT_SCHEMES:
        raise ConfigError(f"{what}: quant_scheme {scheme!r} is not one of {sorted(QUANT_SCHEMES)}")
    if not 2 <= int(bits) <= 8:
        raise ConfigError(f"{what}: weight-only one-shot quantization takes quant_bits 2..8, got {bits}")
    qrange = config.get("quant_range", "narrow")
    if qrange not in QUANT_RANGES:
        raise ConfigError(f"{what}: quant_range {qrange!r} is not one of {list(QUANT_RANGES)}")
    return os1.QuantSpec(int(bits), symmetric=QUANT_SCHEMES[scheme], group_size=config.get("group_size"),
                         narrow=qrange == "narrow")


# ------------------------------------------------------------------------------------------------ model side
@dataclass
class LayerTask:
    """One selected layer: ``name`` (its path), ``config`` (its normalised config entry), ``in_features``
    (the canonical weight's axis 1), ``handle`` (whatever the backend needs: the wrapper, the layer)."""

    name: str
    config: dict[str, Any]
    in_features: int
    handle: Any = None


@dataclass
class LayerResult:
    """What a method made of one layer: ``weight`` (canonical ``[out, in]`` float64, what the layer computes
    with from now on), ``mask`` (bool keep-mask, pruners), ``quantized`` (codes + scales, quantizers),
    ``scales`` (AWQ's per-input-channel ``s``: ``weight = Q(W s) / s``), ``info`` (numbers for the report)."""

    weight: np.ndarray
    mask: np.ndarray | None = None
    quantized: os1.QuantizedWeight | None = None
    scales: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)


class OneShotBackend(Protocol):
    """What :func:`run_sequential` asks a backend. Inputs / outputs of blocks are opaque to the driver.

    Optional: ``shared_inputs(block, inputs, tasks) -> {layer: earlier layer}`` names the layers of a block
    that read the very same input as an earlier one (q / k / v, gate / up); they then share its accumulator
    (equal statistics, computed once) and are not passed to ``observe``.
    ``snapshot(task) -> copy`` / ``restore(task, copy)``: a host copy of everything :meth:`write` (and
    ``set_weight``) change in the layer, and putting it back; with them a run that fails part way (any
    exception, KeyboardInterrupt) leaves every layer as it was.
    ``set_weight(task, weight)`` (canonical ``[out, in]``, float weight only) and ``block_output(block,
    inputs) -> iterable of arrays, one per input`` (the block's hidden-state outputs): AWQ's block-output search
    (``awq_search: 'block'``).
    ``awq_parent(block, tasks) -> module or None``, ``record_calls(block, inputs, modules) -> [calls per
    module]`` and ``module_output(module, calls) -> iterable of arrays, one per call``: the smallest module of the block holding
    ``tasks`` (None: the block itself), its call arguments recorded in one run of the block, and its (hidden-state)
    output on them, real tokens only; AWQ's parent-output search.
    ``advance(block, inputs)``: the block's outputs as :meth:`run_block` without observing, written over
    ``inputs`` in place (the driver no longer needs them: one copy of the activations instead of two)."""

    def blocks(self) -> Sequence[tuple[str, Any]]:
        """The repeated blocks (decoder layers) in execution order, ``(path, block)``; empty: no blocks."""

    def block_layers(self, block: Any) -> list[LayerTask]:
        """The selected layers inside ``block`` (``None``: the selected layers outside every block)."""

    def first_inputs(self, batches: Sequence[Any]) -> list[Any]:
        """The first block's inputs, one entry per calibration batch (the model is run up to the block)."""

    def run_block(self, block: Any, inputs: list[Any], observe: dict[str, Callable[[Any], None]] | None) -> list[Any]:
        """``block`` on each cached input; ``observe[layer name](x)`` gets each observed layer's input
        (any ``[..., in]`` array-like) on every call. Returns the outputs, one per input."""

    def run_model(self, batches: Sequence[Any], observe: dict[str, Callable[[Any], None]]) -> None:
        """The whole model on the calibration batches, observing as :meth:`run_block`."""

    def read_weight(self, task: LayerTask) -> tuple[np.ndarray, np.ndarray | None]:
        """``(weight, keep-mask or None)`` of the layer, canonical ``[out, in]`` (float64 / bool)."""

    def write(self, task: LayerTask, result: LayerResult) -> None:
        """Install ``result`` in the layer (weight, mask, quantization state)."""


# ------------------------------------------------------------------------------------------------ methods
class OneShotMethod:
    """A one-shot algorithm over one layer's weight and input statistics."""

    name = "oneshot"
    kind = "pruner"  # or 'quantizer'
    #: statistics: 'gram' (H = sum x^T x), 'norms' (per-channel sums only), None (no calibration data)
    statistics: str | None = "gram"

    def compress(self, task: LayerTask, weight: np.ndarray, mask: np.ndarray | None,
                 stats: os1.GramAccumulator | None) -> LayerResult:
        raise NotImplementedError


def _sparsity(config: dict[str, Any]) -> tuple[float | None, str | None]:
    pattern = config.get("sparse_pattern")
    if pattern is not None:
        parse_sparse_pattern(pattern)
        return None, pattern
    return float(config["sparsity"]), None


class WandaMethod(OneShotMethod):
    """Wanda (Sun et al. 2023): prune by ``|W_ij| * ||X_j||`` per output row (no weight update)."""

    name = "wanda"
    statistics = "norms"

    def compress(self, task, weight, mask, stats):
        sparsity, pattern = _sparsity(task.config)
        keep = os1.wanda_mask(weight, stats.channel_norms(), sparsity, pattern)
        if mask is not None:
            keep &= mask
        return LayerResult(weight=np.where(keep, weight, 0.0), mask=keep)


class SparseGPTMethod(OneShotMethod):
    """SparseGPT (Frantar & Alistarh 2023): OBS pruning with weight updates from the layer's Hessian."""

    name = "sparsegpt"

    def compress(self, task, weight, mask, stats):
        c = task.config
        sparsity, pattern = _sparsity(c)
        r = os1.sparsegpt_prune(weight, stats.gram_for_solver(), sparsity, pattern, damp=c.get("damp", os1.DEFAULT_DAMP),
                                block_size=c.get("block_size", os1.DEFAULT_BLOCK_SIZE),
                                mask_scope=c.get("mask_scope", "block"))
        keep = r.mask if mask is None else (r.mask & mask)
        return LayerResult(weight=np.where(keep, r.weight, 0.0), mask=keep,
                           info={"error": r.error, "dead_inputs": int(np.count_nonzero(r.dead))})


class GptqMethod(OneShotMethod):
    """GPTQ (Frantar et al. 2022): weight-only quantization with OBS error feedback. A layer already pruned
    (a keep-mask from a pruner on the same layer) keeps its zeros."""

    name = "gptq"
    kind = "quantizer"

    def compress(self, task, weight, mask, stats):
        c = task.config
        q = os1.gptq_quantize(weight, stats.gram_for_solver(), quant_spec_of(c, "GptqQuantizer"),
                              damp=c.get("damp", os1.DEFAULT_DAMP), block_size=c.get("block_size", os1.DEFAULT_BLOCK_SIZE),
                              act_order=c.get("act_order", False), mask=mask)
        return LayerResult(weight=q.dequantized, mask=mask, quantized=q, info={"error": q.error})


class RtnMethod(OneShotMethod):
    """Round to nearest, weight-only, per group (the baseline; needs no calibration data)."""

    name = "rtn"
    kind = "quantizer"
    statistics = None

    def compress(self, task, weight, mask, stats):
        w = weight if mask is None else np.where(mask, weight, 0.0)
        q = os1.rtn_quantize(w, quant_spec_of(task.config, "RtnQuantizer"))
        return LayerResult(weight=q.dequantized, mask=mask, quantized=q)


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

    def compress(self, task, weight, mask, stats):
        c = task.config
        spec = quant_spec_of(c, "AwqQuantizer")
        w = weight if mask is None else np.where(mask, weight, 0.0)
        h = stats.gram
        duo = c.get("duo_scaling", True)
        w_mean = os1.awq_weight_mean(w, spec.group_size) if duo is not False else None

        def loss(s: np.ndarray) -> float:
            d = w - os1.awq_effective(w, s, spec)
            return float(np.sum((d @ h) * d))

        found = os1.awq_search(stats.abs_mean(), loss, c.get("n_grid", os1.AWQ_N_GRID), w_mean, duo)
        return self.result(task, w, mask, found.scales, spec, self.info(found), h)

    @staticmethod
    def info(found: os1.AwqSearch) -> dict[str, Any]:
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
               spec: os1.QuantSpec, info: dict[str, Any], gram: np.ndarray) -> LayerResult:
        clip = os1.awq_clip_search(w, gram, scales, spec) if self.clips(task) else None
        a = os1.awq_quantize(w, scales, spec, clip, keep_dequantized=False)
        eff = a.effective
        if mask is not None:
            np.copyto(eff, 0.0, where=~mask)
        if clip is not None:  # share of groups whose range was cut
            starts = np.arange(0, w.shape[1], a.quantized.group_size)
            cut = sum(int(np.count_nonzero(clip[r] < np.maximum.reduceat(np.abs(w[r] * scales[None, :]), starts,
                                                                          axis=1)))
                      for r in os1.row_chunks(*w.shape))
            info = {**info, "clipped": cut / clip.size}
        return LayerResult(weight=eff, mask=mask, quantized=a.quantized, scales=a.scales, info=info)

    def search_group(self, tasks: list[LayerTask], weights: list[tuple[np.ndarray, np.ndarray | None]],
                     stats: os1.GramAccumulator, block_loss: Callable[[Mapping[str, np.ndarray]], float]
                     ) -> Iterator[LayerResult]:
        """One ``alpha`` for ``tasks`` (layers that read one input, statistics ``stats``): ``block_loss({layer:
        candidate effective weight})`` is the block's output error with those weights. Returns one result per
        task (the group's ``alpha`` and loss in ``info``), computed as the iterator is consumed."""
        c = tasks[0].config
        specs = [quant_spec_of(t.config, "AwqQuantizer") for t in tasks]
        ws = [w if m is None else np.where(m, w, 0.0) for w, m in weights]
        duo = c.get("duo_scaling", True)
        w_mean = (os1.awq_weight_mean(ws, specs[0].group_size)
                  if duo is not False else None)

        def candidate(i: int, s: np.ndarray) -> np.ndarray:
            eff = os1.awq_effective(ws[i], s, specs[i])
            m = weights[i][1]
            return eff if m is None else np.where(m, eff, 0.0)

        def loss(s: np.ndarray) -> float:
            # each layer's candidate weight is computed when block_loss reads it, and not kept: one at a time
            return block_loss(_Lazy({t.name: (lambda i=i: candidate(i, s)) for i, t in enumerate(tasks)}))

        found = os1.awq_search(stats.abs_mean(), loss, c.get("n_grid", os1.AWQ_N_GRID), w_mean, duo)
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


class OneShotReport(list):
    """The rows of a one-shot run (dicts: ``layer``, ``block``, ``method``, ``sparsity`` or ``bits`` /
    ``group_size``, the method's numbers: GPTQ's ``error``, AWQ's ``alpha`` / ``duo`` / ``error``); ``str()`` is
    a table with a column per key, in the order the keys first appear."""

    def __str__(self) -> str:
        keys: list[str] = []
        for r in self:
            keys += [k for k in r if k not in keys]

        def fmt(v: Any) -> str:
            if isinstance(v, float):
                return f"{v:.4g}"
            return "" if v is None else str(v)

        body = [[fmt(r.get(k)) for k in keys] for r in self]
        widths = [max([len(k)] + [len(row[i]) for row in body]) for i, k in enumerate(keys)]
        line = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join(x.rstrip() for x in [line.format(*keys), line.format(*("-" * w for w in widths))]
                         + [line.format(*row) for row in body])


# ------------------------------------------------------------------------------------------------ the loop
def _glibc_trim() -> Callable[[], Any] | None:
    """glibc's ``malloc_trim`` (None elsewhere): see :func:`release_freed_heap`."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl, no libc.so.6
        return None


_TRIM = _glibc_trim()


def release_freed_heap() -> None:
    """Give the heap pages freed since the last call back to the OS (glibc ``malloc_trim(0)``; a no-op where
    there is none). Between blocks a calibration run frees a block's worth of activations, statistics and
    solver copies; glibc keeps most of it (its mmap threshold grows with the first frees, so later
    activation-sized buffers come from the heap), and the next block's peak stacks on top: measured on the
    issue-25 Llama (128 windows, max of 2 runs each), peak extra memory SparseGPT 129 -> 102 MiB, GPTQ 132 -> 96,
    Wanda 92 -> 87."""
    if _TRIM is not None:
        _TRIM(0)


def _progress(stream: Any) -> Callable[[str], None]:
    if stream is None or stream is False:
        return lambda msg: None
    out = sys.stderr if stream is True else stream

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)
    return say


class _Spill:
    """The arrays of the undo copies in an anonymous temporary file (host RAM holds one layer's copy at a time,
    not a second copy of every compressed weight); arrays are written as they come and read back only by a
    rollback. Without a usable temporary directory the arrays are kept in memory (copied)."""

    MIN_BYTES = 1 << 16  # smaller arrays (masks of tiny layers, scalars) stay in memory

    def __init__(self) -> None:
        self.file: Any = None
        self.failed = False

    def _open(self) -> Any:
        if self.file is None and not self.failed:
            try:
                self.file = tempfile.TemporaryFile(prefix="compressor-undo-")
            except OSError:
                self.failed = True
        return self.file

    def put(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.nbytes < self.MIN_BYTES or obj.dtype.hasobject or self._open() is None:
                return np.array(obj, copy=True)
            f = self.file
            f.seek(0, 2)
            offset = f.tell()
            f.write(np.ascontiguousarray(obj).tobytes())
            return _Spilled(offset, obj.shape, obj.dtype)
        if type(obj) is dict:
            return {k: self.put(v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(self.put(v) for v in obj)
        return obj

    def get(self, obj: Any) -> Any:
        if isinstance(obj, _Spilled):
            self.file.seek(obj.offset)
            n = int(np.prod(obj.shape, dtype=np.int64)) * obj.dtype.itemsize
            return np.frombuffer(self.file.read(n), dtype=obj.dtype).reshape(obj.shape).copy()
        if type(obj) is dict:
            return {k: self.get(v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(self.get(v) for v in obj)
        return obj

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


@dataclass(frozen=True)
class _Spilled:
    offset: int
    shape: tuple
    dtype: np.dtype


class _Undo:
    """Host copies of what a run changes, taken per layer just before its first change (the backend's optional
    ``snapshot(task)`` / ``restore(task, copy)``); :meth:`rollback` puts them back, newest first, so a run that
    fails part way leaves the model as it found it. The copies' numpy arrays go to a temporary file
    (:class:`_Spill`): the backup costs disk, not a second copy of the weights in RAM; a snapshot may hand over
    views of the live arrays, they are written out at once."""

    def __init__(self, backend: OneShotBackend):
        self.backend = backend
        self.enabled = callable(getattr(backend, "snapshot", None)) and callable(getattr(backend, "restore", None))
        self.saved: list[tuple[LayerTask, Any]] = []
        self.names: set[str] = set()
        self.spill = _Spill()

    def before(self, task: LayerTask) -> None:
        if self.enabled and task.name not in self.names:
            self.saved.append((task, self.spill.put(self.backend.snapshot(task))))  # type: ignore[attr-defined]
            self.names.add(task.name)

    def rollback(self) -> None:
        for task, saved in reversed(self.saved):
            self.backend.restore(task, self.spill.get(saved))  # type: ignore[attr-defined]
        self.close()

    def close(self) -> None:
        self.saved, self.names = [], set()
        self.spill.close()


def _row(task: LayerTask, method: OneShotMethod, result: LayerResult, block: str) -> dict[str, Any]:
    if not np.all(np.isfinite(result.weight)):
        raise ModelError(f"{method.name}: layer {task.name!r}: the compressed weight is not finite")
    row = {"layer": task.name, "block": block, "method": method.name}
    if result.mask is not None:
        row["sparsity"] = 1.0 - float(np.count_nonzero(result.mask)) / result.mask.size
    if result.quantized is not None:
        row["bits"] = result.quantized.spec.bits
        row["group_size"] = result.quantized.group_size
    row.update(result.info)
    return row


def _check_seen(method: OneShotMethod, task: LayerTask, stats: os1.GramAccumulator | None) -> None:
    if stats is not None and stats.count == 0:
        raise ModelError(f"{type(method).__name__}: layer {task.name!r} saw no input during calibration (is it "
                         f"used in the model's forward for these inputs?); exclude it or check the data")


def _compute_layer(backend: OneShotBackend, method: OneShotMethod, task: LayerTask,
                   stats: os1.GramAccumulator | None) -> LayerResult:
    """``method``'s result for ``task`` from its current weight and ``stats`` (the model is not changed)."""
    weight, mask = backend.read_weight(task)
    _check_seen(method, task, stats)
    return method.compress(task, np.asarray(weight, np.float64), mask, stats)


def _commit_layer(backend: OneShotBackend, method: OneShotMethod, task: LayerTask, result: LayerResult,
                  rows: list[dict[str, Any]], block: str, undo: _Undo | None) -> None:
    """Write ``result`` into the model (after the undo copy of the layer) and add its report row."""
    row = _row(task, method, result, block)
    if undo is not None:
        undo.before(task)
    backend.write(task, result)
    rows.append(row)


def _compress_layers(backend: OneShotBackend, method: OneShotMethod, tasks: list[LayerTask],
                     accs: dict[str, os1.GramAccumulator], rows: list[dict[str, Any]], block: str,
                     undo: _Undo | None = None) -> None:
    later = [id(accs[t.name]) if accs.get(t.name) is not None else None for t in tasks]
    for i, t in enumerate(tasks):
        stats = accs.get(t.name)
        if stats is not None and id(stats) not in later[i + 1:]:
            stats.consumable = True  # no later layer reads it: the solver may take it
        result = _compute_layer(backend, method, t, stats)
        _commit_layer(backend, method, t, result, rows, block, undo)
        del result
        release_freed_heap()  # the solver's matrices: the next layer's start on a trimmed heap


def _output_error(outs: Iterable[Any], ref: Sequence[np.ndarray]) -> float:
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
    return total / max(n, 1)


def _compact(weight: Any) -> np.ndarray:
    """A weight kept only to be written back: float32 where that holds every value exactly (the weights of a
    float32 / bf16 / fp16 model; half the bytes of the float64 canonical copy), float64 otherwise."""
    a = np.asarray(weight, np.float64)
    b = a.astype(np.float32)
    return b if np.array_equal(b, a) else a


def _awq_parent_modules(backend: OneShotBackend, block: Any, groups: list[list[LayerTask]]) -> list[Any]:
    """Per group: the smallest module of the block that holds the group's layers (self_attn for q / k / v, mlp for
    gate / up): AWQ's loss is that module's output, as AutoAWQ / llmcompressor take it. ``None``: the block
    itself (no such module, or a backend without ``awq_parent`` / ``record_calls`` / ``module_output``)."""
    parent_of = getattr(backend, "awq_parent", None)
    if parent_of is None or getattr(backend, "record_calls", None) is None or \
            getattr(backend, "module_output", None) is None:
        return [None] * len(groups)
    return [parent_of(block, g) for g in groups]


def _record_float(backend: OneShotBackend, block: Any, inputs: list[Any], module: Any,
                  done: list[tuple[LayerTask, Any, Any]], spill: _Spill) -> Any:
    """``module``'s recorded calls in one run of the FLOAT block (the layers of the block already compressed,
    ``done``: ``(task, float weight, compressed weight)``, both as ``spill`` keeps them: they are read back one
    layer at a time, run with their float weights for it and get their compressed ones back): each parent is
    recorded just before its group is searched, so one parent's inputs are in memory at a time, and they are
    what recording all parents in one float run gives."""
    for t, w_float, _ in done:
        backend.set_weight(t, spill.get(w_float))  # type: ignore[attr-defined]
    try:
        calls = backend.record_calls(block, inputs, [module])[0]  # type: ignore[attr-defined]
    finally:
        for t, _, w_done in done:
            backend.set_weight(t, spill.get(w_done))  # type: ignore[attr-defined]
    release_freed_heap()  # the recording run's (and a backend's merging of the calls) transient buffers
    if not calls:
        raise ModelError(f"AWQ: module {getattr(module, 'name', type(module).__name__)!r}, which holds layers of "
                         f"block {block!r}, was not called when the block ran on the calibration inputs")
    return calls


def _awq_block(backend: OneShotBackend, method: AwqMethod, block: Any, inputs: list[Any], tasks: list[LayerTask],
               accs: dict[str, os1.GramAccumulator], rows: list[dict[str, Any]], name: str, undo: _Undo) -> None:
    """AWQ with ``awq_search: 'block'``: the layers sharing an accumulator (one input) are one group, searched
    on the output of the smallest module that holds them (see :class:`AwqMethod`); a layer alone is searched on
    its own output error."""
    groups: dict[int, list[LayerTask]] = {}
    for t in tasks:
        groups.setdefault(id(accs[t.name]) if method.block_search(t) else id(t), []).append(t)
    multi = [g for g in groups.values() if len(g) > 1]
    if not multi:
        _compress_layers(backend, method, tasks, accs, rows, name, undo)
        return
    set_weight = getattr(backend, "set_weight", None)
    if set_weight is None:
        raise ModelError(f"{type(backend).__name__} cannot run a block with candidate weights (set_weight); give "
                         f"awq_search: 'layer'")
    # the grid is scored on a subset of the calibration batches (``search_samples``); statistics use all
    inputs = search_inputs(backend, inputs, tasks[0].config.get("search_samples", AWQ_SEARCH_SAMPLES))
    parents = dict(zip(map(id, multi), _awq_parent_modules(backend, block, multi)))
    run = getattr(backend, "block_output", None)
    if run is None and any(p is None for p in parents.values()):
        raise ModelError(f"{type(backend).__name__} cannot run a block with candidate weights (block_output); give "
                         f"awq_search: 'layer'")
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
            early[g[0].name] = _compute_layer(backend, method, g[0], accs.get(g[0].name))
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
                _commit_layer(backend, method, group[0], early.pop(group[0].name), rows, name, undo)
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
                    return backend.module_output(module, calls)  # type: ignore[attr-defined]
                ref = list(forward())
            release_freed_heap()  # the module runs' transients, interleaved with the kept references

            def block_loss(cand: Mapping[str, np.ndarray], group: list[LayerTask] = group, forward: Any = forward,
                           ref: Any = ref) -> float:
                for t in group:
                    set_weight(t, cand[t.name])
                err = _output_error(forward(), ref)
                release_freed_heap()
                return err

            results = method.search_group(group, weights, stats, block_loss)
            del ref, forward, block_loss
            if parent is not None:
                del calls
            for t, r in zip(group, results):
                _commit_layer(backend, method, t, r, rows, name, undo)  # (its undo copy was taken above)
                del r  # before the next result is computed
            for t in group:  # the group's statistics are not read again
                accs.pop(t.name, None)
            del stats, results
            compressed(group)
            release_freed_heap()
    finally:
        spill.close()


def _observers(method: OneShotMethod, tasks: list[LayerTask], shared: dict[str, str] | None = None
               ) -> tuple[dict[str, os1.GramAccumulator], dict[str, Callable]]:
    """One accumulator per layer; a layer in ``shared`` (``{layer: earlier layer that reads the same input}``,
    e.g. k / v -> q) gets the earlier layer's accumulator and is not observed (its statistics are equal)."""
    accs: dict[str, os1.GramAccumulator] = {}
    observe: dict[str, Callable] = {}
    shared = shared or {}
    # leaders first: a leader may come after its followers in the layer list (keras-hub Llama: the up
    # projection is defined before the gate, which is called first)
    for t in sorted(tasks, key=lambda t: t.name in shared):
        lead = shared.get(t.name)
        if lead in accs and accs[lead].in_features == t.in_features:
            accs[t.name] = accs[lead]
        else:
            accs[t.name] = os1.GramAccumulator(t.in_features, gram=method.statistics == "gram")
            observe[t.name] = accs[t.name].add
    return accs, observe


class ObservedAll(Exception):
    """Raised by a backend's observing hook once a block call has handed over every observed layer's input (see
    :class:`ObserveCalls`); the backend catches it around that call, whose output an observing run drops."""


class ObserveCalls:
    """When may an observing run of a block stop? After the last observed input of the call: the layers that
    run after it (Llama's down projection and the residual add; fc2 in OPT / GPT-2) compute an output nobody
    reads. Skipping them saves one of seven matrix products of an observing call (a float64 one, by default,
    on a CPU).

    A backend calls :meth:`begin` before each block call and :meth:`fired(name) <fired>` from each observing
    hook (leaders and the layers that share their input alike), after the hook has done its work; when it
    returns True the hook raises :class:`ObservedAll`. The first call always runs to the end and fixes the
    order: only when each hooked layer fired exactly once there does a later call stop, on the first call's
    last layer, once every hooked layer has fired (a layer called twice per block, or an order that changes
    from call to call, then runs the whole block as before)."""

    def __init__(self, names: Iterable[str]):
        self.names = frozenset(names)
        self._calls: list[str] = []
        self._last: str | None = None
        self._learnt = False

    def begin(self) -> None:
        if self._calls and not self._learnt:  # the first call ran to the end: learn its order
            self._learnt = True
            if len(self._calls) == len(self.names) and set(self._calls) == self.names:
                self._last = self._calls[-1]
        self._calls = []

    def fired(self, name: str) -> bool:
        self._calls.append(name)
        return (self._last is not None and name == self._last and len(self._calls) == len(self.names)
                and set(self._calls) == self.names)


def _shared_inputs(backend: OneShotBackend, block: Any, inputs: list[Any], tasks: list[LayerTask]) -> dict[str, str] | None:
    """The backend's ``shared_inputs(block, inputs, tasks)`` if it has one (optional: layers that read the very
    same input tensor share one accumulator, computed once). It is probed on ONE sequence of the first batch
    (``take_rows``, where the backend has it): which layers share an input is a property of the block's code,
    and a whole batch of 128 windows made the probe a full extra block run (6.3 of 36 s of an AWQ run)."""
    fn = getattr(backend, "shared_inputs", None)
    if fn is None:
        return None
    probe = inputs[:1]
    rows, take = getattr(backend, "batch_rows", None), getattr(backend, "take_rows", None)
    if probe and rows is not None and take is not None and rows(probe[0]) > 1:
        probe = [take(probe[0], [0])]
    return fn(block, probe, tasks)


def _advance(backend: OneShotBackend, block: Any, inputs: list[Any]) -> list[Any]:
    """The block's outputs on ``inputs``: the backend's ``advance(block, inputs)`` if it has one (it replaces the
    inputs by the outputs one by one, in place: one copy of the activations), else ``run_block``."""
    fn = getattr(backend, "advance", None)
    return fn(block, inputs) if fn is not None else backend.run_block(block, inputs, None)


def run_sequential(backend: OneShotBackend, method: OneShotMethod, batches: Sequence[Any],
                   progress: Any = True) -> list[dict[str, Any]]:
    """Compress every selected layer of the backend's model with ``method``, block by block (see the module
    docstring). ``batches``: the calibration batches (backend-specific objects; a method without
    statistics, RTN, needs none). ``progress``: True (stderr), False / None, or a file. Returns one report
    row per layer (``layer``, ``block``, ``method``, ``sparsity`` / ``bits``, the method's numbers)."""
    say = _progress(progress)
    undo = _Undo(backend)
    try:
        rows = _run(backend, method, batches, say, undo)
    except BaseException as e:  # KeyboardInterrupt too: the model goes back to what it was
        try:
            undo.rollback()
        except Exception as r:  # noqa: BLE001
            e.add_note(f"(restoring the layers changed before the failure failed too: {type(r).__name__}: {r})")
        finally:
            undo.close()
            release_freed_heap()
        raise
    undo.close()
    # the last block's activations, statistics and solver copies are free now; glibc would keep most of their
    # pages (measured: 91 MiB resident after the call -> 27 on a 3-block slice of the 34 M-parameter Llama)
    release_freed_heap()
    return rows


def _run(backend: OneShotBackend, method: OneShotMethod, batches: Sequence[Any], say: Callable[[str], None],
         undo: _Undo) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    blocks = list(backend.blocks())
    needs_data = method.statistics is not None
    if needs_data and not batches:
        raise ConfigError(f"{type(method).__name__}: the calibration set is empty; give a few hundred sequences")
    inputs: list[Any] | None = None
    total = len(blocks)
    for i, (name, block) in enumerate(blocks):
        tasks = backend.block_layers(block)
        t0 = time.perf_counter()
        if not needs_data:
            _compress_layers(backend, method, tasks, {}, rows, name, undo)
        else:
            if inputs is None:
                inputs = backend.first_inputs(batches)
                release_freed_heap()
            if tasks:
                accs, observe = _observers(method, tasks, _shared_inputs(backend, block, inputs, tasks))
                backend.run_block(block, inputs, observe)
                observe = None  # its bound methods hold the accumulators: only ``accs`` may, from here on
                release_freed_heap()
                if isinstance(method, AwqMethod) and any(method.block_search(t) for t in tasks):
                    _awq_block(backend, method, block, inputs, tasks, accs, rows, name, undo)
                else:
                    _compress_layers(backend, method, tasks, accs, rows, name, undo)
                accs = None  # type: ignore[assignment]
            if i + 1 < total:  # the compressed block's outputs feed the next block
                inputs = _advance(backend, block, inputs)
                release_freed_heap()
        say(f"[{method.name}] block {i + 1}/{total} {name}: {len(tasks)} layer(s), {time.perf_counter() - t0:.1f} s")
    inputs = None  # free the last block's activations
    rest = backend.block_layers(None)
    if rest:
        t0 = time.perf_counter()
        if needs_data:
            accs, observe = _observers(method, rest)
            backend.run_model(batches, observe)
        else:
            accs = {}
        _compress_layers(backend, method, rest, accs, rows, "", undo)
        where = "outside the blocks" if blocks else "whole model"
        say(f"[{method.name}] {where}: {len(rest)} layer(s), {time.perf_counter() - t0:.1f} s")
    if not rows:
        raise ConfigError(f"{type(method).__name__}: no layer was selected for one-shot compression")
    return rows


def mean_error(rows: list[dict[str, Any]]) -> float:
    """Mean of the rows' ``error`` entries (nan when none has one)."""
    vals = [r["error"] for r in rows if "error" in r]
    return float(np.mean(vals)) if vals else math.nan
