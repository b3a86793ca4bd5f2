"""``WeightSharingQuantizer``: Deep Compression's trained quantization (weight sharing) on Keras 3.

The mirror of :mod:`compressor.torch.weight_sharing` (same config, same core math): each selected layer's
non-zero weights are clustered into ``2**quant_bits`` centroids (k-means, linear initialisation; on the
sorted values, so the centroids equal torch's for the same weights) and the kernel is set to them; in
training the kernel passes through the layer's call unchanged but its gradient (``tf.custom_gradient``,
in-graph) is, for every weight, the sum of its cluster's gradients, zero for pruned weights. Any Keras
optimizer then keeps each cluster one shared value. Works with ``model.fit`` and custom loops; no
optimizer hook is needed for the sharing itself.

Export: :meth:`WeightSharingQuantizer.export_model` writes the plain model (``.keras`` / ``.weights.h5`` /
SavedModel directory) and/or the compressed file (``compressed_path``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tensorflow as tf

from ..core.atomic import atomic_paths
from ..core.errors import ConfigError
from ..core.matching import LayerInfo
from ..core.quantizer import builtin_autograd
from ..core.weight_sharing import check_bits, cluster_gradient, share_weights, tie_weights
from .ops import ops
from .quantization.quantizer import TfQuantizer
from .quantization.wrapper import QuantizerLayerWrapper

__all__ = ["WeightSharingQuantizer"]


class _TfSharingOps:
    """Gather / scatter-add for :func:`~compressor.core.weight_sharing.cluster_gradient`."""

    @staticmethod
    def segment_sum(data: tf.Tensor, segment_ids: tf.Tensor, num_segments: int) -> tf.Tensor:
        return tf.math.unsorted_segment_sum(data, segment_ids, num_segments)

    @staticmethod
    def take(params: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
        return tf.gather(params, indices)


_SOPS = _TfSharingOps()


class WeightSharingQuantizer(TfQuantizer):
    """Weight sharing with ``2**quant_bits['weight']`` centroids per selected layer (bits 1..16).

    ``iterations``: the most k-means (Lloyd) iterations per layer. State per layer (non-trainable variables
    of its wrapper): ``ws_assignment`` (centroid index per weight, Keras layout; the number of centroids for
    pruned ones) and ``ws_centroids``.
    """

    supported_quant_types = ("weight",)

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None, iterations: int = 100) -> None:
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ConfigError(f"WeightSharingQuantizer: iterations = {iterations!r} is invalid; allowed: an int >= 1")
        self.iterations = iterations
        self._shared: dict[int, np.ndarray] = {}
        self._tie_now = False
        super().__init__(model, config_list, optimizer)
        for w in self.modules_wrapper:  # the model is instrumented now: tie the built layers' kernels
            if id(w) in self._shared:
                w.weight.assign(self._shared.pop(id(w)))
        self._tie_now = True  # layers built later are tied when they are

    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)
        check_bits(layer_info.name, config["quant_bits"]["weight"])

    def init_wrapper(self, wrapper: QuantizerLayerWrapper) -> None:
        shared, assignment, centroids = share_weights(np.asarray(wrapper.weight.numpy()), wrapper.quant_bits["weight"],
                                                      self.iterations)
        wrapper.add_state("ws_assignment", assignment.astype(np.int32), tf.int32)
        wrapper.add_state("ws_centroids", centroids, wrapper.weight.dtype)
        wrapper._setattr_raw("ws_k", int(centroids.size))
        if self._tie_now:
            wrapper.weight.assign(shared)
        else:
            self._shared[id(wrapper)] = shared

    @builtin_autograd
    def quantize_weight(self, weight: tf.Tensor, wrapper: QuantizerLayerWrapper, **kwargs: Any) -> tf.Tensor:
        assignment = tf.convert_to_tensor(wrapper.ws_assignment)
        k = wrapper.ws_k

        @tf.custom_gradient
        def shared(x: tf.Tensor) -> Any:
            def grad(dy: tf.Tensor) -> tf.Tensor:
                return cluster_gradient(ops, _SOPS, dy, assignment, k)

            return tf.identity(x), grad

        return shared(weight)

    # ------------------------------------------------------------------ codebooks and export
    def tie(self) -> None:
        """Set every cluster's members to their mean (exact when they are equal, as after optimizer steps)
        and store the centroids in ``ws_centroids``. :meth:`export_model` calls it."""
        for w in self.modules_wrapper:
            if not w.ready:
                continue
            tied, centroids = tie_weights(w.weight.numpy(), w.ws_assignment.numpy(), w.ws_k)
            w.weight.assign(tied)
            w.ws_centroids.assign(centroids)

    def codebooks(self) -> dict[str, np.ndarray]:
        """``{layer: centroids}`` (host copies, after :meth:`tie`)."""
        self.tie()
        return {w.name: w.ws_centroids.numpy().copy() for w in self.modules_wrapper if w.ready}

    def export_model(self, model_path: str | os.PathLike | None = None, compressed_path: str | os.PathLike | None = None,
                     **kwargs: Any) -> dict[str, np.ndarray]:
        """Write the plain model with its shared weights to ``model_path`` (``*.keras``, ``*.weights.h5`` or a
        SavedModel directory) and/or its weights to the compressed file ``compressed_path`` (see
        :mod:`compressor.core.cmpk`); both or neither (atomic). The quantizer stays installed. Returns
        :meth:`codebooks`."""
        from .cmpk import save_compressed
        from .quantization.export import _save

        if kwargs:
            raise ConfigError(f"WeightSharingQuantizer.export_model: unsupported arguments {sorted(kwargs)}; it writes "
                              f"model_path and compressed_path")
        model = self.bound_model
        # the paths are checked (two the same file: ConfigError naming both arguments) before tie() changes weights
        with atomic_paths(model_path, compressed_path, names=("model_path", "compressed_path")) as (tmp_model, tmp_packed):
            books = self.codebooks()
            self._unwrap_model()
            try:
                if tmp_model is not None:
                    _save(model, tmp_model)
                if tmp_packed is not None:
                    save_compressed(model, tmp_packed)
            finally:
                self._wrap_model()
        return books
