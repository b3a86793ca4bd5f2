"""A compressed Hugging Face model as a compressed-tensors checkpoint folder (``export_model(hf_path=DIR)``).

Called by the Hugging Face family plug-in (:mod:`compressor.torch.hf`) with the model's compressed state
(original keys, compressed float values); the format itself is :mod:`compressor.core.compressed_tensors`.

* Layers of a one-shot weight quantizer (:class:`~compressor.torch.quantization.oneshot.GptqQuantizer`,
  ``RtnQuantizer``, ``AwqQuantizer``) that are ``nn.Linear``: ``pack-quantized`` with their own codes,
  scales and zero points (bits, group size, symmetric / asymmetric as calibrated; symmetric codes of the
  narrow range ``[-7, 7]`` are a subset of compressed-tensors' signed int4 ``[-8, 7]``, so they load
  unchanged; affine codes ``[0, 15]`` and zero points are shifted by -8, which keeps ``code - zp``). A
  group size must divide the layer's input width (compressed-tensors has no shorter last group).
* AWQ: the codes quantize ``W * s``; the layer computes ``Q(W s) (x / s)``, so ``1 / s`` is folded into
  what produces ``x`` where that is exact: a norm (weight and bias divided by ``s``) takes the ``1 / s`` of
  its widest AWQ reader, which stays packed with every reader of the same ``s``; its other readers are
  written in float with ``s`` multiplied into their columns (each AWQ layer has its own ``s``, so q / k / v
  and gate / up rarely share one); ``o_proj`` / ``out_proj`` fold into the rows of ``v_proj`` (attention is
  linear in the values; grouped-query heads when their ``s`` agree), ``down_proj`` into ``up_proj`` (``act(gate)
  * up``), ``fc2`` into ``fc1`` (ReLU only). A layer whose ``1 / s`` has no exact home is written as its float
  weight ``Q(W s) / s`` (a warning names it). The folds assume the model calls its layers on the norm's
  output directly; after writing, a fresh model loaded with the checkpoint's float weights is compared with
  the compressed model on a short input, and if the logits differ by more than float32 rounding the
  checkpoint is rewritten without folds (every AWQ layer in float, said in the warning).
* Pruned float layers: ``sparse_format='dense'`` (default: every compressed-tensors / transformers version
  loads it), ``'bitmask'`` (``sparse-bitmask``), ``'2:4'`` (``sparse-24-bitmask``; refused unless every
  pruned layer is 2:4) or ``'auto'`` (2:4 where a layer is, else bitmask). compressed-tensors 0.15+ (and so
  transformers with it) no longer read the sparse formats: load those with
  :func:`compressor.core.compressed_tensors.load_compressed_tensors` / ``compressor unpack``.
* Not packed (float, a warning names them): GPT-2's ``Conv1D`` (:data:`CONV1D_REASON`: transformers cannot
  reload it packed) and a quantized layer whose weight is tied to another (the LM head tied to the embedding).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.atomic import atomic_paths
from ..core.compressed_tensors import (
    bitmask_entries,
    is_24_sparse,
    load_compressed_tensors,
    naive_quantized_entries,
    pack_quantized_entries,
    quant_args,
    sparse24_entries,
    write_safetensors,
)
from ..core.errors import ConfigError, ModelError
from ..core.oneshot.codes import stored_codes_to_full
from .modules import innermost_module, is_wrapper
from .pruning.wrapper import PrunerModuleWrapper
from .quantization.wrapper import QuantizerModuleWrapper
from .sequential.expert_banks import ExpertPiece, checkpoint_layout, export_notes, fuse_pieces, fused_results

__all__ = ["save_compressed_tensors", "SPARSE_FORMATS", "TensorPlan", "plan_tensors", "quantization_config", "write_config",
           "packed_layers", "capture_call", "dense_warning", "CONV1D_REASON"]

SPARSE_FORMATS = ("dense", "bitmask", "2:4", "auto")
#: why a quantized Hugging Face ``Conv1D`` (GPT-2; weight ``[in, out]``) is written as float weights, said once in the
#: export's warning. Measured with transformers 5 / compressed-tensors 0.20 on a tiny GPT-2 with its Conv1D layers
#: packed in the Linear layout: the default load left them randomly initialised (logits off by 0.26, no error), and
#: ``dequantize=True`` refused the [out, in] weights ("size mismatch"; a square one would load transposed)
CONV1D_REASON = ("transformers loads compressed-tensors checkpoints through compressed-tensors, which gives a "
                 "quantization scheme only to nn.Linear / nn.Embedding modules: packed Conv1D tensors would be left "
                 "unread and the layers randomly initialised (and CompressedTensorsConfig(dequantize=True) would put "
                 "[out, in] weights into Conv1D's [in, out]); as float weights they reload exactly")
#: (consumer suffix, producer suffix): the producer's output rows feed the consumer's input columns one to one
_ROW_FOLDS = (("self_attn.o_proj", "self_attn.v_proj"), ("self_attn.out_proj", "self_attn.v_proj"),
              ("attn.out_proj", "attn.v_proj"), ("attention.output.dense", "attention.self.value"),
              ("mlp.down_proj", "mlp.up_proj"), ("fc2", "fc1"))


def _np(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy(), True
    return t.numpy().copy(), False


def _tied(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, v in seen.items() if v > 1}


def _quantized_layers(model: nn.Module) -> list[QuantizerModuleWrapper]:
    out = []
    for _, w in model.named_modules():
        if not isinstance(w, QuantizerModuleWrapper):
            continue
        kinds = [t for t in w.quant_types if t != "weight"]
        if kinds:
            raise ModelError(f"hf_path: layer {w.name!r} quantizes {kinds}; a compressed-tensors checkpoint written "
                             f"here holds weight-only quantization (GptqQuantizer / RtnQuantizer / AwqQuantizer)")
        codes = w._buffers.get("weight_codes")
        done = w._buffers.get("oneshot_calibrated")
        if codes is None or done is None:
            raise ModelError(f"hf_path: layer {w.name!r} is quantized by {type(w.quantizer).__name__}, which keeps no "
                             f"integer codes (weight_codes / weight_group_scale buffers); compressed-tensors "
                             f"checkpoints are written for GptqQuantizer / RtnQuantizer / AwqQuantizer")
        if not bool(done):
            raise ModelError(f"hf_path: layer {w.name!r} is not calibrated yet; run quantizer.calibrate(...) first")
        out.append(w)
    return out


def _weighted(module: nn.Module) -> bool:
    """A layer with a weight (a compressor wrapper or a plain layer), not a container."""
    return is_wrapper(module) or isinstance(module.__dict__.get("_parameters", {}).get("weight"), torch.Tensor)


def _capture(model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """One small forward: each module's first input and its output (the tensors themselves, so identity
    tells who reads what)."""
    training = model.training
    model.eval()
    try:
        return capture_call(model, (), {"input_ids": _probe(model)})
    finally:
        model.train(training)


def capture_call(module: nn.Module, args: tuple, kwargs: dict[str, Any],
                 prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`_capture` for a part of a model (a decoder block) on one recorded call: each submodule's first input
    and its output, by module name in the whole model (``prefix``: the part's own path, e.g. ``model.layers.3``)."""
    ins: dict[str, Any] = {}
    outs = _Outputs()
    handles = []
    depth = [0]  # > 0 inside a weighted layer's forward
    for rel, m in module.named_modules():
        full = ".".join(p for p in (prefix, rel) if p)
        weighted = _weighted(m)

        def pre(mod: nn.Module, a: tuple, kw: dict, name: str = full, weighted: bool = weighted) -> None:
            x = a[0] if a else next(iter(kw.values()), None)
            if isinstance(x, torch.Tensor):
                ins[name] = x
            depth[0] += weighted

        def post(mod: nn.Module, a: tuple, out: Any, name: str = full, weighted: bool = weighted) -> None:
            depth[0] -= weighted
            if isinstance(out, torch.Tensor):
                outs[name] = out
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post))
    try:
        with torch.no_grad(), _OutsideUses(outs.shared, depth):
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return ins, outs


