"""Range observers for post-training quantization, on :class:`~compressor.core.ops.ArrayOps`.

An observer accumulates statistics from calibration batches (``observe(x)``) and produces the real range
``(rmin, rmax)`` (``range()``: 0-d arrays per tensor, ``[C]`` per channel) and from it the scale and zero
point (``qparams()``, computed by :func:`compressor.core.quant.qparams`, which makes the range include 0).
Everything stays on the input's device: ``observe`` reads static shapes only and never copies to the host,
so a torch/tf observer adds kernels, not synchronisations. Observers run eagerly (they keep Python
state); the per-batch functions (:func:`batch_minmax`, :func:`batch_percentile`, :func:`batch_mse_range`)
are pure and also trace inside ``tf.function``.

Per channel (``channel_axis`` given), each channel's statistics use all of its elements: the tensor is
viewed as ``[C, M]`` rows, channel first. Weights are per channel along the canonical out-first axis 0 by
default, activations per tensor (:func:`make_observer`, :meth:`Observer.for_weights`).

Methods, exactly:

* :class:`MinMaxObserver`: running ``min`` / ``max`` over every observed element.
* :class:`MovingAverageMinMaxObserver`: ``m_1 = min(x_1)``, ``m_t = decay * m_{t-1} + (1 - decay) * min(x_t)``
  (:func:`compressor.core.quant.ema`, as QAT's tracked ranges), and the same for the max.
* :class:`PercentileObserver`: histogram-free. For a batch (or channel) of ``n`` values,
  ``k = max(1, ceil(p / 100 * n))`` (computed exactly from the decimal ``p``); ``rmax`` is the k-th smallest
  value and ``rmin`` the k-th largest, i.e. the nearest-rank percentiles ``p`` and ``100 - p`` (numpy's
  ``method='inverted_cdf'`` for the upper one; meant for ``p >= 50``, below it ``rmin > rmax``). The result is the mean over batches of the per-batch
  values. ``p = 100`` gives the batch min / max (so for one batch it equals :class:`MinMaxObserver`; over
  several batches it is the mean of the per-batch extremes). Costs O(n) per tensor (``kth_smallest``),
  a row sort per channel.
* :class:`MseObserver`: for a batch with min / max ``(lo, hi)`` per tensor or channel, candidates are
  ``(a * lo, a * hi)`` for ``a = i / N``, ``i = N, N-1, ..., 1``; each is turned into qparams at the
  observer's bits and scheme and scored by ``sum((fake_quant(x) - x)^2)`` (in float64) over the batch or
  channel; the lowest score wins, ties going to the widest range (``a = 1``, plain min-max, is always a
  candidate, so on a batch the result is never worse than min-max). The result is the mean over batches of
  the per-batch optimal ranges: no data is kept, the state is three arrays. Costs N fake-quant passes
  per batch.

State combines: :class:`MinMaxObserver`, :class:`PercentileObserver` and :class:`MseObserver` can
:meth:`~Observer.merge` another observer of the same kind (e.g. calibrated on another shard); the state is
identical to having observed both batch streams. ``reset()`` forgets everything.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction
from typing import Any

from . import quant as cq
from .errors import ConfigError
from .ops import Array, ArrayOps

__all__ = [
    "OBSERVERS", "MinMaxObserver", "MovingAverageMinMaxObserver", "MseObserver", "Observer", "PercentileObserver",
    "batch_minmax", "batch_mse_range", "batch_percentile", "channel_rows", "make_observer", "percentile_rank",
]

_NOT_CALIBRATED = "calibrate with at least one batch"


# ----------------------------------------------------------------------------------------------- checks


def _check_bits(bits: Any) -> int:
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 2 <= bits <= 16:
        raise ConfigError(f"observer bits must be an int in 2..16, got {bits!r}")
    return int(bits)


def _check_real(name: str, value: Any, ok: bool, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok:
        raise ConfigError(f"observer {name} must be {allowed}, got {value!r}")
    return float(value)


def _check_percentile(p: Any) -> float:
    ok = isinstance(p, numbers.Real) and not isinstance(p, bool) and 0 < p <= 100
    return _check_real("percentile", p, ok, "a number in (0, 100] (e.g. 99.99)")


def _check_decay(decay: Any) -> float:
    ok = isinstance(decay, numbers.Real) and not isinstance(decay, bool) and 0 <= decay < 1
    return _check_real("decay", decay, ok, "a number in [0, 1) (e.g. 0.99)")


def _check_grid(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 2:
        raise ConfigError(f"observer grid_size must be an int >= 2 (number of clipping candidates), got {n!r}")
    return int(n)


def _check_axis(axis: Any) -> int | None:
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, numbers.Integral)):
        raise ConfigError(f"observer channel_axis must be an int or None (per tensor), got {axis!r}")
    return None if axis is None else int(axis)


def _check_batch(ops: ArrayOps, x: Array, channel_axis: int | None, what: str) -> None:
    if ops.numel(x) == 0:
        raise ValueError(f"{what}: observed an empty batch (shape {ops.shape(x)}); {_NOT_CALIBRATED} "
                         f"holding values")
    if channel_axis is not None:
        nd = len(ops.shape(x))
        if not -nd <= channel_axis < nd:
            raise ValueError(f"{what}: channel_axis {channel_axis} is out of range for a batch of shape "
                             f"{ops.shape(x)}")


# ------------------------------------------------------------------------------------ per-batch maths


def channel_rows(ops: ArrayOps, x: Array, channel_axis: int) -> Array:
    """``x`` as ``[C, M]``: one row per channel along ``channel_axis``, holding all of that channel's values."""
    shape = ops.shape(x)
    c = channel_axis % len(shape)
    if c != 0:
        x = ops.transpose(x, [c] + [a for a in range(len(shape)) if a != c])
    return ops.reshape(x, (shape[c], -1))


