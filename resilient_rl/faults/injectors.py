"""Fault injectors for worker processes, and a schedule that fires them during a run.

    schedule = (FaultSchedule().at_step(3).kill("critic", 1)
                .at_step(5).hang("actor", 0, in_call="update_actor")  # inside the update's collectives
                .at_checkpoint(6).kill("actor", 1, delay_s=0.05)  # while the shards are being written
                .during_recovery("rejoining").kill("critic", 0)   # a second failure inside recovery
                .at_validation(8).kill("rollout", 0)              # as the validation pass of step 8 starts
                .at_step(9).corrupt_latest_checkpoint()
                .at_step(10).slow("actor", 1, seconds_per_advance=1.0, advances=8))  # slow, not hung
    trainer = PPOTrainer(cfg, hooks=[schedule])

Each fault fires once, the first time its trigger happens (a replayed step after recovery does not
fire it again), optionally after a delay, or once its target is inside a given call (``in_call``:
however long the run's steps take, the fault lands where the test means it to). Every fault
records what it did (pid, file, time) so a test can prove it took effect.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import ray

from resilient_rl.errors import RRLError
from resilient_rl.trainer.hooks import TrainerHook

logger = logging.getLogger(__name__)

KINDS = ("sigkill", "sigstop", "ray_kill", "corrupt", "truncate", "slow")
TRIGGERS = ("step", "checkpoint", "snapshot", "after_snapshot", "recovery", "validation", "weight_sync",
            "final_save")


class FaultError(RRLError):
    """A fault could not be injected (unknown role or rank, process not found)."""


@dataclass
class Fault:
    """One fault: what to do to which worker, when."""

    step: int | str   # a step number, or a recovery state name for trigger "recovery"
    kind: str
    trigger: str = "step"
    role: str | None = None      # None: a random role
    rank: int | None = None      # None: a random rank
    delay_s: float = 0.0
    # Fire once the target is inside this registered call and has advanced there (see wait_in_call).
    in_call: str | None = None
    fired: bool = False
    pid: int | None = None
    fired_at: float | None = None
    target: tuple[str, int] | None = None

    path: str | None = None
    # "slow": the worker's next ``slow_advances`` progress points each sleep ``slow_s`` first.
    slow_s: float = 0.0
    slow_advances: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FaultError(f"unknown fault kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.trigger not in TRIGGERS:
            raise FaultError(f"unknown fault trigger {self.trigger!r}; allowed: {', '.join(TRIGGERS)}")


def role_pids(roles) -> dict[tuple[str, int], int]:
    """(role, rank) -> pid of every role's processes (colocated roles share a pid)."""
    return {key: pid for key, (pid, _) in roles.role_processes().items()}


def inject(kind: str, roles, role: str, rank: int) -> int:
    """Apply ``kind`` to (role, rank) of a running :class:`RayRoles`; returns the pid hit."""
    pids = role_pids(roles)
    if (role, rank) not in pids:
        raise FaultError(f"no worker {role} rank {rank}; workers: {sorted(pids)}")
    pid = pids[(role, rank)]
    if kind == "sigkill":
        os.kill(pid, signal.SIGKILL)
    elif kind == "sigstop":
        os.kill(pid, signal.SIGSTOP)
    else:
        ray.kill(roles.groups[role].workers[rank], no_restart=False)
    logger.warning("fault: %s %s rank %d (pid %d)", kind, role, rank, pid)
    return pid


def slow_down(roles, role: str, rank: int, seconds_per_advance: float, advances: int) -> int:
    """Make (role, rank) of a running :class:`RayRoles` slow but live; returns its pid."""
    pids = role_pids(roles)
    if (role, rank) not in pids:
        raise FaultError(f"no worker {role} rank {rank}; workers: {sorted(pids)}")
    ray.get(roles.groups[role].workers[rank].inject_slowdown.remote(seconds_per_advance, advances), timeout=60)
    logger.warning("fault: slow %s rank %d (pid %d): %d advance(s) %.2fs slower", role, rank, pids[(role, rank)],
                   advances, seconds_per_advance)
    return pids[(role, rank)]


def wait_in_call(roles, role: str, rank: int, call: str, timeout_s: float = 60.0, poll_s: float = 0.002) -> bool:
    """Wait until (role, rank) is inside the registered call ``call`` and has advanced there at
    least once (a mini-batch done, a block of tokens generated), as its health replies say; whether
    it got there within ``timeout_s``."""
    worker = roles.groups[role].workers[rank]
    deadline = time.monotonic() + timeout_s
    entered_at = None  # the progress counter when the call was first seen
    while time.monotonic() < deadline:
        try:
            info = ray.get(worker.health.remote(), timeout=5)
        except Exception as exc:  # died or restarting: the moment is gone
            logger.warning("fault: %s rank %d did not answer while waiting for %r: %s", role, rank, call, exc)
            return False
        if info.call != call:
            entered_at = None
        elif entered_at is None:
            entered_at = info.advances
        elif info.advances > entered_at:
            return True
        time.sleep(poll_s)
    logger.warning("fault: %s rank %d was not seen inside %r within %.0fs", role, rank, call, timeout_s)
    return False


