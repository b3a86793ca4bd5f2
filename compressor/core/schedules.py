"""Sparsity schedules as pure functions of the clock (epoch or round)."""

from __future__ import annotations


def agp_span(start_epoch: int, end_epoch: int, frequency: int) -> int:
    """Number of epochs over which AGP ramps: the last pruning epoch is ``start + span``."""
    return ((end_epoch - start_epoch - 1) // frequency) * frequency


def agp_sparsity(
    epoch: int, initial_sparsity: float, final_sparsity: float, start_epoch: int, end_epoch: int, frequency: int
) -> float:
    """AGP target (Zhu & Gupta 2017) with NNI's epoch semantics.

    ``s(e) = s_f + (s_i - s_f) * (1 - (e - start) / span) ** 3`` with
    ``span = ((end - start - 1) // freq) * freq``, so the final sparsity is reached at the last epoch
    on a frequency boundary before ``end``. Before ``start`` the target is ``s_i``; ``end <= start``,
    ``span <= 0`` or ``s_i >= s_f`` mean "use ``s_f``".
    """
    span = agp_span(start_epoch, end_epoch, frequency)
    if end_epoch <= start_epoch or span <= 0 or initial_sparsity >= final_sparsity:
        return final_sparsity
    if epoch <= start_epoch:
        return initial_sparsity
    if epoch >= start_epoch + span:
        return final_sparsity
    progress = (epoch - start_epoch) / span
    return final_sparsity + (initial_sparsity - final_sparsity) * (1.0 - progress) ** 3


def agp_should_update(epoch: int, start_epoch: int, end_epoch: int, frequency: int) -> bool:
    """Whether AGP recomputes masks at ``epoch``: on frequency boundaries from ``start`` up to the last ramp epoch."""
    if epoch < start_epoch:
        return False
    span = max(agp_span(start_epoch, end_epoch, frequency), 0)
    return (epoch - start_epoch) % frequency == 0 and epoch <= start_epoch + span


def lottery_keep_ratio(final_sparsity: float, rounds: int) -> float:
    """Fraction of the remaining weights kept per lottery-ticket round: ``(1 - s) ** (1 / rounds)``."""
    if rounds < 1:
        raise ValueError(f"prune_iterations must be >= 1, got {rounds}")
    return (1.0 - final_sparsity) ** (1.0 / rounds)


def lottery_sparsity(round_index: int, final_sparsity: float, rounds: int) -> float:
    """Sparsity of round ``i``: ``1 - keep ** i``; round 0 is dense, round ``rounds`` hits the target."""
    if round_index <= 0:
        return 0.0
    if round_index >= rounds:
        return final_sparsity
    return 1.0 - lottery_keep_ratio(final_sparsity, rounds) ** round_index


def lottery_next_round(current: int | None, rounds: int) -> int:
    """The lottery-ticket round after ``current`` (None: before round 0); RuntimeError past the last one."""
    nxt = 0 if current is None else current + 1
    if nxt > rounds:
        raise RuntimeError(f"LotteryTicketPruner: all {rounds} pruning rounds are done")
    return nxt


def sensitivity_round_due(epoch: int, epochs_per_iteration: int | None, done: int, iterations: int) -> bool:
    """Whether SensitivityPruner runs its next prune round at ``epoch``: every ``epochs_per_iteration``
    epochs after epoch 0, until ``iterations`` rounds are ``done`` (at most one round per period)."""
    per = epochs_per_iteration
    return bool(per and epoch > 0 and epoch % per == 0 and done < iterations and done < epoch // per + 1)
