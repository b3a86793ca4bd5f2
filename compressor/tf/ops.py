"""ArrayOps on TensorFlow tensors/variables: graph-safe (traces inside tf.function), device-agnostic."""

from __future__ import annotations

import tensorflow as tf

_DTYPES = {"float32": tf.float32, "float64": tf.float64, "int32": tf.int32, "int64": tf.int64, "bool": tf.bool,
           "float16": tf.float16, "bfloat16": tf.bfloat16}
_NAMES = {v: k for k, v in _DTYPES.items()}
# float dtype -> (int type of the same width, bisection steps, xor mask flipping all but the sign bit)
_BITS = {tf.float32: (tf.int32, 32, 0x7FFFFFFF), tf.float64: (tf.int64, 64, 0x7FFFFFFFFFFFFFFF)}


def _axis(axis):
    return list(axis) if isinstance(axis, (tuple, list)) else axis


class TfOps:
    """The ``ArrayOps`` protocol of ``compressor.core`` on TensorFlow tensors / variables: the numpy-like operations the shared
    algorithm math (masks, quantization, schedules) is written against. Use the module-level ``ops``."""

    name = "tf"

    def shape(self, x):
        """Static shape; an unknown dimension (a batch inside ``fit``) is -1, as ``reshape`` takes it."""
        return tuple(-1 if d is None else int(d) for d in x.shape)

    def numel(self, x):
        n = 1
        for d in x.shape:
            if d is None:
                raise ValueError(f"numel of a tensor with an unknown dimension: {x.shape}")
            n *= int(d)
        return n

    def dtype_name(self, x):
        return _NAMES[x.dtype]

    def asarray(self, x, like=None, dtype=None):
        if dtype is not None:
            dt = _DTYPES[dtype]
        elif like is not None and not tf.is_tensor(x):
            dt = like.dtype
        else:
            dt = None
        t = tf.convert_to_tensor(x)
        return t if dt is None or t.dtype == dt else tf.cast(t, dt)

    def cast(self, x, dtype):
        return tf.cast(x, _DTYPES[dtype])

    def zeros_like(self, x, dtype=None):
        return tf.zeros_like(x, dtype=_DTYPES[dtype] if dtype else None)

    def ones_like(self, x, dtype=None):
        return tf.ones_like(x, dtype=_DTYPES[dtype] if dtype else None)

    def arange(self, n, like=None):
        return tf.range(n)

    def stop_gradient(self, x):
        return tf.stop_gradient(x)

    def reshape(self, x, shape):
        return tf.reshape(x, list(shape))

    def transpose(self, x, perm):
        return tf.transpose(x, list(perm))

    def broadcast_to(self, x, shape):
        return tf.broadcast_to(x, list(shape))

    def concat(self, xs, axis=0):
        return tf.concat(list(xs), axis=axis)

    def stack(self, xs, axis=0):
        return tf.stack(list(xs), axis=axis)

    def split(self, x, sizes, axis=0):
        return tf.split(x, list(sizes), axis=axis)

    def abs(self, x):
        return tf.abs(x)

    def sign(self, x):
        return tf.sign(x)

    def sqrt(self, x):
        return tf.sqrt(x)

    def square(self, x):
        return tf.square(x)

    def tanh(self, x):
        return tf.tanh(x)

    def round(self, x):
        return tf.round(x)  # half to even

    def floor(self, x):
        return tf.floor(x)

    def clip(self, x, lo, hi):
        x = tf.convert_to_tensor(x)
        return tf.clip_by_value(x, tf.cast(lo, x.dtype), tf.cast(hi, x.dtype))

    def _pair(self, a, b):
        if tf.is_tensor(a) or isinstance(a, tf.Variable):
            a = tf.convert_to_tensor(a)
            return a, tf.cast(b, a.dtype) if not tf.is_tensor(b) else b
        b = tf.convert_to_tensor(b)
        return tf.cast(a, b.dtype), b

    def maximum(self, a, b):
        return tf.maximum(*self._pair(a, b))

    def minimum(self, a, b):
        return tf.minimum(*self._pair(a, b))

    def where(self, cond, a, b):
        a, b = self._pair(a, b)
        return tf.where(cond, a, b)

    def logical_and(self, a, b):
        return tf.logical_and(a, b)

    def logical_or(self, a, b):
        return tf.logical_or(a, b)

    def logical_not(self, a):
        return tf.logical_not(a)

    def equal(self, a, b):
        return tf.equal(*self._pair(a, b))

    def less(self, a, b):
        return tf.less(*self._pair(a, b))

    def less_equal(self, a, b):
        return tf.less_equal(*self._pair(a, b))

    def greater(self, a, b):
        return tf.greater(*self._pair(a, b))

    def sum(self, x, axis=None, keepdims=False):
        return tf.reduce_sum(x, axis=_axis(axis), keepdims=keepdims)

    def mean(self, x, axis=None, keepdims=False):
        return tf.reduce_mean(x, axis=_axis(axis), keepdims=keepdims)

    def max(self, x, axis=None, keepdims=False):
        return tf.reduce_max(x, axis=_axis(axis), keepdims=keepdims)

    def min(self, x, axis=None, keepdims=False):
        return tf.reduce_min(x, axis=_axis(axis), keepdims=keepdims)

    def cumsum(self, x, axis=0):
        return tf.cumsum(x, axis=axis)

    def matmul(self, a, b):
        return tf.matmul(a, b)

    def kth_smallest(self, x, k):
        """O(n) selection without a sort: bisection on the order-preserving integer key of the float bits.

        One counting pass per bit (32 for float32), each a vectorised compare + sum, all graph ops.
        """
        x = tf.reshape(tf.convert_to_tensor(x), [-1])
        orig = x.dtype
        if orig not in _BITS:
            x = tf.cast(x, tf.float32)
        itype, nbits, flip = _BITS[x.dtype]
        bits = tf.bitcast(x, itype)
        key = tf.where(bits < 0, tf.bitwise.bitwise_xor(bits, tf.constant(flip, itype)), bits)
        # smallest t with count(key <= t) >= k; the answer stays in [lo, hi]
        lo = tf.reduce_min(key)
        hi = tf.reduce_max(key)
        kk = tf.constant(k, tf.int64)
        for _ in range(nbits + 1):
            # floor((lo + hi) / 2) without overflow (arithmetic shifts)
            mid = (tf.bitwise.right_shift(lo, 1) + tf.bitwise.right_shift(hi, 1)
                   + tf.bitwise.bitwise_and(tf.bitwise.bitwise_and(lo, hi), tf.constant(1, itype)))
            enough = tf.reduce_sum(tf.cast(key <= mid, tf.int64)) >= kk
            hi = tf.where(enough, mid, hi)
            lo = tf.where(enough, lo, mid + 1)
        t = hi
        out_bits = tf.where(t < 0, tf.bitwise.bitwise_xor(t, tf.constant(flip, itype)), t)
        value = tf.bitcast(out_bits, x.dtype)
        return value if value.dtype == orig else tf.cast(value, orig)

    def sort(self, x):
        return tf.sort(x)

    def argsort(self, x):
        return tf.argsort(x, stable=True)


ops = TfOps()
"""The ``TfOps`` instance to pass as ``ops`` to core math (``calc_mask`` helpers, quantization functions)."""
