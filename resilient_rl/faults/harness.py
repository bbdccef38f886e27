"""Running a training under faults and checking the promises the trainer makes.

Used by the chaos suite (``pytest chaos/``): run a config
once without faults (the reference), run it again with a :class:`FaultSchedule`, and compare.
The invariants, checked by :func:`check_invariants`:

- metric history, final weights and optimizer state bit-identical to the reference (the final
  checkpoint's shard files have the same sha256 as the reference's);
- the step never goes backwards in the metrics log, and replayed steps are reported as events;
- no torn checkpoint became ``latest`` and every committed one verifies, and a run saving on the
  reference's schedule keeps the checkpoints the reference keeps (no due save lost to a fault;
  ``same_checkpoints=False`` where a fault skips saves on purpose, a storage outage);
- every injected fault took effect (a process was really killed or stopped, a file really damaged);
- nothing of the run is left: no actor, placement group or worker process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray

from resilient_rl.faults.injectors import FaultSchedule
from resilient_rl.process_state import process_alive, process_state
from resilient_rl.config.schema import load_config
from resilient_rl.trainer.ppo import PPOTrainer
from resilient_rl.run.folder import deterministic_view
from resilient_rl.trainer.hooks import TrainerHook


class InvariantError(AssertionError):
    """A chaos invariant does not hold."""


@dataclass
class RunResult:
    """What a (faulted) run left behind."""

    name: str
    history: list[dict]
    events: list[dict]       # resilient_rl.events.read_events: validated, every field of the kind present
    final_files: dict[str, str]
    final_trainer_state: dict
    committed: list[int]
    latest: int | None
    verify: dict[int, str]
    pids: set[int]
    run_prefix: str
    wall_s: float
    schedule: FaultSchedule | None = None
    metrics_text: str = ""
    error: BaseException | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def events_of(self, kind: str) -> list[dict]:
        """The run's events of ``kind``, in order."""
        return [e for e in self.events if e["event"] == kind]


def _all_pids(trainer) -> set[int]:
    roles = trainer.roles
    return {pid for pid, _ in roles.known_workers.values()} if roles is not None else set()


def run_training(overrides: list[str], name: str, schedule: FaultSchedule | None = None,
                 config_path: str | None = None, hooks: tuple = ()) -> RunResult:
    """Train ``config + overrides`` as run ``name`` (with ``schedule`` and ``hooks``) and collect what it left."""
    cfg = load_config(config_path, list(overrides) + [f"trainer.run_name={name}"])
    trainer = PPOTrainer(cfg, hooks=([schedule] if schedule else []) + list(hooks))
    pids: set[int] = set()
    error = None
    t0 = time.monotonic()
    metrics_text = ""
    try:
        trainer.start_roles()
        pids |= _all_pids(trainer)

        class _Track(TrainerHook):
            def on_step_start(self, tr, step):
                pids.update(_all_pids(tr))

        trainer.hooks.append(_Track())
        trainer.fit()
        pids |= _all_pids(trainer)
    except Exception as exc:  # the caller decides whether an error was expected
        error = exc
    finally:
        if trainer.telemetry is not None:
            from prometheus_client import generate_latest

            metrics_text = generate_latest(trainer.telemetry.metrics.registry).decode()
        prefix = trainer.roles.instance if trainer.roles is not None else ""
        trainer.shutdown()
    wall = time.monotonic() - t0
    result = collect_run(trainer.cfg)
    result.pids, result.run_prefix, result.wall_s = pids, f"rrl_{name}_{prefix}", wall
    result.schedule, result.metrics_text, result.error = schedule, metrics_text, error
    return result


def collect_run(cfg) -> RunResult:
    """What a run left on disk (metrics, events, checkpoints), without starting anything."""
    from resilient_rl.checkpoint.coordinator import CheckpointCoordinator
    from resilient_rl.run.folder import RunDir

    run_dir = RunDir(cfg.trainer.output_dir, cfg.trainer.run_name)
    manager = CheckpointCoordinator(cfg).manager
    committed = manager.committed_steps()
    final_files, final_state, sizes = {}, {}, {}
    if committed:
        last = committed[-1]
        manifest = manager.load_manifest(last)
        final_files = {r.path: r.sha256 for r in manifest.files if r.path != "trainer_state.json"}
        sizes = {r.path: r.size for r in manifest.files if r.path.endswith(".safetensors")}
        # What training computed; the config (and its digest) and the failure budget (which counts
        # the very faults injected) legitimately differ from the fault-free run.
        final_state = {k: v for k, v in manager.load_trainer_state(last).items()
                       if k not in ("config", "config_digest", "failure_budget")}
    return RunResult(
        name=cfg.trainer.run_name, history=run_dir.read_metrics(), events=run_dir.read_events(),
        final_files=final_files, final_trainer_state=final_state, committed=committed,
        latest=manager.latest_step(), verify={s: manager.verify(s) for s in committed}, pids=set(),
        run_prefix=f"rrl_{cfg.trainer.run_name}_", wall_s=0.0,
        extra={"shard_sizes": sizes, "saves": _save_schedule(cfg)})