class _Outputs(dict):
    """The outputs of :func:`capture_call` by module name, with ``shared``: the ids of the tensors that an op
    outside every weighted layer read for their values (a residual add reading a norm's output, as BERT's
    post-norm blocks do): folding a 1/s into such a tensor's producer would change that other reader too."""

    def __init__(self) -> None:
        super().__init__()
        self.shared: dict[int, torch.Tensor] = {}  # (the tensors kept: their ids stay unique)


class _OutsideUses(torch.overrides.TorchFunctionMode):
    """Records (in ``shared``) the tensor arguments of every op that runs outside a weighted layer's forward
    and gives a floating-point tensor (value uses; shape queries give none)."""

    def __init__(self, shared: dict[int, torch.Tensor], depth: list[int]):
        super().__init__()
        self.shared, self.depth = shared, depth

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.depth[0] and isinstance(out, torch.Tensor) and out.is_floating_point():
            for a in (*args, *(kwargs or {}).values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, torch.Tensor):
                        self.shared[id(t)] = t
        return out


def _probe(model: nn.Module) -> torch.Tensor:
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    return torch.arange(8, device=dev).reshape(1, 8) % 3 + 1


def _fold_error(model: nn.Module, folder: str) -> tuple[float, float]:
    """Max |logits| difference between ``model`` and a fresh model of its class loaded with the float weights
    of the checkpoint in ``folder``, and the tolerance (float32 rounding of the folds)."""
    fresh = type(model)(model.config).eval()
    decoded = fuse_pieces(load_compressed_tensors(folder), checkpoint_layout(model)[0])  # per-expert pieces: fused
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in decoded.items()}, strict=False)
    if callable(getattr(fresh, "tie_weights", None)):
        fresh.tie_weights()
    dev = next((p.device for p in model.parameters()), torch.device("cpu"))
    fresh.to(dev)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ref = model(input_ids=_probe(model)).logits.float()
            got = fresh(input_ids=_probe(model)).logits.float()
    finally:
        model.train(training)
    return float((got - ref).abs().max()), 1e-4 * (1.0 + float(ref.abs().max()))


