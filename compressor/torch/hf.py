"""Hugging Face ``transformers`` models under a compressor (nothing here imports transformers).

A model-family plug-in (:data:`FAMILY`, declared by ``compressor.torch_plugin`` through the
``compressor_add_model_families`` hook; see :mod:`compressor.torch.families`): the base classes of the
backend call it, never this module.

* :func:`is_hf_conv1d`: GPT-2's ``Conv1D`` is a Linear whose weight is stored ``[in, out]``; the
  compressors see it in the canonical out-first layout (see :mod:`compressor.torch.layout`).
* :func:`export_ready`: an ONNX export of a causal LM runs without its key/value cache
  (``config.use_cache = False`` while exporting), so the graph's outputs are the model's tensors.
* :func:`install` (called by every compressor on a ``PreTrainedModel``): ``model.save_pretrained()``
  writes the ORIGINAL keys with the compressed values (pruned weights zero, quantized weights holding
  their quantized values; tied weights stay tied), so ``from_pretrained`` gives the compressed model;
  ``model.resize_token_embeddings()`` is refused while an embedding or the LM head is wrapped.
* :func:`speedup_config` (called by ``speedup_model``): the new widths of a sped-up model written into
  its config, so ``save_pretrained`` / ``from_pretrained`` round-trip; where the config cannot express
  them, ``save_pretrained`` raises instead of writing a checkpoint that would not load.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..core.atomic import atomic_path
from ..core.errors import ModelError
from .families import ModelFamily
from .modules import innermost_module, is_wrapper, named_wrappers
from .pruning.wrapper import PrunerModuleWrapper
from .quantization.export import quantized_state_dict
from .quantization.wrapper import QuantizerModuleWrapper

__all__ = ["FAMILY", "HuggingFace", "is_hf_conv1d", "is_hf_model", "export_ready", "install", "compressed_state_dict", "speedup_config"]


def is_hf_conv1d(module: nn.Module) -> bool:
    """True for ``transformers.pytorch_utils.Conv1D`` (a Linear with its weight stored ``[in, out]``)."""
    t = type(module)
    return t.__name__ == "Conv1D" and t.__module__.startswith("transformers") and hasattr(module, "nf")


def is_hf_model(model: nn.Module) -> bool:
    """True for a ``transformers`` ``PreTrainedModel`` (checked by its methods, without importing it)."""
    return (callable(getattr(type(model), "save_pretrained", None)) and hasattr(model, "config")
            and any(c.__module__.startswith("transformers") for c in type(model).__mro__))


@contextlib.contextmanager
def export_ready(model: nn.Module) -> Iterator[None]:
    """While exporting: a model whose config caches keys/values (causal LMs) runs without the cache."""
    # the model's config and any other config a submodule holds (a model whose config was replaced keeps the
    # old object in its inner modules, which decide whether to build a cache)
    configs = {id(c): c for c in [getattr(model, "config", None)] + [m.__dict__.get("config") for m in model.modules()]
               if c is not None and getattr(c, "use_cache", None)}
    cached = {k: c.use_cache for k, c in configs.items()}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for k, c in configs.items():
            c.use_cache = cached[k]


# ---------------------------------------------------------------------------------- save_pretrained
class _CompressedMethod:
    """``model.<name>`` of a compressed Hugging Face model (an instance attribute shadowing the class's
    method); picklable and deep-copyable with the model. Without wrappers it is the class's method."""

    def __init__(self, model: nn.Module, name: str):
        self.model = model
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = getattr(type(self.model), self.name)
        refused = self.model.__dict__.get("_speedup_config_error")
        if self.name == "save_pretrained" and refused:
            raise ModelError(refused)
        if not named_wrappers(self.model):
            return original(self.model, *args, **kwargs)
        return _OVERRIDES[self.name](self.model, original, *args, **kwargs)


def install(model: nn.Module) -> None:
    """Make ``save_pretrained`` / ``resize_token_embeddings`` of a ``PreTrainedModel`` aware of the
    compressor wrappers in it (idempotent)."""
    for name in _OVERRIDES:
        if callable(getattr(type(model), name, None)) and not isinstance(model.__dict__.get(name), _CompressedMethod):
            object.__setattr__(model, name, _CompressedMethod(model, name))