def _save_schedule(cfg) -> tuple:
    """What decides which checkpoints a run keeps: two runs with the same keep the same ones."""
    c = cfg.checkpoint
    return c.save_every, c.keep_last, c.keep_every, cfg.trainer.total_steps


def leftovers(result: RunResult, wait_s: float = 15.0) -> list[str]:
    """Actors, placement groups and processes of the run still alive (after waiting up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for info in ray._private.state.actors().values():
            if info.get("Name", "").startswith(result.run_prefix) and info.get("State") != "DEAD":
                found.append(f"actor {info['Name']} ({info.get('State')})")
        for pg in ray.util.placement_group_table().values():
            if pg.get("name", "").startswith(result.run_prefix) and pg.get("state") != "REMOVED":
                found.append(f"placement group {pg['name']} ({pg.get('state')})")
        for pid in sorted(result.pids):
            if process_alive(pid):
                found.append(f"process {pid} ({process_state(pid)})")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def metric_totals(text: str) -> dict[str, float]:
    """Sum of every sample of each metric in a Prometheus exposition text (counters by their _total name)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def expected_checkpoints(result: RunResult, reference: list[int]) -> list[int]:
    """The checkpoints ``result`` keeps when it keeps its promise: those of the fault-free run,
    except that a save a recovery abandoned and then restored past (from a newer snapshot) is
    replaced by a save of the restored step (as many kept as the fault-free run keeps)."""
    kept, abandoned = set(reference), []
    for event in result.events:
        if event["event"] == "checkpoint_abandoned":
            abandoned.append(event["step"])
        elif event["event"] == "recovered":
            restored = event["restored_step"]
            for step in abandoned:
                if step < restored and step in kept:
                    kept = (kept - {step}) | {restored}
            abandoned = []
    return sorted(kept)[-len(reference):] if reference else []


def check_invariants(result: RunResult, reference: RunResult, expect_recoveries: int = 1,
                     same_checkpoints: bool = True) -> None:
    """Raise InvariantError naming the first promise ``result`` breaks against ``reference``."""
    if result.error is not None:
        raise InvariantError(f"run {result.name} failed: {result.error!r}")
    steps = [r["step"] for r in result.history]
    if steps != sorted(steps) or len(set(steps)) != len(steps):
        raise InvariantError(f"steps go backwards or repeat in the metrics log: {steps}")
    if deterministic_view(result.history) != deterministic_view(reference.history):
        diff = next((i for i, (a, b) in enumerate(zip(deterministic_view(result.history),
                                                       deterministic_view(reference.history))) if a != b), None)
        raise InvariantError(f"metric history differs from the fault-free run (first at index {diff})")
    if result.final_files != reference.final_files:
        bad = sorted(k for k in set(result.final_files) | set(reference.final_files)
                     if result.final_files.get(k) != reference.final_files.get(k))
        raise InvariantError(f"final weights/optimizer state differ from the fault-free run: {bad[:6]}")
    if result.final_trainer_state != reference.final_trainer_state:
        got, want = result.final_trainer_state or {}, reference.final_trainer_state or {}
        keys = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        detail = "; ".join(f"{k}: {got.get(k)!r} against {want.get(k)!r}" for k in keys)[:1000]
        raise InvariantError(f"final controller state differs from the fault-free run: {detail}")
    for step, status in result.verify.items():
        if status != "ok":
            raise InvariantError(f"committed checkpoint of step {step} does not verify: {status}")
    if result.latest != (result.committed[-1] if result.committed else None):
        raise InvariantError(f"latest points at {result.latest}, newest committed is {result.committed[-1:]}")
    same_schedule = result.extra.get("saves") == reference.extra.get("saves")
    expected = expected_checkpoints(result, reference.committed)
    if same_checkpoints and same_schedule and result.committed != expected:
        raise InvariantError(f"the run kept checkpoints {result.committed}, expected {expected} (the fault-free run "
                             f"{reference.committed}): a due save was lost")
    recovered = result.events_of("recovered")
    if len(recovered) < expect_recoveries:
        raise InvariantError(f"expected >= {expect_recoveries} recoveries, saw {len(recovered)}: the fault did not "
                             "take effect")
    if any("steps_replayed" not in e for e in recovered):
        raise InvariantError("a recovery did not report its replayed steps")
    if expect_recoveries and result.metrics_text:
        totals = metric_totals(result.metrics_text)
        if totals.get("rrl_recoveries_total", 0) < expect_recoveries:
            raise InvariantError(f"rrl_recoveries_total is {totals.get('rrl_recoveries_total', 0)} in the exported "
                                 f"metrics, expected >= {expect_recoveries}")
        if totals.get("rrl_worker_restarts_total", 0) < 1:
            raise InvariantError("no restart in rrl_worker_restarts_total of the exported metrics")
    if result.schedule is not None:
        for f in result.schedule.faults:
            if not f.fired:
                raise InvariantError(f"fault {f} never fired")
            if f.kind in ("sigkill", "sigstop", "ray_kill") and (f.pid is None or process_alive(f.pid)):
                raise InvariantError(f"fault {f.kind} on {f.target}: process {f.pid} is still alive")
    left = leftovers(result)
    if left:
        raise InvariantError(f"left behind after the run: {left}")
