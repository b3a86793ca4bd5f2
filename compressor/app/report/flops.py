"""MACs per sample and parameters, dense vs. after structured speedup (always on a copy): of an exported model
file (:func:`file_flops`, ``compressor report --flops``) or of a live pruner (:func:`pruner_report`).
"""

from __future__ import annotations

import os
from typing import Any

from ...core.errors import ConfigError, ModelError
from .files import _check_file, _suffix
from .keras_files import load_keras
from .torch_files import TORCH_SUFFIXES, _torch_load


def pruner_report(pruner: Any, dummy_input: Any = None, strict: bool = False) -> Any:
    """``pruner``'s sparsity report (see ``pruner.report()``) with ``report.flops``: MACs per sample and
    parameters of the dense model and of a sped-up copy (``speedup_model`` on a copy; the pruner and its
    model are not modified). torch needs ``dummy_input`` (one forward's input); Keras does not."""
    from ...core.registry import backend_for

    backend = backend_for(getattr(pruner, "bound_model", getattr(pruner, "model", pruner)))
    if backend == "torch":
        if dummy_input is None:
            raise ConfigError("pruner_report on a torch pruner needs dummy_input (one forward's input)")
        from ...torch.pruning.report import sparsity_report

        return sparsity_report(pruner, dummy_input=dummy_input, strict=strict)
    if dummy_input is not None:
        raise ConfigError("pruner_report on a Keras pruner takes no dummy_input (shapes are in the model)")
    from ...tf.pruning.report import sparsity_report as tf_report

    refresh = getattr(pruner, "_refresh_ready", None)
    if refresh is not None:
        refresh()
    return tf_report(pruner, flops=True, strict=strict)


def parse_input_shape(text: str) -> tuple[int, ...]:
    """``'1,3,32,32'`` (or ``1x3x32x32``) -> ``(1, 3, 32, 32)``; ConfigError on anything else."""
    parts = [p for p in text.replace("x", ",").replace(" ", "").split(",") if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise ConfigError(f"--input-shape {text!r}: expected positive integers such as 1,3,32,32")
    return shape


def _import_model_fn(spec: str) -> Any:
    import importlib
    import sys

    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"--model-fn {spec!r}: expected MODULE:CALLABLE (e.g. mypkg.models:resnet18)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        fn: Any = importlib.import_module(module)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--model-fn {spec!r}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"--model-fn {spec!r} is not callable")
    return fn


def _torch_model(path: str, model_fn: str) -> Any:
    """The model built by ``model_fn`` with the state_dict of ``path`` loaded (wrapped keys unwrapped)."""
    sd = _torch_load(path)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ModelError(f"{path!r} holds a {type(sd).__name__}, not a state_dict")
    state = {}
    for key, value in sd.items():
        parts = [p for p in key.split(".") if p != "module"]
        if parts[-1] in ("weight_mask", "bias_mask"):
            continue
        state[".".join(parts)] = value
    model = _import_model_fn(model_fn)()
    try:
        model.load_state_dict(state)
    except Exception as e:  # missing / unexpected keys, shape mismatches
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{path!r} does not fit the model of --model-fn {model_fn!r} ({first})") from None
    return model


def file_flops(path: str | os.PathLike, masks: str | os.PathLike | None = None,
               input_shape: tuple[int, ...] | None = None, model_fn: str | None = None) -> dict[str, Any]:
    """MACs per sample and parameters of an exported model as it is ("dense") and after ``speedup_model``
    (masks from ``masks`` or, for a wrapped torch state_dict, from the file; without masks, channels whose
    weights are all zero go): a :func:`~compressor.core.report.flops_summary` dict. ``.keras`` files load
    as they are; a torch state_dict needs ``model_fn`` (``'module:callable'`` returning the model) and
    ``input_shape`` (with the batch dimension, e.g. ``(1, 3, 32, 32)``)."""
    from ...core.report import flops_summary

    p = _check_file(path, "model file")
    m = None if masks is None else _check_file(masks, "mask file")
    suffix = _suffix(p)
    if suffix == ".keras":
        model = load_keras(p)
        from ...tf.speedup import speedup_model

        _, rep = speedup_model(model, masks=m, strict=False, return_report=True)
        return flops_summary(rep.macs_before, rep.params_before, rep.macs_after, rep.params_after, rep.notes)
    if suffix in TORCH_SUFFIXES:
        if model_fn is None or input_shape is None:
            raise ConfigError(f"MACs of {p!r} need the model's class and an input: pass --model-fn MODULE:CALLABLE "
                              f"and --input-shape (e.g. 1,3,32,32); a state_dict holds no architecture")
        import torch

        from ...torch.speedup import speedup_model, speedup_report

        model = _torch_model(p, model_fn)
        wrapped_masks: dict[str, dict[str, Any]] = {}
        if m is None:  # a wrapped model's state_dict carries its masks
            raw = _torch_load(p)
            raw = raw["state_dict"] if isinstance(raw, dict) and isinstance(raw.get("state_dict"), dict) else raw
            for key, value in raw.items():
                parts = [q for q in key.split(".") if q != "module"]
                if parts[-1] in ("weight_mask", "bias_mask"):
                    wrapped_masks.setdefault(".".join(parts[:-1]), {})[parts[-1][:-5]] = value
        model.eval()
        small = speedup_model(model, torch.zeros(input_shape), masks=m if m is not None else (wrapped_masks or None),
                              strict=False)
        rep = speedup_report(small)
        return flops_summary(rep.macs_before, rep.params_before, rep.macs_after, rep.params_after, rep.notes)
    raise ConfigError(f"{p!r}: MACs need a Keras model (.keras) or a torch state_dict (.pt/.pth) with --model-fn")
