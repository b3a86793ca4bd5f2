"""AGPPruner's backend-agnostic part: its arguments and config keys, their validation, the per-layer schedule.

Config keys per entry: ``final_sparsity`` (or ``sparsity``), ``initial_sparsity`` (0), ``start_epoch``
(0), ``end_epoch`` (10), ``frequency`` (1). Both backends' ``AGPPruner`` call these functions, so a
config_list means the same on torch and tf. The schedule math itself is
:func:`compressor.core.schedules.agp_sparsity` / ``agp_should_update``.

:class:`AGPScheduleMixin` is the schedule driver both backends' ``AGPPruner`` inherit: the constructor
checks, which layers are due at an epoch, the pending set and its (de)serialisation. Each backend adds only
what touches its framework (validating a layer, computing masks on its tensors, in-graph updates on tf).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from .errors import ConfigError
from .pruner_config import check_activation, check_statistics_batch_num
from .pruning import nm_validate_config
from .schedules import agp_should_update, agp_sparsity

__all__ = [
    "AGP_CRITERIA_TABLE", "AGP_DEFAULTS", "AGPScheduleMixin", "resolve_agp_criteria", "agp_due_layers", "agp_masker_kwargs", "agp_schedule", "agp_target", "check_agp_algorithm",
    "check_agp_args", "check_agp_dependency", "validate_agp_config", "AGP_FILTER_CRITERIA",
]

#: values of the per-entry AGP keys an entry leaves out
AGP_DEFAULTS: dict[str, Any] = {"initial_sparsity": 0.0, "start_epoch": 0, "end_epoch": 10, "frequency": 1}


#: The criteria AGPPruner offers on both backends, in this order: ``pruning_algorithm -> (masker class name,
#: what op_types 'default' means)``; the latter is ``'weighted'`` (the backend's weighted layers), ``'filter'``
#: (the layers whose filters a filter criterion ranks) or ``'bn'`` (the norms slimming ranks).
AGP_CRITERIA_TABLE: dict[str, tuple[str, str]] = {
    "level": ("LevelPrunerMasker", "weighted"),
    "l1": ("L1FilterPrunerMasker", "filter"),
    "l2": ("L2FilterPrunerMasker", "filter"),
    "fpgm": ("FPGMPrunerMasker", "filter"),
    "slim": ("SlimPrunerMasker", "bn"),
    "apoz": ("ActivationAPoZRankFilterPrunerMasker", "filter"),
    "mean_activation": ("ActivationMeanRankFilterPrunerMasker", "filter"),
    "taylorfo": ("TaylorFOWeightFilterPrunerMasker", "filter"),
}


def resolve_agp_criteria(maskers: Iterable[type],
                         default_types: Mapping[str, tuple[str, ...]]) -> dict[str, tuple[type, tuple[str, ...]]]:
    """A backend's ``AGP_CRITERIA``: :data:`AGP_CRITERIA_TABLE` with each masker name resolved among the
    backend's ``maskers`` (by class name) and each default-types kind in ``default_types``."""
    by_name = {m.__name__: m for m in maskers}
    missing = [name for name, _ in AGP_CRITERIA_TABLE.values() if name not in by_name]
    if missing:
        raise TypeError(f"resolve_agp_criteria: no masker class named {missing}")
    return {algo: (by_name[masker], tuple(default_types[kind])) for algo, (masker, kind) in AGP_CRITERIA_TABLE.items()}


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