def _awq_folds(model: nn.Module, awq: dict[str, np.ndarray], state: dict[str, torch.Tensor],
               packed: set[str], capture: Any = None,
               config: Any = None) -> tuple[dict[str, list[tuple[str, np.ndarray]]], dict[str, str]]:
    """``{key of a float tensor: [(how, s)]}`` (``how``: ``'div'`` elementwise, ``'offset_div'`` for a norm that
    scales by ``1 + weight`` (Gemma's RMSNorm: ``w -> (1 + w) / s - 1``), ``'div_rows'``, ``'mul_cols'``) and the
    AWQ layers left in float with why (``{layer: reason}``). ``capture``: who reads what (``(inputs, outputs)`` by
    module name, as :func:`_capture` finds them with one forward of the whole model; a part of a model brings its
    own); ``config``: the model's config (grouped-query heads), default ``model.config``."""
    try:
        ins, outs = (capture or _capture)(model)
    except Exception as e:  # noqa: BLE001 - a model the probe cannot run (e.g. needs decoder inputs): no folds
        return {}, dict.fromkeys(sorted(awq), f"the model could not be probed to find who reads what "
                                              f"({type(e).__name__})")
    why: dict[str, str] = {}  # an AWQ layer's reason not to fold, the first found
    shared = getattr(outs, "shared", {})
    folds: dict[str, list[tuple[str, np.ndarray]]] = {}
    row_scale: dict[str, np.ndarray] = {}
    done: set[str] = set()
    normed: set[str] = set()
    names = dict(model.named_modules())
    tied = _tied(model)
    # 1. norms: the norm takes one reader's 1/s; readers with that s stay packed, the others (float) take s
    #    into their weight's columns
    for name in awq:
        if name in done or name not in ins:
            continue
        x = ins[name]
        # the layers reading x (containers that pass x on are not readers; a wiring this misses shows in the
        # logits check after writing)
        readers = sorted(n for n, t in ins.items() if t is x and _weighted(names[n]))
        readers = [n for n in readers if not any(n.startswith(o + ".") for o in readers if o != n)]
        producers = [n for n, t in outs.items() if t is x and type(names[n]).__name__.lower().endswith("norm")]
        if len(producers) != 1:
            why.setdefault(name, "its input comes from neither a norm nor a Linear it alone reads (e.g. a GELU)")
            continue
        if any(not isinstance(innermost_module(names[r]), nn.Linear) for r in readers):
            continue
        norm = producers[0]
        if norm in normed:
            continue
        normed.add(norm)
        ours = [r for r in readers if r in awq]
        if id(x) in shared:  # e.g. BERT: the norm's output is also the residual
            for r in ours:
                why[r] = f"its norm's output ({norm!r}) is also read outside its layers (a residual add)"
            continue
        if not ours or any(id(innermost_module(names[r]).weight) in tied for r in readers):
            continue  # a tied weight (LM head / embedding) cannot take s without changing its twin
        chosen = max(ours, key=lambda r: (innermost_module(names[r]).out_features, -ours.index(r)))
        s = awq[chosen]
        if f"{norm}.weight" not in state or state[f"{norm}.weight"].shape != (s.size,) or any(
                f"{r}.weight" not in state for r in readers):
            continue
        how = _norm_fold(names[norm], ins.get(norm), x, s)
        if how is None:
            for r in ours:
                why[r] = f"its norm {norm!r} ({type(innermost_module(names[norm])).__name__}) does not scale its " \
                         f"output by its weight"
            continue
        for key in (f"{norm}.weight", f"{norm}.bias"):
            if key in state:
                folds.setdefault(key, []).append((how if key.endswith("weight") else "div", s))
        for r in readers:
            if r in awq and np.array_equal(awq[r], s):
                done.add(r)
            else:
                folds.setdefault(f"{r}.weight", []).append(("mul_cols", s))
                if r in awq:
                    why[r] = f"its norm {norm!r} took the 1/s of {chosen!r}, another reader (different s)"
    # 2. Linear -> Linear (the producer's output rows are the consumer's input columns)
    config = config if config is not None else getattr(model, "config", None)
    for name, s in awq.items():
        if name in done:
            continue
        for cons, prod in _ROW_FOLDS:
            if not name.endswith(cons):
                continue
            p = name[: -len(cons)] + prod
            if p not in names or f"{p}.weight" not in state:
                continue
            if prod == "fc1" and getattr(config, "activation_function", None) not in ("relu",):
                why[name] = f"its input is {prod!r} after a non-ReLU activation"
                continue
            n_out = int(getattr(innermost_module(names[p]), "out_features", -1))
            if n_out == s.size:
                rows = s
            elif "v_proj" in prod and n_out > 0 and s.size % n_out == 0:  # grouped-query attention
                heads = getattr(config, "num_attention_heads", None)
                kv = getattr(config, "num_key_value_heads", None)
                if not heads or not kv or s.size % heads:
                    continue
                d, rep = s.size // heads, heads // kv
                r = s.reshape(kv, rep, d)
                if not np.all(r == r[:, :1, :]):
                    why[name] = f"its s differs between the query heads sharing one key/value head of {p!r}"
                    continue
                rows = r[:, 0, :].reshape(-1)
            else:
                continue
            if p in row_scale:
                continue
            row_scale[p] = rows
            done.add(name)
    unfolded = {n: why.get(n, "nothing before it can take its 1/s exactly (no norm or Linear whose outputs it "
                              "alone reads)") for n in sorted(set(awq) - done)}
    for p, rows in row_scale.items():
        target = f"{p}.weight_scale" if p in packed and p not in unfolded else f"{p}.weight"
        folds.setdefault(target, []).append(("div_rows", rows))
        if f"{p}.bias" in state:
            folds.setdefault(f"{p}.bias", []).append(("div", rows))
    return folds, unfolded


