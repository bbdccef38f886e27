"""Fault injectors for worker processes, and a schedule that fires them during a run.

    schedule = FaultSchedule().at_step(3).kill("critic", 1).at_step(5).hang("actor", 0, delay_s=0.2)
    trainer = PPOTrainer(cfg, hooks=[schedule])

Each fault fires once, the first time its step starts (a replayed step after recovery does not
fire it again), optionally after a delay so it lands mid-step (e.g. inside a collective). Every
fault records what it did (pid, time) so a test can prove it took effect.
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

logger = logging.getLogger(__name__)

KINDS = ("sigkill", "sigstop", "ray_kill")


class FaultError(RRLError):
    """A fault could not be injected (unknown role or rank, process not found)."""


@dataclass
class Fault:
    """One fault: what to do to which worker, when."""

    step: int
    kind: str
    role: str | None = None      # None: a random role
    rank: int | None = None      # None: a random rank
    delay_s: float = 0.0
    fired: bool = False
    pid: int | None = None
    fired_at: float | None = None
    target: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FaultError(f"unknown fault kind {self.kind!r}; allowed: {', '.join(KINDS)}")


def process_state(pid: int) -> str | None:
    """The kernel's state letter of ``pid`` (R, S, T for stopped, Z), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def inject(kind: str, roles, role: str, rank: int) -> int:
    """Apply ``kind`` to (role, rank) of a running :class:`RayRoles`; returns the pid hit."""
    pids = roles.worker_pids()
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


@dataclass
class FaultSchedule:
    """Faults keyed by step, fired by the trainer's ``on_step_start`` hook."""

    seed: int = 0
    faults: list[Fault] = field(default_factory=list)
    _step: int | None = None

    def at_step(self, step: int) -> "FaultSchedule":
        self._step = step
        return self

    def _add(self, kind: str, role: str | None, rank: int | None, delay_s: float) -> "FaultSchedule":
        if self._step is None:
            raise FaultError("call at_step(n) before adding a fault")
        self.faults.append(Fault(self._step, kind, role, rank, delay_s))
        return self

    def kill(self, role: str | None = None, rank: int | None = None, delay_s: float = 0.0) -> "FaultSchedule":
        return self._add("sigkill", role, rank, delay_s)

    def hang(self, role: str | None = None, rank: int | None = None, delay_s: float = 0.0) -> "FaultSchedule":
        return self._add("sigstop", role, rank, delay_s)

    def ray_kill(self, role: str | None = None, rank: int | None = None, delay_s: float = 0.0) -> "FaultSchedule":
        return self._add("ray_kill", role, rank, delay_s)

    # ------------------------------------------------------------------ trainer hook
    def on_step_start(self, trainer, step: int) -> None:
        for fault in self.faults:
            if fault.step == step and not fault.fired:
                fault.fired = True
                self._fire(trainer.roles, fault)

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
            fault.pid = inject(fault.kind, roles, role, rank)
            fault.fired_at = time.time()

        if fault.delay_s:
            threading.Thread(target=run, name=f"fault-{fault.kind}", daemon=True).start()
        else:
            run()

    def summary(self) -> list[dict]:
        return [{"step": f.step, "kind": f.kind, "target": f.target, "pid": f.pid, "fired": f.fired}
                for f in self.faults]
