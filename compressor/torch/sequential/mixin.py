"""What the five one-shot compressors share on PyTorch (:class:`OneShotMixin`): ``sequential_targets``, the default
layer types (Linear + HF Conv1D; the output head and embedding-tied layers left out unless named), and
:meth:`~OneShotMixin.calibrate`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core.config import KeySpec
from ...core.errors import ConfigError, ModelError
from ...core.interrupts import deferred_interrupts
from ...core.matching import type_names
from ...core.oneshot import (
    ONESHOT_KEYS,
    ONESHOT_SKIP_HINT,
    LayerResult,
    OneShotMethod,
    forward_in_float64,
    run_sequential,
)
from ..calibration_data import _model_device, _to, calibration_batches
from ..layout import in_out_features
from ..modules import innermost_module
from .backend import TorchOneShotBackend
from .blocks import find_routers

#: what ``op_types: ['default']`` selects for the one-shot compressors: Linear layers (HF ``Conv1D`` included)
ONESHOT_DEFAULT_TYPES = ("Linear", "Conv1D")


def _check_targets(model: nn.Module, targets: Any, what: str) -> list[str] | None:
    if targets is None:
        return None
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(f"{what}: sequential_targets must be None or a non-empty list of block class names, e.g. "
                          f"['LlamaDecoderLayer'], got {targets!r}")
    present = {type(m).__name__ for m in model.modules()}
    missing = [t for t in targets if t not in present]
    if missing:
        lists = sorted({type(c).__name__ for m in model.modules() if isinstance(m, nn.ModuleList) for c in m})
        raise ModelError(f"{what}: sequential_targets {missing} name no module class of the model; the classes in "
                         f"its ModuleLists are {lists}")
    return list(targets)


def _is_output_embedding(model: nn.Module, module: nn.Module, name: str, embeddings: set[int]) -> bool:
    layer = innermost_module(module)
    if isinstance(layer, nn.Embedding):
        return False
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            out = get()
        except Exception:  # noqa: BLE001  (a model whose method needs more than it has)
            out = None
        if out is not None and innermost_module(out) is layer:
            return True
    w = getattr(layer, "weight", None)
    return name.rpartition(".")[2] == "lm_head" or (w is not None and id(w) in embeddings)


class OneShotMixin:
    """What the one-shot pruners and quantizers share: ``sequential_targets``, the default layer types
    (Linear + HF Conv1D, the output head and embedding-tied layers left out unless named in op_names), and
    :meth:`calibrate`. Mixed in before :class:`TorchPruner` / :class:`TorchQuantizer`."""

    method_class: type[OneShotMethod] = OneShotMethod
    default_types = ONESHOT_DEFAULT_TYPES
    default_skip_hint = ONESHOT_SKIP_HINT
    #: the rows of the last :meth:`calibrate` (``layer``, ``block``, ``method``, ``sparsity`` / ``bits``, ...)
    oneshot_rows: list[dict[str, Any]]

    def _init_oneshot(self, model: nn.Module, sequential_targets: Any) -> None:
        what = type(self).__name__
        if not isinstance(model, nn.Module):
            raise ModelError(f"{what}: model must be a torch.nn.Module, got {type(model).__module__}."
                             f"{type(model).__qualname__}")
        self.sequential_targets = _check_targets(model, sequential_targets, what)
        self.oneshot_rows = []
        self.calibrated = False

    def _substitute_layers(self, selected: list, layers: list, modules: dict[str, nn.Module]) -> list:
        """'default' selects Linear-like layers only (a torch nn.Conv1d shares the alias Conv1D); the output head
        (``get_output_embeddings()``, a layer called ``lm_head``, a weight tied to an ``nn.Embedding``) and the
        routers of mixture-of-experts blocks are left out unless op_names names them."""
        selected = super()._substitute_layers(selected, layers, modules)  # type: ignore[misc]
        model = self.bound_model  # type: ignore[attr-defined]
        # the routers / gates of mixture-of-experts blocks stay float unless named (as llmcompressor and vLLM expect)
        routers = set(find_routers(model))
        selected = [(i, c) for i, c in selected if i.name not in routers or i.name in c.get("op_names", ())]
        embeddings = {id(e.weight) for e in map(innermost_module, modules.values()) if isinstance(e, nn.Embedding)}
        out = []
        skipped = []
        for info, cfg in selected:
            module = modules[info.name]
            if info.name in cfg.get("op_names", ()):
                out.append((info, cfg))
                continue
            typed = any(t != "default" and info.type in type_names(t) for t in cfg.get("op_types", ()))
            if not typed and in_out_features(module) is None:
                continue  # 'default' = Linear-like layers (a torch nn.Conv1d shares the alias Conv1D)
            if _is_output_embedding(model, module, info.name, embeddings):
                skipped.append(info.name)
                continue
            out.append((info, cfg))
        if not out:
            present = sorted({info.type for info in layers if info.extra.get("weighted")})
            extra = f" (left out by default: the output head {skipped}; name it in op_names to include it)" if skipped else ""
            raise ConfigError(f"{type(self).__name__}: config_list selects no Linear layer of the model{extra}. Weighted "
                              f"layer types in the model: {present}; 'default' means {list(ONESHOT_DEFAULT_TYPES)}")
        return out

    def validate_layer(self, layer_info: Any, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)  # type: ignore[misc]
        if in_out_features(module) is None or getattr(module, "weight", None) is None or module.weight.dim() != 2:
            raise ConfigError(f"{type(self).__name__}: layer {layer_info.name!r} ({layer_info.type}) is not a Linear "
                              f"layer; the one-shot methods take nn.Linear and Hugging Face Conv1D")

    def _oneshot_mask(self, wrapper: nn.Module) -> torch.Tensor | None:
        """The keep-mask the method must respect (a pruner's own mask / the pruner wrapper under a quantizer)."""
        return None

    def _oneshot_write(self, wrapper: nn.Module, result: LayerResult) -> None:
        """Install the method's result in ``wrapper`` (the weight is written already)."""

    def calibrate(self, data: Any = None, num_samples: int | None = None, progress: Any = True,
                  forward_dtype: str = "model") -> Any:
        """Run the one-shot method on the calibration ``data`` (a tensor of token ids, a tuple of positional
        inputs, a dict / ``BatchEncoding`` of keyword inputs, or a DataLoader / list / iterable of those;
        ``num_samples``: at most that many sequences), block by block, and leave the model compressed.
        ``progress``: one line per block on stderr (True), a file, or False. ``forward_dtype``: the dtype of the
        block passes that record the statistics and hand the compressed outputs on ('model', the default: the
        model's own dtype, as llmcompressor; 'float64': the same result as Keras to ~1e-8; 'auto': float64 on CPU,
        the model's dtype on an accelerator; see
        :func:`compressor.core.oneshot.forward_in_float64`). Bad data raises before any weight
        changes. Returns self."""
        what = type(self).__name__
        method = self.method_class()
        model: nn.Module = self.bound_model  # type: ignore[attr-defined]
        device = _model_device(model)
        float64 = forward_in_float64(forward_dtype, f"{what}.calibrate", device.type == "cpu")
        if method.statistics is None and data is None:
            batches: list[tuple[tuple, dict[str, Any]]] = []
        else:
            batches = [(_to(a, device), _to(k, device))
                       for _, a, k in calibration_batches(data, f"{what}.calibrate", num_samples=num_samples)]
        backend = TorchOneShotBackend(self, self.sequential_targets, float64)
        modes = {m: m.training for m in model.modules()}
        grad = torch.is_grad_enabled()
        try:
            model.eval()
            with torch.no_grad():
                self.oneshot_rows = run_sequential(backend, method, batches, progress=progress)
        finally:
            # the training flags and torch's grad mode back, whatever stopped the run (a Ctrl-C may land inside
            # no_grad's own exit), with a second Ctrl-C held back meanwhile
            with deferred_interrupts():
                torch.set_grad_enabled(grad)
                for m, mode in modes.items():
                    m.training = mode
        self.calibrated = True
        return self


def oneshot_key_specs(*names: str) -> tuple[KeySpec, ...]:
    """The :data:`~compressor.core.oneshot.ONESHOT_KEYS` specs of ``names``."""
    return tuple(ONESHOT_KEYS[n] for n in names)

