"""Goodput's numerator: the seconds spent in training steps that count, across rollbacks."""

from __future__ import annotations

import array
from typing import Iterable


class UsefulTime:
    """Seconds spent in steps that count (goodput's numerator), kept up in O(1) per step.

    Steps are recorded in order; a recovery rolls back to its restored step, dropping the
    steps after it (they are replayed and recorded again). Running totals per step, in flat
    arrays (16 bytes a step), make both a record and the total O(1) over a week-long run.

    A controller that continues a run seeds the totals with the newest steps its predecessors
    recorded (:meth:`seed`, from the run folder's ledger): a rollback to a step older than those
    is estimated from the oldest one, as if the steps before it had taken equal time."""

    def __init__(self) -> None:
        self._steps = array.array("q")
        self._totals = array.array("d")
        self._floor: tuple[int, float] = (0, 0.0)  # (step, total) before the first recorded step

    @property
    def total(self) -> float:
        return self._totals[-1] if self._totals else self._floor[1]

    def seed(self, totals: Iterable[tuple[int, float]]) -> None:
        """Start from running totals ``(step, total)`` of earlier steps, oldest first."""
        pairs = [(int(s), float(t)) for s, t in totals]
        self._steps, self._totals = array.array("q"), array.array("d")
        self._floor = pairs[0] if pairs else (0, 0.0)
        for step, total in pairs[1:]:
            self._steps.append(step)
            self._totals.append(total)

    def tail(self, n: int) -> list[tuple[int, float]]:
        """The newest ``n`` running totals ``(step, total)`` (the floor first when fewer are kept)."""
        pairs = [self._floor] + list(zip(self._steps[-n:], self._totals[-n:]))
        return pairs[-n:]

    def record(self, step: int, seconds: float) -> float:
        """Count step ``step`` (an earlier record of it, or of a later step, is replaced); returns
        the seconds of the replaced records that no longer count."""
        dropped = self.rollback(step - 1)
        self._totals.append(self.total + seconds)
        self._steps.append(step)
        return dropped

    def rollback(self, step: int) -> float:
        """Forget the steps after ``step``; returns the seconds that no longer count."""
        before = self.total
        while self._steps and self._steps[-1] > step:
            self._steps.pop()
            self._totals.pop()
        floor_step, floor_total = self._floor
        if not self._steps and step < floor_step:
            self._floor = (max(0, step), floor_total * max(0, step) / floor_step)
        return before - self.total
