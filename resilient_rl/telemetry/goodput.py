"""Goodput's numerator: the seconds spent in training steps that count, across rollbacks."""

from __future__ import annotations

import array


class UsefulTime:
    """Seconds spent in steps that count (goodput's numerator), kept up in O(1) per step.

    Steps are recorded in order; a recovery rolls back to its restored step, dropping the
    steps after it (they are replayed and recorded again). Running totals per step, in flat
    arrays (16 bytes a step), make both a record and the total O(1) over a week-long run."""

    def __init__(self) -> None:
        self._steps = array.array("q")
        self._totals = array.array("d")

    @property
    def total(self) -> float:
        return self._totals[-1] if self._totals else 0.0

    def record(self, step: int, seconds: float) -> None:
        """Count step ``step`` (an earlier record of it, or of a later step, is replaced)."""
        self.rollback(step - 1)
        self._totals.append(self.total + seconds)
        self._steps.append(step)

    def rollback(self, step: int) -> None:
        """Forget the steps after ``step``."""
        while self._steps and self._steps[-1] > step:
            self._steps.pop()
            self._totals.pop()

