"""Interleaved wall-clock timing, shared by the demo's artifact table and the benchmarks: every callable runs
``calls`` times per round, in a freshly shuffled order each round, so load on the machine hits all of them
alike (the project's rule for comparing latencies: ratios from one interleaved run)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

__all__ = ["interleaved_times"]


def interleaved_times(fns: dict[Any, Callable[[], Any]], rounds: int, calls: int = 1, warmup: int = 1,
                      seed: int = 0) -> dict[Any, list[float]]:
    """Seconds per call of each callable: after ``warmup`` untimed calls each, ``rounds`` rounds that run
    every callable ``calls`` times (their mean is the round's sample) in a freshly shuffled order, so load
    on the machine hits all of them alike."""
    order = list(fns)
    for key in order:
        for _ in range(warmup):
            fns[key]()
    times: dict[Any, list[float]] = {k: [] for k in order}
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            fn = fns[key]
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[key].append((time.perf_counter() - t0) / calls)
    return times