def _wrapper_own_names(wrapper: nn.Module) -> set[str]:
    return set(wrapper._buffers) | set(wrapper._parameters)


def _original_key(key: str, wrappers: dict[str, list[nn.Module]]) -> str | None:
    """``key`` of a state_dict with compressor wrappers, as the plain model names it (None: a wrapper's
    own buffer or parameter, e.g. a mask or a scale)."""
    for name in sorted(wrappers, key=len, reverse=True):
        prefix = f"{name}." if name else ""
        if not key.startswith(prefix):
            continue
        rest, inner = key[len(prefix):], False
        while rest.startswith("module."):
            rest, inner = rest[len("module."):], True
        if not inner and any(rest.split(".")[0] in _wrapper_own_names(w) for w in wrappers[name]):
            return None
        return prefix + rest
    return key


def compressed_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict of the plain model (ORIGINAL keys, no masks or quantizer state) holding the
    compressed values: pruned weights zero, quantized weights their quantized values. Keys that name one
    Parameter (tied weights) hold one tensor."""
    wrappers: dict[str, list[nn.Module]] = {}
    quantizers: dict[int, Any] = {}
    for _, m in model.named_modules():
        if isinstance(m, PrunerModuleWrapper):
            m.apply_masks()
        if isinstance(m, (PrunerModuleWrapper, QuantizerModuleWrapper)):
            wrappers.setdefault(m.name, []).append(m)
        if isinstance(m, QuantizerModuleWrapper):
            if m.quantizer is None:
                raise ModelError(f"layer {m.name!r}: this quantized model was pickled or copied without its "
                                 f"quantizer; save it from the model the quantizer is attached to, or use "
                                 f"quantizer.export_model()")
            quantizers[id(m.quantizer)] = m.quantizer
    if len(quantizers) > 1:
        raise ModelError(f"{len(quantizers)} quantizers are attached to this model; save it with each quantizer's "
                         f"export_model() instead")
    training = model.training
    model.eval()
    try:
        if quantizers:
            state, _ = quantized_state_dict(next(iter(quantizers.values())))
        else:
            state = model.state_dict()
    finally:
        model.train(training)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        k = _original_key(key, wrappers)
        if k is not None:
            out[k] = value.detach().clone()
    # one tensor per Parameter: Hugging Face saves a tied weight once (it finds ties by storage)
    first: dict[int, str] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        k = _original_key(key, wrappers)
        if k is None or k not in out:
            continue
        if id(p) in first:
            out[k] = out[first[id(p)]]
        else:
            first[id(p)] = k
    return out


@contextlib.contextmanager
def _plain_modules(model: nn.Module) -> Iterator[None]:
    """The original layers in the module tree for a while (wrappers put back afterwards)."""
    swaps = []
    for parent in list(model.modules()):
        for attr, child in list(parent._modules.items()):
            if child is not None and is_wrapper(child) and not is_wrapper(parent):
                swaps.append((parent, attr, child))
    try:
        for parent, attr, child in swaps:
            parent._modules[attr] = innermost_module(child)
        yield
    finally:
        for parent, attr, child in swaps:
            parent._modules[attr] = child


def _save_pretrained(model: nn.Module, original: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """Save the compressed model in the Hugging Face format: original keys, compressed values; the config
    and everything else as ``save_pretrained`` writes them."""
    if kwargs.get("state_dict") is not None or len(args) >= 2:
        raise ModelError("save_pretrained(state_dict=...) on a compressed model: the state_dict is the compressed "
                         "model's own (original keys, compressed values); leave state_dict out")
    activations = sorted({w.name for _, w in model.named_modules() if isinstance(w, QuantizerModuleWrapper)
                          and any(t in w.quant_types for t in ("input", "output"))})
    if activations:
        warnings.warn(f"save_pretrained stores the quantized weights; the input/output quantization of "
                      f"{activations} is not part of a Hugging Face checkpoint (the reloaded model computes "
                      f"those activations in float). quantizer.export_model(calibration_path=..., "
                      f"onnx_path=...) keeps it", UserWarning, stacklevel=3)
    state = compressed_state_dict(model)
    target = os.fspath(save_directory)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise NotADirectoryError(errno.ENOTDIR, "save_pretrained needs a directory; this is a file", target)
    if kwargs.get("push_to_hub"):  # the repository is named after the target folder, not the temporary one
        kwargs.setdefault("repo_id", os.path.basename(os.path.abspath(target)))
    # all or nothing: written into a sibling temporary folder, swapped in when complete (core.atomic)
    with atomic_path(target) as tmp:
        os.mkdir(tmp)
        _copy_kept_files(target, tmp)
        with _plain_modules(model):
            result = original(model, tmp, *args, state_dict=state, **kwargs)
    return result


# what save_pretrained (re)writes or deletes itself: config, generation config, weights, shards, shard index
_REWRITTEN = re.compile(r"(config|generation_config)\.json|(pytorch_|tf_|flax_)?model(-\d{5}-of-\d{5})?"
                        r"\.(safetensors|bin|h5|msgpack)(\.index\.json)?")


def _copy_kept_files(folder: str, tmp: str) -> None:
    """Copy what else the existing checkpoint folder holds (tokenizer files, a README, training arguments)
    into the temporary folder, so the swap keeps them as writing in place would."""
    if not os.path.isdir(folder):
        return
    for entry in os.scandir(folder):
        if _REWRITTEN.fullmatch(entry.name):
            continue
        dst = os.path.join(tmp, entry.name)
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, dst, symlinks=True)
        else:
            shutil.copy2(entry.path, dst, follow_symlinks=False)


def _resize_token_embeddings(model: nn.Module, original: Any, *args: Any, **kwargs: Any) -> Any:
    """Refused while the token embedding or the LM head is compressed (their masks / quantizer state
    have the old vocabulary size); other compressed layers do not care."""
    hit = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        module = fn() if callable(fn) else None
        if module is not None and is_wrapper(module):
            hit.append(getattr(module, "name", getter))
    if hit:
        raise ModelError(f"resize_token_embeddings: {hit} are compressed (wrapped) and their masks / quantizer "
                         f"state have the current vocabulary size; resize before compressing, or save the "
                         f"compressed model (save_pretrained / export_model), reload it, resize, and compress again")
    return original(model, *args, **kwargs)


_OVERRIDES = {"save_pretrained": _save_pretrained, "resize_token_embeddings": _resize_token_embeddings}


# ---------------------------------------------------------------------------------- after speedup
#: config attributes that hold layer widths speedup can change (per model family, the names HF uses)
_WIDTH_KEYS = ("intermediate_size", "n_inner", "hidden_sizes", "embedding_size")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def speedup_config(model: nn.Module, layers: list[dict[str, Any]]) -> str | None:
    """Write the widths of a sped-up ``PreTrainedModel`` into ``model.config``; returns a note.

    ``layers``: the speedup report's rows (``out = (before, after)`` per changed layer). Each width
    attribute (``intermediate_size``, ``n_inner``, ``hidden_sizes``, ``embedding_size``; heads:
    ``num_attention_heads`` with ``head_dim`` kept) whose old value was cut to ONE new value everywhere
    takes it; the result is accepted only if the model class built from the new config (on the meta
    device, no memory) has exactly the sped-up model's parameter shapes, so ``from_pretrained`` reloads
    it. Otherwise the config stays, and ``save_pretrained`` of this model raises :class:`ModelError`
    naming the layers whose widths the config cannot express (e.g. widths that differ per layer, or
    ConvNext / MobileNetV2 inner widths derived from fixed ratios); save with ``torch.save(model)`` or
    export ONNX instead."""
    import copy

    if not is_hf_model(model):
        return None
    install(model)
    config = model.config
    new = copy.deepcopy(config)
    cut: dict[int, set[int]] = {}
    heads: dict[int, set[int]] = {}
    for row in layers:
        if row.get("out") is None:
            continue
        before, after = row["out"]
        cut.setdefault(int(before), set()).add(int(after))
        if row.get("heads") is not None:
            h0, h1 = row["heads"]
            heads.setdefault(int(h0), set()).add(int(h1))

    def mapped(v: Any, table: dict[int, set[int]]) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and len(table.get(v, ())) == 1:
            return next(iter(table[v]))
        return v

    for key in _WIDTH_KEYS:
        v = getattr(config, key, None)
        if key == "n_inner" and v is None and isinstance(getattr(config, "n_embd", None), int):
            v = 4 * config.n_embd  # GPT-2: None means 4 * n_embd
            if v not in cut:
                continue
        if isinstance(v, (list, tuple)):
            setattr(new, key, type(v)(mapped(x, cut) for x in v))
        elif v is not None:
            setattr(new, key, mapped(v, cut))
    for key in _HEAD_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and len(heads.get(v, ())) == 1:
            d = getattr(config, "head_dim", None)
            hidden = getattr(config, "hidden_size", None)
            if d is None and isinstance(hidden, int) and v:
                new.head_dim = hidden // v  # models that read head_dim from the config keep theirs
            setattr(new, key, next(iter(heads[v])))
    have = _shapes(model)
    try:
        with torch.device("meta"):
            ref = type(model)(new)
        want = _shapes(ref)
    except Exception as e:  # noqa: BLE001 - any failure means the config cannot express the model
        want, why = None, f"{type(model).__name__}({type(e).__name__}: {e})"
    if want is not None:
        bad = sorted(k for k in have if k in want and have[k] != want[k])
        missing = sorted(set(have) ^ set(want))
        if not bad and not missing:
            # every submodule holding the old config (GPT2Model, its attention blocks, ...) gets the new one:
            # they read use_cache / output flags from it, so the export context (use_cache=False) reaches them
            for module in model.modules():
                if module.__dict__.get("config") is config:
                    module.config = new
            model.__dict__.pop("_speedup_config_error", None)
            changed = {k: getattr(new, k) for k in (*_WIDTH_KEYS, *_HEAD_KEYS, "head_dim")
                       if getattr(new, k, None) != getattr(config, k, None)}
            return f"config updated for save_pretrained / from_pretrained: {changed}" if changed else None
        why = "; ".join([f"{k}: {have[k]} (the config gives {want[k]})" for k in bad[:6]]
                        + ([f"keys differ: {missing[:4]}"] if missing else []))
    msg = (f"save_pretrained: this sped-up {type(model).__name__} has layer widths its config cannot express "
           f"({why}); a checkpoint written now would not load with from_pretrained. Save it with "
           f"torch.save(model) (or export ONNX), or prune with the same sparsity in every repeated block")
    model.__dict__["_speedup_config_error"] = msg
    return "save_pretrained is refused: the config cannot express the new widths (see the error it raises)"


# ---------------------------------------------------------------------------------- the plug-in
class HuggingFace(ModelFamily):
    """``transformers`` models: GPT-2's ``Conv1D`` is an ``[in, out]`` Linear; a compressed
    ``PreTrainedModel`` saves its compressed values with ``save_pretrained``; causal LMs export without
    their key/value cache; a sped-up model's config gets its new widths."""

    name = "huggingface"

    def claims(self, model: nn.Module) -> bool:
        return is_hf_model(model)

    def is_in_out_linear(self, layer: nn.Module) -> bool:
        return is_hf_conv1d(layer)

    def on_compress(self, model: nn.Module) -> None:
        install(model)

    def export_context(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return export_ready(model)

    def after_speedup(self, model: nn.Module, layers: list[dict[str, Any]]) -> str | None:
        return speedup_config(model, layers)

    def save_checkpoint(self, model: nn.Module, path: str, **options: Any) -> bool:
        from .hf_checkpoint import save_compressed_tensors

        save_compressed_tensors(model, path, compressed_state_dict(model), **options)
        return True


#: the adapter ``compressor.torch_plugin`` declares
FAMILY = HuggingFace()
