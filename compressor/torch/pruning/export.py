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

from ...core.errors import ConfigError
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
    paths = sorted(wrappers, key=len, reverse=True)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        p = _owner(key, paths)
        if p is None:
            out[key] = value.detach().clone()
            continue
        rest = key[len(p) + 1:]
        if rest.startswith("module."):
            out[f"{p}.{rest[len('module.'):]}"] = value.detach().clone()
        elif rest.split(".")[0] not in wrappers[p]._buffers:
            out[key] = value.detach().clone()
    for p, w in wrappers.items():  # zero explicitly: weights may have been written through .data
        for param, mask in (("weight", w.weight_mask), ("bias", w.bias_mask)):
            key = f"{p}.{param}"
            if mask is not None and key in out:
                out[key].mul_(mask.to(out[key].device))
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
    return clone


def masks_of(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer path: {'weight': mask, 'bias': mask}}`` on the CPU."""
    out = {}
    for p, w in pruner_wrappers(model).items():
        entry = {"weight": w.weight_mask.detach().cpu().clone()}
        if w.bias_mask is not None:
            entry["bias"] = w.bias_mask.detach().cpu().clone()
        out[p] = entry
    return out


def export_pruned_model(pruner: Any, model_path: str | os.PathLike, mask_path: str | os.PathLike | None = None,
                        onnx_path: str | os.PathLike | None = None, input_shape: tuple[int, ...] | None = None,
                        device: Any = None) -> None:
    """Write the original-keys state_dict, the masks and an onnxruntime-checked ONNX file."""
    model = pruner.bound_model
    if onnx_path is not None and input_shape is None:
        raise ConfigError("export_model: onnx_path needs input_shape (e.g. (1, 3, 32, 32))")
    torch.save(unwrapped_state_dict(model), model_path)
    if mask_path is not None:
        torch.save(masks_of(model), mask_path)
    if onnx_path is not None:
        export_onnx(unwrapped_model(model), onnx_path, tuple(input_shape), device)


def export_onnx(model: nn.Module, onnx_path: str | os.PathLike, input_shape: tuple[int, ...], device: Any = None) -> None:
    """Export ``model`` (eval mode) to ONNX and, when onnxruntime is installed, check it gives the same outputs."""
    if device is None:
        device = next(iter(model.parameters()), torch.empty(0)).device
    model = model.to(device).eval()
    dummy = torch.randn(*input_shape, device=device)
    torch.onnx.export(model, (dummy,), os.fspath(onnx_path), dynamo=True, external_data=False, verbose=False)
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - optional dependency
        return
    session = ort.InferenceSession(os.fspath(onnx_path), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: dummy.detach().cpu().numpy()})[0]
    with torch.no_grad():
        want = model(dummy).detach().cpu().numpy()
    import numpy as np

    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-3, atol=1e-4):
        raise RuntimeError(f"ONNX export check failed: onnxruntime output differs from the model's "
                           f"(max abs diff {float(np.max(np.abs(got - want))) if got.shape == want.shape else 'shape'})")


def load_into_wrapped(pruner: Any, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into the wrapped model: original keys are mapped to ``<layer>.module.<param>``;
    a wrapped-model state_dict (with masks) loads as is. Then the masks are applied."""
    model = pruner.bound_model
    wrappers = pruner_wrappers(model)
    paths = sorted(wrappers, key=len, reverse=True)
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
                   if not (_owner(k, paths) and k[len(_owner(k, paths)) + 1:].split(".")[0] in wrappers[_owner(k, paths)]._buffers)]
        if missing or result.unexpected_keys:
            raise ConfigError(f"load_model_state_dict: state does not fit the model; missing keys {missing}, "
                              f"unexpected keys {list(result.unexpected_keys)}")
    for w in wrappers.values():
        w.apply_masks()


def apply_compression_results(model: nn.Module, mask_path: str | os.PathLike, device: Any = None) -> nn.Module:
    """Apply a mask file written by ``export_model`` to ``model``: pruning wrappers get the masks, plain
    layers get their pruned weights zeroed in place. Loaded with ``weights_only=True``."""
    masks = torch.load(mask_path, map_location=device or "cpu", weights_only=True)
    if not isinstance(masks, dict):
        raise ConfigError(f"{os.fspath(mask_path)!r} is not a mask file (expected {{layer: {{'weight': mask}}}})")
    for name, entry in masks.items():
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