def batch_minmax(ops: ArrayOps, x: Array, channel_axis: int | None = None) -> tuple[Array, Array]:
    """Min and max of a batch: 0-d arrays per tensor, ``[C]`` per channel."""
    if channel_axis is None:
        return cq.minmax(ops, x)
    return cq.minmax(ops, channel_rows(ops, x, channel_axis), 0)


def percentile_rank(n: int, percentile: float) -> int:
    """Nearest rank of the ``percentile`` of ``n`` values: ``max(1, ceil(p / 100 * n))``, 1-based.

    Exact for the decimal ``p`` as written (99.99 means 9999/100, not its binary approximation).
    """
    return max(1, math.ceil(Fraction(repr(float(percentile))) * n / 100))


def _select_column(ops: ArrayOps, rows: Array, k: int) -> Array:
    """Column ``k`` (1-based) of the ``[C, M]`` array ``rows``, as ``[C]``."""
    c, m = ops.shape(rows)
    sizes = [s for s in (k - 1, 1, m - k) if s > 0]
    parts = ops.split(rows, sizes, axis=1)
    return ops.reshape(parts[1 if k > 1 else 0], (c,))


def batch_percentile(ops: ArrayOps, x: Array, percentile: float = 99.99,
                     channel_axis: int | None = None) -> tuple[Array, Array]:
    """Nearest-rank ``(100 - p, p)`` percentiles of a batch (see the module doc): ``rmax`` is the k-th
    smallest value, ``rmin`` the k-th largest, ``k = percentile_rank(n, p)``."""
    if channel_axis is None:
        n = ops.numel(x)
        k = percentile_rank(n, percentile)
        flat = ops.reshape(x, (-1,))
        return ops.kth_smallest(flat, n + 1 - k), ops.kth_smallest(flat, k)
    rows = ops.sort(channel_rows(ops, x, channel_axis))  # ascending along each row
    m = ops.shape(rows)[1]
    k = percentile_rank(m, percentile)
    return _select_column(ops, rows, m + 1 - k), _select_column(ops, rows, k)


