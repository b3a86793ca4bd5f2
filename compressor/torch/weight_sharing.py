"""``WeightSharingQuantizer``: Deep Compression's trained quantization (weight sharing) on PyTorch.

A quantizer like the others (config ``{'quant_types': ['weight'], 'quant_bits': b, 'op_types'/'op_names':
...}``): when it is built, each selected layer's non-zero weights are clustered into ``2**b`` centroids (core
:func:`~compressor.core.weight_sharing.share_weights`: 1-D k-means, linear initialisation) and the weights
are set to their centroids; pruned (zero) weights stay zero. In training, the layer's forward passes the
weight through unchanged but its gradient becomes, for every weight, the SUM of its cluster's gradients
(the centroid gradient of the paper; core :func:`~compressor.core.weight_sharing.cluster_gradient`), zero
for pruned weights. Any optimizer then moves all members of a cluster by the same amount, so they stay
one shared value: the weights ARE the fine-tuned centroids, the optimizer needs no extra parameters, and
the exported state_dict holds at most ``2**b`` distinct non-zero values per layer, which the compressed
file stores as a codebook plus Huffman-coded indices.

Typical use (after pruning and exporting, on the reloaded plain model)::

    sharer = WeightSharingQuantizer(model, [{'quant_types': ['weight'], 'quant_bits': 6, 'op_types': ['Linear']}],
                                    optimizer)
    model = sharer.compress()
    ... fine-tune ...
    sharer.export_model('model.pt', compressed_path='model.cmpk')
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.atomic import atomic_paths
from ..core.errors import ConfigError
from ..core.matching import LayerInfo
from ..core.quantizer import builtin_autograd
from ..core.weight_sharing import check_bits, cluster_gradient, share_weights, tie_weights
from .ops import ops
from .quantization.quantizer import TorchQuantizer
from .quantization.wrapper import QuantizerModuleWrapper

__all__ = ["WeightSharingQuantizer"]


class _TorchSharingOps:
    """Gather / scatter-add for :func:`~compressor.core.weight_sharing.cluster_gradient`."""

    @staticmethod
    def segment_sum(data: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
        return torch.zeros(num_segments, dtype=data.dtype, device=data.device).index_add_(0, segment_ids, data)

    @staticmethod
    def take(params: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return params.index_select(0, indices)


_SOPS = _TorchSharingOps()


class _SharedGradient(torch.autograd.Function):
    """Identity forward; backward: each weight gets its cluster's summed gradient (0 when pruned)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, assignment: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(assignment)
        ctx.k = k
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (assignment,) = ctx.saved_tensors
        return cluster_gradient(ops, _SOPS, grad, assignment, ctx.k), None, None


class WeightSharingQuantizer(TorchQuantizer):
    """Weight sharing with ``2**quant_bits['weight']`` centroids per selected layer (bits 1..16).

    ``iterations``: the most k-means (Lloyd) iterations per layer. State per layer (buffers of its wrapper,
    saved with the model): ``ws_assignment`` (centroid index per weight; the number of centroids for pruned
    ones) and ``ws_centroids``.
    """

    supported_quant_types = ("weight",)

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: torch.optim.Optimizer | None = None,
                 iterations: int = 100):
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ConfigError(f"WeightSharingQuantizer: iterations = {iterations!r} is invalid; allowed: an int >= 1")
        self.iterations = iterations
        self._shared: dict[int, np.ndarray] = {}
        super().__init__(model, config_list, optimizer)
        with torch.no_grad():  # the model is wrapped now: tie each layer's weights to its centroids
            for w in self.modules_wrapper:
                value = self._shared.pop(id(w))
                w.weight.copy_(torch.from_numpy(value).to(w.weight.device))

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        check_bits(layer_info.name, config["quant_bits"]["weight"])

    def init_wrapper(self, wrapper: QuantizerModuleWrapper) -> None:
        weight = wrapper.weight.detach()
        shared, assignment, centroids = share_weights(weight.cpu().numpy(), wrapper.quant_bits["weight"], self.iterations)
        wrapper.register_buffer("ws_assignment", torch.from_numpy(assignment).to(weight.device))
        wrapper.register_buffer("ws_centroids", torch.from_numpy(centroids).to(weight.device))
        self._shared[id(wrapper)] = shared

    @builtin_autograd
    def quantize_weight(self, weight: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        return _SharedGradient.apply(weight, wrapper.ws_assignment, int(wrapper.ws_centroids.numel()))

    # ------------------------------------------------------------------ codebooks and export
    def tie(self) -> None:
        """Set every cluster's members to their mean (exact when they are equal, as after SGD/Adam steps)
        and store the centroids in ``ws_centroids``. :meth:`export_model` calls it."""
        with torch.no_grad():
            for w in self.modules_wrapper:
                k = int(w.ws_centroids.numel())
                tied, centroids = tie_weights(w.weight.detach().cpu().numpy(), w.ws_assignment.cpu().numpy(), k)
                w.weight.copy_(torch.from_numpy(tied).to(w.weight.device))
                w.ws_centroids.copy_(torch.from_numpy(centroids).to(w.ws_centroids.device))

    def codebooks(self) -> dict[str, np.ndarray]:
        """``{layer: centroids}`` (host copies, after :meth:`tie`)."""
        self.tie()
        return {w.name: w.ws_centroids.detach().cpu().numpy().copy() for w in self.modules_wrapper}

    def export_model(self, model_path: str | os.PathLike | None, compressed_path: str | os.PathLike | None = None,
                     **kwargs: Any) -> dict[str, np.ndarray]:
        """Write the state_dict of the ORIGINAL model class (shared weights) to ``model_path`` and/or the
        compressed file ``compressed_path`` (codebook + indices per shared layer; see
        :mod:`compressor.core.cmpk`); both or neither (atomic). Returns :meth:`codebooks`."""
        from .cmpk import save_compressed
        from .quantization.export import quantized_state_dict

        if kwargs:
            raise ConfigError(f"WeightSharingQuantizer.export_model: unsupported arguments {sorted(kwargs)}; it writes "
                              f"model_path (state_dict) and compressed_path")
        # the paths are checked (two the same file: ConfigError naming both arguments) before tie() changes weights
        with atomic_paths(model_path, compressed_path, names=("model_path", "compressed_path")) as (tmp_model, tmp_packed):
            books = self.codebooks()
            model = self.bound_model
            training = model.training
            model.eval()
            try:
                state, _ = quantized_state_dict(self)
            finally:
                model.train(training)
            if tmp_model is not None:
                torch.save(state, tmp_model)
            if tmp_packed is not None:
                save_compressed(state, tmp_packed)
        return books
