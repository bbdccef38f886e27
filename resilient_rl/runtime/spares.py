"""Warm spares: idle, fully started worker processes that take a dead rank's place at once.

When a rank's process dies, Ray restarts it, and a new process costs
seconds on any machine: Python, torch and the worker's imports, then its constructor. A worker
group with ``recovery.spares`` = N keeps N processes of its class started ahead of need, outside
its placement groups and spread over the cluster's nodes (Ray's ``SPREAD``), with the resources
and restart budget of a rank. When recovery finds a rank dead, :meth:`SparePool.adopt` hands the
rank to a ready spare (:meth:`~resilient_rl.runtime.worker_group.RayWorkerGroup.adopt`): the
spare takes the rank's identity and the group calls it from then on. It then joins the new
process-group generation, builds its models and restores the rank's state like any restarted
rank. The process it replaced is being restarted by Ray meanwhile and joins the pool as a spare
once it answers: the pool refills in the background, and the run holds the same resources as
before (the replaced process keeps the rank's placement-group bundle).

A spare is *ready* once its process has started and finished warming up (its background imports,
:meth:`~resilient_rl.runtime.worker.RankWorker.warmed_up`); one still starting is never waited for
(the rank then waits for Ray's restart, as without spares). A spare that dies while idle or while
taking over is restarted by Ray and tried again once it answers; one Ray has given up on is
replaced by a fresh one. A CPU group's spares need free resources (a rank's share), and where
there are none they stay pending and recovery falls back to Ray's restart. A GPU group's spares
reserve no GPU: each waits on a node of the group's ranks and takes the GPUs of a rank of its node
that dies (:mod:`resilient_rl.runtime.devices`), so they start where every GPU runs a rank; a
rank of a node without a ready spare waits for Ray's restart. When a spare that served a rank is
gone for good (its node was lost), the process of the rank's own bundle, which Ray restarts with
the bundle, serves the rank again (:meth:`~resilient_rl.runtime.worker_group.RayWorkerGroup.rehome`).

Spares never compete with ranks for resources. A rank's restart normally goes into its own
placement-group bundle, whose resources stay reserved for it; but when a node is lost, Ray must
place its bundles again, and spares started outside the bundles could take the free resources
first. The pool's owner then releases those spares (:meth:`~SparePool.release`; a replaced process
kept as a spare sits in its rank's bundle and stays) and refills the pool once every rank answers
again (:meth:`~SparePool.refill`). For the same reason a group whose bundles wait to be placed
again takes spares only when every dead rank of it gets one
(:meth:`~resilient_rl.runtime.pool.ray_roles.RayRoles.adopt_spares`): a rank left to wait needs the
whole placement group placed, and a spare holding a rank outside it only takes resources from it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

import ray

from resilient_rl.runtime.ended_calls import read_ended
from resilient_rl.runtime.health import dead_for_good, node_answers
from resilient_rl.runtime import worker_group_spares as group_spares
from resilient_rl.errors import WorkerError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Spare:
    handle: Any
    ping: Any  # the ObjectRef of its ping in flight
    ok: bool = False  # whether its last ping answered (a new one is sent after each answer)
    node: str | None = None  # its node, from its last answer
    in_bundle: bool = False  # a replaced rank's process: it lives in that rank's placement-group bundle


class SparePool:
    """``n`` warm spares of ``group`` (a :class:`~resilient_rl.runtime.worker_group.RayWorkerGroup`
    that started its own processes); see the module docstring.

    ``timeout_s`` bounds a spare's taking over a rank (its constructor runs again)."""

    def __init__(self, group, n: int, timeout_s: float) -> None:
        self.group = group
        self.n = n
        self.timeout_s = timeout_s
        self._names = itertools.count()
        self._turns = itertools.count()  # which node of the group's ranks a GPU spare waits on
        self._spares: list[_Spare] = []
        self.refill()

    def refill(self) -> None:
        """Start spares until there are ``n`` (none is waited for)."""
        while len(self._spares) < self.n:
            self._start()

    def _start(self) -> None:
        name = f"{self.group.name_prefix}_spare{next(self._names)}"
        self._watch(group_spares.start_spare(self.group, name, next(self._turns)), in_bundle=False)

    def _watch(self, handle, in_bundle: bool) -> None:
        """Keep ``handle`` as a spare, ready once its process has warmed up."""
        self._spares.append(_Spare(handle, handle.warmed_up.remote(), in_bundle=in_bundle))

    def __len__(self) -> int:
        return len(self._spares)

    def ready(self) -> list:
        """The spares whose last ping answered (without waiting; the first one answers once the
        process has warmed up). Each answer sends the next ping, so a spare that died since is
        found at a later call: it is asked again once Ray restarted it, or replaced where Ray
        gave up on it."""
        out = []
        for spare in list(self._spares):
            if self.group.ranks.serves_a_rank(spare.handle):  # it serves a rank again (rehome)
                self._spares.remove(spare)
                self._start()
                continue
            ended, _ = read_ended([spare.ping])
            if ended:
                _, info, error = ended[0]
                spare.ok = error is None  # else it died, and Ray restarts it or gave up on it
                if spare.ok:
                    spare.node = getattr(info, "node_id", None)
                elif dead_for_good(spare.handle):
                    logger.info("warm spare of %s is gone for good (%s); starting another",
                                self.group.name_prefix, error)
                    self._spares.remove(spare)
                    self._start()
                    continue
                # A restarted process is asked to warm up again before it counts as ready.
                spare.ping = spare.handle.ping.remote() if spare.ok else spare.handle.warmed_up.remote()
            if spare.ok:
                out.append(spare)
        return out

    def adopt(self, rank: int):
        """Hand ``rank`` to a ready spare, those on the rank's node first (the only ones that can
        take a GPU rank's devices) unless that node's raylet does not answer (the node is being
        lost: its spares die with it, though their last ping answered); the spare's ping reply
        (its pid, node), or None when no spare is ready or none of the ready ones could take over
        (the rank then waits for Ray's restart)."""
        ready = self.ready()
        node = self.group.ranks.placement(rank)[0]
        if node is not None and any(spare.node == node for spare in ready) and not node_answers(node):
            logger.warning("%s rank %d is dead and its node %s does not answer: its spares there go with it",
                           self.group.name_prefix, rank, node)
            ready = [spare for spare in ready if spare.node != node]
        ready.sort(key=lambda spare: spare.node != node)
        logger.info("%s rank %d is dead: %d of %d warm spares ready", self.group.name_prefix, rank, len(ready),
                    len(self._spares))
        for spare in ready:
            self._spares.remove(spare)
            try:
                replaced, info = group_spares.adopt(self.group, rank, spare.handle, self.timeout_s)
            except WorkerError as exc:  # it died (Ray restarts it), or cannot take the rank's GPUs
                logger.warning("warm spare of %s could not take over rank %d: %s", self.group.name_prefix, rank, exc)
                self._watch(spare.handle, spare.in_bundle)
                continue
            self.give(replaced)
            return info
        return None

    def give(self, handle) -> None:
        """Keep ``handle`` (a replaced rank's process, which Ray is restarting: in that rank's
        bundle, or where the spare that served the rank was) as a spare once it answers."""
        self._watch(handle, in_bundle=self.group.ranks.is_bundle_process(handle))

    def release(self) -> None:
        """Kill the spares started outside placement groups (no restart), freeing their resources
        for ranks; :meth:`refill` starts them again."""
        self._kill([s for s in self._spares if not s.in_bundle])

    def shutdown(self) -> None:
        """Kill every spare (no restart)."""
        self._kill(list(self._spares))

    def _kill(self, spares: list[_Spare]) -> None:
        for spare in spares:
            self._spares.remove(spare)
            try:
                ray.kill(spare.handle, no_restart=True)
            except Exception as exc:  # already gone
                logger.debug("ray.kill of a spare failed: %s", exc)
