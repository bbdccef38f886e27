"""Recovery you can watch: its phases, the seconds lost by cause, and the run's ETTR.

- ``rrl_recovery_phase_seconds{phase}`` (histogram): one observation per recovery and phase:
  ``detect`` (from the controller learning of the failure, or from the start of a hang, to
  recovery starting; a death's own delay before Ray reports it is not seen here), ``restart``
  (probing, killing, waiting for restarted or replacement workers), ``rejoin`` (new process-group
  generation and model rebuild), ``restore`` (snapshot or checkpoint loaded), ``replay`` (from
  training resumed until the step that failed is done again: the lost steps and that step).
- ``rrl_lost_seconds_total{cause}``: wall seconds that did not train steps that count, by the
  failure's cause (``died``, ``hang``, ...), ``controller`` (a crashed controller's pause and the
  steps its successor trains again) or ``nonfinite`` (steps rolled back past a NaN/Inf). Seeded
  from the run folder's ledger, so the counter continues across controllers.
- ``rrl_ettr_ratio``: effective-training-time ratio over the run's whole life, read on every
  scrape (:mod:`resilient_rl.telemetry.training_time`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from resilient_rl.errors import TelemetryError

#: The phases of a recovery, in the order they happen.
RECOVERY_PHASES: tuple[str, ...] = ("detect", "restart", "rejoin", "restore", "replay")
# A rejoin of two CPU ranks takes tens of milliseconds; a replacement node, minutes.
PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                 600.0, 1800.0)


class _Ratio(Collector):
    """One unlabelled gauge read from ``source`` on every scrape; absent while it returns None."""

    def __init__(self, name: str, doc: str, source: Callable[[], float | None]) -> None:
        self.name, self.doc, self.source = name, doc, source

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(self.name, self.doc)]

    def collect(self) -> Iterable[Metric]:
        value = self.source()
        if value is not None:
            yield GaugeMetricFamily(self.name, self.doc, value=value)


class RecoveryMetrics:
    """The recovery phase histogram, lost seconds by cause and the ETTR gauge, in ``registry``.

    Args:
        registry: the controller's registry.
        ettr: returns the run's ETTR now (None: not known yet, the series is absent).
        lost: seconds already lost by cause (the run's earlier controllers), counted from the start.
    """

    def __init__(self, registry: CollectorRegistry, ettr: Callable[[], float | None],
                 lost: Mapping[str, float] | None = None) -> None:
        self.phase_seconds = Histogram("rrl_recovery_phase_seconds",
                                       "Duration of one phase of a recovery: detect, restart, rejoin, "
                                       "restore, replay (until the failed step is done again).",
                                       ["phase"], buckets=PHASE_BUCKETS, registry=registry)
        for phase in RECOVERY_PHASES:
            self.phase_seconds.labels(phase=phase)
        self.lost_seconds = Counter("rrl_lost_seconds", "Wall seconds not spent on steps that count, by "
                                    "cause, over the run's whole life (failed work, recovery, rolled-back "
                                    "steps, a crashed controller's pause).", ["cause"], registry=registry)
        for cause, seconds in (lost or {}).items():
            self.lost_seconds.labels(cause=cause).inc(max(0.0, seconds))
        registry.register(_Ratio("rrl_ettr_ratio", "Effective training time ratio: seconds of steps that "
                                 "count over wall seconds, across every controller of the run.", ettr))

    def observe_phases(self, phases: Mapping[str, float]) -> None:
        """Record one recovery's phase durations (any subset of :data:`RECOVERY_PHASES`).

        Raises:
            TelemetryError: an unknown phase or a negative or non-finite duration.
        """
        for phase, seconds in phases.items():
            if phase not in RECOVERY_PHASES:
                raise TelemetryError(f"unknown recovery phase {phase!r}; known: {list(RECOVERY_PHASES)}")
            if seconds is None or not (0.0 <= float(seconds) < float("inf")):
                raise TelemetryError(f"recovery phase {phase!r}: duration must be finite and >= 0, got {seconds!r}")
            self.phase_seconds.labels(phase=phase).observe(float(seconds))

    def record_lost(self, cause: str, seconds: float) -> None:
        """Count ``seconds`` lost to ``cause``."""
        if seconds > 0:
            self.lost_seconds.labels(cause=cause).inc(seconds)
