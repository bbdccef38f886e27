"""A clock for tests: time moves only when slept on or advanced, so ages and deadlines are exact."""

from __future__ import annotations


class FakeClock:
    """Callable like ``time.monotonic``/``time.time``; ``sleep`` advances it instead of waiting."""

    def __init__(self, start: float = 1000.0):
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    advance = sleep
