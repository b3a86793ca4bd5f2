"""ArrayOps on torch tensors: thin wrappers, results stay on the input's device, no host syncs."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
           "bool": torch.bool, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in _DTYPES.items()}


def _axis(axis):
    return tuple(axis) if isinstance(axis, (tuple, list)) else axis


class TorchOps:
    """The ``ArrayOps`` protocol of ``compressor.core`` on torch tensors: the numpy-like operations the shared
    algorithm math (masks, quantization, schedules) is written against. Use the module-level ``ops``."""

    name = "torch"

    def shape(self, x):
        return tuple(x.shape)

    def numel(self, x):
        return int(x.numel())

    def dtype_name(self, x):
        return _NAMES[x.dtype]

    def asarray(self, x, like=None, dtype=None):
        if like is not None and isinstance(x, (int, float, bool)):
            # a fill kernel on the device: no host-to-device copy (which would sync a CUDA stream)
            dt = _DTYPES[dtype] if dtype is not None else like.dtype
            return torch.full((), x, dtype=dt, device=like.device)
        kw = {}
        if like is not None:
            kw["device"] = like.device
            if dtype is None and not torch.is_tensor(x):
                kw["dtype"] = like.dtype
        if dtype is not None:
            kw["dtype"] = _DTYPES[dtype]
        return torch.as_tensor(x, **kw)

    def cast(self, x, dtype):
        return x.to(_DTYPES[dtype])

    def zeros_like(self, x, dtype=None):
        return torch.zeros_like(x, dtype=_DTYPES[dtype] if dtype else None)

    def ones_like(self, x, dtype=None):
        return torch.ones_like(x, dtype=_DTYPES[dtype] if dtype else None)

    def arange(self, n, like=None):
        return torch.arange(n, device=None if like is None else like.device)

    def stop_gradient(self, x):
        return x.detach()

    def reshape(self, x, shape):
        return x.reshape(tuple(shape))

    def transpose(self, x, perm):
        return x.permute(*perm)

    def broadcast_to(self, x, shape):
        return x.expand(*shape)

    def concat(self, xs, axis=0):
        return torch.cat(list(xs), dim=axis)

    def stack(self, xs, axis=0):
        return torch.stack(list(xs), dim=axis)

    def split(self, x, sizes, axis=0):
        return list(torch.split(x, list(sizes), dim=axis))

    def abs(self, x):
        return torch.abs(x)

    def sign(self, x):
        return torch.sign(x)

    def sqrt(self, x):
        return torch.sqrt(x)

    def square(self, x):
        return torch.square(x)

    def tanh(self, x):
        return torch.tanh(x)

    def round(self, x):
        return torch.round(x)

    def floor(self, x):
        return torch.floor(x)

    def clip(self, x, lo, hi):
        return torch.clamp(x, lo, hi)

    # Python scalars go to clamp / scalar overloads, never through a tensor built on the host.
    def maximum(self, a, b):
        if not torch.is_tensor(a):
            a, b = b, a
        return torch.maximum(a, b) if torch.is_tensor(b) else torch.clamp(a, min=b)

    def minimum(self, a, b):
        if not torch.is_tensor(a):
            a, b = b, a
        return torch.minimum(a, b) if torch.is_tensor(b) else torch.clamp(a, max=b)

    def where(self, cond, a, b):
        return torch.where(cond, a, b)

    def logical_and(self, a, b):
        return torch.logical_and(a, b)

    def logical_or(self, a, b):
        return torch.logical_or(a, b)

    def logical_not(self, a):
        return torch.logical_not(a)

    def equal(self, a, b):
        return torch.eq(a, b) if torch.is_tensor(a) else torch.eq(b, a)

    def less(self, a, b):
        return torch.lt(a, b) if torch.is_tensor(a) else torch.gt(b, a)

    def less_equal(self, a, b):
        return torch.le(a, b) if torch.is_tensor(a) else torch.ge(b, a)

    def greater(self, a, b):
        return torch.gt(a, b) if torch.is_tensor(a) else torch.lt(b, a)

    def sum(self, x, axis=None, keepdims=False):
        return torch.sum(x) if axis is None else torch.sum(x, dim=_axis(axis), keepdim=keepdims)

    def mean(self, x, axis=None, keepdims=False):
        return torch.mean(x) if axis is None else torch.mean(x, dim=_axis(axis), keepdim=keepdims)

    def max(self, x, axis=None, keepdims=False):
        return torch.amax(x) if axis is None else torch.amax(x, dim=_axis(axis), keepdim=keepdims)

    def min(self, x, axis=None, keepdims=False):
        return torch.amin(x) if axis is None else torch.amin(x, dim=_axis(axis), keepdim=keepdims)

    def cumsum(self, x, axis=0):
        return torch.cumsum(x, dim=axis)

    def matmul(self, a, b):
        return torch.matmul(a, b)

    def kth_smallest(self, x, k):
        flat = x.reshape(-1)
        if flat.device.type == "cpu":
            return torch.kthvalue(flat, k).values  # O(n) selection
        # CUDA's kthvalue selects within one slice per thread block: on a 4096 x 4096 weight on an H200 it took
        # 119 ms, a full sort 70x less; the k-th smallest value is the same number either way (no host sync)
        return torch.sort(flat).values[k - 1]

    def sort(self, x):
        return torch.sort(x, stable=True).values

    def argsort(self, x):
        return torch.sort(x, stable=True).indices


ops = TorchOps()
"""The ``TorchOps`` instance to pass as ``ops`` to core math (``calc_mask`` helpers, quantization functions)."""
