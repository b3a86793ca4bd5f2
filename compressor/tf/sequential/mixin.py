"""What the five one-shot compressors share on Keras (:class:`OneShotMixin`): ``sequential_targets``, the layers
'default' selects (Dense / EinsumDense; a MultiHeadAttention through its projections; the LM head left out unless
named), and :meth:`~OneShotMixin.calibrate`."""

from __future__ import annotations

import warnings
from typing import Any

import keras
import tensorflow as tf

from ...core.errors import ConfigError, ModelError
from ...core.matching import LayerInfo
from ...core.oneshot import (
    ONESHOT_SKIP_HINT,
    OneShotMethod,
    OneShotReport,
    QuantSpec,
    forward_in_float64,
    quant_spec_of,
    run_sequential,
)
from ...core.sparse_pattern import parse_sparse_pattern
from ..calibration_data import calibration_batches
from ..kernel_layout import ONESHOT_DEFAULT_TYPES, KernelLayout, kernel_layout
from .backend import KerasOneShotBackend
from .blocks import find_blocks, find_routers, remapper_off
from .expert_banks import supported as bank_supported

#: sequences per forward pass when the calibration data is one array of samples
CALIBRATION_BATCH_SIZE = 8


def _targets(sequential_targets: Any, what: str) -> list[str] | None:
    if sequential_targets is None:
        return None
    if isinstance(sequential_targets, str):
        sequential_targets = [sequential_targets]
    if not isinstance(sequential_targets, (list, tuple)) or not sequential_targets or \
            not all(isinstance(t, str) and t for t in sequential_targets):
        raise ConfigError(f"{what}: sequential_targets must be None or a non-empty list of layer class names (e.g. "
                          f"['TransformerDecoder']), got {sequential_targets!r}")
    return list(sequential_targets)


