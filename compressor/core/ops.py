"""The numpy-like operations core math is written against.

Every algorithm in :mod:`compressor.core` takes an ``ops`` object first and touches arrays only through
it, so the same function runs on numpy (:class:`NumpyOps`), torch (``compressor.torch.TorchOps``) and
TensorFlow (``compressor.tf.TfOps``). Rules for implementations:

* results stay on the input's device; nothing here may copy to the host (no ``.item()``, ``.numpy()``);
* ``shape``/``numel`` read static metadata only;
* dtype names are strings: ``'float32'``, ``'float64'``, ``'int32'``, ``'int64'``, ``'bool'``;
* python scalars are accepted wherever an array is (broadcasting like numpy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

Array = Any
Axis = int | tuple[int, ...] | None


@runtime_checkable
class ArrayOps(Protocol):
    """Operations the core math needs. Method names and semantics follow numpy."""

    name: str

    # metadata
    def shape(self, x: Array) -> tuple[int, ...]: ...
    def numel(self, x: Array) -> int: ...
    def dtype_name(self, x: Array) -> str: ...
    # construction / conversion
    def asarray(self, x: Any, like: Array | None = None, dtype: str | None = None) -> Array: ...
    def cast(self, x: Array, dtype: str) -> Array: ...
    def zeros_like(self, x: Array, dtype: str | None = None) -> Array: ...
    def ones_like(self, x: Array, dtype: str | None = None) -> Array: ...
    def arange(self, n: int, like: Array | None = None) -> Array: ...
    def stop_gradient(self, x: Array) -> Array: ...
    # shape manipulation
    def reshape(self, x: Array, shape: Sequence[int]) -> Array: ...
    def transpose(self, x: Array, perm: Sequence[int]) -> Array: ...
    def broadcast_to(self, x: Array, shape: Sequence[int]) -> Array: ...
    def concat(self, xs: Sequence[Array], axis: int = 0) -> Array: ...
    def stack(self, xs: Sequence[Array], axis: int = 0) -> Array: ...
    def split(self, x: Array, sizes: Sequence[int], axis: int = 0) -> list[Array]: ...
    # elementwise
    def abs(self, x: Array) -> Array: ...
    def sign(self, x: Array) -> Array: ...
    def sqrt(self, x: Array) -> Array: ...
    def square(self, x: Array) -> Array: ...
    def tanh(self, x: Array) -> Array: ...
    def round(self, x: Array) -> Array: ...
    def floor(self, x: Array) -> Array: ...
    def clip(self, x: Array, lo: Any, hi: Any) -> Array: ...
    def maximum(self, a: Any, b: Any) -> Array: ...
    def minimum(self, a: Any, b: Any) -> Array: ...
    def where(self, cond: Array, a: Any, b: Any) -> Array: ...
    def logical_and(self, a: Array, b: Array) -> Array: ...
    def logical_or(self, a: Array, b: Array) -> Array: ...
    def logical_not(self, a: Array) -> Array: ...
    def equal(self, a: Any, b: Any) -> Array: ...
    def less(self, a: Any, b: Any) -> Array: ...
    def less_equal(self, a: Any, b: Any) -> Array: ...
    def greater(self, a: Any, b: Any) -> Array: ...
    # reductions
    def sum(self, x: Array, axis: Axis = None, keepdims: bool = False) -> Array: ...
    def mean(self, x: Array, axis: Axis = None, keepdims: bool = False) -> Array: ...
    def max(self, x: Array, axis: Axis = None, keepdims: bool = False) -> Array: ...
    def min(self, x: Array, axis: Axis = None, keepdims: bool = False) -> Array: ...
    def cumsum(self, x: Array, axis: int = 0) -> Array: ...
    def matmul(self, a: Array, b: Array) -> Array: ...
    # selection
    def kth_smallest(self, x: Array, k: int) -> Array:
        """The k-th smallest value (1-based) of the 1-D array ``x``, as a 0-d array, in O(n)."""
        ...
    def sort(self, x: Array) -> Array: ...
    def argsort(self, x: Array) -> Array: ...


_NP_DTYPES = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "int64": np.int64, "bool": np.bool_}


class NumpyOps:
    """Reference implementation of :class:`ArrayOps` on numpy."""

    name = "numpy"

    def shape(self, x):
        return tuple(np.shape(x))

    def numel(self, x):
        return int(np.size(x))

    def dtype_name(self, x):
        return np.asarray(x).dtype.name

    def asarray(self, x, like=None, dtype=None):
        if dtype is None and like is not None and not isinstance(x, np.ndarray):
            dtype = self.dtype_name(like)
        return np.asarray(x, dtype=_NP_DTYPES[dtype] if dtype else None)

    def cast(self, x, dtype):
        return np.asarray(x).astype(_NP_DTYPES[dtype])

    def zeros_like(self, x, dtype=None):
        return np.zeros_like(x, dtype=_NP_DTYPES[dtype] if dtype else None)

    def ones_like(self, x, dtype=None):
        return np.ones_like(x, dtype=_NP_DTYPES[dtype] if dtype else None)

    def arange(self, n, like=None):
        return np.arange(n)

    def stop_gradient(self, x):
        return x

    def reshape(self, x, shape):
        return np.reshape(x, tuple(shape))

    def transpose(self, x, perm):
        return np.transpose(x, tuple(perm))

    def broadcast_to(self, x, shape):
        return np.broadcast_to(x, tuple(shape))

    def concat(self, xs, axis=0):
        return np.concatenate(list(xs), axis=axis)

    def stack(self, xs, axis=0):
        return np.stack(list(xs), axis=axis)

    def split(self, x, sizes, axis=0):
        return np.split(x, np.cumsum(sizes)[:-1], axis=axis)

    abs = staticmethod(np.abs)
    sign = staticmethod(np.sign)
    sqrt = staticmethod(np.sqrt)
    square = staticmethod(np.square)
    tanh = staticmethod(np.tanh)
    round = staticmethod(np.round)  # half to even, like torch.round and tf.round
    floor = staticmethod(np.floor)
    clip = staticmethod(np.clip)
    maximum = staticmethod(np.maximum)
    minimum = staticmethod(np.minimum)
    where = staticmethod(np.where)
    logical_and = staticmethod(np.logical_and)
    logical_or = staticmethod(np.logical_or)
    logical_not = staticmethod(np.logical_not)
    equal = staticmethod(np.equal)
    less = staticmethod(np.less)
    less_equal = staticmethod(np.less_equal)
    greater = staticmethod(np.greater)
    matmul = staticmethod(np.matmul)

    def sum(self, x, axis=None, keepdims=False):
        return np.sum(x, axis=axis, keepdims=keepdims)

    def mean(self, x, axis=None, keepdims=False):
        return np.mean(x, axis=axis, keepdims=keepdims)

    def max(self, x, axis=None, keepdims=False):
        return np.max(x, axis=axis, keepdims=keepdims)

    def min(self, x, axis=None, keepdims=False):
        return np.min(x, axis=axis, keepdims=keepdims)

    def cumsum(self, x, axis=0):
        return np.cumsum(x, axis=axis)

    def kth_smallest(self, x, k):
        x = np.asarray(x).reshape(-1)
        return np.partition(x, k - 1)[k - 1]  # introselect: O(n)

    def sort(self, x):
        return np.sort(x, kind="stable")

    def argsort(self, x):
        return np.argsort(x, kind="stable")

