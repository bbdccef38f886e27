"""Backing off between failures in a row, so a condition that lasts a while does not spend the
failure budget within seconds.

A failure is *in a row* when no step past the last failed one has completed since (the replayed
step failed again), or when it happens inside the recovery itself. Recovering from it at once
runs into the same condition again: a restarted rank whose accelerator memory the dead process
still holds, a node that is coming back, a storage endpoint that is restarting; ``max_failures``
would then be spent before the condition clears. The first failure is recovered from at once
(that is the recovery whose time matters); the n-th in a row (n >= 2) first waits
``recovery.backoff_s * 2 ** (n - 2)``, at most :data:`CAP_S`. The wait asks the pool whether to
stop (a preemption signal) every :data:`POLL_S`, so it never holds up a preemption.
"""

from __future__ import annotations

from typing import Callable

#: The longest wait before recovering again.
CAP_S = 60.0
#: How often a wait asks whether to stop.
POLL_S = 0.5


class Backoff:
    """Counts the failures in a row and waits before recovering from the second and later ones."""

    def __init__(self, base_s: float, clock: Callable[[], float], sleep: Callable[[float], None]):
        self.base_s = base_s
        self.clock, self.sleep = clock, sleep
        self.in_a_row = 0
        self._last_failed_step: int | None = None

    def failed(self, step: int) -> None:
        """A step failed: the first of a row, unless no step past the last failed one has completed."""
        last = self._last_failed_step
        self.in_a_row = self.in_a_row + 1 if last is not None and step <= last else 1
        self._last_failed_step = step if last is None else max(last, step)

    def failed_again(self) -> None:
        """A failure inside the recovery of the last one: always in a row."""
        self.in_a_row += 1

    def seconds(self) -> float:
        """How long to wait before recovering from the current failure."""
        if self.in_a_row < 2 or self.base_s <= 0:
            return 0.0
        return min(CAP_S, self.base_s * 2 ** (self.in_a_row - 2))

    def wait(self, interrupt: Callable[[], None]) -> float:
        """Wait :meth:`seconds`, calling ``interrupt`` (which raises to stop) between short sleeps."""
        total = self.seconds()
        end = self.clock() + total
        while (left := end - self.clock()) > 0:
            interrupt()
            self.sleep(min(POLL_S, left))
        return total
