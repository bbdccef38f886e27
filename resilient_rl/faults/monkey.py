"""A chaos monkey for a live run: attach to its named actors and kill or hang one now and then.

Worker actors are named ``rrl_{run}_{instance}_{group}_{rank}``, so the monkey finds a run's
workers in the cluster's actor table without talking to its controller. Each fault is applied
on the worker's own node (a small task pinned there sends the signal), so it works on
multi-node clusters. ``dry_run`` only prints what it would do.
"""

from __future__ import annotations

import logging
import random
import re
import signal
import time
from dataclasses import dataclass
from typing import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from resilient_rl.faults.injectors import FaultError

logger = logging.getLogger(__name__)

MONKEY_KINDS = ("sigkill", "sigstop")


@dataclass(frozen=True)
class Target:
    """A live worker actor of a run."""

    name: str
    group: str
    rank: int
    pid: int
    node_id: str


def parse_worker_name(name: str) -> tuple[str, str, str, int] | None:
    """(run, instance, group, rank) of a worker actor name ``rrl_{run}_{instance}_{group}_{rank}``,
    or None. Parsed from the right: instance (hex) and group (a role) hold no ``_``, while a
    run name may, so ``rrl_ppo_v2_...`` belongs to run ``ppo_v2``, never to run ``ppo``."""
    if not name.startswith("rrl_"):
        return None
    parts = name[len("rrl_"):].rsplit("_", 3)
    if len(parts) != 4:
        return None
    run, instance, group, rank = parts
    if not run or not rank.isdigit() or not re.fullmatch(r"[0-9a-f]+", instance) or not group.isalpha():
        return None
    return run, instance, group, int(rank)


def find_run_workers(run_name: str) -> list[Target]:
    """Alive worker actors of run ``run_name`` (exactly that run) in the connected cluster."""
    out = []
    for info in ray._private.state.actors().values():
        name = info.get("Name") or ""
        parsed = parse_worker_name(name)
        if parsed is None or parsed[0] != run_name or info.get("State") != "ALIVE" or not info.get("Pid"):
            continue
        out.append(Target(name, parsed[2], parsed[3], int(info["Pid"]), info["Address"]["NodeID"]))
    return sorted(out, key=lambda t: t.name)


@ray.remote(num_cpus=0)
def _signal(pid: int, signum: int) -> None:
    import os

    os.kill(pid, signum)


def send_signal(target: Target, kind: str) -> None:
    """SIGKILL or SIGSTOP ``target`` on its node."""
    signum = signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP
    strategy = NodeAffinitySchedulingStrategy(target.node_id, soft=False)
    ray.get(_signal.options(scheduling_strategy=strategy).remote(target.pid, signum), timeout=60)


class ChaosMonkey:
    """Every ``interval_s``, hit a random worker of ``run_name`` with a random fault, ``max_faults`` times."""

    def __init__(self, run_name: str, interval_s: float, max_faults: int, kinds: tuple[str, ...] = MONKEY_KINDS,
                 seed: int | None = None, dry_run: bool = False, sleep: Callable[[float], None] = time.sleep,
                 echo: Callable[[str], None] = print):
        bad = [k for k in kinds if k not in MONKEY_KINDS]
        if bad:
            raise FaultError(f"unknown fault kind(s) {bad}; allowed: {', '.join(MONKEY_KINDS)}")
        if max_faults < 1 or interval_s < 0:
            raise FaultError(f"max_faults must be >= 1 and interval >= 0, got {max_faults} and {interval_s}")
        self.run_name, self.interval_s, self.max_faults, self.kinds = run_name, interval_s, max_faults, kinds
        self.seed = seed if seed is not None else random.SystemRandom().randrange(1 << 30)
        self.rng = random.Random(self.seed)
        self.dry_run, self.sleep, self.echo = dry_run, sleep, echo
        self.done: list[tuple[str, Target]] = []

    def targets(self) -> list[Target]:
        """The run's live workers now; FaultError when it has none (a wrong run name, a run not started)."""
        targets = find_run_workers(self.run_name)
        if not targets:
            raise FaultError(f"no live workers of run {self.run_name!r} in this cluster (actors named "
                             f"rrl_{self.run_name}_...)")
        return targets

    def step(self, at_s: float | None = None) -> tuple[str, Target]:
        """Hit one random worker (a dry run only says which); ``at_s``: when, for the message."""
        targets = self.targets()
        target, kind = self.rng.choice(targets), self.rng.choice(self.kinds)
        verb = "would send" if self.dry_run else "sending"
        when = f"at +{at_s:g}s: " if at_s is not None else ""
        self.echo(f"chaos: {when}{verb} {kind} to {target.name} (group {target.group}, rank {target.rank}, "
                  f"pid {target.pid})")
        if not self.dry_run:
            send_signal(target, kind)
        self.done.append((kind, target))
        return kind, target

    def run(self) -> list[tuple[str, Target]]:
        """The plan and the run's workers at once, then ``max_faults`` faults ``interval_s`` apart.

        A dry run touches nothing, so it does not wait either: it prints every fault it would send
        with its time, drawn from the same seed (and the workers alive now) as a real session."""
        self.echo(f"chaos: run {self.run_name!r}, {self.max_faults} fault(s) every {self.interval_s:g}s, "
                  f"seed {self.seed}{' (dry run)' if self.dry_run else ''}")
        targets = self.targets()
        self.echo(f"chaos: {len(targets)} live worker(s): "
                  + ", ".join(f"{t.group} rank {t.rank} (pid {t.pid})" for t in targets))
        for index in range(1, self.max_faults + 1):
            if not self.dry_run:
                self.sleep(self.interval_s)
            self.step(at_s=index * self.interval_s)
        return self.done
