"""A one-shot run split over processes (core.oneshot.collective), with threads standing for the processes: the
statistics summed over all of them, each layer solved by one and shared, so every process ends with the blocks a
single process computes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from compressor.core.oneshot import GptqMethod, SparseGPTMethod, WandaMethod
from compressor.core.oneshot.collective import LOCAL, Collective, owner_of, reduce_statistics, split_evenly
from compressor.core.oneshot.statistics import GramAccumulator
from compressor.core.oneshot.stream import RunStore, run_streamed
from tests.core.test_sequential import BATCHES
from tests.core.test_stream import W4, DiskBackend, DiskIO, finished, streamed


class _Group:
    """What the processes share: a barrier and one slot per process."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list = [None] * world


class ThreadCollective(Collective):
    def __init__(self, group: _Group, rank: int) -> None:
        self.g, self.rank, self.world = group, rank, group.world
        self.calls: list[str] = []

    def _all(self, value):
        self.g.slots[self.rank] = value
        self.g.barrier.wait()
        got = list(self.g.slots)
        self.g.barrier.wait()
        return got

    def sum_arrays(self, arrays):
        self.calls.append("sum_arrays")
        got = self._all([a.copy() for a in arrays])
        for i, a in enumerate(arrays):
            a[...] = sum(g[i] for g in got)  # in rank order, as every process adds them

    def sum_values(self, values):
        got = self._all([float(v) for v in values])
        return [float(sum(g[i] for g in got)) for i in range(len(values))]

    def gather_values(self, value):
        return [int(v) for v in self._all(int(value))]

    def broadcast_object(self, obj, src):
        self.calls.append("broadcast")
        return self._all(obj)[src]

    def barrier(self):
        self._all(None)


def test_shares_and_owners():
    assert split_evenly(list(range(7)), 3, 0) == [0, 1, 2]
    assert split_evenly(list(range(7)), 3, 1) == [3, 4]
    assert split_evenly(list(range(7)), 3, 2) == [5, 6]
    assert [owner_of(i, 3) for i in range(5)] == [0, 1, 2, 0, 1]
    assert LOCAL.sequence_range(5) == (0, 5) and LOCAL.broadcast_object("x", 0) == "x"


def test_statistics_summed_over_processes_equal_one_process_on_all_rows():
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=(6, 5)) for _ in range(4)]
    whole = GramAccumulator(5)
    for r in rows:
        whole.add(r)
    group = _Group(2)
    parts = [GramAccumulator(5), GramAccumulator(5)]

    def run(rank):
        for r in split_evenly(rows, 2, rank):
            parts[rank].add(r)
        reduce_statistics(ThreadCollective(group, rank), {"q": parts[rank], "k": parts[rank]})  # shared: summed once
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for p in parts:
        assert p.count == 24
        np.testing.assert_allclose(p.gram, whole.gram, rtol=1e-13)
        np.testing.assert_allclose(p.abs_sum, whole.abs_sum, rtol=1e-13)
    np.testing.assert_array_equal(parts[0].gram, parts[1].gram)  # bit for bit the same on every process


@pytest.mark.parametrize("method, config", [(SparseGPTMethod(), {"sparsity": 0.5}),
                                            (GptqMethod(), {"quant_bits": {"weight": 4}}),
                                            (WandaMethod(), {"sparsity": 0.5})])
def test_a_run_over_two_processes_gives_every_process_the_single_process_blocks(tmp_path, method, config):
    _, ref_store, _ = streamed(tmp_path / "one", method, config)
    ref = finished(ref_store, 4)
    group = _Group(2)
    out: dict[int, object] = {}
    colls = [ThreadCollective(group, r) for r in range(2)]

    def run(rank):
        try:
            be = DiskBackend(W4, config)
            be.collective = colls[rank]
            store = RunStore(tmp_path / "two" / "run", "key-1", 4, writer=rank == 0) if rank == 0 else None
            colls[rank].barrier()
            if store is None:
                store = RunStore(tmp_path / "two" / "run", "key-1", 4, writer=False)
            rows = run_streamed([(be, method)], DiskIO(be), split_evenly(BATCHES, 2, rank), store, progress=False)
            out[rank] = (rows, be)
        except BaseException as e:  # noqa: BLE001
            out[rank] = e
            group.barrier.abort()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for r in range(2):
        assert not isinstance(out[r], BaseException), out[r]
    store = RunStore(tmp_path / "two" / "run", "key-1", 4)
    assert store.done == 4
    for got, want in zip(finished(store, 4), ref):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # the statistics were summed once per block; each block's one layer was solved by process 0 and shared
    assert colls[1].calls.count("broadcast") == 4
    assert colls[1].calls.count("sum_arrays") == (4 if method.statistics else 0)