@dataclass
class TensorPlan:
    """What a checkpoint holds for a set of layers, before anything is written: ``tensors`` (file names ->
    arrays; bf16 values as uint16 bit patterns, named in ``bf16``), the packed layers by ``(bits, group size or
    None, symmetric)`` (``groups``), the sparse-format layers (``sparse``: name -> format, with their weights'
    element and zero counts), the layers written in float with why (``dense_notes``), whether AWQ's 1/s folds
    were used (``folded``), the packed per-expert layers of fused routed experts by ``(bits, group size or None,
    symmetric)`` (``experts``: the checkpoint's names, e.g. ``model.layers.0.block_sparse_moe.experts.3.w1``)."""

    tensors: dict[str, np.ndarray]
    bf16: set[str]
    groups: dict[tuple[int, int | None, bool], list[str]]
    sparse: dict[str, str]
    sparse_total: int
    sparse_zeros: int
    dense_notes: list[str]
    folded: bool
    experts: dict[tuple[int, int | None, bool], list[str]] = field(default_factory=dict)

    def merge(self, other: TensorPlan) -> None:
        """Add ``other``'s layers (another part of the same model) to this plan's counts and groups; the
        tensors stay in their own parts (a streamed checkpoint writes each part to its own shard)."""
        for k, names in other.groups.items():
            self.groups.setdefault(k, []).extend(names)
        self.sparse.update(other.sparse)
        self.sparse_total += other.sparse_total
        self.sparse_zeros += other.sparse_zeros
        self.dense_notes.extend(other.dense_notes)
        self.folded = self.folded or other.folded
        for k, names in other.experts.items():
            self.experts.setdefault(k, []).extend(names)


def dense_warning(notes: list[str]) -> str:
    """The warning for the layers a checkpoint writes as float weights (``notes``: one per layer, and the folds'
    remarks), with :data:`CONV1D_REASON` said once where Conv1D layers are among them."""
    why = f" ({CONV1D_REASON})" if any("(Conv1D:" in n for n in notes) else ""
    return f"written as float weights (not packed): {', '.join(notes)}{why}"


