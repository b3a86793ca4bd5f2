"""Export and reload of pruned models.

* :func:`unwrapped_state_dict` -- the wrapped model's state_dict under the ORIGINAL keys (``conv1.weight``,
  not ``conv1.module.weight``), pruned weights zeroed, masks and wrapper buffers left out: it loads into
  a fresh instance of the user's model class.
* :func:`export_pruned_model` -- writes that state_dict, optionally the masks (``{layer: {'weight': mask,
  'bias': mask}}``) and an ONNX file of the unwrapped model, verified against the model with onnxruntime.
* :func:`load_into_wrapped` -- loads an original-keys (or wrapped) state_dict into the wrapped model.
* :func:`apply_compression_results` -- applies a saved mask file to a model (wrapped or not).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from ...core.atomic import atomic_paths
from ...core.errors import ConfigError
from ..slots import apply_slot_masks, container_masks, slot_of, slotted_layers, unwrap_containers
from .wrapper import PrunerModuleWrapper

__all__ = ["apply_compression_results", "export_pruned_model", "load_into_wrapped", "pruner_wrappers",
           "unwrapped_model", "unwrapped_state_dict"]


def pruner_wrappers(model: nn.Module) -> dict[str, PrunerModuleWrapper]:
    """Path -> pruning wrapper, for every pruning wrapper in ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, PrunerModuleWrapper)}


def _owner(key: str, paths: list[str]) -> str | None:
    for p in paths:  # longest first
        if key.startswith(p + "."):
            return p
    return None


def unwrapped_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with original keys; pruned weights/biases are zero in it (independent copies)."""
    wrappers = pruner_wrappers(model)
    for w in wrappers.values():
        w.apply_masks()
    containers = slotted_layers(model)  # recurrent / attention layers: <layer>.module.<param>, <layer>.slots.*
    paths = sorted([*wrappers, *containers], key=len, reverse=True)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        p = _owner(key, paths)
        if p is None:
            out[key] = value.detach().clone()
            continue
        rest = key[len(p) + 1:]
        if rest.startswith("module."):
            out[f"{p}.{rest[len('module.'):]}"] = value.detach().clone()
        elif p in containers:
            continue
        elif rest.split(".")[0] not in wrappers[p]._buffers:
            out[key] = value.detach().clone()
    for p, w in wrappers.items():  # zero explicitly: weights may have been written through .data
        for param, mask in (("weight", w.weight_mask), ("bias", w.bias_mask)):
            key = f"{p}.{param}"
            if mask is not None and key in out:  # where(), not *: a pruned negative weight is +0.0, not -0.0
                out[key] = torch.where(mask.to(out[key].device), out[key], torch.zeros((), dtype=out[key].dtype,
                                                                                       device=out[key].device))
    return out


def unwrapped_model(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every pruning wrapper replaced by its (masked) original layer."""
    wrappers = pruner_wrappers(model)
    for w in wrappers.values():
        w.apply_masks()
    clone = copy.deepcopy(model)
    for path in sorted(pruner_wrappers(clone), key=len, reverse=True):
        parent_path, _, attr = path.rpartition(".")
        parent = clone.get_submodule(parent_path) if parent_path else clone
        setattr(parent, attr, parent._modules[attr].module)
    unwrap_containers(clone)
    return clone


def masks_of(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer path: {'weight': mask, 'bias': mask}}`` on the CPU."""
    wrappers = pruner_wrappers(model)
    out = container_masks(model, wrappers)  # a matrix of a recurrent / attention layer: {layer: {param: mask}}
    for p, w in wrappers.items():
        if slot_of(w) is not None:
            continue
        entry = {"weight": w.weight_mask.detach().cpu().clone()}
        if w.bias_mask is not None:
            entry["bias"] = w.bias_mask.detach().cpu().clone()
        out[p] = entry
    return out


def export_pruned_model(pruner: Any, model_path: str | os.PathLike, mask_path: str | os.PathLike | None = None,
                        onnx_path: str | os.PathLike | None = None, input_shape: tuple[int, ...] | None = None,
                        device: Any = None, dummy_input: Any = None, compressed_path: str | os.PathLike | None = None,
                        **onnx_kwargs: Any) -> None:
    """Write the original-keys state_dict, the masks and an onnxruntime-checked ONNX file (inputs:
    ``dummy_input`` -- a tensor, tuple or dict of keyword arguments -- or ``torch.randn(*input_shape)``;
    see :mod:`compressor.torch.onnx_io`), and the same state_dict as a compressed file
    (``compressed_path``, :mod:`compressor.torch.cmpk`)."""
    from ..onnx_io import model_inputs

    model = pruner.bound_model
    args: tuple = ()
    kwargs: dict[str, Any] = {}
    if onnx_path is not None:
        if device is None:
            device = next(iter(model.parameters()), torch.empty(0)).device
        args, kwargs = model_inputs(dummy_input, input_shape, device)
    with atomic_paths(model_path, mask_path, onnx_path, compressed_path, names=(
            "model_path", "mask_path", "onnx_path", "compressed_path")) as (
            tmp_model, tmp_masks, tmp_onnx, tmp_packed):  # all or nothing (one transaction, core.atomic)
        state = unwrapped_state_dict(model)
        if tmp_model is not None:  # model_path=None: only the other artifacts (hf_path, compressed_path)
            save_file(state, tmp_model)
        if tmp_packed is not None:
            from ..cmpk import save_compressed

            save_compressed(state, tmp_packed)
        if tmp_masks is not None:
            save_file(masks_of(model), tmp_masks)
        if tmp_onnx is not None:
            export_onnx(unwrapped_model(model), tmp_onnx, args, kwargs, device, **onnx_kwargs)


def save_file(obj: Any, path: str) -> None:
    """``torch.save`` through a file object: a failed write (full disk) then carries the system error, which
    :mod:`compressor.core.atomic` reports as an OSError naming the target (a path gives torch's own
    ``inline_container.cc`` RuntimeError without it)."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def export_onnx(model: nn.Module, onnx_path: str | os.PathLike, args: tuple, kwargs: dict[str, Any] | None = None,
                device: Any = None, **onnx_kwargs: Any) -> None:
    """Export ``model`` (eval mode, on ``device``) to ONNX, checked with onnxruntime on ``(args, kwargs)``."""
    from ..onnx_io import export_onnx as export_checked

    if device is None:
        device = next(iter(model.parameters()), torch.empty(0)).device
    model = model.to(device).eval()
    export_checked(model, onnx_path, args, kwargs, **onnx_kwargs)


