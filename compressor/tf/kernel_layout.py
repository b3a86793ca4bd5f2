"""How a Keras Dense / EinsumDense kernel maps to core's canonical ``[out, in]`` weight and its input to rows
``[tokens, in]``: used by the one-shot compressors (:mod:`compressor.tf.sequential`) and the low-bit export
(:mod:`compressor.tf.quantization.lowbit`), below both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ..core.errors import ConfigError
from . import layout

__all__ = ["KernelLayout", "kernel_layout", "ONESHOT_DEFAULT_TYPES"]

#: what ``op_types: ['default']`` means for the one-shot compressors (attention projections are EinsumDense)
ONESHOT_DEFAULT_TYPES = ("Dense", "EinsumDense")


@dataclass(frozen=True)
class KernelLayout:
    """How a Dense / EinsumDense kernel maps to core's ``[out, in]`` and its input to rows ``[tokens, in]``."""

    layer_type: str
    kernel_shape: tuple[int, ...]
    perm: tuple[int, ...]  # kernel axes in [out axes..., in axes...] order
    n_out: int
    n_in: int

    def to_canonical(self, kernel: Any) -> np.ndarray:
        k = np.asarray(kernel)
        if self.layer_type == "Dense":
            return np.asarray(layout.to_canonical("Dense", tf.convert_to_tensor(k)))
        return np.transpose(k, self.perm).reshape(self.n_out, self.n_in)

    def from_canonical(self, w: Any) -> np.ndarray:
        w = np.asarray(w)
        if self.layer_type == "Dense":
            return np.asarray(layout.from_canonical("Dense", tf.convert_to_tensor(w), self.kernel_shape))
        permuted = [self.kernel_shape[a] for a in self.perm]
        return np.transpose(w.reshape(permuted), np.argsort(self.perm))

    def rows(self, x: Any) -> np.ndarray:
        """``x`` as rows ``[tokens, in]`` for core's accumulator: float32 / float64 as they are (core takes float32
        products of float32 values whatever the dtype: a float64 copy changed no statistic and was a transient
        of twice the input's bytes per observed call), half precision widened to float32, other dtypes float64."""
        a = np.asarray(x)
        if a.dtype != np.float32 and a.dtype != np.float64:
            floating = np.issubdtype(a.dtype, np.floating) or a.dtype.name in ("bfloat16", "float16")
            a = a.astype(np.float32 if floating and a.dtype.itemsize < 4 else np.float64)
        return a.reshape(-1, self.n_in)


def _einsum_layout(name: str, equation: str, shape: tuple[int, ...]) -> KernelLayout:
    bad = (f"layer {name!r} (EinsumDense) has equation {equation!r}: one-shot compression needs the kernel's "
           f"contracted axes to be the input's trailing axes and every other kernel axis an output axis "
           f"(e.g. 'abc,cd->abd', 'abc,cde->abde', 'abcd,cde->abe')")
    try:
        lhs, out = equation.replace(" ", "").split("->")
        x_spec, k_spec = lhs.split(",")
    except ValueError:
        raise ConfigError(bad) from None
    x_spec, out = x_spec.replace("...", ""), out.replace("...", "")
    if "." in k_spec or len(k_spec) != len(shape):
        raise ConfigError(bad)
    contracted = [c for c in x_spec if c in k_spec and c not in out]
    outs = [c for c in out if c in k_spec and c not in x_spec]
    if not contracted or len(contracted) + len(outs) != len(k_spec) or x_spec[len(x_spec) - len(contracted):] != "".join(contracted):
        raise ConfigError(bad)
    perm = tuple(k_spec.index(c) for c in outs + contracted)
    n_out = int(np.prod([shape[k_spec.index(c)] for c in outs])) if outs else 1
    n_in = int(np.prod([shape[k_spec.index(c)] for c in contracted]))
    return KernelLayout("EinsumDense", tuple(shape), perm, n_out, n_in)


def kernel_layout(name: str, layer: Any) -> KernelLayout:
    """The :class:`KernelLayout` of a built Dense / EinsumDense ``layer`` (ConfigError for anything else)."""
    kernel = layout.weight_of(layer)
    if kernel is None or not hasattr(layer, "kernel"):
        raise ConfigError(f"layer {name!r} ({type(layer).__name__}) has no built kernel; one-shot compression takes "
                          f"Dense and EinsumDense layers of a built model (call it on data or keras.Input first)")
    shape = tuple(int(d) for d in kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense):
        return _einsum_layout(name, layer.equation, shape)
    if isinstance(layer, keras.layers.Dense) and len(shape) == 2:
        return KernelLayout("Dense", shape, (1, 0), shape[1], shape[0])
    raise ConfigError(f"layer {name!r} ({type(layer).__name__}) is not a Dense or EinsumDense layer; one-shot "
                      f"compression takes {list(ONESHOT_DEFAULT_TYPES)}")
