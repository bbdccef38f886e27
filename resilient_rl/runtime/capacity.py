"""Whether a placement group waiting to be placed again can be placed at all.

When a node is lost, Ray places the bundles that were on it again and restarts the ranks in
them once they are placed. With no node able to hold them, Ray waits for ever; so does a
controller that only waits for the ranks to answer. Before and while waiting, recovery asks
:func:`unplaceable`: for each of a pool's placement groups with bundles waiting, is there an
alive node whose *total* resources hold those bundles (all of them on one node under
``STRICT_PACK``, one each under ``STRICT_SPREAD``), outside the nodes its label selector keeps it
off? If not, and no node is being launched (an autoscaler's pending nodes), nothing the run can
wait for will bring the ranks back: the run stops with
:class:`~resilient_rl.errors.NoCapacityError`, naming the lost node, the ranks and the resources
missing. Resources that exist but are in use (another job, released spares) are waited for,
since Ray places the bundles as soon as they are free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shortfall:
    """A placement group whose waiting bundles no alive node can hold."""

    group: int            # its index in the pool
    bundles: list[dict]   # the resources of each waiting bundle
    strategy: str
    largest: dict         # the largest alive candidate node's resources (empty: no candidate node)
    indices: tuple[int, ...] = ()  # the waiting bundles' indices in the placement group

    def describe(self) -> str:
        need = _sum(self.bundles) if self.strategy in ("STRICT_PACK", "PACK") else self.bundles[0]
        have = {k: self.largest.get(k, 0.0) for k in need}
        where = ("no other alive node" if not self.largest
                 else f"the largest other alive node has {_fmt(have)}")
        per = "on one node" if self.strategy in ("STRICT_PACK", "PACK") else "per node"
        return f"placement group {self.group}: {len(self.bundles)} bundle(s) need {_fmt(need)} {per}; {where}"


def _sum(bundles: list[dict]) -> dict:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def _fmt(resources: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items())) or "nothing"


def _fits(need: dict, have: dict) -> bool:
    return all(float(have.get(k, 0.0)) + 1e-9 >= float(v) for k, v in need.items())


def shortfall(index: int, bundles: list[dict], strategy: str, nodes: dict[str, dict],
              excluded: set[str], indices: tuple[int, ...] = ()) -> Shortfall | None:
    """Whether ``bundles`` (waiting bundles of one placement group, at ``indices`` in it) fit the
    alive ``nodes`` (node id -> total resources) other than ``excluded``, under ``strategy``; None
    when they fit."""
    if not bundles:
        return None
    candidates = {nid: res for nid, res in nodes.items() if nid not in excluded}
    if strategy in ("STRICT_PACK", "PACK"):
        need = _sum(bundles)
        fits = any(_fits(need, res) for res in candidates.values())
        if strategy == "PACK" and not fits:  # PACK may split across nodes
            fits = _fits(need, _sum(list(candidates.values())))
    elif strategy == "STRICT_SPREAD":
        fits = sum(1 for res in candidates.values() if _fits(bundles[0], res)) >= len(bundles)
    else:  # SPREAD: any node per bundle
        fits = _fits(_sum(bundles), _sum(list(candidates.values()))) and \
            all(any(_fits(b, res) for res in candidates.values()) for b in bundles)
    if fits:
        return None
    largest = max(candidates.values(), key=lambda r: sum(float(r.get(k, 0.0)) for k in bundles[0]), default={})
    return Shortfall(index, bundles, strategy, dict(largest), tuple(indices))


def alive_nodes() -> dict[str, dict]:
    """node id -> total resources of every alive node of the cluster."""
    import ray

    return {n["NodeID"]: dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")}


def nodes_launching() -> int:
    """Nodes an autoscaler is launching or starting now (0 where the cluster has none or it
    cannot be read)."""
    import ray

    try:
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(ray.get_runtime_context().gcs_address)
        return len(status.pending_launches) + len(status.pending_nodes)
    except Exception as exc:  # noqa: BLE001 -- an older Ray or no autoscaler state: none known
        logger.debug("cluster status unavailable: %s", exc)
        return 0


def unplaceable(pool) -> list[Shortfall]:
    """The placement groups of ``pool`` (a :class:`~resilient_rl.runtime.resource_pool.RayResourcePool`)
    with bundles waiting that no alive node can hold."""
    from ray.util.placement_group import placement_group_table

    nodes = alive_nodes()
    out = []
    for i, pg in enumerate(pool.pgs or []):
        try:
            table = placement_group_table(pg)
        except Exception as exc:  # noqa: BLE001 -- the GCS did not answer: do not act on a guess
            logger.debug("placement group state unknown: %s", exc)
            continue
        if table.get("state") in ("CREATED", "REMOVED"):
            continue
        placed = table.get("bundles_to_node_id", {}) or {}
        waiting = {j: dict(b) for j, b in sorted(table.get("bundles", {}).items())
                   if j not in placed or placed[j] not in nodes}
        found = shortfall(i, list(waiting.values()), table.get("strategy", pool.strategy), nodes,
                          pool.excluded_nodes(i), indices=tuple(waiting))
        if found is not None:
            out.append(found)
    return out
