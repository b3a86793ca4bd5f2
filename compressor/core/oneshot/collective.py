"""A one-shot run split over several processes: what the driver asks of the processes' group.

Data parallel: each process calibrates on its own share of the calibration sequences; the statistics a method
reads (:class:`~compressor.core.oneshot.statistics.GramAccumulator`: sums) are summed over the processes before a
layer is solved, so every process solves from the statistics of ALL the sequences. Weight parallel: the layers of a
block are solved by different processes (split by their cost: :func:`assign_layers`) and each result is sent to all, so
every process holds the same compressed block and computes its own sequences' inputs of the next block. AWQ's
grid search runs on every process, each scoring the candidates on its own sequences, the losses summed.

A :class:`Collective` is that group seen from one process. :data:`LOCAL` is the group of one (every call a
no-op); a backend brings its framework's (``torch.distributed``: :class:`compressor.torch.distributed.TorchCollective`).
The collectives are called by every process in the same order: the driver's loop is the same on all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Collective", "LOCAL", "reduce_statistics", "owner_of", "assign_layers", "split_evenly"]


class Collective:
    """The processes of one run, seen from one of them (the default: a single process; every call returns its
    input)."""

    rank = 0
    world = 1

    def sum_arrays(self, arrays: Sequence[np.ndarray]) -> None:
        """Replace each float64 array by its sum over the processes, in place (same shapes, same order on all)."""

    def sum_values(self, values: Sequence[float]) -> list[float]:
        """The element-wise sums over the processes of a few numbers (float64)."""
        return [float(v) for v in values]

    def gather_values(self, value: int) -> list[int]:
        """Every process's ``value``, by rank."""
        return [int(value)]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Process ``src``'s ``obj`` (picklable), on every process."""
        return obj

    def barrier(self) -> None:
        """Return once every process has called it."""

    def sequence_range(self, local: int) -> tuple[int, int]:
        """``(first, total)``: the global index of this process's first calibration sequence when it holds
        ``local`` of them (processes hold consecutive shares in rank order), and their number over all processes."""
        counts = self.gather_values(local)
        return sum(counts[: self.rank]), sum(counts)


#: the group of one process
LOCAL = Collective()


def owner_of(index: int, world: int) -> int:
    """The process of layer ``index`` when the layers cost the same (what :func:`assign_layers` gives then)."""
    return index % world


def assign_layers(costs: Sequence[float], world: int) -> list[int]:
    """The process that solves each of a block's layers, given each layer's cost: the costliest first, each to the
    process with the least work so far (ties: the lower rank; the same answer on every process). A TinyLlama
    block over 2 processes: its down projection (2/3 of the solving) on one, the six others on the other, where
    ``i mod 2`` gave one process 4/5 of the work."""
    load = [0.0] * world
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def split_evenly(items: Sequence[Any], world: int, rank: int) -> list[Any]:
    """``rank``'s consecutive share of ``items`` (shares differ in size by at most one, the larger ones first)."""
    n = len(items)
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return list(items[start:start + base + (rank < extra)])


def reduce_statistics(collective: Collective, accs: dict[str, Any]) -> None:
    """Sum every accumulator of ``accs`` (each once, however many layers share it) over the processes, in place:
    its Gram matrix, per-channel sums and row count. A no-op in one process."""
    if collective.world == 1:
        return
    seen: set[int] = set()
    for name in sorted(accs):
        acc = accs[name]
        if acc is None or id(acc) in seen:
            continue
        seen.add(id(acc))
        arrays = [a for a in (*(acc.gram_blocks or ()), acc._sq, acc.abs_sum) if a is not None]
        collective.sum_arrays(arrays)
        acc.count = int(collective.sum_values([acc.count])[0])
