"""AGPPruner's backend-agnostic part: its arguments and config keys, their validation, the per-layer schedule.

Config keys per entry: ``final_sparsity`` (or ``sparsity``), ``initial_sparsity`` (0), ``start_epoch``
(0), ``end_epoch`` (10), ``frequency`` (1). Both backends' ``AGPPruner`` call these functions, so a
config_list means the same on torch and tf. The schedule math itself is
:func:`compressor.core.schedules.agp_sparsity` / ``agp_should_update``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from .errors import ConfigError
from .pruner_config import check_activation, check_statistics_batch_num
from .schedules import agp_should_update, agp_sparsity

__all__ = [
    "AGP_DEFAULTS", "agp_due_layers", "agp_masker_kwargs", "agp_schedule", "agp_target", "check_agp_algorithm",
    "check_agp_args", "check_agp_dependency", "validate_agp_config", "AGP_FILTER_CRITERIA",
]

#: values of the per-entry AGP keys an entry leaves out
AGP_DEFAULTS: dict[str, Any] = {"initial_sparsity": 0.0, "start_epoch": 0, "end_epoch": 10, "frequency": 1}


def agp_schedule(config: dict[str, Any]) -> tuple[float, float, int, int, int]:
    """``(initial, final, start_epoch, end_epoch, frequency)`` of a normalised config entry."""
    final = config.get("final_sparsity", config.get("sparsity"))
    return (config.get("initial_sparsity", AGP_DEFAULTS["initial_sparsity"]), final,
            config.get("start_epoch", AGP_DEFAULTS["start_epoch"]), config.get("end_epoch", AGP_DEFAULTS["end_epoch"]),
            config.get("frequency", AGP_DEFAULTS["frequency"]))


def agp_target(config: dict[str, Any], epoch: int) -> float:
    """The AGP target sparsity of a layer configured by ``config`` at ``epoch``."""
    si, sf, start, end, freq = agp_schedule(config)
    return agp_sparsity(epoch, si, sf, start, end, freq)


def agp_due_layers(configs: Sequence[dict[str, Any]], epoch: int) -> set[int]:
    """Indices of the layers (one config each, in wrapper order) whose masks AGP recomputes at ``epoch``."""
    due = set()
    for idx, config in enumerate(configs):
        _, _, start, end, freq = agp_schedule(config)
        if agp_should_update(epoch, start, end, freq):
            due.add(idx)
    return due


def check_agp_algorithm(pruning_algorithm: Any, allowed: Collection[str]) -> str:
    """``pruning_algorithm`` if it names one of ``allowed`` criteria, else ConfigError."""
    if pruning_algorithm not in allowed:
        raise ConfigError(f"AGPPruner: pruning_algorithm = {pruning_algorithm!r} is invalid; "
                          f"allowed: {list(allowed)}")
    return pruning_algorithm


def check_agp_args(pruning_algorithm: Any, allowed: Collection[str], statistics_batch_num: Any,
                   activation: Any) -> None:
    """Refuse AGPPruner's constructor arguments (``allowed``: the backend's criteria names)."""
    check_agp_algorithm(pruning_algorithm, allowed)
    check_statistics_batch_num(statistics_batch_num, "AGPPruner")
    check_activation(activation, "AGPPruner")


#: the criteria that rank whole filters (channels): those that can prune coupled layers together
AGP_FILTER_CRITERIA = ("l1", "l2", "fpgm", "slim", "apoz", "mean_activation", "taylorfo")


def check_agp_dependency(pruning_algorithm: str, dependency_aware: Any) -> bool:
    """Refuse ``dependency_aware`` that is not a bool, or True with a criterion that does not rank filters."""
    if not isinstance(dependency_aware, bool):
        raise ConfigError(f"AGPPruner: dependency_aware must be True or False, got {dependency_aware!r}")
    if dependency_aware and pruning_algorithm not in AGP_FILTER_CRITERIA:
        raise ConfigError(f"AGPPruner: dependency_aware=True needs a filter criterion (pruning_algorithm in "
                          f"{list(AGP_FILTER_CRITERIA)}); {pruning_algorithm!r} prunes single weights, not channels")
    return dependency_aware


def validate_agp_config(config_list: list[dict[str, Any]], pruning_algorithm: str) -> None:
    """Refuse normalised entries without a final sparsity, with two disagreeing ones, with an initial
    sparsity above the final one, or (slim: one global threshold) with differing schedules."""
    schedules = []
    for i, c in enumerate(config_list):
        if c["exclude"]:
            continue
        if "final_sparsity" not in c and "sparsity" not in c:
            raise ConfigError(f"config_list[{i}]: AGPPruner needs 'final_sparsity' (or 'sparsity') in every "
                              f"non-excluded entry")
        if "final_sparsity" in c and "sparsity" in c and c["final_sparsity"] != c["sparsity"]:
            raise ConfigError(f"config_list[{i}]: 'sparsity' = {c['sparsity']} and 'final_sparsity' = "
                              f"{c['final_sparsity']} disagree; give one of them")
        s = agp_schedule(c)
        if s[0] > s[1]:
            raise ConfigError(f"config_list[{i}]: 'initial_sparsity' = {s[0]} is invalid; allowed: a value "
                              f"<= final sparsity ({s[1]})")
        schedules.append(s)
    if pruning_algorithm == "slim" and len(set(schedules)) > 1:
        raise ConfigError("AGPPruner(pruning_algorithm='slim'): one global threshold needs one schedule, "
                          f"but config entries give {sorted(set(schedules))}")


def agp_masker_kwargs(pruning_algorithm: str, activation: str, statistics_batch_num: int) -> dict[str, Any]:
    """Keyword arguments of the masker behind ``pruning_algorithm`` (data criteria take statistics options)."""
    if pruning_algorithm in ("apoz", "mean_activation"):
        return {"activation": activation, "statistics_batch_num": statistics_batch_num}
    if pruning_algorithm == "taylorfo":
        return {"statistics_batch_num": statistics_batch_num}
    return {}