def load_into_wrapped(pruner: Any, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into the wrapped model: original keys are mapped to ``<layer>.module.<param>``;
    a wrapped-model state_dict (with masks) loads as is. Then the masks are applied."""
    model = pruner.bound_model
    wrappers = pruner_wrappers(model)
    containers = slotted_layers(model)
    paths = sorted([*wrappers, *containers], key=len, reverse=True)
    wrapped_format = any(k.startswith(p + ".module.") for k in state for p in paths)
    if wrapped_format:
        model.load_state_dict(state)
    else:
        mapped = {}
        for key, value in state.items():
            p = _owner(key, paths)
            mapped[key if p is None else f"{p}.module.{key[len(p) + 1:]}"] = value
        result = model.load_state_dict(mapped, strict=False)
        missing = [k for k in result.missing_keys
                   if not (_owner(k, paths) and (_owner(k, paths) in containers or k[len(_owner(k, paths)) + 1:].split(".")[0]
                                                 in wrappers[_owner(k, paths)]._buffers))]
        if missing or result.unexpected_keys:
            raise ConfigError(f"load_model_state_dict: state does not fit the model; missing keys {missing}, "
                              f"unexpected keys {list(result.unexpected_keys)}")
    for w in wrappers.values():
        w.apply_masks()


def load_mask_file(mask_path: str | os.PathLike, device: Any = None) -> Any:
    """The content of a torch mask file (``torch.load(..., weights_only=True)``: no arbitrary pickle, after
    :func:`compressor.core.archives.check_torch_archive`); a ConfigError naming the file when it is missing,
    not a torch file or past the caps."""
    p = os.fspath(mask_path)
    from ...core.atomic import recover_for_reading

    recover_for_reading(p)  # a killed export of this file: finished or undone before it is read
    if not os.path.isfile(p):
        raise ConfigError(f"mask file {p!r} does not exist")
    from ...core.archives import check_torch_archive
    from ..archive_checks import check_torch_object

    try:
        check_torch_archive(p)  # the zip's directory and pickle against the stated caps (core.archives)
        masks = torch.load(p, map_location=device or "cpu", weights_only=True)
        check_torch_object(masks, os.path.getsize(p))
        return masks
    except Exception as e:  # noqa: BLE001 - unpickling / zip / weights_only refusals, the caps: all bad input
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot read mask file {p!r} ({type(e).__name__}: {first}); write one with "
                          f"pruner.export_model(model_path, mask_path)") from None


def apply_compression_results(model: nn.Module, mask_path: str | os.PathLike, device: Any = None) -> nn.Module:
    """Apply a mask file written by ``export_model`` to ``model``: pruning wrappers get the masks, plain
    layers get their pruned weights zeroed in place. Loaded with ``weights_only=True``."""
    masks = load_mask_file(mask_path, device)
    if not isinstance(masks, dict):
        raise ConfigError(f"{os.fspath(mask_path)!r} is not a mask file (expected {{layer: {{'weight': mask}}}})")
    for name, entry in masks.items():
        try:
            if apply_slot_masks(model, name, entry, PrunerModuleWrapper):  # a recurrent / attention layer's
                continue
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ConfigError(f"mask file names layer {name!r}, which the model does not have") from None
        if isinstance(module, PrunerModuleWrapper):
            module.set_masks({f"{k}_mask": v for k, v in entry.items()})
            module.apply_masks()
            continue
        for param_name, mask in entry.items():
            param = getattr(module, param_name, None)
            if not torch.is_tensor(param) or tuple(param.shape) != tuple(mask.shape):
                raise ConfigError(f"mask {name}.{param_name} of shape {tuple(mask.shape)} does not fit the model")
            with torch.no_grad():
                param.mul_(mask.to(param.device))
    return model