class OneShotMixin:
    """What the one-shot pruners and quantizers share (mixed in before TfPruner / TfQuantizer)."""

    method: OneShotMethod
    default_types = ONESHOT_DEFAULT_TYPES
    default_skip_hint = ONESHOT_SKIP_HINT

    def _init_oneshot(self, sequential_targets: Any) -> None:
        self._what = type(self).__name__
        self.sequential_targets = _targets(sequential_targets, self._what)
        self._layouts: dict[str, KernelLayout] = {}
        self._blocks: list[tuple[str, Any]] = []
        self.excluded: list[str] = []
        self._specs: dict[str, QuantSpec] = {}
        self.calibrated = False
        self.rows: OneShotReport = OneShotReport()

    # -- selection (before the model changes)
    def _substitute_layers(self, selected: list[tuple[LayerInfo, dict[str, Any]]], layers: list[LayerInfo],
                           by_name: dict[str, Any]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """A selected MultiHeadAttention is compressed through its EinsumDense projections; the LM head (a layer
        outside every block producing the vocabulary of an Embedding of the model) is left out unless it is
        named in ``op_names``; the blocks are found here."""
        what = self._what
        # the routers / gates of mixture-of-experts layers stay float unless named (as llmcompressor and vLLM expect)
        routers = set(find_routers(self.bound_model))
        selected = [(i, c) for i, c in selected if i.name not in routers or i.name in c.get("op_names", ())]
        chosen = {i.name for i, _ in selected}
        out: list[tuple[LayerInfo, dict[str, Any]]] = []
        for info, cfg in selected:
            layer = by_name[info.name]
            if isinstance(layer, keras.layers.MultiHeadAttention):
                subs = [i for i in layers if i.name.startswith(info.name + "/") and i.type == "EinsumDense"]
                if not layer.built or not subs:
                    raise ConfigError(f"{what}: layer {info.name!r} (MultiHeadAttention) is compressed through its "
                                      f"EinsumDense projections; build the model first (call it on data)")
                out.extend((i, cfg) for i in subs if i.name not in chosen)
                chosen.update(i.name for i in subs)
            else:
                out.append((info, cfg))
        for info, _ in out:
            self._layouts[info.name] = kernel_layout(info.name, by_name[info.name])
        self._blocks = find_blocks(self.bound_model, [i.name for i, _ in out], self.sequential_targets, bank_supported)
        vocab = {int(layer.input_dim) for layer in by_name.values() if isinstance(layer, keras.layers.Embedding)}
        kept = []
        for info, cfg in out:
            inside = any(info.name.startswith(p + "/") for p, _ in self._blocks)
            if not inside and self._layouts[info.name].n_out in vocab and info.name not in cfg.get("op_names", ()):
                self.excluded.append(info.name)
                continue
            kept.append((info, cfg))
        if not kept:
            raise ConfigError(f"{what}: the config selects only the LM head {self.excluded} (left out by default: it "
                              f"produces the vocabulary); name it in op_names to compress it. Layers in the model: "
                              f"{sorted({i.type for i in layers})}")
        return kept

    def validate_layer(self, layer_info: LayerInfo, layer: Any, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, layer, config)  # type: ignore[misc]
        plan = self._layouts.get(layer_info.name) or kernel_layout(layer_info.name, layer)
        pattern = config.get("sparse_pattern")
        if pattern is not None:
            _, m = parse_sparse_pattern(pattern)
            if plan.n_in % m:
                raise ConfigError(f"{self._what}: layer {layer_info.name!r} ({layer_info.type}) has {plan.n_in} input "
                                  f"features, not a multiple of M={m} of sparse_pattern {pattern!r}; exclude it")
        if self.method.kind == "quantizer":  # the layer's grid, resolved once: the one-shot run reads it from here
            self._specs[layer_info.name] = quant_spec_of(config, self._what)

    # -- calibration
    def calibrate(self, data: Any = None, num_samples: int | None = None, progress: Any = True,
                  forward_dtype: str = "model") -> Any:
        """Run the one-shot algorithm on ``data`` (see :mod:`compressor.tf.calibration_data` for the forms; at most
        ``num_samples`` sequences) block by block and leave the model compressed. ``progress``: a line per
        block on stderr (True), nothing (False) or a file. ``forward_dtype``: the dtype of the block passes that
        record the statistics and hand the compressed outputs on ('model', the default: the model's own dtype, as
        llmcompressor; 'float64': the same result as PyTorch to ~1e-8; 'auto': float64 on CPU, the model's dtype
        on an accelerator; see :func:`compressor.core.oneshot.forward_in_float64`). Bad data
        is an error before the model changes. Returns self."""
        what = f"{self._what}.calibrate"
        float64 = forward_in_float64(forward_dtype, what, not tf.config.list_logical_devices("GPU"))
        batches: list[Any] = []
        if self.method.statistics is not None or data is not None:
            if data is None:
                raise ConfigError(f"{what}: {self.method.name} needs calibration data (a few hundred sequences)")
            n_inputs = len(getattr(self.bound_model, "inputs", None) or []) or 1
            batches = list(calibration_batches(data, what=what, num_samples=num_samples,
                                               batch_size=CALIBRATION_BATCH_SIZE, n_inputs=n_inputs,
                                               hint="give a few hundred calibration sequences"))
            if not batches:
                raise ConfigError(f"{what}: the calibration data is empty; give a few hundred calibration sequences")
        blocks = self._blocks
        if self.method.statistics is not None:
            backend = KerasOneShotBackend(self, blocks)
            why = backend.check(batches[0])
            if why is not None:
                if self.sequential_targets:
                    raise ModelError(f"{what}: the blocks {self.sequential_targets} cannot be calibrated one after "
                                     f"the other: {why}")
                warnings.warn(f"{what}: the repeated layers {[p for p, _ in blocks]} are not a chain of blocks ({why}); "
                              f"calibrating the whole model in one pass instead", RuntimeWarning, stacklevel=2)
                blocks = []
        backend = KerasOneShotBackend(self, blocks, float64)
        with remapper_off():
            rows = run_sequential(backend, self.method, batches, progress=progress)
        self.rows = OneShotReport(rows)
        self.calibrated = True
        self._after_calibrate()
        self._retrace()  # type: ignore[attr-defined]
        return self

    def _after_calibrate(self) -> None:
        pass

    @property
    def blocks(self) -> list[str]:
        """Paths of the blocks calibrated one after the other."""
        return [p for p, _ in self._blocks]

