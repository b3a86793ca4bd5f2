"""``LsqQuantizer``: learned step size quantization (Esser et al. 2020).

Each quantized tensor of a layer gets a trainable step size ``<type>_scale`` (an ``nn.Parameter`` of the
wrapper, so ``model.parameters()`` has it; the optimizer given to the quantizer gets a new param group
with all of them). Forward ``round(clip(x / s, qmin, qmax)) * s`` (:func:`compressor.core.quant.lsq_quantize`)
with the paper's gradients: clipped STE for ``x``, the LSQ step-size gradient scaled by
``g = 1 / sqrt(N * qmax)`` (N: weight numel, or features per sample for activations).
Range: ``quant_dtype`` 'int' (default; full signed ``[-2^(b-1), 2^(b-1)-1]`` as in the paper) or 'uint'
(``[0, 2^b-1]``, for non-negative activations). Initial step: ``2 mean|x| / sqrt(qmax)`` from the weight at
construction and from the first training batch for activations. ``quant_grad`` is not used: LSQ's
gradients are its own.

Under torch.distributed the activations' initial step sizes are averaged over the ranks (equal per-rank
batches: the global batch's value), so DDP starts every rank from the same step sizes; compress before
wrapping the model in DDP, so DDP also averages the step sizes' gradients.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ...core import quant as cq
from ...core.matching import LayerInfo
from ..distributed import all_reduce_mean, is_distributed
from .fakequant import ops
from .quantizer import TorchQuantizer, builtin_autograd
from .settings import layer_device, resolve_spec
from .wrapper import QuantizerModuleWrapper

__all__ = ["LsqQuantizer"]


class LsqQuantizer(TorchQuantizer):
    """Quantize with learned per-tensor step sizes."""

    config_keys = ("quant_dtype",)

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: torch.optim.Optimizer | None = None):
        super().__init__(model, config_list, optimizer)
        if optimizer is not None:
            optimizer.add_param_group({"params": self.scale_parameters()})

    def _spec(self, layer: nn.Module, name: str, config: dict[str, Any], t: str):
        return resolve_spec(config, t, layer, name, default_dtype="int", narrow=False, what="LsqQuantizer")

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        for t in config["quant_types"]:
            self._spec(module, layer_info.name, config, t)

    def init_wrapper(self, wrapper: QuantizerModuleWrapper) -> None:
        dev = layer_device(wrapper.layer)
        wrapper.lsq_specs = {}
        for t in wrapper.quant_types:
            spec = self._spec(wrapper.layer, wrapper.name, wrapper.config, t)
            wrapper.lsq_specs[t] = spec
            if t == "weight":
                with torch.no_grad():
                    init = cq.lsq_init_scale(ops, wrapper.weight.detach(), spec.qmax).to(torch.float32)
            else:
                init = torch.ones((), device=dev)
                wrapper.register_buffer(f"{t}_observed", torch.zeros((), dtype=torch.bool, device=dev))
            wrapper.register_parameter(f"{t}_scale", nn.Parameter(init.clone()))
            wrapper.register_buffer(f"{t}_zero_point", torch.zeros((), device=dev))
            wrapper.qranges[t] = (spec.qmin, spec.qmax)

    def scale_parameters(self) -> list[nn.Parameter]:
        """The learned step sizes of all layers."""
        return [p for w in self.get_modules_wrapper() for n, p in w.named_parameters(recurse=False)
                if n.endswith("_scale")]

    def _lsq(self, t: str, x: torch.Tensor, wrapper: QuantizerModuleWrapper, numel: int) -> torch.Tensor:
        spec = wrapper.lsq_specs[t]
        scale = wrapper._parameters[f"{t}_scale"]
        g = cq.lsq_grad_scale(numel, spec.qmax)
        return cq.lsq_quantize(ops, x, scale, spec.qmin, spec.qmax, g)

    @builtin_autograd
    def quantize_weight(self, weight: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        return self._lsq("weight", weight, wrapper, weight.numel())

    def _activation(self, t: str, x: torch.Tensor, wrapper: QuantizerModuleWrapper) -> torch.Tensor:
        if wrapper.training:
            flag = wrapper._buffers[f"{t}_observed"]
            scale = wrapper._parameters[f"{t}_scale"]
            with torch.no_grad():  # first training batch sets the initial step size, on device
                init = cq.lsq_init_scale(ops, x.detach(), wrapper.lsq_specs[t].qmax).to(scale.dtype)
                synced = wrapper.__dict__.setdefault("_lsq_init_synced", set())
                if t not in synced and self.sync_ranks and is_distributed():
                    all_reduce_mean(init)  # once per process (all ranks alike); later batches keep the scale
                    synced.add(t)
                scale.copy_(torch.where(flag, scale, init))
                flag.fill_(True)
        per_sample = math.prod(x.shape[1:]) if x.dim() > 1 else x.numel()
        return self._lsq(t, x, wrapper, per_sample)

    @builtin_autograd
    def quantize_input(self, inputs: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        return self._activation("input", inputs, wrapper)

    @builtin_autograd
    def quantize_output(self, output: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        return self._activation("output", output, wrapper)
