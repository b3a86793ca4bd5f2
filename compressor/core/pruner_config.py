"""Argument and config checks of the built-in pruners, shared by both backends.

Each check raises :class:`ConfigError` naming the pruner, the argument and what is allowed, before the
model is touched, with the same message on torch and tf.
"""

from __future__ import annotations

from typing import Any

from .config import key_spec
from .errors import ConfigError

__all__ = [
    "ACTIVATIONS", "MASK_NAMES", "PRUNE_ITERATIONS", "check_activation", "check_common_prune_iterations", "check_common_sparsity",
    "check_positive_int", "check_sensitivity_args", "check_statistics_batch_num", "first_active", "mask_to_set",
    "refuse_sparsity_key", "FilterPrunerArgs", "ActivationPrunerArgs", "TaylorPrunerArgs",
]

#: the masks a pruned layer may hold (``set_mask`` names)
MASK_NAMES = ("weight_mask", "bias_mask")

#: activations the activation-rank criteria apply to a layer's output
ACTIVATIONS = ("relu", "relu6")


def check_positive_int(value: Any, name: str, what: str) -> int:
    """``value`` if it is an int >= 1 (bool is refused), else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what}: {name} = {value!r} is invalid; allowed: an int >= 1")
    return value


def check_statistics_batch_num(value: Any, what: str) -> int:
    """``statistics_batch_num`` of a data-driven criterion: an int >= 1."""
    return check_positive_int(value, "statistics_batch_num", what)


def check_activation(value: Any, what: str) -> str:
    """``activation`` of an activation-rank criterion: one of :data:`ACTIVATIONS`."""
    if value not in ACTIVATIONS:
        raise ConfigError(f"{what}: activation = {value!r} is invalid; allowed: {list(ACTIVATIONS)}")
    return value


def check_sensitivity_args(iterations: Any, epochs_per_iteration: Any) -> None:
    """SensitivityPruner's rounds: ``iterations`` an int >= 1, ``epochs_per_iteration`` None or an int >= 1."""
    check_positive_int(iterations, "iterations", "SensitivityPruner")
    if epochs_per_iteration is not None:
        check_positive_int(epochs_per_iteration, "epochs_per_iteration", "SensitivityPruner")


def refuse_sparsity_key(config_list: list[dict[str, Any]]) -> None:
    """SensitivityPruner: entries give ``sensitivity`` (a threshold factor), never ``sparsity``."""
    for i, c in enumerate(config_list):
        if "sparsity" in c:
            raise ConfigError(f"config_list[{i}]: SensitivityPruner takes 'sensitivity' (threshold = "
                              f"sensitivity * std of the layer's weights), not 'sparsity'")


def first_active(config_list: list[dict[str, Any]], key: str) -> Any:
    """``key`` of the first non-excluded normalised entry (a pruner-wide setting such as slim's sparsity)."""
    return next(c[key] for c in config_list if not c["exclude"])


def check_common_sparsity(config_list: list[dict[str, Any]]) -> None:
    """SlimPruner: one global threshold, so the non-excluded entries may not give different sparsities."""
    values = {c["sparsity"] for c in config_list if not c["exclude"]}
    if len(values) > 1:
        raise ConfigError(
            f"SlimPruner: one global threshold needs one sparsity, but config entries give {sorted(values)}"
        )


def _prune_iterations(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError
    return v


#: LotteryTicketPruner's config key: the number of pruning rounds
PRUNE_ITERATIONS = key_spec("prune_iterations", _prune_iterations, "an int >= 1 (number of pruning rounds)")


def check_common_prune_iterations(config_list: list[dict[str, Any]]) -> None:
    """LotteryTicketPruner: the entries that give ``prune_iterations`` must give the same number."""
    values = {c["prune_iterations"] for c in config_list if not c["exclude"] and "prune_iterations" in c}
    if len(values) > 1:
        raise ConfigError(f"LotteryTicketPruner: all entries must use the same prune_iterations, got {sorted(values)}")


def mask_to_set(layer: str, name: str, has_mask: bool, value: Any) -> bool:
    """Whether ``value`` is to be copied into mask ``name`` of ``layer``: False for None where the layer
    has no such mask (nothing to do); ValueError for a value where it has none, or None where it has one."""
    if not has_mask:
        if value is None:
            return False
        raise ValueError(f"{layer}: layer has no {name.split('_')[0]} to mask")
    if value is None:
        raise ValueError(f"{layer}: {name} cannot be None (use an all-True mask to keep everything)")
    return True


# ---------------------------------------------------------------------------------------------- constructors
# The public constructors of the one-shot filter pruners, the same on both backends: put the mixin before the
# backend's ``OneShotPruner`` (whose constructor takes ``dependency_aware``, ``dummy_input`` and the
# masker's keyword arguments). Arguments are checked before the model is touched.


#: what ``op_types: ['default']`` leaving layers out means for a filter pruner (the generic advice, "add them to
#: op_types", would name types these pruners refuse, e.g. Keras SeparableConv2D or Embedding)
FILTER_SKIP_HINT = ("add them to op_types only if filter pruning takes them (convolutions, depthwise ones "
                    "included, and Linear / Dense layers); layers of other types keep all their weights (speedup "
                    "still removes the input channels they lose when the layers feeding them are pruned)")


class FilterPrunerArgs:
    """``(model, config_list, optimizer=None, dependency_aware=False, dummy_input=None)``: weight criteria."""

    default_skip_hint = FILTER_SKIP_HINT

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None,
                 dependency_aware: bool = False, dummy_input: Any = None) -> None:
        super().__init__(model, config_list, optimizer,  # type: ignore[call-arg]
                         dependency_aware=dependency_aware, dummy_input=dummy_input)


class ActivationPrunerArgs:
    """``(model, config_list, optimizer=None, activation='relu', statistics_batch_num=1, dependency_aware=False,
    dummy_input=None)``: activation-rank criteria (APoZ, mean activation)."""

    default_skip_hint = FILTER_SKIP_HINT

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None,
                 activation: str = "relu", statistics_batch_num: int = 1, dependency_aware: bool = False,
                 dummy_input: Any = None) -> None:
        check_activation(activation, type(self).__name__)
        check_statistics_batch_num(statistics_batch_num, type(self).__name__)
        super().__init__(model, config_list, optimizer, dependency_aware=dependency_aware,  # type: ignore[call-arg]
                         dummy_input=dummy_input, activation=activation, statistics_batch_num=statistics_batch_num)


class TaylorPrunerArgs:
    """``(model, config_list, optimizer=None, statistics_batch_num=1, dependency_aware=False, dummy_input=None)``:
    the Taylor first-order criterion."""

    default_skip_hint = FILTER_SKIP_HINT

    def __init__(self, model: Any, config_list: list[dict[str, Any]], optimizer: Any = None,
                 statistics_batch_num: int = 1, dependency_aware: bool = False, dummy_input: Any = None) -> None:
        check_statistics_batch_num(statistics_batch_num, type(self).__name__)
        super().__init__(model, config_list, optimizer, dependency_aware=dependency_aware,  # type: ignore[call-arg]
                         dummy_input=dummy_input, statistics_batch_num=statistics_batch_num)
