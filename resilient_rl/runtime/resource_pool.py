"""``RayResourcePool``: placement groups that pin a worker group's ranks to nodes.

One placement group per node (STRICT_PACK by default), one bundle per process. With
``distinct_nodes`` (what the trainer asks for a role across nodes) the placement groups of a pool
of several nodes go to distinct nodes: each is created once the previous ones are placed, with a
label selector that keeps it off their nodes (``ray.io/node-id``); the selector stays with the
group, so when its node is lost Ray places it again off the other groups' nodes. Without it (the
default, as in verl) Ray may put several of them on one node that has room for them. A bundle holds one
GPU when ``use_gpu`` and a small, configurable CPU share, so a CPU-only pool fits on a 2-core
machine whose local cluster was started with a generous logical ``num_cpus``. Requests that the
cluster can never satisfy fail at once with a :class:`ResourceError` instead of a silent wait.
"""

from __future__ import annotations

import logging
import time
import uuid

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util import placement_group_table

from resilient_rl.errors import ResourceError

#: The label every Ray node carries with its id (placement group label selectors match on it).
NODE_ID_LABEL = "ray.io/node-id"

logger = logging.getLogger(__name__)


class RayResourcePool:
    """Resources for ``sum(process_on_nodes)`` worker processes, ``process_on_nodes[i]`` of them on node i.

    ``max_colocate_count`` is how many worker processes may share one bundle (several groups
    started on the same pool); each process asks for ``1/max_colocate_count`` of the bundle.
    ``use_gpu`` and ``max_colocate_count`` default to verl's values (True, 10): a CPU-only pool
    says ``use_gpu=False``.
    """

    def __init__(self, process_on_nodes: list[int] | None = None, use_gpu: bool = True, name_prefix: str | None = None,
                 max_colocate_count: int = 10, cpus_per_bundle: float = 0.1, strategy: str = "STRICT_PACK",
                 placement_timeout_s: float = 60.0, detached: bool = False, accelerator_type: str | None = None,
                 distinct_nodes: bool = False):
        process_on_nodes = list(process_on_nodes or [1])
        if not process_on_nodes or any((not isinstance(n, int)) or n < 1 for n in process_on_nodes):
            raise ResourceError(f"process_on_nodes must be a non-empty list of positive ints, got {process_on_nodes!r}")
        if max_colocate_count < 1:
            raise ResourceError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        if cpus_per_bundle <= 0:
            raise ResourceError(f"cpus_per_bundle must be > 0, got {cpus_per_bundle}")
        if strategy not in ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"):
            raise ResourceError(f"unknown placement strategy {strategy!r}; "
                                "allowed: STRICT_PACK, PACK, SPREAD, STRICT_SPREAD")
        self._store = process_on_nodes
        self.use_gpu = use_gpu
        self.name_prefix = name_prefix or f"rrl_{uuid.uuid4().hex[:8]}"
        self.max_colocate_count = max_colocate_count
        self.cpus_per_bundle = cpus_per_bundle
        self.strategy = strategy
        self.placement_timeout_s = placement_timeout_s
        self.detached = detached
        self.accelerator_type = accelerator_type
        self.distinct_nodes = distinct_nodes
        self.pgs: list[PlacementGroup] | None = None
        self._excluded: dict[int, set[str]] = {}  # placement group -> nodes its label selector keeps it off
        self._groups_started = 0

    def excluded_nodes(self, index: int) -> set[str]:
        """The nodes placement group ``index`` may not be placed on (``distinct_nodes``)."""
        return set(self._excluded.get(index, ()))

    def next_group_prefix(self) -> str:
        """The actor-name prefix of the next worker group started on this pool without one: the
        pool's own for the first, then numbered, so two groups' actors never share a name."""
        n, self._groups_started = self._groups_started, self._groups_started + 1
        return self.name_prefix if n == 0 else f"{self.name_prefix}_g{n}"

    def bundle_slots(self) -> list[tuple[PlacementGroup, int, int, int]]:
        """``(placement group, bundle index, local rank, local world size)`` of every rank, in rank order."""
        pgs = self.get_placement_groups()
        return [(pg, i, i, n) for pg, n in zip(pgs, self._store) for i in range(n)]

    # verl's names
    @property
    def store(self) -> list[int]:
        return self._store

    @property
    def world_size(self) -> int:
        return sum(self._store)

    @property
    def n_gpus_per_node(self) -> int:
        return max(self._store)

    def local_world_size_list(self) -> list[int]:
        return [n for n in self._store for _ in range(n)]

    def local_rank_list(self) -> list[int]:
        return [i for n in self._store for i in range(n)]

    def bundle(self) -> dict[str, float]:
        b: dict[str, float] = {"CPU": self.cpus_per_bundle}
        if self.use_gpu:
            b["GPU"] = 1
            if self.accelerator_type:
                b[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return b

    def _check_feasible(self) -> None:
        """Fail fast when the cluster can never host this pool."""
        total = ray.cluster_resources()
        need_gpu = self.world_size if self.use_gpu else 0
        have_gpu = total.get("GPU", 0)
        if need_gpu > have_gpu:
            raise ResourceError(f"resource pool {self.name_prefix!r} asks for {need_gpu} GPU(s) but the cluster has "
                                f"{have_gpu:g}; set use_gpu=False (trainer.device=cpu) or add GPU nodes")
        need_cpu = self.world_size * self.cpus_per_bundle
        if need_cpu > total.get("CPU", 0) + 1e-9:
            raise ResourceError(f"resource pool {self.name_prefix!r} asks for {need_cpu:g} CPU(s) "
                                f"({self.world_size} bundles x {self.cpus_per_bundle:g}) but the cluster has "
                                f"{total.get('CPU', 0):g}; lower ray.cpus_per_worker or raise ray.num_cpus")
        if self.strategy == "STRICT_PACK" and self.use_gpu:
            per_node = [n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("Alive")]
            if per_node and max(self._store) > max(per_node):
                raise ResourceError(f"resource pool {self.name_prefix!r} packs {max(self._store)} GPU processes on one "
                                    f"node but the largest node has {max(per_node):g} GPU(s)")

    def get_placement_groups(self, strategy: str | None = None, name: str | None = None,
                             device_name: str | None = None) -> list[PlacementGroup]:
        """Create (once) and return the pool's placement groups, ready, within ``placement_timeout_s``.

        ``device_name`` (verl) is only checked: bundles hold a GPU exactly when ``use_gpu``."""
        if device_name not in (None, "cuda", "cpu", "npu"):
            raise ResourceError(f"unknown device_name {device_name!r}; use 'cuda' or 'cpu'")
        if self.pgs is not None:
            return self.pgs
        self._check_feasible()
        strategy = strategy or self.strategy
        name = name or self.name_prefix
        lifetime = "detached" if self.detached else None
        if self.distinct_nodes and len(self._store) > 1:
            pgs = self._place_on_distinct_nodes(strategy, name, lifetime)
        else:
            pgs = [placement_group([self.bundle() for _ in range(n)], strategy=strategy, name=f"{name}_pg{i}",
                                   lifetime=lifetime)
                   for i, n in enumerate(self._store)]
            self._wait_placed(pgs, pgs, time.monotonic() + self.placement_timeout_s)
        self.pgs = pgs
        return pgs

    def _place_on_distinct_nodes(self, strategy: str, name: str, lifetime: str | None) -> list[PlacementGroup]:
        """One placement group per entry of the store, each on a node none of the others holds."""
        deadline = time.monotonic() + self.placement_timeout_s
        pgs: list[PlacementGroup] = []
        used: list[str] = []
        for i, n in enumerate(self._store):
            selector = [{NODE_ID_LABEL: f"!in({','.join(used)})"}] * n if used else None
            self._excluded[i] = set(used)
            try:
                pgs.append(placement_group([self.bundle() for _ in range(n)], strategy=strategy,
                                           name=f"{name}_pg{i}", lifetime=lifetime, bundle_label_selector=selector))
            except TypeError as exc:  # a Ray without label selectors on placement groups
                self._refuse_distinct(pgs, f"its placement groups take no label selector ({exc})")
            self._wait_placed(pgs[-1:], pgs, deadline, f" on a node other than those of its first {i} group(s)")
            placed = set(placement_group_table(pgs[-1]).get("bundles_to_node_id", {}).values())
            if placed & set(used):  # accepted, not honoured: the groups would share a node
                self._refuse_distinct(pgs, f"it placed group {i} on node(s) {sorted(placed & set(used))} that "
                                           "its label selector excludes")
            used += sorted(placed)
        return pgs

    def _refuse_distinct(self, created: list[PlacementGroup], why: str) -> None:
        """Remove ``created`` and raise: this Ray cannot keep the pool's groups on distinct nodes."""
        for pg in created:
            remove_placement_group(pg)
        raise ResourceError(f"pool {self.name_prefix!r} needs its {len(self._store)} placement groups on distinct "
                            f"nodes, which Ray {ray.__version__} cannot do: {why}; use a Ray release whose "
                            "placement groups honour bundle_label_selector")

    def _wait_placed(self, waiting: list[PlacementGroup], created: list[PlacementGroup], deadline: float,
                     where: str = "") -> None:
        """Wait until ``waiting`` are placed; past ``deadline`` remove every group in ``created``
        and raise."""
        timeout = max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait([pg.ready() for pg in waiting], num_returns=len(waiting), timeout=timeout)
        if len(ready) == len(waiting):
            return
        for pg in created:
            remove_placement_group(pg)
        raise ResourceError(f"placement groups of pool {self.name_prefix!r} ({self._store} bundles of "
                            f"{self.bundle()}) were not placed{where} within {self.placement_timeout_s:g}s; "
                            f"available: {ray.available_resources()}")

    def nodes(self) -> list[list[str | None]]:
        """The node id of each bundle, placement group by placement group (None where unplaced)."""
        out = []
        for pg, n in zip(self.pgs or [], self._store):
            placed = placement_group_table(pg).get("bundles_to_node_id", {})
            out.append([placed.get(i) for i in range(n)])
        return out

    def unplaced(self) -> bool:
        """Whether a bundle of the pool's placement groups waits to be placed again (Ray
        reschedules the bundles of a node that was lost; the ranks in them restart once placed)."""
        for pg in self.pgs or []:
            try:
                state = placement_group_table(pg).get("state")
            except Exception as exc:  # the GCS did not answer: do not act on a guess
                logger.debug("placement group state unknown: %s", exc)
                continue
            if state not in ("CREATED", "REMOVED"):
                return True
        return False

    def release(self) -> None:
        """Remove the pool's placement groups (the actors in them are killed by Ray)."""
        for pg in self.pgs or []:
            try:
                remove_placement_group(pg)
            except Exception as exc:  # already gone with its node or the cluster
                logger.debug("removing placement group failed: %s", exc)
        self.pgs = None


def merge_resource_pool(rp1: RayResourcePool, rp2: RayResourcePool) -> RayResourcePool:
    """One pool with the nodes of both (before either has placed its groups)."""
    if rp1.use_gpu != rp2.use_gpu:
        raise ResourceError("cannot merge a GPU pool with a CPU pool")
    if rp1.max_colocate_count != rp2.max_colocate_count:
        raise ResourceError("cannot merge pools with different max_colocate_count")
    if rp1.pgs is not None or rp2.pgs is not None:
        raise ResourceError("cannot merge pools whose placement groups already exist")
    return RayResourcePool(rp1.store + rp2.store, use_gpu=rp1.use_gpu,
                           name_prefix=f"{rp1.name_prefix}_{rp2.name_prefix}",
                           max_colocate_count=rp1.max_colocate_count,
                           cpus_per_bundle=max(rp1.cpus_per_bundle, rp2.cpus_per_bundle), strategy=rp1.strategy,
                           placement_timeout_s=max(rp1.placement_timeout_s, rp2.placement_timeout_s),
                           distinct_nodes=rp1.distinct_nodes and rp2.distinct_nodes)


class SubRayResourcePool(RayResourcePool):
    """A contiguous run of another pool's bundles (``split_resource_pool``): its ranks use the
    bundles ``start_bundle_index .. start_bundle_index + subgroup_world_size - 1`` of the parent,
    counted across its nodes in rank order."""

    def __init__(self, parent: RayResourcePool, start_bundle_index: int, subgroup_world_size: int,
                 name_prefix: str) -> None:
        slots = parent.bundle_slots()[start_bundle_index:start_bundle_index + subgroup_world_size]
        per_pg: dict = {}
        for pg, *_ in slots:
            per_pg[pg.id] = per_pg.get(pg.id, 0) + 1
        super().__init__(list(per_pg.values()), use_gpu=parent.use_gpu, name_prefix=name_prefix,
                         max_colocate_count=parent.max_colocate_count, cpus_per_bundle=parent.cpus_per_bundle,
                         strategy=parent.strategy, placement_timeout_s=parent.placement_timeout_s,
                         detached=parent.detached, accelerator_type=parent.accelerator_type)
        self.parent, self.start_bundle_index, self.subgroup_world_size = parent, start_bundle_index, subgroup_world_size
        self._slots = slots
        self.pgs = list(dict.fromkeys(pg for pg, *_ in slots))

    def bundle_slots(self) -> list[tuple[PlacementGroup, int, int, int]]:
        # Local ranks count within this sub-pool's share of each node.
        out, seen = [], {}
        for pg, index, *_ in self._slots:
            local = seen.get(pg.id, 0)
            seen[pg.id] = local + 1
            out.append((pg, index, local, None))
        return [(pg, i, lr, seen[pg.id]) for pg, i, lr, _ in out]

    def release(self) -> None:
        """The parent's placement groups outlive a sub-pool: release the parent to free them."""
        self.pgs = list(dict.fromkeys(pg for pg, *_ in self._slots))


def split_resource_pool(resource_pool: RayResourcePool, split_size: int | list[int]) -> list[SubRayResourcePool]:
    """Split a pool's bundles into consecutive sub-pools of ``split_size`` bundles each (an int:
    equal parts; a list: those sizes, summing to the pool's world size). A sub-pool can be split
    again. The parent's placement groups are created here if they are not yet."""
    if isinstance(split_size, int) and not isinstance(split_size, bool):
        if split_size < 1 or resource_pool.world_size % split_size:
            raise ResourceError(f"split_size {split_size} must be a positive divisor of the pool's world size "
                                f"{resource_pool.world_size}")
        sizes = [split_size] * (resource_pool.world_size // split_size)
    else:
        sizes = list(split_size)
        if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes) or sum(sizes) != resource_pool.world_size:
            raise ResourceError(f"split_size {split_size!r} must be positive ints summing to the pool's world "
                                f"size {resource_pool.world_size}")
    resource_pool.get_placement_groups()
    parent = resource_pool.parent if isinstance(resource_pool, SubRayResourcePool) else resource_pool
    base = resource_pool.start_bundle_index if isinstance(resource_pool, SubRayResourcePool) else 0
    starts = [base + sum(sizes[:i]) for i in range(len(sizes))]
    return [SubRayResourcePool(parent, start, size, f"{resource_pool.name_prefix}_split_{i}")
            for i, (start, size) in enumerate(zip(starts, sizes))]