def wait_snapshot(trainer, step: int, timeout_s: float = 30.0) -> None:
    """Wait until the trainer's in-memory snapshot of ``step`` is complete (or ``timeout_s`` passed)."""
    keeper = trainer.snapshots
    deadline = time.monotonic() + timeout_s
    while keeper is not None and time.monotonic() < deadline:
        snap = next((s for s in keeper.snapshots if s.step == step), None)
        if snap is None or snap.failed or keeper.is_complete(snap):
            return
        time.sleep(0.02)


def _wait_spares(trainer, timeout_s: float = 90.0) -> None:
    """Wait until every warm spare of the run is ready (``recovery.spares``; up to ``timeout_s``):
    faults hit a run in its steady state, where its spares have long been started."""
    deadline = time.monotonic() + timeout_s
    while not trainer.roles.spares_ready() and time.monotonic() < deadline:
        time.sleep(0.1)


@dataclass
class FaultSchedule(TrainerHook):
    """Faults keyed by step, fired by the trainer's ``on_step_start`` hook."""

    seed: int = 0
    faults: list[Fault] = field(default_factory=list)
    _at: tuple[str, int | str] | None = None

    def at_step(self, step: int) -> "FaultSchedule":
        """Faults added next fire when step ``step`` starts."""
        self._at = ("step", step)
        return self

    def at_checkpoint(self, step: int) -> "FaultSchedule":
        """Faults added next fire when the save of step ``step`` has started (shards being written)."""
        self._at = ("checkpoint", step)
        return self

    def at_snapshot(self, step: int) -> "FaultSchedule":
        """Faults added next fire when the in-memory snapshot of step ``step`` has been started
        (the ranks copying and their peers fetching)."""
        self._at = ("snapshot", step)
        return self

    def after_snapshot(self, step: int) -> "FaultSchedule":
        """Faults added next fire when step ``step`` starts, once the snapshot of step ``step - 1``
        is complete on every rank (waited for up to 30 s): a failure that loses only its own step."""
        self._at = ("after_snapshot", step)
        return self

    def at_final_save(self, step: int) -> "FaultSchedule":
        """Faults added next fire when the run, its last step ``step`` done, waits for that step's
        save to commit, once the step's snapshot is complete on every rank (waited for up to 30 s)."""
        self._at = ("final_save", step)
        return self

    def at_validation(self, step: int) -> "FaultSchedule":
        """Faults added next fire when the validation pass over the weights of step ``step`` starts
        (0: the pass before training); with ``in_call="generate_sequences"``, inside its generation."""
        self._at = ("validation", step)
        return self

    def at_weight_sync(self, step: int) -> "FaultSchedule":
        """Faults added next fire when step ``step``'s updates are done, right before the weight
        sync is sent: the sync then meets the fault (with ``delay_s``, a moment into it)."""
        self._at = ("weight_sync", step)
        return self

    def during_recovery(self, state: str = "rejoining") -> "FaultSchedule":
        """Faults added next fire when a recovery enters ``state`` (recovering, rejoining, restoring
        or aborting)."""
        self._at = ("recovery", state)
        return self

    def _add(self, kind: str, role: str | None, rank: int | None, delay_s: float,
             in_call: str | None = None) -> "FaultSchedule":
        if self._at is None:
            raise FaultError("call at_step(n), at_checkpoint(n), at_snapshot(n), at_validation(n), "
                             "at_weight_sync(n) or during_recovery(state) before adding a fault")
        trigger, at = self._at
        self.faults.append(Fault(at, kind, trigger, role, rank, delay_s, in_call))
        return self

    def corrupt_latest_checkpoint(self, truncate: bool = False) -> "FaultSchedule":
        """Flip a byte in (or truncate) a shard of the newest committed checkpoint."""
        return self._add("truncate" if truncate else "corrupt", "actor", 0, 0.0)

    def kill(self, role: str | None = None, rank: int | None = None, delay_s: float = 0.0,
             in_call: str | None = None) -> "FaultSchedule":
        return self._add("sigkill", role, rank, delay_s, in_call)

    def hang(self, role: str | None = None, rank: int | None = None, delay_s: float = 0.0,
             in_call: str | None = None) -> "FaultSchedule":
        return self._add("sigstop", role, rank, delay_s, in_call)

    def ray_kill(self, role: str | None = None, rank: int | None = None, delay_s: float = 0.0,
                 in_call: str | None = None) -> "FaultSchedule":
        return self._add("ray_kill", role, rank, delay_s, in_call)

    def slow(self, role: str | None = None, rank: int | None = None, seconds_per_advance: float = 1.0,
             advances: int = 8) -> "FaultSchedule":
        """Make a worker slow but live: its next ``advances`` progress points (mini-batches, token
        blocks, ...) each take ``seconds_per_advance`` longer. A healthy slow step: no recovery."""
        if seconds_per_advance <= 0 or advances < 1:
            raise FaultError(f"slow needs seconds_per_advance > 0 and advances >= 1, got {seconds_per_advance} "
                             f"and {advances}")
        self._add("slow", role, rank, 0.0)
        self.faults[-1].slow_s, self.faults[-1].slow_advances = float(seconds_per_advance), int(advances)
        return self

    # ------------------------------------------------------------------ trainer hook
    def _trigger(self, trainer, trigger: str, at) -> None:
        for fault in self.faults:
            if fault.trigger == trigger and fault.step == at and not fault.fired:
                fault.fired = True
                if trigger != "recovery":  # a fault during recovery hits what recovery is doing
                    _wait_spares(trainer)
                if fault.kind in ("corrupt", "truncate"):
                    fault.path = damage_latest_checkpoint(trainer.ckpt.manager, fault.kind)
                    fault.fired_at = time.time()
                else:
                    self._fire(trainer.roles, fault)

    def _trigger_after_snapshot(self, trainer, trigger: str, step: int, snapshot_step: int) -> None:
        """Fire ``trigger``'s faults at ``step`` once the snapshot of ``snapshot_step`` is complete."""
        if any(f.trigger == trigger and f.step == step and not f.fired for f in self.faults):
            wait_snapshot(trainer, snapshot_step)
            self._trigger(trainer, trigger, step)

    def on_step_start(self, trainer, step: int) -> None:
        self._trigger(trainer, "step", step)
        self._trigger_after_snapshot(trainer, "after_snapshot", step, step - 1)

    def on_checkpoint_started(self, trainer, step: int) -> None:
        self._trigger(trainer, "checkpoint", step)

    def on_validation_start(self, trainer, step: int) -> None:
        self._trigger(trainer, "validation", step)

    def on_weight_sync_start(self, trainer, step: int) -> None:
        self._trigger(trainer, "weight_sync", step)

    def on_final_save_wait(self, trainer, step: int) -> None:
        self._trigger_after_snapshot(trainer, "final_save", step, step)

    def on_snapshot_started(self, trainer, step: int) -> None:
        self._trigger(trainer, "snapshot", step)

    def on_recovery_state(self, trainer, state) -> None:
        self._trigger(trainer, "recovery", state.value)

    def _choose(self, roles, fault: Fault) -> tuple[str, int]:
        rng = random.Random(f"{self.seed}:{fault.step}:{fault.kind}")
        role = fault.role or rng.choice(sorted(roles.groups))
        rank = fault.rank if fault.rank is not None else rng.randrange(roles.groups[role].world_size)
        return role, rank

    def _fire(self, roles, fault: Fault) -> None:
        role, rank = self._choose(roles, fault)
        fault.target = (role, rank)

        def run():
            if fault.delay_s:
                time.sleep(fault.delay_s)
            if fault.in_call and not wait_in_call(roles, role, rank, fault.in_call):
                return  # not fired: the run's checks report that the fault did not take effect
            if fault.kind == "slow":
                fault.pid = slow_down(roles, role, rank, fault.slow_s, fault.slow_advances)
            else:
                fault.pid = inject(fault.kind, roles, role, rank)
            fault.fired_at = time.time()

        if fault.delay_s or fault.in_call:
            threading.Thread(target=run, name=f"fault-{fault.kind}", daemon=True).start()
        else:
            run()

    @classmethod
    def random(cls, seed: int, steps: int, n_faults: int, roles: list[str], world_sizes: dict[str, int],
               kinds: tuple[str, ...] = ("sigkill", "sigstop", "ray_kill"),
               max_delay_s: float = 0.3) -> "FaultSchedule":
        """A reproducible random schedule (the soak test prints ``seed`` so a failure can be replayed).

        Each fault fires at the start of its step after a delay of up to ``max_delay_s``: keep it
        below a step's time, or a fault of the last step fires after the run has ended."""
        rng = random.Random(seed)
        schedule = cls(seed=seed)
        for step in sorted(rng.sample(range(2, steps + 1), min(n_faults, steps - 1))):
            role = rng.choice(roles)
            schedule.at_step(step)._add(rng.choice(kinds), role, rng.randrange(world_sizes[role]),
                                        round(rng.uniform(0.0, max_delay_s), 3))
        return schedule


def damage_latest_checkpoint(manager, kind: str = "corrupt", role: str = "actor") -> str:
    """Flip one byte in the middle of (or truncate) rank 0's shard of ``role`` in the newest committed step."""
    steps = manager.committed_steps()
    if not steps:
        raise FaultError(f"no committed checkpoint under {manager.run_url} to damage")
    rel = f"{manager.run_name}/step_{steps[-1]:08d}/{role}/shard_00000.safetensors"
    data = bytearray(manager.storage.read_bytes(rel))
    if kind == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) * 3 // 4] ^= 0xFF
    manager.storage.write_bytes_atomic(rel, bytes(data))
    logger.warning("fault: %s %s", kind, manager.storage.url_for(rel))
    return manager.storage.url_for(rel)
