"""SensitivityPruner's round schedule (core, shared by both backends) on a framework-free host."""

from typing import Any

import pytest

from compressor.core.errors import ConfigError
from compressor.core.sensitivity import SensitivityRoundsMixin


class _Base:
    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None) -> None:
        self.validate_config(config_list)
        self.current_epoch = 0
        self.rounds_at: list[tuple[int, bool]] = []

    def update_mask(self) -> None:
        self.rounds_at.append((self.current_epoch, self._due))

    def update_epoch(self, epoch: int) -> None:
        self.current_epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.current_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current_epoch = state["epoch"]


class _Pruner(SensitivityRoundsMixin, _Base):
    pass


CFG = [{"sensitivity": 0.5, "op_types": ["default"], "exclude": False}]


def test_rounds_run_every_epochs_per_iteration_until_done():
    p = _Pruner(None, CFG, iterations=3, epochs_per_iteration=2)
    assert (p.iterations, p.epochs_per_iteration, p.iteration, p._due) == (3, 2, 0, False)
    p.prune_iteration()  # round 1 (what compress() does)
    for epoch in range(1, 9):
        p.update_epoch(epoch)
    # rounds 2 and 3 at epochs 2 and 4, then none: 3 rounds done; _due only inside a round
    assert p.rounds_at == [(0, True), (2, True), (4, True)]
    assert p.iteration == 3 and p._due is False
    assert p.state_dict() == {"epoch": 8, "iteration": 3}
    q = _Pruner(None, CFG, iterations=3, epochs_per_iteration=2)
    q.load_state_dict({"epoch": 8, "iteration": 3})
    assert q.iteration == 3 and q.current_epoch == 8


def test_one_round_without_epochs_per_iteration():
    p = _Pruner(None, CFG)
    p.prune_iteration()
    for epoch in range(1, 5):
        p.update_epoch(epoch)
    assert p.rounds_at == [(0, True)] and p.iteration == 1


def test_bad_arguments_and_sparsity_key_are_refused():
    with pytest.raises(ConfigError, match="iterations"):
        _Pruner(None, CFG, iterations=0)
    with pytest.raises(ConfigError, match="sparsity"):
        _Pruner(None, [{"sparsity": 0.5, "op_types": ["default"], "exclude": False}])
