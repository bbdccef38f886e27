"""Workers' device reports, collected without ever blocking the controller.

A worker's health reply (:class:`~resilient_rl.runtime.worker.WorkerInfo`) says which GPU its
process computes on and how much memory torch holds there. Telemetry wants that refreshed while
training runs, and the training loop must never wait for it: :class:`DeviceReportPoller` sends
``health`` calls (answered through the workers' health concurrency group even while a training
call runs) at most every ``interval_s``, at most one outstanding per process, and picks up the
replies that have arrived, without waiting, the next time it is polled. A process
that died simply stops replying; recovery, not the poller, deals with it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Mapping

from resilient_rl.runtime.ended_calls import read_ended
from resilient_rl.runtime.health import answers_during_calls

logger = logging.getLogger(__name__)

Key = tuple[str, int]  # (worker group name, rank): one process


class DeviceReportPoller:
    """Latest health reply of every worker process, refreshed in the background.

    Args:
        interval_s: least time between two rounds of health calls
            (``telemetry.gpu_sample_interval_s``).
        clock: monotonic time source.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = float(interval_s)
        self._clock = clock
        self._pending: dict[Any, Key] = {}
        self._last_round: float | None = None
        self.reports: dict[Key, Any] = {}

    def reset(self, reports: Mapping[Key, Any]) -> None:
        """Start over from ``reports`` (the replies of a fresh ping of every process, after the
        workers started or recovered); replies still in flight are dropped."""
        self._pending = {}
        self._last_round = None
        self.reports = dict(reports)

    def poll(self, groups: Iterable[Any]) -> bool:
        """Take the replies that have arrived and, once ``interval_s`` has passed, send a new
        round of health calls to the processes of ``groups`` (worker groups with distinct
        processes). Never waits. Returns whether any report changed."""
        changed = self._harvest()
        now = self._clock()
        if self._last_round is not None and now - self._last_round < self.interval_s:
            return changed
        self._last_round = now
        outstanding = set(self._pending.values())
        for group in groups:
            if not answers_during_calls(group):
                continue  # its ping would queue behind the running training call
            for rank, worker in enumerate(group.workers):
                key = (group.name_prefix, rank)
                if key not in outstanding:
                    self._pending[worker.health.remote()] = key
        return changed

    def _harvest(self) -> bool:
        ended, _ = read_ended(self._pending)
        changed = False
        for ref, info, error in ended:
            key = self._pending.pop(ref)
            if error is not None:  # died or restarting: recovery's business
                logger.debug("no device report from %s rank %d: %s", key[0], key[1], error)
                continue
            if self.reports.get(key) != info:
                self.reports[key] = info
                changed = True
        return changed
