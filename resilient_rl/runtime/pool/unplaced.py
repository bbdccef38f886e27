"""Ranks whose node was lost: their placement groups wait to be placed again, and the wait for
them gives way (warm spares released) or ends (no alive node can ever hold them)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from resilient_rl.errors import NoCapacityError
from resilient_rl.runtime.capacity import Shortfall, alive_nodes, nodes_launching, unplaceable
from resilient_rl.runtime.spares import SparePool
from resilient_rl.runtime.worker import WorkerInfo
from resilient_rl.runtime.worker_group import RayWorkerGroup

logger = logging.getLogger(__name__)


def yield_to_unplaced(process_groups: list[RayWorkerGroup], spares: dict[str, SparePool],
                      known: Mapping[tuple[str, int], WorkerInfo], roles: Mapping[str, tuple[str, ...]]) -> None:
    """Between tries of a wait for ranks: where a rank's bundle waits to be placed again (its node
    was lost), release the warm spares started outside placement groups (they must not take the
    free resources the bundle needs; the pool starts them again once every rank answers), and
    raise :class:`NoCapacityError` when no alive node can hold the bundle and none is launching.
    ``known``: (process group, rank) -> the ping reply of every rank before the failure; ``roles``:
    process group -> its roles, the one it is reported under first."""
    unplaced = [g for g in process_groups if g.resource_pool is not None and g.resource_pool.unplaced()]
    if not unplaced:
        return
    if any(len(pool) for pool in spares.values()):
        logger.warning("placement groups of %s wait to be placed again: releasing the warm spares "
                       "so that their ranks get the resources", ", ".join(g.name_prefix for g in unplaced))
        for pool in spares.values():
            pool.release()
    for g in unplaced:
        short = unplaceable(g.resource_pool)
        if short and not nodes_launching():
            raise NoCapacityError(_no_capacity(g, short, known, roles[g.name_prefix][0]))


def _no_capacity(g: RayWorkerGroup, short: list[Shortfall], known: Mapping[tuple[str, int], WorkerInfo],
                 role: str) -> str:
    """The error's text: the ranks whose bundles wait (read from the placement groups, not from
    the replies before the failure, which may already place a rank elsewhere), the node they were
    lost with, and what no alive node has."""
    ranks = waiting_ranks(g.resource_pool, short)
    alive = set(alive_nodes())
    nodes = sorted({known[(g.name_prefix, r)].node_id for r in ranks if (g.name_prefix, r) in known} - alive - {None})
    return (f"{role} ranks {ranks} were lost with "
            f"node {', '.join(nodes) or '(unknown)'} and no alive node can take them: "
            + "; ".join(s.describe() for s in short)
            + ". The run folder and its last committed checkpoint are intact: once the cluster has a node "
              "with those resources, the same command continues the run")


def waiting_ranks(pool, short: list[Shortfall]) -> list[int]:
    """The ranks of ``pool`` whose bundles are among the waiting bundles of ``short``."""
    waiting = {(pool.pgs[s.group].id, j) for s in short for j in s.indices}
    return [rank for rank, (pg, j, *_) in enumerate(pool.bundle_slots()) if (pg.id, j) in waiting]
