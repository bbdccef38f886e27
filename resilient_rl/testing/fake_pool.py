"""A scripted worker pool: the recovery protocol, run in milliseconds (with :mod:`resilient_rl.testing.clock`).

:class:`FakePool` implements the process side of :class:`~resilient_rl.runtime.pool.WorkerPool`
the way Ray and the workers behave: a killed or crashed process is restarted with a new pid
until its actor has used ``ray_max_restarts`` restarts (then waiting for it fails with cause
``exhausted``); a stopped process answers no probe until killed; a rank inside a call reports
the call and how long it has not advanced. Faults are set per rank (:meth:`crash`, :meth:`stop`,
:meth:`busy`) and per operation (:meth:`fail_next`), and every call is logged in ``calls``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from resilient_rl.runtime.pool import role_order
from resilient_rl.runtime.worker import WorkerInfo
from resilient_rl.errors import WorkerDiedError, WorkerError


@dataclass
class FakeProcess:
    pid: int
    node: str
    state: str = "ok"  # ok | dead | stopped
    call: str | None = None
    progress_age_s: float | None = None
    restarts: int = 0
    #: Still running its start-up imports: it says so, and answers no probe for this many more
    #: probes (None: none at all).
    warming: bool = False
    silent_probes: int | None = 0
    left: bool = False  # left its collectives; its group's next rendezvous clears it


@dataclass
class FakePool:
    """Process groups of ``world_size`` ranks hosting ``roles``; see the module docstring."""

    groups: dict[str, tuple[str, ...]] = field(default_factory=lambda: {"main": ("actor", "rollout", "ref")})
    world_size: int = 2
    ray_max_restarts: int = 10
    nodes: tuple[str, ...] = ("node-a", "node-b")
    writes_checkpoints: bool = True
    critic_enabled: bool = False
    spares: int = 0  # warm spares per group, ready now (the processes they replace refill the pool)
    #: Process groups one collective spans, with the calls inside it (the weight channel's).
    shared_calls: dict[str, frozenset[str]] = field(default_factory=dict)
    interrupt: Callable[[], None] = lambda: None  # as the controller sets it (raises to stop recovering)

    def __post_init__(self) -> None:
        self._pids = itertools.count(100)
        self.generation = 1
        self.procs = {(g, r): FakeProcess(next(self._pids), self.nodes[r % len(self.nodes)])
                      for g in self.groups for r in range(self.world_size)}
        self.known = {key: self._info(key) for key in self.procs}
        self.calls: list[tuple] = []
        self.empty_inits: list[bool] = []  # the ``empty`` argument of each init_models call
        self._failures: dict[str, list[BaseException]] = {}
        self.ready_spares = {g: self.spares for g in self.groups}
        self._refills: dict[str, int] = {g: 0 for g in self.groups}
        self.spare_dies = 0  # spares that die taking over next (each tries the next ready one)
        self._late: set = set()  # processes that die just after answering (see die_late)

    # ------------------------------------------------------------------ faults
    def crash(self, group: str, rank: int) -> None:
        """The process exits (SIGKILL, OOM): Ray restarts it when asked to wait for it."""
        self.procs[(group, rank)].state = "dead"

    def stop(self, group: str, rank: int) -> None:
        """The process is SIGSTOPped: it answers nothing until killed."""
        self.procs[(group, rank)].state = "stopped"

    def warm_up(self, group: str, rank: int, silent_probes: int | None = None) -> None:
        """The process is still importing at start: it said ``warming`` when last asked, and
        answers none of the next ``silent_probes`` probes (None: it never does; it is wedged)."""
        p = self.procs[(group, rank)]
        p.warming, p.silent_probes = True, silent_probes
        self.known[(group, rank)] = self._info((group, rank))

    def busy(self, group: str, rank: int, call: str, progress_age_s: float) -> None:
        """The process is inside ``call`` and has not advanced for ``progress_age_s``."""
        p = self.procs[(group, rank)]
        p.call, p.progress_age_s = call, progress_age_s

    def leave(self, group: str, rank: int) -> None:
        """The process left its collectives on its own: a call of it inside one raised (a peer
        in another group died), and it is idle now."""
        p = self.procs[(group, rank)]
        p.call, p.left = None, True

    def lose_node(self, node: str) -> None:
        """Every process on ``node`` dies; restarts land on the other nodes."""
        for p in self.procs.values():
            if p.node == node:
                p.state = "dead"
        self.nodes = tuple(n for n in self.nodes if n != node)

    def die_late(self, group: str, rank: int) -> None:
        """The process answers the probes and its group's wait with its old pid, then dies (its
        node is gone; its processes notice a moment later) and Ray restarts it while the other
        groups are waited for."""
        self._late.add((group, rank))

    def fail_next(self, operation: str, exc: BaseException) -> None:
        """The next call of ``operation`` (``rendezvous``, ``init_models``, ``wait_alive``) raises ``exc``."""
        self._failures.setdefault(operation, []).append(exc)

    def _maybe_fail(self, operation: str) -> None:
        pending = self._failures.get(operation)
        if pending:
            raise pending.pop(0)

    # ------------------------------------------------------------------ the WorkerPool process side
    def _info(self, key) -> WorkerInfo:
        p = self.procs[key]
        return WorkerInfo(key[1], self.world_size, self.generation, p.pid, p.node,
                          call=p.call, progress_age_s=p.progress_age_s, warming=p.warming, left=p.left)

    def process_groups(self) -> list[str]:
        return list(self.groups)

    def workers(self) -> dict:
        return dict(self.known)

    def refresh_workers(self) -> None:
        self.calls.append(("refresh_workers",))
        self.known = {key: self._info(key) for key in self.procs}

    def probe(self, group: str, timeout_s: float, during_call: bool = False) -> dict:
        self.calls.append(("probe", group, during_call))
        out = {}
        for rank in range(self.world_size):
            p = self.procs[(group, rank)]
            if p.state == "stopped":
                out[rank] = None
            elif p.state == "dead":
                out[rank] = WorkerDiedError(f"{group} rank {rank} died", role=group, rank=rank)
            elif p.warming and (p.silent_probes is None or p.silent_probes > 0):
                p.silent_probes = None if p.silent_probes is None else p.silent_probes - 1
                out[rank] = None
            else:
                p.warming = False
                out[rank] = self._info((group, rank))
        return out

    def kill(self, key) -> None:
        self.calls.append(("kill", key))
        self.procs[key].state = "dead"
        self.procs[key].call = None
        self.procs[key].warming = False  # its successor starts warm here

    def leave_collectives(self, keys, reason: str) -> None:
        """A survivor told to leave its collectives ends its call (it was waiting on a dead peer)."""
        self.calls.append(("leave_collectives", tuple(keys)))
        for key in keys:
            if self.procs[key].state == "ok":
                self.procs[key].call, self.procs[key].left = None, True

    def adopt_spares(self, keys) -> list:
        """A dead rank of ``keys`` gets a ready spare's new process on another node (no restart
        of its own); the replaced process is a spare again at the next :meth:`wait_alive`."""
        adopted = []
        for group, rank in keys:
            p = self.procs[(group, rank)]
            while p.state == "dead" and self.ready_spares[group] > 0:
                self.ready_spares[group] -= 1
                self._refills[group] += 1  # Ray restarts the one that died taking over, too
                if self.spare_dies > 0:
                    self.spare_dies -= 1
                    continue
                self.calls.append(("adopt", (group, rank)))
                p.pid, p.state, p.call, p.left = next(self._pids), "ok", None, False
                p.node = next((n for n in self.nodes if n != p.node), p.node)
                adopted.append((group, rank))
        return adopted

    def wait_alive(self, group: str, timeout_s: float) -> list[WorkerInfo]:
        self.calls.append(("wait_alive", group))
        self.interrupt()
        self._maybe_fail("wait_alive")
        self.ready_spares[group] += self._refills[group]
        self._refills[group] = 0
        for rank in range(self.world_size):
            p = self.procs[(group, rank)]
            if p.state == "stopped":
                raise WorkerError(f"{group} rank {rank} did not answer within {timeout_s:g}s", role=group,
                                  rank=rank, cause="timeout")
            if p.state == "dead":
                if p.restarts >= self.ray_max_restarts:
                    raise WorkerError(f"{group} rank {rank}: no restarts left", role=group, rank=rank,
                                      cause="exhausted")
                p.pid, p.state, p.restarts, p.left = next(self._pids), "ok", p.restarts + 1, False
                p.node = self.nodes[rank % len(self.nodes)]
        answers = [self._info((group, rank)) for rank in range(self.world_size)]
        for key in sorted(k for k in self._late if k[0] == group):
            self._late.discard(key)
            p = self.procs[key]
            p.pid, p.restarts, p.left = next(self._pids), p.restarts + 1, False
        return answers

    def locate(self, name: str | None) -> tuple[str | None, str | None]:
        if name is None:
            return None, None
        group, _, role = name.partition(":")
        if group not in self.groups:
            return None, None
        return group, role or self.roles_of(group)[0]

    def roles_of(self, group: str) -> tuple[str, ...]:
        return tuple(sorted(self.groups[group], key=role_order))

    def role_processes(self) -> dict:
        return {(role, rank): (info.pid, info.node_id) for (g, rank), info in self.known.items()
                for role in self.groups[g]}

    def rendezvous(self, groups: list[str] | None = None) -> None:
        self.calls.append(("rendezvous", groups))
        self._maybe_fail("rendezvous")
        self.generation += 1
        for (group, _), p in self.procs.items():
            if groups is None or group in groups:
                p.left = False

    def init_models(self, groups: list[str] | None = None, empty: bool = False) -> None:
        self.calls.append(("init_models", groups))
        self.empty_inits.append(empty)
        self._maybe_fail("init_models")

    def ops(self) -> list[str]:
        """The names of the calls made, in order."""
        return [c[0] for c in self.calls]
