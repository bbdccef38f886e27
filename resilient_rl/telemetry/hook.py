"""Telemetry of a training run: the controller's exporter, per-node device exporters, file_sd.

:class:`TelemetryHook` is built by :class:`~resilient_rl.trainer.ppo.PPOTrainer` when
``telemetry.enabled`` is set. It owns

- a :class:`TrainerMetrics` served by a :class:`MetricsServer` on the controller
  (``telemetry.bind_address:telemetry.port``, 0 = a free port), fed from each step's row;
- the GPU owners: every worker's health reply names the GPU its process computes on and torch's
  memory there (:mod:`resilient_rl.telemetry.gpu_owners`); the replies of the pings made when
  workers start or recover, refreshed by non-blocking health calls every
  ``telemetry.gpu_sample_interval_s`` from :meth:`TelemetryHook.observe_step`, label each GPU
  series with its ``role``/``rank`` on the exporter of the node where the GPU is, and feed the
  controller's ``rrl_torch_memory_*`` gauges;
- a subscription to the run's events (failures, restarts, recoveries, NaN/Inf findings), which
  it turns into counters, keeps the worker up/down series and the goodput in line with, and the
  ``metrics`` of the :class:`CheckpointCoordinator` (saves, loads, skips, corrupt checkpoints);
- one device endpoint per node that hosts workers: the controller's node is served by the
  controller's exporter (a :class:`DeviceMetrics` in the same registry, sampling the worker
  processes on this node); every other node gets a small Ray actor running a
  :class:`NodeExporter`, pinned there with a ``NodeAffinitySchedulingStrategy``
  (:mod:`resilient_rl.telemetry.nodes`);
- a Prometheus ``file_sd`` targets file listing those endpoints (``telemetry.file_sd_path``,
  default ``{run_dir}/prometheus_targets.json``), labelled with job, run and node.

Goodput is the summed duration of the steps that were kept (a step rolled back by a recovery
no longer counts; its replay does; :mod:`resilient_rl.telemetry.goodput`) over the wall time since
the exporter started, which is the start of ``fit``; ETTR is the same ratio over the run's whole
life, continued from the ledger earlier controllers left in the run folder. Both are read on
every scrape and fall while a step hangs (:mod:`resilient_rl.telemetry.training_time`). Each
recovery's phases (detect, restart, rejoin, restore from its ``recovered`` event; replay until the
failed step is done again) and the seconds lost by cause are exported too
(:mod:`resilient_rl.telemetry.recovery_metrics`).
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Callable, Mapping

from resilient_rl.events import AnyEvent
from resilient_rl.runtime.device_poller import DeviceReportPoller
from resilient_rl.telemetry import (PHASES, DeviceMetrics, FileSDWriter, GpuSampler, MetricsServer,
                                    ProcessDevices, ProcessSampler, TorchMemoryMetrics,
                                    TrainerMetrics, gpu_assignments)
from resilient_rl.process_state import process_alive
from resilient_rl.runtime.health import node_answers
from resilient_rl.telemetry.gpu_owners import processes_from_reports
from resilient_rl.telemetry.recovery_metrics import RecoveryMetrics
from resilient_rl.run.record import read_controller_record
from resilient_rl.runtime.pool import WorkerPool, role_order
from resilient_rl.telemetry.nodes import RemoteNodeExporter, Worker, node_table, ray_if_initialized
from resilient_rl.telemetry.training_time import TrainingTime

logger = logging.getLogger(__name__)

JOB = "resilient-rl"
#: Row key of each loss kind exported as ``rrl_<kind>_loss``.
LOSS_KEYS = {"actor": "actor/pg_loss", "critic": "critic/vf_loss"}
#: Row keys of the actor-vs-reference KL, in order of preference.
KL_KEYS = ("actor/reward_kl_penalty", "actor/kl_loss")
# Causes whose error names the failed worker; a collective error names the survivor reporting it.
_NAMING_CAUSES = ("died", "timeout", "node_lost")
_WILDCARDS = ("", "0.0.0.0", "::")


def one_per_process(pids: Mapping[Worker, int]) -> dict[Worker, int]:
    """Keep one (role, rank) per pid, the first role of :data:`ROLE_ORDER` sharing the process,
    so that colocated roles do not export the same process's CPU and memory several times."""
    chosen: dict[int, Worker] = {}
    for key, pid in pids.items():
        if pid not in chosen or (role_order(key[0]), key[1]) < (role_order(chosen[pid][0]), chosen[pid][1]):
            chosen[pid] = key
    return {key: pid for pid, key in chosen.items()}


