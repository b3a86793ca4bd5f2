"""tf.distribute helpers: keep compression state identical on every replica.

Under ``tf.distribute.MirroredStrategy`` (and ``MultiWorkerMirroredStrategy``) each replica runs the train
step on its own slice of the global batch. The wrappers' state variables are ``MirroredVariable``\\ s whose
in-step writes (``assign`` in replica context, aggregation ``NONE``) update each replica's own copy, so any
statistic read from data would drift apart per replica. The built-in compressors therefore reduce every
per-batch statistic over the replicas BEFORE it is accumulated (activation counts and sums, the gradients
Taylor scores are built from: SUM; QAT activation min / max: MIN / MAX; LSQ's first-batch step size:
MEAN); each replica then writes the same values, and masks and scales computed from them are identical on
all replicas (and equal to those of one device on the global batch). Nothing is ``MEAN``-reduced that
should not be, and no mask update runs in a ``merge_call``: masks are chosen in the step, in replica
context, from identical inputs.

Collectives cannot run inside ``tf.cond`` branches of a replica function, so the reductions run
unconditionally in the step (small per-channel vectors) and only the accumulation is conditional. Outside a
replica context with more than one replica (one device, or eager cross-replica code) every helper returns
its inputs unchanged. Set ``compressor.sync_ranks = False`` to skip the reductions.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = [
    "all_reduce_max", "all_reduce_mean", "all_reduce_min", "all_reduce_sum", "replica_context", "replica_values",
    "strategy_of", "strategy_scope_of", "unsynchronized",
]


def replica_context() -> Any:
    """The current replica context when it spans more than one replica (a synchronisation is due), else None."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync <= 1:
        return None
    return ctx


def all_reduce_sum(*tensors: Any) -> list[tf.Tensor]:
    """The tensors summed over the replicas (unchanged outside a multi-replica context)."""
    ctx = replica_context()
    if ctx is None or not tensors:
        return list(tensors)
    return list(ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(tensors)))


def all_reduce_mean(*tensors: Any) -> list[tf.Tensor]:
    """The tensors averaged over the replicas (unchanged outside a multi-replica context)."""
    ctx = replica_context()
    if ctx is None or not tensors:
        return list(tensors)
    return list(ctx.all_reduce(tf.distribute.ReduceOp.MEAN, list(tensors)))


def _gathered(x: Any) -> tf.Tensor | None:
    ctx = replica_context()
    if ctx is None:
        return None
    return ctx.all_gather(tf.expand_dims(tf.convert_to_tensor(x), 0), axis=0)  # [replicas, *shape]


def all_reduce_min(x: Any) -> tf.Tensor:
    """Element-wise minimum over the replicas (``ReduceOp`` has no MIN: an all-gather of the small tensor)."""
    g = _gathered(x)
    return tf.convert_to_tensor(x) if g is None else tf.reduce_min(g, axis=0)


def all_reduce_max(x: Any) -> tf.Tensor:
    """Element-wise maximum over the replicas."""
    g = _gathered(x)
    return tf.convert_to_tensor(x) if g is None else tf.reduce_max(g, axis=0)


def strategy_of(variable: Any) -> Any:
    """The distribution strategy a (Keras) variable was created under, or None."""
    raw = getattr(variable, "_value", variable)
    return getattr(raw, "_distribute_strategy", None)


@contextmanager
def strategy_scope_of(variable: Any):
    """Enter the strategy scope of ``variable`` when none is active, so state created next to it (masks,
    statistics) is mirrored like it, even if the compressor was built outside ``strategy.scope()``."""
    strategy = strategy_of(variable)
    if strategy is not None and not tf.distribute.has_strategy():
        with strategy.scope():
            yield strategy
    else:
        yield strategy


def replica_values(variable: Any) -> list[np.ndarray]:
    """The value of ``variable`` on each replica (one entry for a plain variable); eager, for checks."""
    raw = getattr(variable, "_value", variable)
    values = getattr(raw, "values", None)
    if values is None:
        return [np.asarray(raw.numpy())]
    return [np.asarray(v.numpy()) for v in values]


def unsynchronized(compressor: Any) -> list[str]:
    """``<layer>.<name>`` of the compressor state variables whose replicas do not hold bit-identical values
    (``[]`` when all agree); eager, reads values on the host: a check for tests and debugging."""
    out = []
    for wrapper in compressor.get_modules_wrapper():
        state = dict(wrapper.state_variables())
        for var in getattr(wrapper, "_layer_variables", ()):
            state[var.name] = var
        for name, var in state.items():
            vals = replica_values(var)
            first = np.ascontiguousarray(vals[0]).view(np.uint8)
            if any(not np.array_equal(first, np.ascontiguousarray(v).view(np.uint8)) for v in vals[1:]):
                out.append(f"{wrapper.name}.{name}")
    return out
