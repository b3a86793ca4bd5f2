"""Model families (Hugging Face ``transformers``, ...) as plug-ins of the PyTorch backend.

The base classes of the backend (layouts, wrappers, the ``Compressor``, speedup, ONNX export) never name a
model family. What a family needs from them goes through the questions of :class:`ModelFamily`,
answered by the adapters that plugins declare with the ``compressor_add_model_families`` pluggy hook
(the built-in one: ``compressor.torch.hf:FAMILY``, registered by ``compressor.torch_plugin``). A family
adapter is any object with these methods; subclass :class:`ModelFamily` for the defaults.

Adding a family: write the adapter next to the family's code (above the base layers), declare it in a
plugin's ``compressor_add_model_families(registry)`` with ``registry.add_model_family('torch', name,
'package.module:ADAPTER')``; nothing in the base classes changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ..core.errors import ModelError
from ..core.registry import registry

__all__ = ["ModelFamily", "families", "is_in_out_linear", "on_compress", "export_context", "after_speedup",
           "save_checkpoint"]


class ModelFamily:
    """The hooks a model family can implement (every default does nothing)."""

    name = "family"

    def claims(self, model: nn.Module) -> bool:
        """True when ``model`` belongs to this family (the per-model hooks below run only then)."""
        return False

    def is_in_out_linear(self, layer: nn.Module) -> bool:
        """True for a layer of this family that computes like ``nn.Linear`` with its weight stored
        ``[in, out]`` (the backend sees it transposed, out-first: :mod:`compressor.torch.layout`)."""
        return False

    def on_compress(self, model: nn.Module) -> None:
        """Called once a compressor has wrapped layers of ``model`` (e.g. make the family's save method
        write the compressed values)."""

    def export_context(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A context the model is exported to ONNX under (e.g. a causal LM without its key/value cache)."""
        return contextlib.nullcontext()

    def after_speedup(self, model: nn.Module, layers: list[dict[str, Any]]) -> str | None:
        """Called on a sped-up model with the speedup report's rows; returns a note for the report."""
        return None

    def save_checkpoint(self, model: nn.Module, path: str, **options: Any) -> bool:
        """Write the compressed ``model`` as this family's checkpoint folder at ``path`` (e.g. Hugging Face's
        compressed-tensors format); False when the family has no such format."""
        return False


_CACHE: list[Any] = [None, []]  # [the registry the list was read from, the adapters]


def families() -> list[Any]:
    """The PyTorch family adapters of every registered plugin (read again when the registry is rebuilt,
    e.g. after ``compressor.core.register_plugin``)."""
    reg = registry()
    if _CACHE[0] is not reg:
        _CACHE[:] = [reg, reg.model_families("torch")]
    return _CACHE[1]


def _claiming(model: nn.Module) -> list[Any]:
    return [f for f in families() if f.claims(model)]


def is_in_out_linear(layer: nn.Module) -> bool:
    """True when a family says ``layer`` is a Linear whose weight is stored ``[in, out]``."""
    return any(f.is_in_out_linear(layer) for f in families())


def on_compress(model: nn.Module) -> None:
    for f in _claiming(model):
        f.on_compress(model)


@contextlib.contextmanager
def export_context(model: nn.Module) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for f in _claiming(model):
            stack.enter_context(f.export_context(model))
        yield


def after_speedup(model: nn.Module, layers: list[dict[str, Any]]) -> list[str]:
    """The notes of every family that claims the sped-up ``model``."""
    return [n for f in _claiming(model) if (n := f.after_speedup(model, layers))]


def save_checkpoint(model: nn.Module, path: Any, **options: Any) -> None:
    """Write ``model`` in the checkpoint format of the family that claims it (``export_model(hf_path=...)``)."""
    for f in _claiming(model):
        if f.save_checkpoint(model, path, **options):
            return
    raise ModelError(f"hf_path: {type(model).__name__} belongs to no model family with a checkpoint format (a Hugging "
                     f"Face transformers PreTrainedModel writes compressed-tensors checkpoints); use model_path")