def batch_mse_range(ops: ArrayOps, x: Array, qmin: int, qmax: int, symmetric: bool = False,
                    grid_size: int = 100, channel_axis: int | None = None) -> tuple[Array, Array]:
    """The clipping range among ``(a * min, a * max)``, ``a = i / grid_size``, whose fake quantization has
    the least squared error on this batch (per channel: on each channel); ties go to the widest range."""
    rows = ops.reshape(x, (1, -1)) if channel_axis is None else channel_rows(ops, x, channel_axis)
    lo, hi = cq.minmax(ops, rows, 0)  # [C]
    x64 = ops.cast(rows, "float64")
    errs, los, his = [], [], []
    for i in range(grid_size, 0, -1):
        a = i / grid_size
        clo, chi = (lo, hi) if i == grid_size else (lo * a, hi * a)
        s, z = cq.qparams(ops, clo, chi, qmin, qmax, symmetric)
        fq = cq.fake_quantize(ops, rows, ops.reshape(s, (-1, 1)), ops.reshape(z, (-1, 1)), qmin, qmax)
        errs.append(ops.sum(ops.square(ops.cast(fq, "float64") - x64), axis=1))
        los.append(clo)
        his.append(chi)
    err = ops.stack(errs, 0)  # [N, C], widest range first
    hit = ops.equal(err, ops.min(err, axis=0, keepdims=True))
    first = ops.logical_and(hit, ops.equal(ops.cumsum(ops.cast(hit, "int32"), axis=0), 1))

    def pick(cands: list[Array]) -> Array:
        c = ops.stack(cands, 0)
        return ops.sum(ops.where(first, c, ops.zeros_like(c)), axis=0)  # one non-zero term: exact

    rmin, rmax = pick(los), pick(his)
    if channel_axis is None:
        rmin, rmax = ops.reshape(rmin, ()), ops.reshape(rmax, ())
    return rmin, rmax


# ------------------------------------------------------------------------------------------ observers


