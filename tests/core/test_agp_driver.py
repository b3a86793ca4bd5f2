"""The AGP schedule driver both backends' AGPPruner inherit (core, pure Python): exact due layers, targets,
pending bookkeeping, statistics on/off and checkpoint round trip, on a framework-free host."""

from types import SimpleNamespace
from typing import Any

import pytest

from compressor.core.agp import AGPScheduleMixin
from compressor.core.errors import ConfigError


class _Masker:
    def __init__(self, model: Any, pruner: Any, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.needs_data = False
        self.events: list[str] = []

    def start_statistics(self) -> None:
        self.events.append("start")

    def stop_statistics(self) -> None:
        self.events.append("stop")


class _Base:
    """Stands for the backend's pruner base: an epoch clock, wrappers with configs, a mask-update counter."""

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        self.modules_wrapper = [SimpleNamespace(config=c) for c in configs]
        self.current_epoch = 0
        self.updates: list[int] = []

    def get_modules_wrapper(self) -> list[Any]:
        return list(self.modules_wrapper)

    def update_epoch(self, epoch: int) -> None:
        self.current_epoch = epoch

    def update_mask(self) -> None:
        self.updates.append(self.current_epoch)
        self._done(*sorted(self._pending))

    def compress(self) -> str:
        return "model"

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.current_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current_epoch = state["epoch"]


class _Pruner(AGPScheduleMixin, _Base):
    AGP_CRITERIA = {"level": (_Masker, ("Linear",)), "apoz": (_Masker, ("Conv2d",)),
                    "slim": (_Masker, ("BatchNorm2d",))}

    def __init__(self, configs: list[dict[str, Any]], algorithm: str = "level", **kw: Any) -> None:
        self._agp_setup(algorithm, kw.get("statistics_batch_num", 1), "relu", kw.get("dependency_aware", False))
        _Base.__init__(self, configs)
        self._agp_start(None, "relu", kw.get("statistics_batch_num", 1))


A = {"final_sparsity": 0.8, "start_epoch": 0, "end_epoch": 5, "frequency": 2}  # span 4: updates at 0, 2, 4
B = {"initial_sparsity": 0.2, "final_sparsity": 0.5, "start_epoch": 1, "end_epoch": 3, "frequency": 1}  # 1, 2


def test_targets_and_due_layers_follow_the_schedule():
    p = _Pruner([A, B])
    assert [p.target_sparsity(0, e) for e in range(6)] == pytest.approx([0.0, 0.4625, 0.7, 0.7875, 0.8, 0.8])
    assert [p.target_sparsity(1, e) for e in range(4)] == [0.2, 0.2, 0.5, 0.5]
    assert p.compress() == "model"
    assert p._scheduled_epoch == 0 and p._pending == {0} and p.masker.events == ["start"]
    for epoch in range(1, 6):
        p.update_epoch(epoch)
    # update_mask ran exactly on the epochs with a due layer: 1 (B), 2 (A, B), 4 (A)
    assert p.updates == [1, 2, 4]
    assert p._pending == set() and p._scheduled_epoch == 5
    assert p.masker.events == ["start", "start", "stop", "start", "stop", "start", "stop"]


def test_same_epoch_is_scheduled_once_and_data_criteria_wait():
    p = _Pruner([A, B], "apoz", statistics_batch_num=3)
    p.masker.needs_data = True
    p.compress()
    p.compress()
    assert p.masker.events == ["start"] and p.masker.kwargs == {"activation": "relu", "statistics_batch_num": 3}
    p.update_epoch(1)
    p.update_epoch(2)
    assert p.updates == [] and p._pending == {0, 1}  # data criteria recompute in the optimizer hook
    p._done(0)
    assert p.masker.events == ["start", "start", "start"]
    p._done(1)
    assert p._pending == set() and p.masker.events[-1] == "stop"


def test_slim_uses_the_first_schedule_for_every_layer():
    p = _Pruner([A, dict(A)], "slim")
    assert p._group_producers_needed is False and p._rank_globally is True
    p.modules_wrapper[1].config = B  # slim: one global schedule, wrapper 0's
    assert p.target_sparsity(1, 2) == pytest.approx(0.7)


def test_checkpoint_round_trip():
    p = _Pruner([A, B], "apoz")
    p.masker.needs_data = True
    p.compress()
    p.update_epoch(2)
    state = p.state_dict()
    assert state == {"epoch": 2, "scheduled_epoch": 2, "pending": [0, 1]}
    q = _Pruner([A, B], "apoz")
    q.load_state_dict(state)
    assert q.current_epoch == 2 and q._scheduled_epoch == 2 and q._pending == {0, 1}
    assert q.masker.events == ["start"]
    r = _Pruner([A, B])
    r.load_state_dict({"epoch": 3})
    assert r._scheduled_epoch is None and r._pending == set() and r.masker.events == ["stop"]


def test_bad_arguments_are_refused_before_anything():
    with pytest.raises(ConfigError, match="pruning_algorithm = 'l7' is invalid; allowed: \\['level', 'apoz', 'slim'\\]"):
        _Pruner([A], "l7")
    with pytest.raises(ConfigError, match="dependency_aware=True needs a filter criterion"):
        _Pruner([A], "level", dependency_aware=True)
    with pytest.raises(ConfigError, match="statistics_batch_num"):
        _Pruner([A], "apoz", statistics_batch_num=0)


def test_criteria_table_resolves_per_backend():
    from compressor.core.agp import AGP_CRITERIA_TABLE, resolve_agp_criteria

    maskers = [type(name, (), {}) for name, _ in AGP_CRITERIA_TABLE.values()]
    got = resolve_agp_criteria(maskers, {"weighted": ["Linear"], "filter": ("Conv2d",), "bn": ("BatchNorm2d",)})
    assert list(got) == ["level", "l1", "l2", "fpgm", "slim", "apoz", "mean_activation", "taylorfo"]
    assert got["level"] == (maskers[0], ("Linear",)) and got["slim"] == (maskers[4], ("BatchNorm2d",))
    assert got["taylorfo"] == (maskers[7], ("Conv2d",))
    with pytest.raises(TypeError, match=r"no masker class named \['TaylorFOWeightFilterPrunerMasker'\]"):
        resolve_agp_criteria(maskers[:7], {"weighted": (), "filter": (), "bn": ()})