def packed_layers(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[dict[str, QuantizerModuleWrapper],
                                                                              dict[str, np.ndarray], list[str]]:
    """The one-shot quantized Linear layers of ``model`` that a compressed-tensors checkpoint packs, their AWQ
    scales, and the notes of those it cannot (GPT-2's Conv1D, weights tied to another layer)."""
    tied = _tied(model)
    pack: dict[str, QuantizerModuleWrapper] = {}
    dense_notes: list[str] = []
    awq: dict[str, np.ndarray] = {}
    for w in _quantized_layers(model):
        layer = innermost_module(w)
        if not isinstance(layer, nn.Linear):
            dense_notes.append(f"{w.name!r} ({type(layer).__name__}: not a Linear for compressed-tensors)")
            continue
        if id(layer.weight) in tied:
            dense_notes.append(f"{w.name!r} (its weight is tied to another layer's)")
            continue
        spec = w.quant_spec
        n_in = layer.in_features
        gs = spec.group_width(n_in)
        if n_in % gs:
            raise ModelError(f"hf_path: layer {w.name!r}: group_size {gs} does not divide its {n_in} input columns; "
                             f"compressed-tensors needs equal groups (use a group_size dividing {n_in}, or -1)")
        pack[w.name] = w
        if "awq_scales" in w._buffers:
            awq[w.name] = w._buffers["awq_scales"].detach().cpu().double().numpy()
    missing = [f"{n}.weight" for n in pack if f"{n}.weight" not in state]
    if missing:
        raise ModelError(f"hf_path: the model's state has no {missing}")
    return pack, awq, dense_notes


def plan_tensors(model: nn.Module, state: dict[str, torch.Tensor], sparse_format: str = "dense",
                 fold: bool = True, capture: Any = None, config: Any = None,
                 unfolded: str = "its 1/s is not folded when a checkpoint is written block by block",
                 experts: dict[str, list[ExpertPiece]] | None = None) -> TensorPlan:
    """The checkpoint's tensors for ``model`` (the whole model, or a part of it such as one decoder block) from
    its compressed ``state`` (original keys); see the module docstring. ``fold``: fold AWQ's 1/s into the layers
    that produce an AWQ layer's input; who reads what comes from one forward of the whole model, or for a part
    from ``capture(part) -> (inputs, outputs)`` by module name (``config``: the model's config). ``unfolded``: why an
    AWQ layer is written in float when ``fold`` is False (the note of each). ``experts``: the per-expert layout of
    the fused routed experts (:func:`~.sequential.expert_banks.checkpoint_layout`; default: found on ``model``,
    which must then be the whole ``PreTrainedModel``); see :func:`_expert_plan`."""
    if sparse_format not in SPARSE_FORMATS:
        raise ConfigError(f"export_model: hf_sparse_format must be one of {list(SPARSE_FORMATS)}, got {sparse_format!r}")
    tied = _tied(model)
    pack, awq, dense_notes = packed_layers(model, state)
    folds, left = _awq_folds(model, awq, state, set(pack), capture, config) if awq and fold else (
        {}, dict.fromkeys(awq, unfolded))
    by_reason: dict[str, list[str]] = {}
    for n, reason in left.items():
        pack.pop(n)
        by_reason.setdefault(reason, []).append(repr(n))
    for reason, layers in by_reason.items():  # one note per reason: the warning stays one readable line
        dense_notes.append(f"{', '.join(layers)} (AWQ, as Q(W s) / s: {reason})")
    # pruned float layers
    sparse_layers: dict[str, str] = {}
    if sparse_format != "dense":
        for _, pw in model.named_modules():
            if not isinstance(pw, PrunerModuleWrapper) or pw.name in pack:
                continue
            key = f"{pw.name}.weight"
            if key not in state or state[key].dim() != 2 or id(innermost_module(pw).weight) in tied:
                continue
            value = state[key]
            if value.dtype == torch.bfloat16:
                continue
            two_four = is_24_sparse(value.cpu().numpy())
            if sparse_format == "2:4" and not two_four:
                raise ModelError(f"hf_path: hf_sparse_format='2:4' but layer {pw.name!r} is not 2:4 sparse (at most 2 "
                                 f"non-zeros in every 4 consecutive inputs); use 'bitmask' or 'auto'")
            sparse_layers[pw.name] = "sparse-24-bitmask" if sparse_format == "2:4" or (
                sparse_format == "auto" and two_four) else "sparse-bitmask"
    if experts is None:
        experts = checkpoint_layout(model)[0]
    ex = _expert_plan(model, state, experts, sparse_format)
    dense_notes.extend(ex.notes)
    sparse_layers.update(ex.sparse)
    if sparse_layers:
        kinds = set(sparse_layers.values())
        if len(kinds) > 1:  # one sparsity_config format per checkpoint: bitmask holds any pattern
            sparse_layers = dict.fromkeys(sparse_layers, "sparse-bitmask")

    # ---- build the tensors (nothing written yet)
    def host(key: str) -> tuple[np.ndarray, bool]:
        value = state[key]
        if key in folds:
            v = value.detach().cpu().double()
            for how, s in folds[key]:
                t = torch.from_numpy(s)
                if how == "offset_div":  # a norm scaling by (1 + weight): (1 + w') = (1 + w) / s
                    v = (1 + v) / t - 1
                else:
                    v = v * t if how == "mul_cols" else v / (t[:, None] if how == "div_rows" and v.dim() == 2 else t)
            value = v.to(value.dtype)
        return _np(value)

    tensors: dict[str, np.ndarray] = {}
    bf16: set[str] = set()
    seen: dict[int, str] = {}
    for key, value in state.items():
        if id(value) in seen:  # tied: stored once, as save_pretrained does
            continue
        seen[id(value)] = key
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        if layer in pack or layer in sparse_layers or key in ex.written:
            continue
        arr, is_bf16 = host(key)
        tensors[key] = arr
        if is_bf16:
            bf16.add(key)
    groups: dict[tuple[int, int | None, bool], list[str]] = {}
    for name, w in pack.items():
        spec = w.quant_spec
        # the codes as the wrapper keeps them (two per byte at 4 bits or fewer): converted once, to the file's
        # int32 words (symmetric) or to one signed byte per code (affine: naive-quantized)
        stored = w._buffers["weight_codes"].detach().cpu().numpy()
        n_in = int(innermost_module(w).in_features)
        scale = w._buffers["weight_group_scale"].detach().cpu().double().numpy()
        zp = w._buffers["weight_group_zero_point"].detach().cpu().numpy()
        symmetric = spec.symmetric
        for _, rows in folds.get(f"{name}.weight_scale", []):
            scale = scale / rows[:, None]
        weight = state[f"{name}.weight"]
        sdtype = np.float32 if weight.dtype != torch.float16 else np.float16
        if symmetric:
            tensors.update(pack_quantized_entries(name, stored, scale, zp, spec.bits, True, sdtype, stored_cols=n_in))
        else:
            tensors.update(naive_quantized_entries(name, stored_codes_to_full(stored, spec.bits, n_in), scale, zp,
                                                   spec.bits, False, sdtype))
        gs = spec.group_width(n_in)
        groups.setdefault((spec.bits, None if gs == n_in else gs, symmetric), []).append(name)
    tensors.update(ex.tensors)
    total = zeros = 0
    for name, kind in sparse_layers.items():
        arr = ex.sparse_values[name] if name in ex.sparse_values else host(f"{name}.weight")[0]
        tensors.update(sparse24_entries(name, arr) if kind == "sparse-24-bitmask" else bitmask_entries(name, arr))
        total += arr.size
        zeros += int((arr == 0).sum())
    return TensorPlan(tensors, bf16, groups, sparse_layers, total, zeros, dense_notes, bool(folds), ex.groups)


@dataclass
class _ExpertPlan:
    """What :func:`_expert_plan` writes: packed tensors (``tensors``) by scheme (``groups``), the per-expert layers
    stored in a sparse format (``sparse``: name -> format, ``sparse_values``: their float values), the fused keys
    these replace (``written``), and the notes of the compressed experts left float (``notes``)."""

    tensors: dict[str, np.ndarray]
    groups: dict[tuple[int, int | None, bool], list[str]]
    sparse: dict[str, str]
    sparse_values: dict[str, np.ndarray]
    written: set[str]
    notes: list[str]


#: why a fused parameter's quantized experts are stored dense (their compressed values as floats, fused names)
_EXPERT_REASONS = {
    "awq": "AWQ: their 1/s has no exact home (their input is the norm output the router and every expert read)",
    "asymmetric": "asymmetric codes: transformers dequantizes per-expert packed weights without zero points",
    "partial": "not every expert of the parameter is quantized: transformers merges a parameter's experts only "
               "when every one is packed",
    "schemes": "the routed experts use several bit widths: transformers dequantizes all routed experts of a "
               "checkpoint with one scheme",
}


def _expert_plan(model: nn.Module, state: dict[str, torch.Tensor], experts: dict[str, list[ExpertPiece]],
                 sparse_format: str) -> _ExpertPlan:
    """The fused routed experts (transformers 5's 3-D ``gate_up_proj`` / ``down_proj``) whose slices a one-shot run
    compressed, in the checkpoint's per-expert layout (``experts``: :func:`checkpoint_layout`), which
    ``from_pretrained`` merges back into the fused parameters:

    * quantized: ``pack-quantized`` per expert (``<piece>.weight_packed`` / ``weight_scale`` / ``weight_shape``),
      when every expert of the parameter is quantized symmetric with equal groups and all packed experts of the
      checkpoint share one scheme: transformers (5.x with compressed-tensors) dequantizes the pieces with the one
      config group whose ``re:`` targets name the experts, before it merges them. Otherwise the parameter is
      stored dense (a note says why).
    * pruned, with a sparse format: ``sparse-bitmask`` / ``sparse-24-bitmask`` per expert when every expert of the
      parameter has a mask (readable with :func:`~compressor.core.compressed_tensors.load_compressed_tensors`; like
      every sparse-format layer, not by transformers with compressed-tensors 0.15+).
    * anything else (pruned with ``sparse_format='dense'``, uncompressed, not packable): the fused float tensor
      under its model name, as before (a checkpoint with a quantization_config loads per-expert float pieces
      through transformers' dequantizing merge, which drops them: measured with transformers 5.24).

    Banks without a per-expert layout (no conversion mapping: transposed / hand-made banks) keep the fused float
    tensors with :func:`export_notes`' note."""
    modules = dict(model.named_modules())
    out = _ExpertPlan({}, {}, {}, {}, set(), [])
    packable: dict[str, tuple[tuple[int, int | None, bool], list[Any]]] = {}
    why: dict[str, tuple[str, int]] = {}  # fused key -> (reason, compressed slices)
    handled: set[str] = set()
    for key, pieces in experts.items():
        path, _, param = key.rpartition(".")
        bank = modules.get(path)
        if key not in state or bank is None:
            continue
        handled.add(path)
        got = fused_results(bank)
        n_exp, _, n_in = pieces[0].shape
        results = [got.get(f"{path}.{e}.{param}") for e in range(n_exp)]
        quantized = [r for r in results if r is not None and r.quantized is not None]
        if quantized:
            if len(quantized) < n_exp:
                why[key] = ("partial", len(quantized))
            elif any(r.scales is not None for r in quantized):
                why[key] = ("awq", len(quantized))
            elif not all(r.quantized.spec.symmetric for r in quantized):
                why[key] = ("asymmetric", len(quantized))
            else:
                packable[key] = (n_in, results)
            continue
        masked = [r for r in results if r is not None and r.mask is not None]
        if sparse_format == "dense" or len(masked) < n_exp or state[key].dtype == torch.bfloat16:
            continue
        value = state[key].detach().cpu()
        for p in pieces:
            arr = value[p.expert][p.rows if isinstance(p.rows, slice) else torch.from_numpy(p.rows)].numpy().copy()
            two_four = is_24_sparse(arr)
            if sparse_format == "2:4" and not two_four:
                raise ModelError(f"hf_path: hf_sparse_format='2:4' but routed expert {p.expert} of {key!r} is not "
                                 f"2:4 sparse; use 'bitmask' or 'auto'")
            out.sparse[p.name] = "sparse-24-bitmask" if sparse_format == "2:4" or (
                sparse_format == "auto" and two_four) else "sparse-bitmask"
            out.sparse_values[p.name] = arr
        out.written.add(key)
    scheme = _experts_scheme(packable)
    if isinstance(scheme, str):  # one experts scheme per checkpoint
        for key, (_, results) in packable.items():
            why[key] = (scheme, len(results))
        packable = {}
    for key, (n_in, results) in packable.items():
        bits, g, _ = scheme
        sdtype = np.float16 if state[key].dtype == torch.float16 else np.float32
        for p in experts[key]:
            q = results[p.expert].quantized
            # a coarser group (or per channel) written in the common group width: each scale repeated
            cols = np.arange(0, n_in, g or n_in) // min(int(q.group_size), n_in)
            out.tensors.update(pack_quantized_entries(p.name, q.codes[p.rows], q.scale[p.rows][:, cols],
                                                      q.zero_point[p.rows][:, cols], bits, True, sdtype))
            out.groups.setdefault(scheme, []).append(p.name)
        out.written.add(key)
    by_bank: dict[tuple[str, str, int], list[str]] = {}
    for key, (reason, n) in why.items():
        path, _, param = key.rpartition(".")
        by_bank.setdefault((path, _EXPERT_REASONS.get(reason, reason), n), []).append(param)
    for (path, reason, n), params in by_bank.items():
        out.notes.append(f"{path}.{{{','.join(sorted(params))}}} (fused 3-D routed experts, {n} slices quantized "
                         f"each: {reason}; their compressed values are stored dense)")
    out.notes.extend(export_notes(model, skip=handled))
    return out


def _experts_scheme(packable: dict[str, tuple[int, list[Any]]]) -> tuple[int, int | None, bool] | str | None:
    """The one ``(bits, group width or None, symmetric)`` the packable routed experts are written with: the
    narrowest group width among them, when it divides every other width (a per-channel slice is any multiple) and
    every input width; None for per channel everywhere. Else the reason why none is packed."""
    bits: set[int] = set()
    widths: list[tuple[int, int]] = []  # (group width, input width)
    for n_in, results in packable.values():
        for r in results:
            bits.add(int(r.quantized.spec.bits))
            widths.append((min(int(r.quantized.group_size), n_in), n_in))
    if not widths:
        return None
    if len(bits) > 1:
        return "schemes"
    grouped = [w for w, n in widths if w < n]
    if not grouped:
        return bits.pop(), None, True
    g = min(grouped)
    if any(w % g or n % g for w, n in widths):
        return (f"their group widths {sorted({w for w, _ in widths})} have no common width dividing every input "
                f"width (compressed-tensors needs one group size, equal groups)")
    return bits.pop(), g, True


def _expert_targets(names: list[str], avoid: Any = ()) -> list[str]:
    """``re:`` targets matching exactly the per-expert layers ``names`` (and none of ``avoid``), few of them: names
    that differ only in their numbers (layer, expert) and last part (``w1`` / ``w3``) share one pattern where their
    numbers are all combinations of the values seen; each names ``experts``, which is how transformers finds the
    config group of the routed experts (``get_experts_scheme``)."""
    by_shape: dict[tuple[str, ...], list[tuple[str, tuple[str, ...]]]] = {}
    for name in names:
        parts = name.split(".")
        nums = tuple(x for x in parts[:-1] if x.isdigit())
        shape = tuple("#" if x.isdigit() else x for x in parts[:-1])
        by_shape.setdefault(shape, []).append((parts[-1], nums))
    targets: list[str] = []
    for shape, items in by_shape.items():
        lasts = sorted({last for last, _ in items})
        nums = [sorted({n[i] for _, n in items}, key=int) for i in range(sum(x == "#" for x in shape))]
        combos = 1
        for v in nums:
            combos *= len(v)
        it = iter(nums)
        body = r"\.".join("(?:" + "|".join(next(it)) + ")" if x == "#" else re.escape(x) for x in shape)
        pattern = "^" + body + r"\.(?:" + "|".join(re.escape(x) for x in lasts) + ")$"
        exact = len(set(items)) == combos * len(lasts) and len(pattern) < 900
        if exact and not any(re.match(pattern, a) for a in avoid):
            targets.append("re:" + pattern)
        else:
            shape_names = [".".join([*_fill(shape, n), last]) for last, n in items]
            targets.extend(f"re:^{re.escape(n)}$" for n in shape_names)
    return targets


def _fill(shape: tuple[str, ...], nums: tuple[str, ...]) -> list[str]:
    it = iter(nums)
    return [next(it) if x == "#" else x for x in shape]


def quantization_config(plan: TensorPlan) -> dict[str, Any]:
    """The ``quantization_config`` of config.json for what ``plan`` packs ({} when nothing is)."""
    groups, sparse_layers, experts = plan.groups, plan.sparse, plan.experts
    if not (groups or sparse_layers or experts):
        return {}
    formats = {"pack-quantized" if sym else "naive-quantized" for _, _, sym in groups}
    formats |= {"pack-quantized" for _ in experts}
    qc: dict[str, Any] = {
        "quant_method": "compressed-tensors",
        "format": (formats.pop() if len(formats) == 1 else "mixed-precision") if formats else "dense",
        "quantization_status": "compressed", "kv_cache_scheme": None, "global_compression_ratio": None,
        "ignore": [], "config_groups": {}, "sparsity_config": {}, "transform_config": {}}
    for i, ((bits, gs, sym), names) in enumerate(sorted(groups.items(), key=lambda kv: kv[1][0])):
        qc["config_groups"][f"group_{i}"] = {"targets": sorted(names), "weights": quant_args(bits, gs, sym),
                                             "input_activations": None, "output_activations": None,
                                             "format": "pack-quantized" if sym else "naive-quantized"}
    # the routed experts' packed pieces: a group of their own whose re: targets name the experts (transformers
    # dequantizes every routed expert with that group's scheme; the pieces match no module of the loaded model,
    # which compressed-tensors logs as "Could not match" once per target)
    for i, ((bits, gs, sym), names) in enumerate(sorted(experts.items(), key=lambda kv: kv[1][0])):
        qc["config_groups"][f"group_{len(groups) + i}"] = {
            "targets": _expert_targets(names, avoid=sparse_layers), "weights": quant_args(bits, gs, sym),
            "input_activations": None, "output_activations": None, "format": "pack-quantized"}
    if sparse_layers:
        kind = next(iter(sparse_layers.values()))
        qc["sparsity_config"] = {"format": kind, "targets": sorted(sparse_layers), "ignore": [],
                                 "global_sparsity": plan.sparse_zeros / plan.sparse_total if plan.sparse_total else 0.0,
                                 "sparsity_structure": "2:4" if kind == "sparse-24-bitmask" else "unstructured"}
    return qc


def write_config(model: nn.Module, folder: str, qc: dict[str, Any]) -> None:
    """config.json (with ``qc`` as its quantization_config) and generation_config.json of ``model`` into
    ``folder``."""
    model.config.save_pretrained(folder)
    gen = getattr(model, "generation_config", None)
    if gen is not None and callable(getattr(model, "can_generate", None)) and model.can_generate():
        gen.save_pretrained(folder)
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if qc:
        config["quantization_config"] = qc
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _owned(name: str) -> bool:
    """A file of an existing checkpoint folder that the export replaces: its config, and the weight files of any
    checkpoint (safetensors / PyTorch shards and their indexes), which ``save_pretrained`` replaces too."""
    if name in ("config.json", "generation_config.json"):
        return True
    stem = name.split(".", 1)[0]
    return stem.startswith(("model", "pytorch_model")) and name.endswith((".safetensors", ".bin", ".index.json"))


def _keep_foreign_files(path: str, tmp: str) -> None:
    """Copy what an existing checkpoint folder ``path`` holds beside its weights (tokenizer files, README, training
    arguments, sub-folders) into the new folder ``tmp`` before it replaces ``path``: an export into a checkpoint
    folder keeps every file it does not write, as ``save_pretrained`` does."""
    if not os.path.isdir(path):
        return
    for name in sorted(os.listdir(path)):
        src, dst = os.path.join(path, name), os.path.join(tmp, name)
        if _owned(name) or os.path.lexists(dst):
            continue
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)