class Observer:
    """Base observer: bits / integer range / scheme, channel bookkeeping, ``range`` -> ``qparams``.

    ``dtype`` 'int' (narrow signed range by default, int8 = [-127, 127]) or 'uint'; ``symmetric`` picks the
    symmetric or affine qparams; ``channel_axis`` None = per tensor. The defaults are those of activations
    (per-tensor affine uint8); :meth:`for_weights` gives per-channel symmetric int8 along axis 0.
    """

    method = "base"

    def __init__(self, ops: ArrayOps, *, bits: int = 8, dtype: str = "uint", symmetric: bool = False,
                 channel_axis: int | None = None, narrow: bool = True):
        if not isinstance(ops, ArrayOps):
            raise ConfigError(f"observer ops must implement ArrayOps (NumpyOps, TorchOps, TfOps), got "
                              f"{type(ops).__name__}")
        self.ops = ops
        self.bits = _check_bits(bits)
        try:
            self.qmin, self.qmax = cq.quant_range(self.bits, dtype, narrow=bool(narrow))
        except ValueError as e:
            raise ConfigError(f"observer: {e}") from None
        self.dtype = dtype
        self.narrow = bool(narrow)
        self.symmetric = bool(symmetric)
        self.channel_axis = _check_axis(channel_axis)
        self.reset()

    @classmethod
    def for_weights(cls, ops: ArrayOps, **kwargs: Any) -> Observer:
        """Per-channel (out-first axis 0) symmetric signed observer, the weight default."""
        kwargs = {"channel_axis": 0, "dtype": "int", "symmetric": True, **kwargs}
        return cls(ops, **kwargs)

    @classmethod
    def from_spec(cls, ops: ArrayOps, spec: Any, **kwargs: Any) -> Observer:
        """An observer for a :class:`~compressor.core.quant_config.QuantSpec` (bits, dtype, scheme, axis)."""
        narrow = (spec.qmin, spec.qmax) == cq.quant_range(spec.bits, spec.dtype, narrow=True)
        return cls(ops, bits=spec.bits, dtype=spec.dtype, symmetric=spec.symmetric, channel_axis=spec.axis,
                   narrow=narrow, **kwargs)

    # -- state
    def reset(self) -> None:
        """Forget every observation."""
        self.count = 0  # batches observed
        self.channels: int | None = None

    @property
    def calibrated(self) -> bool:
        return self.count > 0

    def _begin(self, x: Array) -> Array:
        """Check a batch (non-empty, same channel count as before); detach it, ints as float32."""
        ops = self.ops
        name = type(self).__name__
        _check_batch(ops, x, self.channel_axis, name)
        if self.channel_axis is not None:
            c = ops.shape(x)[self.channel_axis]
            if self.channels is not None and c != self.channels:
                raise ValueError(f"{name}: batch has {c} channels along axis {self.channel_axis}, earlier "
                                 f"batches had {self.channels}")
        x = ops.stop_gradient(x)
        if not ops.dtype_name(x).startswith(("float", "bfloat")):
            x = ops.cast(x, "float32")
        return x

    def _commit(self, x: Array) -> None:
        """Count a batch whose statistics were stored."""
        if self.channel_axis is not None:
            self.channels = self.ops.shape(x)[self.channel_axis]
        self.count += 1

    def observe(self, x: Array) -> None:
        """Add one calibration batch."""
        raise NotImplementedError

    def _range(self) -> tuple[Array, Array]:
        raise NotImplementedError

    def range(self) -> tuple[Array, Array]:
        """The observed real range ``(rmin, rmax)``: 0-d arrays per tensor, ``[C]`` per channel."""
        if not self.calibrated:
            raise RuntimeError(f"{type(self).__name__} has no observations: {_NOT_CALIBRATED} before asking "
                               f"for its range or qparams")
        return self._range()

    def qparams(self) -> tuple[Array, Array]:
        """``(scale, zero_point)`` of the observed range (the range made to include 0)."""
        rmin, rmax = self.range()
        return cq.qparams(self.ops, rmin, rmax, self.qmin, self.qmax, self.symmetric)

    def merge(self, other: Observer) -> None:
        """Combine ``other``'s state into this one, as if this observer had seen ``other``'s batches too."""
        if type(other) is not type(self) or self._config() != other._config():
            raise ConfigError(f"{type(self).__name__}.merge: can only merge an observer of the same kind and "
                              f"settings {self._config()}, got {type(other).__name__} {other._config()}")
        if not other.calibrated:
            return
        if self.calibrated and self.channels != other.channels:
            raise ValueError(f"{type(self).__name__}.merge: {other.channels} channels vs {self.channels}")
        if not self.calibrated:
            self._copy_state(other)
        else:
            self._merge_state(other)
        self.count += other.count
        self.channels = other.channels

    def _config(self) -> dict[str, Any]:
        return {"bits": self.bits, "dtype": self.dtype, "narrow": self.narrow, "symmetric": self.symmetric,
                "channel_axis": self.channel_axis}

    def _copy_state(self, other: Observer) -> None:
        raise NotImplementedError

    def _merge_state(self, other: Observer) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({cfg}, batches={self.count})"


class MinMaxObserver(Observer):
    """Running min / max over every observed element."""

    method = "minmax"

    def reset(self) -> None:
        super().reset()
        self.min_val: Array | None = None
        self.max_val: Array | None = None

    def observe(self, x: Array) -> None:
        x = self._begin(x)
        lo, hi = batch_minmax(self.ops, x, self.channel_axis)
        if self.count:
            lo, hi = self.ops.minimum(self.min_val, lo), self.ops.maximum(self.max_val, hi)
        self.min_val, self.max_val = lo, hi
        self._commit(x)

    def _range(self):
        return self.min_val, self.max_val

    def _copy_state(self, other):
        self.min_val, self.max_val = other.min_val, other.max_val

    def _merge_state(self, other):
        self.min_val = self.ops.minimum(self.min_val, other.min_val)
        self.max_val = self.ops.maximum(self.max_val, other.max_val)


