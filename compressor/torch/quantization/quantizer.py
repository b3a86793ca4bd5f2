"""``TorchQuantizer`` (exported as ``Quantizer``): the base of every PyTorch quantizer.

Writing a quantizer (seeds 002 and 003): subclass and override ``quantize_weight``, ``quantize_input``
and/or ``quantize_output``; each returns the quantized tensor. Two calling styles are accepted:

* **canonical (seed 002)**: ``quantize_weight(self, weight, wrapper, **kwargs)``,
  ``quantize_input(self, *inputs, wrapper, **kwargs)``, ``quantize_output(self, output, wrapper, **kwargs)``;
  ``wrapper`` is the layer's :class:`QuantizerModuleWrapper` (``wrapper.config`` is its config entry,
  buffers set with ``set_wrappers_attribute`` live there);
* **seed 003**: the same methods with a parameter named ``config`` instead of ``wrapper``; they get the
  layer's config dict (and ``op``, ``op_type``, ``op_name`` if they take ``**kwargs``).

The style is read from each method's signature (a parameter named ``config`` and none named ``wrapper``).
The wrapper passes the tensor as the first argument and the wrapper/config as a keyword; for inputs only
the first positional input of the layer is quantized.

Gradients: each quantization runs through ``self.quant_grad`` (default :class:`QuantGrad`: straight-through
estimator clipped to the quantization range the quantizer recorded on the wrapper, plain STE when it
recorded none); set ``self.quant_grad = MyGrad`` to change it. Built-in quantizers whose methods already
carry the right gradient (fused fake-quant kernels) skip the extra autograd function while
``quant_grad`` is the default.

Clocks: ``step()`` runs after every ``optimizer.step()`` (optimizer hook) and counts steps for the
``quant_start_step`` key: a layer is left unquantized until that many steps have run (quantizers that
track ranges keep tracking them). Subclasses overriding ``step`` should call ``super().step()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ...core.quantizer import QuantizerBaseMixin, builtin_autograd, builtin_ste, calls_directly
from ..compressor import Compressor
from .grad import QuantGrad, QuantType
from .wrapper import QuantizerModuleWrapper

__all__ = ["TorchQuantizer", "Quantizer", "builtin_ste", "builtin_autograd"]

#: ``(parent type, child attributes)``: children whose weights the parent's forward reads directly
_DIRECT_READERS: tuple[tuple[type, tuple[str, ...]], ...] = ((nn.MultiheadAttention, ("out_proj",)),)


class TorchQuantizer(QuantizerBaseMixin, Compressor):
    """Base quantizer: wraps the selected layers in :class:`QuantizerModuleWrapper`.

    Config keys: ``quant_types`` (list of 'input' / 'weight' / 'output'), ``quant_bits`` (int or
    ``{type: bits}``, 1..32), optional ``quant_start_step``; subclasses add their own.
    """

    #: autograd function of every quantization; swap it per instance (``self.quant_grad = MyGrad``)
    quant_grad: type[QuantGrad] = QuantGrad
    #: ``quant_grad is QuantGrad``, kept as a plain bool (see ``__init_subclass__`` / ``__setattr__``): the forward
    #: reads the bool, so torch.compile never has to compare autograd.Function classes (``is`` breaks the graph on
    #: every torch, ``id()`` of them on torch 2.11: 27 breaks on a 2-layer BERT, seen on an H200)
    _default_grad: bool = True
    #: True: the model exports as an integer ONNX graph (``onnx_format='int8'``): the scales are the static
    #: asymmetric ones QDQ needs (QAT_Quantizer, PtqQuantizer)
    integer_onnx: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._default_grad = cls.quant_grad is QuantGrad

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "quant_grad":
            super().__setattr__("_default_grad", value is QuantGrad)

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: torch.optim.Optimizer | None = None):
        self._steps = 0
        self._read_method_styles()
        super().__init__(model, config_list, optimizer)
        self._refresh_active()

    # ------------------------------------------------------------------ construction
    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        what = type(self).__name__
        types = config.get("quant_types", [])
        self._check_quant_types(layer_info.name, types)
        if "weight" in types and not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise ConfigError(f"{what}: layer {layer_info.name!r} ({layer_info.type}) has no weight tensor to quantize")

    def _check_direct_reads(self, model: nn.Module, layer: LayerInfo, module: nn.Module, what: str) -> None:
        """A quantizer wrapper acts in its forward; a layer whose parent reads its weight directly (never
        calling it) would stay float without a word: refused."""
        for parent, attr in self._parent_slots(model, module):
            for kind, attrs in _DIRECT_READERS:
                if isinstance(parent, kind) and attr in attrs:
                    owner = layer.name.rpartition(".")[0]
                    raise ConfigError(
                        f"{what}: layer {layer.name!r} cannot be quantized on its own: {type(parent).__name__} "
                        f"reads {attr}.weight / {attr}.bias directly in its forward (F.multi_head_attention_forward) "
                        f"and never calls {attr}, so a wrapper around it would change nothing. Select the "
                        f"{type(parent).__name__} itself (op_names [{owner!r}] or op_types "
                        f"['{type(parent).__name__}']): its weights, {attr}'s included, are then quantized where "
                        f"the attention reads them")

    def _create_wrapper(self, module: nn.Module, layer_info: LayerInfo, config: dict[str, Any]) -> nn.Module:
        wrapper = QuantizerModuleWrapper(module, layer_info.name, layer_info.type, config, self)
        wrapper.training = module.training  # wrapping an eval-mode model must not switch its layers to training
        self.init_wrapper(wrapper)
        return wrapper

    def init_wrapper(self, wrapper: QuantizerModuleWrapper) -> None:
        """Hook: register the buffers/parameters a layer's quantization needs (before the model changes)."""

    # ------------------------------------------------------------------ dispatch (called by the wrapper)
    def _call(self, quant_type: str, tensor: torch.Tensor, wrapper: QuantizerModuleWrapper) -> torch.Tensor:
        return self._call_method(quant_type, tensor, wrapper)

    def _quantize(self, quant_type: str, tensor: torch.Tensor, wrapper: QuantizerModuleWrapper) -> torch.Tensor:
        t = quant_type.value if isinstance(quant_type, QuantType) else quant_type
        if not wrapper.quant_active and not self.handles_start_step:
            return tensor
        mode = self._autograd[t]
        # a bool attribute, not a comparison of autograd.Function classes (see ``_default_grad``); dynamo guards on
        # it, so swapping quant_grad recompiles
        if calls_directly(mode, self._default_grad):
            return self._call(t, tensor, wrapper)
        grad = self.quant_grad

        def run(x: torch.Tensor) -> tuple[torch.Tensor, Any]:
            return self._call(t, x, wrapper), wrapper.qparams(t)

        return grad.apply(tensor, QuantType(t), run)

    def _export_forward(self, wrapper: QuantizerModuleWrapper, inputs: tuple, kwargs: dict[str, Any]) -> Any:
        from .export import export_forward

        return export_forward(self, wrapper, inputs, kwargs)

    # ------------------------------------------------------------------ clocks
    def step(self) -> None:
        """After each optimizer step: advance the step counter (``quant_start_step``)."""
        self._steps += 1
        for w in self.modules_wrapper:
            w.frozen = False  # weights moved: loaded calibration no longer describes them
        self._refresh_active()

    def _refresh_active(self) -> None:
        for w in self.modules_wrapper:
            w.quant_active = self._steps >= w.config.get("quant_start_step", 0)

    @property
    def steps(self) -> int:
        """Optimizer steps seen so far."""
        return self._steps

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self._steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps = int(state.get("steps", 0))
        self._refresh_active()

    # ------------------------------------------------------------------ export
    def export_weight(self, wrapper: QuantizerModuleWrapper) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight (and bias, None = unchanged) the exported float model holds for ``wrapper``'s layer."""
        weight = wrapper.weight
        if QuantType.QUANT_WEIGHT in wrapper.quant_types and wrapper.quant_active:
            weight = self._quantize("weight", weight, wrapper)
        return weight.detach(), None

    def calibration(self, wrapper: QuantizerModuleWrapper) -> dict[str, Any]:
        """The calibration record of one layer (see :func:`compressor.torch.quantization.export.calibration_entry`)."""
        from .export import calibration_entry

        return calibration_entry(wrapper)

    def export_model(self, model_path: str | None, calibration_path: str | None = None, onnx_path: str | None = None,
                     input_shape: tuple[int, ...] | None = None, device: torch.device | str | None = None,
                     hf_path: str | None = None, hf_sparse_format: str = "dense",
                     **onnx_kwargs: Any) -> dict[str, dict[str, Any]] | None:
        """Save a plain float state_dict (quantized weight values) loadable into the original model class,
        and return (and save to ``calibration_path``) the per-layer calibration config. With ``onnx_path``
        and ``input_shape`` (or ``dummy_input=``: a tensor, a tuple, or a dict of keyword arguments) also
        export ONNX with QuantizeLinear/DequantizeLinear nodes. ``hf_path``: a Hugging Face model quantized
        by a one-shot weight quantizer (GPTQ / RTN / AWQ, alone or on a pruner) as a compressed-tensors
        checkpoint folder that ``AutoModelForCausalLM.from_pretrained`` loads (see
        :mod:`compressor.torch.hf_checkpoint`; ``hf_sparse_format`` for pruned float layers); with
        ``model_path=None`` only that folder is written (returns None). ``model_path=None`` with ``onnx_path`` /
        ``calibration_path`` writes only those; with no target at all it is a ``ConfigError``."""
        from ...core.atomic import transaction
        from .. import families
        from .export import export_model

        with transaction():  # every artifact, the hf_path folder included, lands or none does (core.atomic)
            if hf_path is not None:
                families.save_checkpoint(self.bound_model, hf_path, sparse_format=hf_sparse_format)
                if model_path is None and calibration_path is None and onnx_path is None:
                    return None
            return export_model(self, model_path, calibration_path, onnx_path, input_shape, device, **onnx_kwargs)

    def load_calibration_config(self, calibration_config: dict[str, dict[str, Any]]) -> None:
        """Load ranges, scales and zero points saved by :meth:`export_model` into the wrappers (checked
        completely before anything is written)."""
        from .export import load_calibration_config

        load_calibration_config(self, calibration_config)


Quantizer = TorchQuantizer