class TelemetryHook:
    """The telemetry of one run; also the ``metrics`` of its checkpoint coordinator.

    Args:
        cfg: the run's config (``telemetry``, ``trainer.run_name``).
        run_dir: the run folder (the default targets file lives there).
        subscribe: ``subscribe(listener)`` registers ``listener(kind, fields)`` for the run's events.
    """

    def __init__(self, cfg, run_dir, subscribe: Callable[[Callable[[str, dict], None]], Any]) -> None:
        tc = cfg.telemetry
        self.cfg = tc
        self.run = cfg.trainer.run_name
        self.timeout_s = tc.call_timeout_s
        self.pool: WorkerPool | None = None
        self.metrics = TrainerMetrics(run=self.run, saves_checkpoints=cfg.checkpoint.save_every > 0)
        # Read before this controller's fit replaces controller.json: did the previous one crash?
        previous = read_controller_record(run_dir.path)
        self.time = TrainingTime(run_dir.path, previous.state if previous is not None else None,
                                 on_lost=lambda cause, seconds: self.recovery_metrics.record_lost(cause, seconds))
        self.recovery_metrics = RecoveryMetrics(self.metrics.registry, self.time.ettr, self.time.lost)
        self.metrics.set_goodput_source(self.time.goodput)
        self.server = MetricsServer(self.metrics.registry, tc.bind_address, tc.port)
        self.node = socket.gethostname()
        self.node_id: str | None = None
        self.host = "127.0.0.1"
        self.devices = DeviceMetrics(
            registry=self.metrics.registry, node=self.node,
            gpu_sampler=GpuSampler(all_devices=True, max_age_s=tc.gpu_sample_interval_s),
            process_sampler=ProcessSampler())
        self.torch_memory = TorchMemoryMetrics()
        self.metrics.registry.register(self.torch_memory)
        self.device_reports = DeviceReportPoller(tc.gpu_sample_interval_s)
        self._process_roles: dict[str, tuple[str, ...]] = {}  # worker group name -> roles in its processes
        self._sent_assignments: dict[str, dict[str, tuple[str, str]]] = {}  # node id -> last sent
        self.file_sd = FileSDWriter(tc.file_sd_path or run_dir.path / "prometheus_targets.json")
        self.node_exporters: dict[str, RemoteNodeExporter] = {}
        self._workers: dict[Worker, tuple[int, str | None]] = {}  # (role, rank) -> (pid, node id)
        self._unknown_phases: set[str] = set()
        self._on_event = {"failure": self._event_failure, "failure_during_recovery": self._mark_down,
                          "worker_restarted": self._event_restart,
                          "recovered": self._event_recovered, "nonfinite": self._event_nonfinite,
                          "nonfinite_rollback": self._event_nonfinite_rollback,
                          "snapshot_corrupt": lambda e: self.metrics.record_corrupt_snapshot(e["source"])}
        subscribe(self._event)

    @property
    def url(self) -> str | None:
        """The controller's metrics URL once started."""
        return self.server.url

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the controller's exporter and publish it; idempotent.

        Raises:
            TelemetryError: the port is in use or the address cannot be bound (both named).
        """
        if self.server.running:
            return
        self.server.start()
        self.time.start()
        self._locate_controller()
        self._publish()
        logger.info("run %s: metrics at %s (Prometheus targets in %s)", self.run, self.url, self.file_sd.path)

    def watch_roles(self, pool: WorkerPool, last_committed: tuple[int, float] | None = None) -> None:
        """The pool is up (and restored): mark workers up, start node exporters, note the
        checkpoint resumed from (``(step, commit time)``)."""
        self.pool = pool
        self.start()
        self.time.steps_resume()
        self._sync_workers(pool)
        if last_committed is not None:
            self.metrics.set_last_committed(*last_committed)

    def stop(self) -> None:
        """Write the run's time ledger, stop every exporter and delete the targets file; idempotent."""
        self.time.close()
        for exporter in self.node_exporters.values():
            exporter.stop()
        self.node_exporters = {}
        self.server.stop()
        self.file_sd.close()

    # ------------------------------------------------------------------ steps
    def observe_step(self, row: Mapping[str, Any]) -> None:
        """Record a finished step from its metrics row (``PPOTrainer.train_step``)."""
        step, duration = int(row["step"]), float(row["timing/step_s"])
        phases = {}
        for key, value in row.items():
            if key.startswith("timing/") and key.endswith("_s") and key not in ("timing/step_s", "timing/val_s"):
                phase = key[len("timing/"):-len("_s")]
                if phase in PHASES:
                    phases[phase] = float(value)
                elif phase not in self._unknown_phases:
                    self._unknown_phases.add(phase)
                    logger.warning("telemetry: phase %r is not exported (known: %s)", phase, ", ".join(PHASES))
        kl = next((row[k] for k in KL_KEYS if k in row), None)
        self.metrics.observe_step(
            step, duration, phases, tokens=int(row.get("tokens", 0)), reward_mean=row.get("reward/mean"),
            losses={kind: float(row[key]) for kind, key in LOSS_KEYS.items() if key in row}, kl=kl,
            lr={role: float(row[f"{role}/lr"]) for role in ("actor", "critic") if f"{role}/lr" in row} or None)
        self.observe_validation(row)
        replay = self.time.step_done(step, duration)
        if replay is not None:  # the step a recovery failed at is done again
            self.recovery_metrics.observe_phases({"replay": replay})
        try:
            self._poll_device_reports()
        except Exception as exc:  # noqa: BLE001 -- telemetry must not fail a training step
            logger.warning("telemetry: device reports not refreshed: %s", exc)

    def observe_validation(self, row: Mapping[str, Any]) -> None:
        """Record the validation pass a metrics row holds (none: nothing to do); the ``step: 0``
        row of ``trainer.val_before_train`` comes here alone."""
        if "val/reward_mean" in row:
            self.metrics.observe_validation(float(row["val/reward_mean"]), float(row["val/accuracy"]))

    # ------------------------------------------------------------------ the run's events
    def _event(self, event: AnyEvent) -> None:
        handler = self._on_event.get(event.kind)
        if handler is None:
            return
        try:
            handler(event.payload())
        except Exception as exc:  # noqa: BLE001 -- telemetry must not fail a run
            logger.warning("telemetry: event %s not recorded: %s", event.kind, exc)

    def _event_failure(self, e: dict) -> None:
        """Count a failure and mark down the workers it took out (:meth:`_mark_down`)."""
        self.metrics.record_failure(e["cause"])
        self.time.failed(e["cause"])
        self._mark_down(e)

    def _mark_down(self, e: dict) -> None:
        """Mark down the workers a failure (or a failure during a recovery) took out: every role of
        the process it names (when its cause names the failed process), every worker on that
        process's node when the node no longer answers (a lost node takes all of them, though the
        failure names the first one heard of), and every worker on this node whose process is gone."""
        cause, group, rank = e["cause"], e.get("group"), e.get("rank")
        down: set[Worker] = set()
        if group is not None and rank is not None and cause in _NAMING_CAUSES and self.pool is not None:
            down |= {(r, int(rank)) for r in self.pool.roles_of(group)}
        nodes = {self._workers[key][1] for key in down if key in self._workers} - {None, self.node_id}
        lost = {node for node in nodes if not node_answers(node)}
        down |= {key for key, (_, node) in self._workers.items() if node in lost}
        local = {key for key, (_, node) in self._workers.items() if node in (None, self.node_id)}
        pids_gone = {pid for key, (pid, _) in self._workers.items() if key in local and not process_alive(pid)}
        down |= {key for key in local if self._workers[key][0] in pids_gone}
        for key in sorted(down):
            if key in self._workers:
                self.metrics.set_workers_up(key[0], key[1], self._node_label(self._workers[key][1]), False)

    def _event_restart(self, e: dict) -> None:
        self.metrics.record_restart(e["role"] or e["group"], int(e["rank"]), e["cause"])

    def _event_recovered(self, e: dict) -> None:
        """Count a recovery, forget the steps it rolled back and mark the workers up again."""
        self.metrics.record_recovery(float(e["duration_s"]), int(e["steps_replayed"]))
        self.time.recovered(int(e["failed_step"]), int(e["restored_step"]))
        if self.pool is not None:
            try:
                self._sync_workers(self.pool)
            except Exception as exc:  # noqa: BLE001 -- telemetry must not fail a recovered run
                logger.warning("telemetry: cannot refresh the worker series after recovery: %s", exc)
        # Last: a malformed phase (an event of another version) must not keep the workers marked down.
        self.recovery_metrics.observe_phases(e.get("phases") or {})

    def _event_nonfinite_rollback(self, e: dict) -> None:
        """The run rolled back past a NaN/Inf: the steps after the restored one are lost."""
        self.time.rolled_back(int(e["restored_step"]), "nonfinite")

    def _event_nonfinite(self, e: dict) -> None:
        """Count a NaN/Inf met by a step or refused in a checkpoint (:mod:`resilient_rl.recovery.nonfinite`)."""
        self.metrics.record_nonfinite(e["quantity"], e["action"])

    # ------------------------------------------------------------------ checkpoints' metrics
    def record_checkpoint_save(self, duration_s: float, stall_s: float, nbytes: int, step: int) -> None:
        self.metrics.record_checkpoint_save(duration_s, stall_s, nbytes, step)
        self.metrics.observe_phase("checkpoint", stall_s)

    def record_checkpoint_load(self, duration_s: float) -> None:
        self.metrics.record_checkpoint_load(duration_s)

    def record_corrupt_checkpoint(self) -> None:
        self.metrics.record_corrupt_checkpoint()

    def record_checkpoint_skipped(self, reason: str) -> None:
        self.metrics.record_checkpoint_skipped(reason)

    # ------------------------------------------------------------------ workers and nodes
    def _locate_controller(self) -> None:
        ray = ray_if_initialized()
        if ray is not None:
            self.node_id = ray.get_runtime_context().get_node_id()
            self.node, self.host = node_table().get(self.node_id, (self.node, self.host))
            self.devices.node = self.node

    def _node_label(self, node_id: str | None) -> str:
        if node_id is None or node_id == self.node_id:
            return self.node
        exporter = self.node_exporters.get(node_id)
        return exporter.node if exporter is not None else node_id[:12]

    def _sync_workers(self, pool: WorkerPool) -> None:
        workers = pool.role_processes()
        for key in set(self._workers) - set(workers):
            self.metrics.remove_worker(*key)
        self._workers = workers
        by_node: dict[str | None, dict[Worker, int]] = {}
        for key, (pid, node_id) in workers.items():
            by_node.setdefault(None if node_id == self.node_id else node_id, {})[key] = pid
        self.devices.set_processes(one_per_process(by_node.pop(None, {})))
        for node_id in set(self.node_exporters) - set(by_node):
            self.node_exporters.pop(node_id).stop()
        table = node_table()
        for node_id, pids in by_node.items():
            if node_id not in self.node_exporters:
                self.node_exporters[node_id] = self._start_node_exporter(node_id, table)
            self.node_exporters[node_id].set_processes(one_per_process(pids))
        for (role, rank), (_, node_id) in workers.items():
            self.metrics.set_workers_up(role, rank, self._node_label(node_id), True)
        self._reset_device_reports(pool)
        self._publish()

    # ------------------------------------------------------------------ GPU owners
    def _reset_device_reports(self, pool: WorkerPool) -> None:
        """After start or recovery: the ping replies of every process label the GPUs at once."""
        self._process_roles = {group: pool.roles_of(group) for group in pool.process_groups()}
        self.device_reports.reset(pool.workers())
        self._sent_assignments = {}
        self._apply_device_reports(wait=True)

    def _poll_device_reports(self) -> None:
        """Take the health replies that arrived, send new calls when due; never waits."""
        if self.pool is not None and self.pool.poll_device_reports(self.device_reports):
            self._apply_device_reports(wait=False)

    def _device_processes(self) -> list[ProcessDevices]:
        return processes_from_reports(self.device_reports.reports, self._process_roles, self.node_id)

    def _apply_device_reports(self, wait: bool) -> None:
        """Label the GPU series on the exporter of each GPU's node and refresh torch's memory gauges."""
        processes = self._device_processes()
        assignments = gpu_assignments(processes)
        self.devices.assign_gpus(assignments.pop(None, {}))
        for node_id, exporter in self.node_exporters.items():
            wanted = assignments.get(node_id, {})
            if self._sent_assignments.get(node_id) != wanted:
                exporter.set_gpu_assignments(wanted, wait=wait)
                self._sent_assignments[node_id] = wanted
        labels = {node_id: self._node_label(node_id) for node_id in {p.node_id for p in processes}}
        self.torch_memory.set_processes(processes, labels)

    def _port_for(self, ip: str) -> int:
        """``telemetry.worker_port_base`` on every host (one scrape port per pod or machine, as a
        Kubernetes scrape annotation needs), the next free one where several nodes share a host
        (test clusters); 0 stays 0 (any free port)."""
        base = self.cfg.worker_port_base
        if not base:
            return 0
        taken = {e.target for e in self.node_exporters.values()}
        port = base
        while f"{ip}:{port}" in taken:
            port += 1
        return port

    def _start_node_exporter(self, node_id: str, table: dict[str, tuple[str, str]]) -> RemoteNodeExporter:
        node, ip = table.get(node_id, (node_id[:12], None))
        port = self._port_for(ip or "")
        exporter = RemoteNodeExporter(node_id, node, self.cfg.bind_address, port, ip or "",
                                      self.cfg.gpu_sample_interval_s, self.timeout_s)
        logger.info("run %s: device metrics of node %s at http://%s/metrics", self.run, node, exporter.target)
        return exporter

    def _publish(self) -> None:
        if not self.server.running:
            return
        labels = {"job": JOB, "run": self.run}
        controller = (f"{self.host}:{self.server.port}" if self.cfg.bind_address in _WILDCARDS
                      else str(self.server.target))
        self.file_sd.update([(controller, {**labels, "node": self.node})]
                            + [(e.target, {**labels, "node": e.node}) for e in self.node_exporters.values()])

