"""What the one-shot driver and a backend say to each other: a selected layer (:class:`LayerTask`), what a method
made of it (:class:`LayerResult`), the backend's side (:class:`OneShotBackend`: every call the driver makes, each
declared here with its default) and the report (:class:`OneShotReport`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ModelError
from .codes import QuantizedWeight, QuantSpec
from .collective import LOCAL, Collective
from .config import quant_spec_of


@dataclass
class LayerTask:
    """One selected layer: ``name`` (its path), ``config`` (its normalised config entry), ``in_features``
    (the canonical weight's axis 1), ``handle`` (whatever the backend needs: the wrapper, the layer), ``spec``
    (a quantizer's weight grid, resolved from ``config`` once: the backend hands over the one its wrapper
    resolved; :meth:`quant_spec` resolves and keeps it otherwise)."""

    name: str
    config: dict[str, Any]
    in_features: int
    handle: Any = None
    spec: QuantSpec | None = None

    def quant_spec(self, what: str) -> QuantSpec:
        """The layer's weight grid (:func:`~compressor.core.oneshot.config.quant_spec_of` of its config, once)."""
        if self.spec is None:
            self.spec = quant_spec_of(self.config, what)
        return self.spec


@dataclass
class LayerResult:
    """What a method made of one layer: ``weight`` (canonical ``[out, in]`` float64, what the layer computes
    with from now on), ``mask`` (bool keep-mask, pruners), ``quantized`` (codes + scales, quantizers),
    ``scales`` (AWQ's per-input-channel ``s``: ``weight = Q(W s) / s``), ``info`` (numbers for the report)."""

    weight: np.ndarray
    mask: np.ndarray | None = None
    quantized: QuantizedWeight | None = None
    scales: np.ndarray | None = None
    info: dict[str, Any] = field(default_factory=dict)


class OneShotBackend:
    """Every call :func:`~compressor.core.oneshot.driver.run_sequential` makes to a backend. Inputs and outputs of
    blocks are opaque to the driver. A backend subclasses this; the first seven methods it must implement, the
    others have the defaults written here (a backend that leaves them gets a slower or plainer run, never a
    different result): the torch and Keras adapters implement them all."""

    #: the processes this run is split over (:mod:`~compressor.core.oneshot.collective`); one by default
    collective: Collective = LOCAL

    # ------------------------------------------------------------------ required
    def blocks(self) -> Sequence[tuple[str, Any]]:
        """The repeated blocks (decoder layers) in execution order, ``(path, block)``; empty: no blocks."""
        raise NotImplementedError

    def block_layers(self, block: Any) -> list[LayerTask]:
        """The selected layers inside ``block`` (``None``: the selected layers outside every block)."""
        raise NotImplementedError

    def first_inputs(self, batches: Sequence[Any]) -> list[Any]:
        """The first block's inputs, one entry per calibration batch (the model is run up to the block)."""
        raise NotImplementedError

    def run_block(self, block: Any, inputs: list[Any], observe: dict[str, Callable[[Any], None]] | None) -> list[Any]:
        """``block`` on each cached input; ``observe[layer name](x)`` gets each observed layer's input
        (any ``[..., in]`` array-like) on every call. Returns the outputs, one per input."""
        raise NotImplementedError

    def run_model(self, batches: Sequence[Any], observe: dict[str, Callable[[Any], None]]) -> None:
        """The whole model on the calibration batches, observing as :meth:`run_block`."""
        raise NotImplementedError

    def read_weight(self, task: LayerTask) -> tuple[np.ndarray, np.ndarray | None]:
        """``(weight, keep-mask or None)`` of the layer, canonical ``[out, in]`` (float64 / bool)."""
        raise NotImplementedError

    def write(self, task: LayerTask, result: LayerResult) -> None:
        """Install ``result`` in the layer (weight, mask, quantization state)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ with defaults
    def advance(self, block: Any, inputs: list[Any]) -> list[Any]:
        """The block's outputs on ``inputs`` as :meth:`run_block` without observing; a backend may write them over
        ``inputs`` in place (the driver no longer needs them: one copy of the activations instead of two)."""
        return self.run_block(block, inputs, None)

    def shared_inputs(self, block: Any, inputs: list[Any], tasks: list[LayerTask]) -> dict[str, str]:
        """``{layer: earlier layer}`` for the layers of ``block`` that read the very same input as an earlier one
        (q / k / v, gate / up): they share its accumulator (equal statistics, computed once) and are not observed.
        Default: none shared."""
        return {}

    def batch_rows(self, inp: Any) -> int | None:
        """The number of sequences in one block input; ``None`` (default): a batch cannot be split
        (:meth:`take_rows` is not available, whole batches are used where a subset is wanted)."""
        return None

    def take_rows(self, inp: Any, rows: list[int]) -> Any:
        """The block input made of sequences ``rows`` of ``inp`` (only called when :meth:`batch_rows` is not None)."""
        raise NotImplementedError(f"{type(self).__name__}.take_rows")

    def snapshot(self, task: LayerTask) -> Any:
        """A host copy of everything :meth:`write` and :meth:`set_weight` change in the layer, for :meth:`restore`;
        with it a run that fails part way (any exception, KeyboardInterrupt) leaves every layer as it was.
        ``None`` (default): the backend keeps no undo copies."""
        return None

    def restore(self, task: LayerTask, saved: Any) -> None:
        """Put back what :meth:`snapshot` returned (never called for ``None``)."""
        raise NotImplementedError(f"{type(self).__name__}.restore")

    def set_weight(self, task: LayerTask, weight: np.ndarray) -> None:
        """Run the layer with ``weight`` (canonical ``[out, in]``, float weight only): AWQ's block-output search."""
        raise ModelError(f"{type(self).__name__} cannot run a block with candidate weights (set_weight); give "
                         f"awq_search: 'layer'")

    def block_output(self, block: Any, inputs: list[Any]) -> Iterable[Any]:
        """The block's hidden-state outputs, one array per input: AWQ's block-output search."""
        raise ModelError(f"{type(self).__name__} cannot run a block with candidate weights (block_output); give "
                         f"awq_search: 'layer'")

    def awq_parent(self, block: Any, tasks: list[LayerTask]) -> Any:
        """The smallest module of ``block`` that holds ``tasks`` (self_attn for q / k / v, mlp for gate / up), whose
        output AWQ's search scores; ``None`` (default): the block itself (:meth:`block_output`)."""
        return None

    def record_calls(self, block: Any, inputs: list[Any], modules: list[Any]) -> list[list[Any]]:
        """Each of ``modules``' call arguments, recorded in one run of ``block`` on ``inputs`` (only for a module
        :meth:`awq_parent` returned)."""
        raise NotImplementedError(f"{type(self).__name__}.record_calls")

    def module_output(self, module: Any, calls: list[Any]) -> Iterable[Any]:
        """``module``'s (hidden-state) output on each recorded call, real tokens only, one array per call."""
        raise NotImplementedError(f"{type(self).__name__}.module_output")


class OneShotReport(list):
    """The rows of a one-shot run (dicts: ``layer``, ``block``, ``method``, ``sparsity`` or ``bits`` /
    ``group_size``, the method's numbers: GPTQ's ``error``, AWQ's ``alpha`` / ``duo`` / ``error``); ``str()`` is
    a table with a column per key, in the order the keys first appear."""

    def __str__(self) -> str:
        keys: list[str] = []
        for r in self:
            keys += [k for k in r if k not in keys]

        def fmt(v: Any) -> str:
            if isinstance(v, float):
                return f"{v:.4g}"
            return "" if v is None else str(v)

        body = [[fmt(r.get(k)) for k in keys] for r in self]
        widths = [max([len(k)] + [len(row[i]) for row in body]) for i, k in enumerate(keys)]
        line = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join(x.rstrip() for x in [line.format(*keys), line.format(*("-" * w for w in widths))]
                         + [line.format(*row) for row in body])

