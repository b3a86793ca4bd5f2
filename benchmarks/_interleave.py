"""Interleaved timing shared by the artifact benchmarks: every callable runs ``calls`` times per round, in a
freshly shuffled order each round, so load on the machine hits all of them alike; medians per callable; and the structured random inputs they feed their models."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable

import numpy as np

from compressor.core.timing import interleaved_times


def interleaved_medians(fns: dict[Hashable, Callable[[], object]], rounds: int, calls: int,
                        warmup: int = 2, seed: int = 0) -> dict[Hashable, float]:
    """``{key: median seconds per call}`` over ``rounds`` shuffled rounds of ``calls`` calls each
    (:func:`compressor.core.timing.interleaved_times`)."""
    times = interleaved_times(fns, rounds, calls, warmup=warmup, seed=seed)
    return {k: statistics.median(t) for k, t in times.items()}


def artifact_row(model: str, variant: str, size: int, float_size: int, med: dict, agree: float, against: str,
                 extra: str) -> str:
    """One markdown row: size, batch 1 / 32 latency and their ratios to ``('float', b)``, agreement."""
    return (f"| {model} | {variant} | {size / 1024:.1f} | {size / float_size:.2f}x | "
            f"{med[(variant, 1)] * 1e3:.3f} | {med[(variant, 1)] / med[('float', 1)]:.2f}x | "
            f"{med[(variant, 32)] * 1e3:.2f} | {med[(variant, 32)] / med[('float', 32)]:.2f}x | "
            f"{agree:.1%} ({against}) | {extra} |")


def inputs(shape: tuple[int, ...], n: int, seed: int) -> np.ndarray:
    """Class prototypes plus noise: structured inputs, so a random network's logits have margins."""
    rng = np.random.default_rng(seed)
    proto = rng.standard_normal((10, *shape)).astype(np.float32)
    return (proto[rng.integers(0, 10, n)] + 0.5 * rng.standard_normal((n, *shape))).astype(np.float32)