class MovingAverageMinMaxObserver(MinMaxObserver):
    """EMA of per-batch min / max, seeded with the first batch's (:func:`compressor.core.quant.ema`)."""

    method = "moving_average_minmax"

    def __init__(self, ops: ArrayOps, *, decay: float = 0.99, **kwargs: Any):
        self.decay = _check_decay(decay)
        super().__init__(ops, **kwargs)

    def observe(self, x: Array) -> None:
        x = self._begin(x)
        lo, hi = batch_minmax(self.ops, x, self.channel_axis)
        if self.count:
            lo = cq.ema(self.ops, self.min_val, lo, self.decay)
            hi = cq.ema(self.ops, self.max_val, hi, self.decay)
        self.min_val, self.max_val = lo, hi
        self._commit(x)

    def _config(self):
        return {**super()._config(), "decay": self.decay}

    def merge(self, other: Observer) -> None:
        raise ConfigError("MovingAverageMinMaxObserver.merge: an exponential moving average depends on the "
                          "order of the batches and cannot be merged; use MinMaxObserver, PercentileObserver "
                          "or MseObserver to calibrate on shards")


class _MeanRangeObserver(Observer):
    """Mean over batches of a per-batch range: state ``sum_min``, ``sum_max``, ``count``."""

    def reset(self) -> None:
        super().reset()
        self.sum_min: Array | None = None
        self.sum_max: Array | None = None

    def _batch_range(self, x: Array) -> tuple[Array, Array]:
        raise NotImplementedError

    def observe(self, x: Array) -> None:
        x = self._begin(x)
        lo, hi = self._batch_range(x)
        if self.count:
            lo, hi = self.sum_min + lo, self.sum_max + hi
        self.sum_min, self.sum_max = lo, hi
        self._commit(x)

    def _range(self):
        # a reciprocal rounded once in Python: the same float on every backend (see quant.qparams)
        inv = 1.0 / self.count
        if self.count == 1:
            return self.sum_min, self.sum_max
        return self.sum_min * inv, self.sum_max * inv

    def _copy_state(self, other):
        self.sum_min, self.sum_max = other.sum_min, other.sum_max

    def _merge_state(self, other):
        self.sum_min = self.sum_min + other.sum_min
        self.sum_max = self.sum_max + other.sum_max


class PercentileObserver(_MeanRangeObserver):
    """Mean over batches of the nearest-rank ``(100 - p, p)`` percentiles (:func:`batch_percentile`)."""

    method = "percentile"

    def __init__(self, ops: ArrayOps, *, percentile: float = 99.99, **kwargs: Any):
        self.percentile = _check_percentile(percentile)
        super().__init__(ops, **kwargs)

    def _batch_range(self, x):
        return batch_percentile(self.ops, x, self.percentile, self.channel_axis)

    def _config(self):
        return {**super()._config(), "percentile": self.percentile}


class MseObserver(_MeanRangeObserver):
    """Mean over batches of the per-batch MSE-optimal clipping range (:func:`batch_mse_range`)."""

    method = "mse"

    def __init__(self, ops: ArrayOps, *, grid_size: int = 100, **kwargs: Any):
        self.grid_size = _check_grid(grid_size)
        super().__init__(ops, **kwargs)

    def _batch_range(self, x):
        return batch_mse_range(self.ops, x, self.qmin, self.qmax, self.symmetric, self.grid_size,
                               self.channel_axis)

    def _config(self):
        return {**super()._config(), "grid_size": self.grid_size}


OBSERVERS: dict[str, type[Observer]] = {
    cls.method: cls for cls in (MinMaxObserver, MovingAverageMinMaxObserver, PercentileObserver, MseObserver)
}


def make_observer(ops: ArrayOps, method: str = "minmax", target: str = "activation", **kwargs: Any) -> Observer:
    """An observer by name (``'minmax'``, ``'moving_average_minmax'``, ``'percentile'``, ``'mse'``).

    ``target='weight'``: per channel along axis 0, symmetric signed (int8: [-127, 127]);
    ``target='activation'``: per tensor, affine unsigned ([0, 255]). ``kwargs`` override either.
    """
    if method not in OBSERVERS:
        raise ConfigError(f"unknown observer {method!r}; allowed: {sorted(OBSERVERS)}")
    cls = OBSERVERS[method]
    if target == "weight":
        return cls.for_weights(ops, **kwargs)
    if target == "activation":
        return cls(ops, **kwargs)
    raise ConfigError(f"observer target must be 'weight' or 'activation', got {target!r}")