def _reload_problem(model: nn.Module, pack: dict[str, QuantizerModuleWrapper]) -> str | None:
    """Why ``from_pretrained`` would fail on the packed checkpoint, known at export: a packed layer of a Linear
    subclass (Falcon's FalconLinear) whose model's ``_init_weights`` reads the ``weight`` that compressed-tensors
    replaces by its packed tensors (probed on a weightless instance of that class); None when nothing is known."""
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        return None
    by_class: dict[type, list[str]] = {}
    for name, w in pack.items():
        layer = innermost_module(w)
        if type(layer) is not nn.Linear:
            by_class.setdefault(type(layer), []).append(name)
    for cls, names in by_class.items():
        probe = cls.__new__(cls)
        nn.Module.__init__(probe)
        probe.register_parameter("bias", None)
        probe.in_features, probe.out_features = 1, 1
        try:
            with torch.no_grad():
                init(probe)
        except AttributeError as e:
            return (f"transformers cannot reload this checkpoint: {type(model).__name__}._init_weights reads "
                    f"{cls.__name__}.weight, which the packed layers ({', '.join(repr(n) for n in names[:3])}"
                    f"{', ...' if len(names) > 3 else ''}) no longer have ({e}); use compressor's "
                    f"load_compressed_tensors, or export without packing (pack_weights / a model_path)")
        except Exception:  # noqa: BLE001 - anything else says nothing about the reload
            continue
    return None


