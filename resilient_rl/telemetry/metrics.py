"""Metric definitions: every series resilient-rl exports, in one place.

Naming follows Prometheus conventions: one prefix (``rrl_``), base units in the name
(``_seconds``, ``_bytes``, ``_ratio``, ``_watts``, ``_celsius``, ``_hertz``), counters end in
``_total``, and labels come from a small, low-cardinality set (``role``, ``rank``, ``node``,
``gpu``, ``uuid``, ``phase``, ``cause``). Each process owns a private ``CollectorRegistry`` so
that tests, benchmarks and several trainers in one interpreter never share series.

- :class:`TrainerMetrics` is what the controller updates: progress, step and phase durations,
  losses, workers up/down, restarts, recoveries, checkpoints, goodput.
- :class:`DeviceMetrics` is a collector sampled on every scrape, one per node: per-GPU readings
  through NVML (devices without a reading are absent, never zero) and CPU seconds and resident
  memory of the node's worker processes.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from resilient_rl.errors import Cause, TelemetryError

#: Why a checkpoint save was skipped (``rrl_checkpoint_skipped_total{reason}``).
SKIP_REASONS = ("storage", "slow")
#: Where a snapshot copy is loaded from, in the order recovery tries them (workers/snapshots/keeper.py).
SNAPSHOT_SOURCES = ("own", "node", "object_store", "peer")
#: What the trainer can do about each non-finite quantity (recovery/nonfinite.py), whatever its
#: ``trainer.nonfinite`` policy: ``rrl_nonfinite_total{quantity, action}`` exports each pair at 0.
NONFINITE_OUTCOMES: dict[str, tuple[str, ...]] = {
    "reward": ("zeroed", "raised"),
    "kl": ("skipped", "rolled_back", "raised"),
    "loss": ("skipped", "rolled_back", "raised"),
    "metric": ("reported", "rolled_back", "raised"),
    "checkpoint": ("refused",),
}

#: The phases of one training step, in the order a step runs them (trainer/step.py times them and
#: imports this tuple; defined here, next to the metric that labels them, so there is one list).
#: ``old_log_prob`` is the actor's recomputation of the rollout's log-probabilities.
PHASES: tuple[str, ...] = ("gen", "ref", "old_log_prob", "values", "adv", "update_critic", "update_actor",
                           "weight_sync")
#: The values of the ``phase`` label: the step's :data:`PHASES` and ``checkpoint``, the time a
#: checkpoint save blocked training (its stall), observed when the save commits.
PHASE_LABELS: tuple[str, ...] = PHASES + ("checkpoint",)
#: Losses accepted by :meth:`TrainerMetrics.observe_step`, each exported as ``rrl_<kind>_loss``.
LOSS_KINDS: tuple[str, ...] = ("actor", "critic")

# Steps of a tiny CPU run take tens of milliseconds, those of a large model minutes.
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 600.0)
# Phases such as weight_sync or adv can be a few milliseconds.
PHASE_BUCKETS = (0.005, 0.01, 0.025) + STEP_BUCKETS
CHECKPOINT_BUCKETS = (0.01, 0.025) + STEP_BUCKETS
# A recovery waits at least for an actor restart (seconds) and at most for a replacement node.
RECOVERY_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def _non_negative(name: str, value: float) -> float:
    if value is None or not math.isfinite(value) or value < 0:
        raise TelemetryError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


class _CheckpointCommitCollector(Collector):
    """Last committed checkpoint: step and timestamp once one exists, and its age on scrape (absent
    for a run that saves none: ``saves`` false, and nothing committed)."""

    def __init__(self, clock: Callable[[], float], saves: bool = True) -> None:
        self._clock = clock
        self._saves = saves
        self._started_at = clock()
        # (step, timestamp) replaced as one object, so a scrape never sees half an update.
        self._last: tuple[int, float] | None = None

    def set(self, step: int, timestamp: float) -> None:
        self._last = (step, timestamp)

    def age(self) -> float:
        last = self._last
        return max(0.0, self._clock() - (last[1] if last is not None else self._started_at))

    def describe(self) -> Iterable[Metric]:
        yield from self._families(with_values=False)

    def collect(self) -> Iterable[Metric]:
        yield from self._families(with_values=True)

    def _families(self, with_values: bool) -> Iterable[Metric]:
        step = GaugeMetricFamily("rrl_checkpoint_last_committed_step",
                                 "Training step of the last committed checkpoint.")
        stamp = GaugeMetricFamily("rrl_checkpoint_last_committed_timestamp_seconds",
                                  "Unix time the last committed checkpoint was committed.")
        age = GaugeMetricFamily("rrl_checkpoint_age_seconds",
                                "Seconds since the last committed checkpoint (since the trainer "
                                "started while none is committed): the work a crash would lose.")
        if with_values:
            last = self._last
            # Before the first commit there is no step or timestamp to report: absent, not zero.
            if last is not None:
                step.add_metric([], last[0])
                stamp.add_metric([], last[1])
            if self._saves or last is not None:  # an age that only grows would alert all run long
                age.add_metric([], self.age())
        return [step, stamp, age]


class _LastValues(Collector):
    """Unlabelled gauges that stay absent until first set.

    A plain ``Gauge`` reads 0 before it is set, which is a lie for a loss a run never computes
    (no critic in GRPO) or a ratio not yet known.
    """

    def __init__(self, docs: Mapping[str, str]) -> None:
        self._docs = dict(docs)
        self._values: dict[str, float] = {}
        self._sources: dict[str, Callable[[], float | None]] = {}

    def set(self, name: str, value: float) -> None:
        if name not in self._docs:
            raise KeyError(name)
        self._values[name] = float(value)

    def set_source(self, name: str, source: Callable[[], float | None]) -> None:
        """Read ``name`` from ``source`` on every scrape from now on (None: absent)."""
        if name not in self._docs:
            raise KeyError(name)
        self._sources[name] = source

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(name, doc) for name, doc in self._docs.items()]

    def collect(self) -> Iterable[Metric]:
        values = dict(self._values)
        for name, source in list(self._sources.items()):
            value = source()
            if value is not None:
                values[name] = float(value)
        for name, doc in self._docs.items():
            if name in values:
                yield GaugeMetricFamily(name, doc, value=values[name])


class TrainerMetrics:
    """The controller's metrics: progress, timing, reliability and checkpoints.

    Args:
        registry: where the series live; None creates a private registry (see ``.registry``).
        run: the run's name, exported once as ``rrl_run_info{run=...}``.
        clock: Unix time source, for the checkpoint age.
        saves_checkpoints: whether the run saves checkpoints (``checkpoint.save_every > 0``):
            without, the checkpoint age is not exported.
    """

    def __init__(self, registry: CollectorRegistry | None = None, run: str = "default",
                 clock: Callable[[], float] = time.time, saves_checkpoints: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.run = run
        self._clock = clock
        self._lock = threading.Lock()
        self._worker_nodes: dict[tuple[str, str], str] = {}
        r = self.registry

        self.run_info = Info("rrl_run", "The run this trainer is executing.", registry=r)
        self.run_info.info({"run": run})

        # Progress and timing.
        self.step = Gauge("rrl_step", "Last completed training step.", registry=r)
        self.step_duration = Histogram("rrl_step_duration_seconds",
                                       "Wall time of one training step.",
                                       buckets=STEP_BUCKETS, registry=r)
        self.phase_duration = Histogram("rrl_phase_duration_seconds",
                                        "Wall time of one phase of a training step.",
                                        ["phase"], buckets=PHASE_BUCKETS, registry=r)
        for phase in PHASE_LABELS:
            self.phase_duration.labels(phase=phase)
        self.tokens = Counter("rrl_tokens", "Tokens processed by training steps "
                              "(prompt + response, replayed steps included).", registry=r)

        # Training signals, absent until first reported.
        self._signals = _LastValues({
            "rrl_reward_mean": "Mean sequence reward of the last step.",
            **{f"rrl_{kind}_loss": f"{kind.capitalize()} loss of the last step."
               for kind in LOSS_KINDS},
            "rrl_kl": "Mean KL divergence between the actor and the reference policy in the "
                      "last step.",
            "rrl_goodput_ratio": "Share of wall time spent on steps that were kept (not lost "
                                 "to failures, recovery or replay).",
            "rrl_val_reward_mean": "Mean reward on the held-out prompts in the last validation pass.",
            "rrl_val_accuracy_ratio": "Share of held-out responses scoring 1 in the last validation pass.",
        })
        r.register(self._signals)
        self.learning_rate = Gauge("rrl_learning_rate", "Learning rate in the last step.",
                                   ["role"], registry=r)

        # Workers and failures.
        self.worker_up = Gauge("rrl_worker_up", "1 while a worker is alive and in the group, "
                               "0 while it is down.", ["role", "rank", "node"], registry=r)
        self.worker_restarts = Counter("rrl_worker_restarts", "Worker restarts.",
                                       ["role", "rank", "cause"], registry=r)
        self.failures = Counter("rrl_failures", "Failures detected by the controller.",
                                ["cause"], registry=r)
        # Labelled counters are exported at 0 from the start wherever their labels are known: a
        # series first exported at 1 (by its first event) has that event missed by increase(),
        # in the range panels and alerts, and so does a new controller's series after a restart.
        for cause in Cause:
            self.failures.labels(cause=cause.value)
        self.recoveries = Counter("rrl_recoveries", "Completed recoveries.", registry=r)
        self.recovery_duration = Histogram("rrl_recovery_duration_seconds",
                                           "Time from failure detection to training resumed.",
                                           buckets=RECOVERY_BUCKETS, registry=r)
        self.steps_replayed = Counter("rrl_steps_replayed", "Steps lost to failures and "
                                      "trained again after a restore.", registry=r)
        self.nonfinite = Counter("rrl_nonfinite", "NaN or Inf values met by training steps (replayed "
                                 "steps included), by quantity (loss, reward, kl, metric, checkpoint) and "
                                 "the action taken (skipped, zeroed, rolled_back, raised, refused, reported).",
                                 ["quantity", "action"], registry=r)
        for quantity, actions in NONFINITE_OUTCOMES.items():
            for action in actions:
                self.nonfinite.labels(quantity=quantity, action=action)

        # Checkpoints.
        self.checkpoint_save_duration = Histogram(
            "rrl_checkpoint_save_duration_seconds",
            "Time from the start of a checkpoint save to its commit.",
            buckets=CHECKPOINT_BUCKETS, registry=r)
        self.checkpoint_stall = Histogram(
            "rrl_checkpoint_stall_seconds",
            "Time training was blocked by a checkpoint save (staging to host memory).",
            buckets=CHECKPOINT_BUCKETS, registry=r)
        self.checkpoint_load_duration = Histogram(
            "rrl_checkpoint_load_duration_seconds", "Time to load and restore a checkpoint.",
            buckets=CHECKPOINT_BUCKETS, registry=r)
        self.checkpoint_bytes = Counter("rrl_checkpoint_bytes", "Bytes written to checkpoints.",
                                        registry=r)
        self.checkpoint_corrupt = Counter("rrl_checkpoint_corrupt", "Committed checkpoints that "
                                          "failed verification when loaded.", registry=r)
        self.snapshot_corrupt = Counter("rrl_snapshot_corrupt", "Copies of in-memory snapshots that failed "
                                        "their checksum when loaded (never restored), by where the copy "
                                        "was (own, node, object_store, peer).", ["source"], registry=r)
        self.checkpoint_skipped = Counter("rrl_checkpoint_skipped", "Checkpoint saves skipped while training "
                                          "went on, by reason (storage: an outage past the retries; slow: "
                                          "the previous save was still being written).", ["reason"], registry=r)
        for reason in SKIP_REASONS:  # exported at 0 from the start, so an increase() alert sees the first
            self.checkpoint_skipped.labels(reason=reason)
        for source in SNAPSHOT_SOURCES:
            self.snapshot_corrupt.labels(source=source)
        self._commits = _CheckpointCommitCollector(clock, saves_checkpoints)
        r.register(self._commits)

    # -- progress ------------------------------------------------------------------------
    def observe_step(self, step: int, duration_s: float,
                     phase_durations: Mapping[str, float] | None = None, tokens: int = 0,
                     reward_mean: float | None = None, losses: Mapping[str, float] | None = None,
                     kl: float | None = None,
                     lr: float | Mapping[str, float] | None = None) -> None:
        """Record a completed step. ``lr`` is one rate (the actor's) or a rate per role.

        Raises:
            TelemetryError: on an unknown phase or loss kind, or a negative duration or count.
        """
        phase_durations = dict(phase_durations or {})
        losses = dict(losses or {})
        unknown = sorted(set(phase_durations) - set(PHASE_LABELS))
        if unknown:
            raise TelemetryError(f"observe_step: unknown phase(s) {unknown}; known: {list(PHASE_LABELS)}")
        unknown = sorted(set(losses) - set(LOSS_KINDS))
        if unknown:
            raise TelemetryError(f"observe_step: unknown loss kind(s) {unknown}; "
                                 f"known: {list(LOSS_KINDS)}")
        duration = _non_negative("observe_step: duration_s", duration_s)
        phases = {p: _non_negative(f"observe_step: phase_durations[{p!r}]", d)
                  for p, d in phase_durations.items()}
        n_tokens = _non_negative("observe_step: tokens", tokens)

        self.step.set(step)
        self.step_duration.observe(duration)
        for phase, seconds in phases.items():
            self.phase_duration.labels(phase=phase).observe(seconds)
        self.tokens.inc(n_tokens)
        if reward_mean is not None:
            self._signals.set("rrl_reward_mean", reward_mean)
        for kind, value in losses.items():
            self._signals.set(f"rrl_{kind}_loss", value)
        if kl is not None:
            self._signals.set("rrl_kl", kl)
        if lr is not None:
            rates = lr if isinstance(lr, Mapping) else {"actor": lr}
            for role, rate in rates.items():
                self.learning_rate.labels(role=role).set(rate)

    def observe_validation(self, reward_mean: float, accuracy: float) -> None:
        """Record a validation pass: its mean reward and accuracy on the held-out prompts."""
        self._signals.set("rrl_val_reward_mean", reward_mean)
        self._signals.set("rrl_val_accuracy_ratio", accuracy)

    def observe_phase(self, phase: str, duration_s: float) -> None:
        """Record one phase outside a step's row, e.g. the ``checkpoint`` stall once it is known.

        Raises:
            TelemetryError: on an unknown phase or a negative duration.
        """
        if phase not in PHASE_LABELS:
            raise TelemetryError(f"observe_phase: unknown phase {phase!r}; known: {list(PHASE_LABELS)}")
        self.phase_duration.labels(phase=phase).observe(
            _non_negative(f"observe_phase: duration_s of {phase!r}", duration_s))

    def set_goodput(self, useful_s: float, wall_s: float) -> None:
        """Set the goodput ratio: useful seconds over wall-clock seconds of the run so far."""
        useful = _non_negative("set_goodput: useful_s", useful_s)
        wall = _non_negative("set_goodput: wall_s", wall_s)
        if wall > 0:
            self._signals.set("rrl_goodput_ratio", min(1.0, useful / wall))

    def set_goodput_source(self, source: Callable[[], float | None]) -> None:
        """Read the goodput ratio from ``source`` on every scrape, so that it falls while a step hangs
        (:meth:`set_goodput` sets it only when told)."""
        self._signals.set_source("rrl_goodput_ratio", source)

    # -- workers and failures ------------------------------------------------------------
    def set_workers_up(self, role: str, rank: int, node: str, up: bool) -> None:
        """Mark worker (role, rank) up or down on ``node``.

        A worker that comes back on another node drops its old series, so a replaced worker
        does not leave a ``0`` behind that would keep the worker-down alert firing.
        """
        key = (role, str(rank))
        with self._lock:
            previous = self._worker_nodes.get(key)
            if previous is not None and previous != node:
                self.worker_up.remove(role, str(rank), previous)
            self._worker_nodes[key] = node
            self.worker_up.labels(role=role, rank=str(rank), node=node).set(1 if up else 0)

    def remove_worker(self, role: str, rank: int) -> None:
        """Forget worker (role, rank), e.g. after the group shrank."""
        with self._lock:
            node = self._worker_nodes.pop((role, str(rank)), None)
            if node is not None:
                self.worker_up.remove(role, str(rank), node)

    def record_failure(self, cause: str) -> None:
        """Count a failure detected by the controller (``cause`` e.g. died, timeout, collective)."""
        self.failures.labels(cause=cause).inc()

    def record_restart(self, role: str, rank: int, cause: str) -> None:
        """Count a restart of worker (role, rank)."""
        self.worker_restarts.labels(role=role, rank=str(rank), cause=cause).inc()

    def record_recovery(self, duration_s: float, steps_replayed: int) -> None:
        """Record a completed recovery and the steps it had to train again."""
        self.recovery_duration.observe(_non_negative("record_recovery: duration_s", duration_s))
        self.steps_replayed.inc(_non_negative("record_recovery: steps_replayed", steps_replayed))
        self.recoveries.inc()

    def record_nonfinite(self, quantity: str, action: str) -> None:
        """Count a step's non-finite ``quantity`` and what the trainer did about it."""
        self.nonfinite.labels(quantity=quantity, action=action).inc()

    # -- checkpoints ---------------------------------------------------------------------
    def record_checkpoint_save(self, duration_s: float, stall_s: float, nbytes: int, step: int,
                               committed_at: float | None = None) -> None:
        """Record a committed checkpoint of ``step`` (``committed_at`` defaults to now)."""
        self.checkpoint_save_duration.observe(
            _non_negative("record_checkpoint_save: duration_s", duration_s))
        self.checkpoint_stall.observe(_non_negative("record_checkpoint_save: stall_s", stall_s))
        self.checkpoint_bytes.inc(_non_negative("record_checkpoint_save: nbytes", nbytes))
        self.set_last_committed(step, self._clock() if committed_at is None else committed_at)

    def set_last_committed(self, step: int, timestamp: float) -> None:
        """Set the last committed checkpoint, e.g. the one a resumed run started from."""
        self._commits.set(int(step), float(timestamp))

    def record_checkpoint_load(self, duration_s: float) -> None:
        """Record a checkpoint load (at resume or during a recovery)."""
        self.checkpoint_load_duration.observe(
            _non_negative("record_checkpoint_load: duration_s", duration_s))

    def record_corrupt_checkpoint(self) -> None:
        """Count a committed checkpoint that failed verification."""
        self.checkpoint_corrupt.inc()

    def record_corrupt_snapshot(self, source: str) -> None:
        """Count a snapshot copy from ``source`` that failed its checksum when loaded."""
        self.snapshot_corrupt.labels(source=source).inc()

    def record_checkpoint_skipped(self, reason: str) -> None:
        """Count a checkpoint save that was skipped (``reason``: ``storage`` or ``slow``)."""
        self.checkpoint_skipped.labels(reason=reason).inc()

    def checkpoint_age(self) -> float:
        """Seconds since the last commit (since start while none); exported on every scrape."""
        return self._commits.age()