class AGPScheduleMixin:
    """The AGP schedule driver of both backends' ``AGPPruner`` (pure Python, no framework).

    Put it before the backend's pruner base. The host provides ``get_modules_wrapper()`` (wrappers with a
    normalised ``config``), ``current_epoch``, ``update_epoch``, ``update_mask``, ``compress`` and
    ``state_dict``/``load_state_dict`` (the pruner base does), and ``AGP_CRITERIA`` on the class:
    ``pruning_algorithm -> (masker class, what op_types 'default' means)``.

    State: ``_scheduled_epoch`` (the last epoch scheduled, None before the first) and ``_pending`` (indices
    of the wrappers whose masks are due at that epoch and not computed yet). Statistics of data criteria
    are collected exactly while something is pending.
    """

    AGP_CRITERIA: dict[str, tuple[Any, tuple[str, ...]]] = {}
    pruning_algorithm: str
    masker: Any
    current_epoch: int

    # ------------------------------------------------------------ construction
    def _agp_setup(self, pruning_algorithm: Any, statistics_batch_num: Any, activation: Any,
                   dependency_aware: Any) -> bool:
        """Refuse bad constructor arguments (before the model changes); set the criterion's attributes.
        Returns ``dependency_aware`` (checked)."""
        check_agp_args(pruning_algorithm, self.AGP_CRITERIA, statistics_batch_num, activation)
        dependency_aware = check_agp_dependency(pruning_algorithm, dependency_aware)
        self.pruning_algorithm = pruning_algorithm
        self._masker_class, self.default_types = self.AGP_CRITERIA[pruning_algorithm]
        self._group_producers_needed = pruning_algorithm != "slim"
        self._rank_globally = pruning_algorithm == "slim"
        return dependency_aware

    def _agp_start(self, model: Any, activation: str, statistics_batch_num: int) -> None:
        """After the base constructor: the criterion's masker and an empty schedule."""
        kwargs = agp_masker_kwargs(self.pruning_algorithm, activation, statistics_batch_num)
        self.masker = self._masker_class(model, self, **kwargs)
        self._scheduled_epoch: int | None = None
        self._pending: set[int] = set()

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        nm_validate_config(config_list, type(self).__name__, "final_sparsity", self.pruning_algorithm)
        validate_agp_config(config_list, self.pruning_algorithm)

    # ------------------------------------------------------------ schedule
    def _config_of(self, wrapper_idx: int) -> dict[str, Any]:
        """The config that schedules wrapper ``wrapper_idx`` (slim: one global schedule, the first one)."""
        return self.get_modules_wrapper()[0 if self.pruning_algorithm == "slim" else wrapper_idx].config

    def target_sparsity(self, wrapper_idx: int, epoch: int | None = None) -> float:
        """The AGP target of wrapper ``wrapper_idx`` at ``epoch`` (default: the current epoch)."""
        return agp_target(self._config_of(wrapper_idx), self.current_epoch if epoch is None else epoch)

    def _schedule_epoch(self, epoch: int) -> None:
        """Mark the layers due at ``epoch`` pending (once per epoch)."""
        if self._scheduled_epoch == epoch:
            return
        self._scheduled_epoch = epoch
        n = len(self.get_modules_wrapper())
        due = agp_due_layers([self._config_of(idx) for idx in range(n)], epoch)
        if due:
            self._pending |= due
            self._on_layers_due(due)

    def _on_layers_due(self, due: set[int]) -> None:
        """Layers ``due`` just became pending: start collecting statistics (a backend may add to this)."""
        self.masker.start_statistics()

    def _done(self, *indices: int) -> None:
        """The masks of ``indices`` are computed: no longer pending; statistics stop once none is."""
        self._pending.difference_update(indices)
        if not self._pending:
            self.masker.stop_statistics()

    def _recompute_now(self) -> None:
        """Recompute the due masks between steps (weight criteria, at ``update_epoch``)."""
        self.update_mask()

    def compress(self) -> Any:
        self._schedule_epoch(self.current_epoch)
        return super().compress()  # type: ignore[misc]

    def update_epoch(self, epoch: int) -> None:
        """Advance the clock; on a schedule epoch, recompute masks (data criteria: once statistics are in)."""
        super().update_epoch(epoch)  # type: ignore[misc]
        self._schedule_epoch(self.current_epoch)
        if self._pending and not self.masker.needs_data:
            self._recompute_now()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "scheduled_epoch": self._scheduled_epoch,  # type: ignore[misc]
                "pending": sorted(self._pending)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # type: ignore[misc]
        self._scheduled_epoch = state.get("scheduled_epoch")
        self._pending = set(state.get("pending", ()))
        self._on_pending_loaded()
        if self._pending:
            self.masker.start_statistics()
        else:
            self.masker.stop_statistics()

    def _on_pending_loaded(self) -> None:
        """A checkpoint just set ``_pending`` (a backend mirrors it onto its wrappers here)."""