def _norm_fold(norm: nn.Module, x: Any, y: Any, s: np.ndarray) -> str | None:
    """How ``1 / s`` folds into ``norm`` exactly: ``'div'`` (the output is ``... * weight (+ bias)``),
    ``'offset_div'`` (``... * (1 + weight)``, Gemma's RMSNorm), or None; tried on the norm's captured input ``x``
    against its output ``y / s``."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return None
    layer = innermost_module(norm)
    w = getattr(layer, "weight", None)
    if not isinstance(w, torch.Tensor):
        return None
    b = getattr(layer, "bias", None)
    t = torch.from_numpy(s).to(device=w.device, dtype=torch.float64)
    want = y.double() / t
    for how, new in (("div", w.double() / t), ("offset_div", (1 + w.double()) / t - 1)):
        params = {"weight": new.to(w.dtype)}
        if isinstance(b, torch.Tensor):
            params["bias"] = (b.double() / t).to(b.dtype)
        try:
            with torch.no_grad():
                got = torch.func.functional_call(layer, params, (x,)).double()
        except Exception:  # noqa: BLE001 - a norm that cannot run alone: not folded
            return None
        if torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-12):
            return how
    return None


def save_compressed_tensors(model: nn.Module, path: Any, state: dict[str, torch.Tensor],
                            sparse_format: str = "dense") -> None:
    """Write ``model`` (a compressed ``PreTrainedModel``; ``state``: its compressed state with the original
    keys) as a compressed-tensors checkpoint folder at ``path``, atomically (a temporary folder next to it,
    renamed into place). See the module docstring for what is packed."""
    path = os.fspath(path)
    if sparse_format not in SPARSE_FORMATS:
        raise ConfigError(f"export_model: hf_sparse_format must be one of {list(SPARSE_FORMATS)}, got {sparse_format!r}")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ModelError(f"hf_path {path!r} exists and is not a folder; a compressed-tensors checkpoint is a folder")
    pack, _, _ = packed_layers(model, state)  # refuse what cannot be written before anything is
    reload_note = _reload_problem(model, pack)
    layout = checkpoint_layout(model)[0]

    def plan(fold: bool, unfolded: str = "its 1/s is not folded") -> tuple[dict[str, np.ndarray], set[str],
                                                                            dict[str, Any], list[str], bool]:
        # fused 3-D experts (transformers 5 MoE): per expert in transformers' layout where packed / sparse
        p = plan_tensors(model, state, sparse_format, fold, unfolded=unfolded, experts=layout)
        return p.tensors, p.bf16, quantization_config(p), p.dense_notes, p.folded

    def write(tmp: str, tensors: dict[str, np.ndarray], bf16: set[str], qc: dict[str, Any]) -> None:
        os.makedirs(tmp)
        write_config(model, tmp, qc)
        write_safetensors(os.path.join(tmp, "model.safetensors"), tensors, {"format": "pt"}, bf16=bf16)

    # ---- write: a temporary folder next to the target, renamed into place
    tensors, bf16, qc, dense_notes, folded = plan(True)
    with atomic_paths(path, names=("hf_path",)) as (tmp,):
        write(tmp, tensors, bf16, qc)
        if folded:  # the AWQ folds assume how the model wires its layers: check them on the written weights
            err, tol = _fold_error(model, tmp)
            if err > tol:
                shutil.rmtree(tmp)
                # the reason first, in the one note of every AWQ layer (the folds assume a wiring this model lacks)
                tensors, bf16, qc, dense_notes, _ = plan(False, f"the AWQ 1/s folds changed this model's logits by "
                                                               f"{err:.3g} (> {tol:.3g}), so none is used")
                write(tmp, tensors, bf16, qc)
        _keep_foreign_files(path, tmp)
    if dense_notes:
        warnings.warn(f"export_model(hf_path=...): {dense_warning(dense_notes)}", UserWarning, stacklevel=4)
    if reload_note and qc.get("config_groups"):
        warnings.warn(f"export_model(hf_path=...): {reload_note}", UserWarning, stacklevel=4)
    if qc.get("sparsity_config"):
        warnings.warn(f"export_model(hf_path=...): {len(qc['sparsity_config']['targets'])} layers are stored "
                      f"{qc['sparsity_config']['format']}, a format compressed-tensors 0.15+ (and transformers with it) "
                      f"no longer reads: from_pretrained would leave those weights randomly initialised. Read it with "
                      f"compressor.core.compressed_tensors.load_compressed_tensors / 'compressor unpack', or write "
                      f"hf_sparse_format='dense' for from_pretrained", UserWarning, stacklevel=4)
