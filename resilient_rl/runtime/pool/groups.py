"""Building a Ray pool's worker groups and their warm spares from the run's config."""

from __future__ import annotations

import logging

import ray

from resilient_rl.config.node_layout import network_runtime_env
from resilient_rl.runtime.resource_pool import RayResourcePool
from resilient_rl.runtime.spare_sizing import available_host_bytes, cores_here, decide as decide_spares
from resilient_rl.runtime.spares import SparePool
from resilient_rl.runtime.worker_group import RayClassWithInitArgs, RayWorkerGroup

logger = logging.getLogger(__name__)


def worker_group(cfg, layout, name: str, cls: RayClassWithInitArgs, instance: str, use_gpu: bool) -> RayWorkerGroup:
    """The worker group ``name`` of the run: its ranks over nodes as ``layout`` places them, one
    placement group per node, each on a node of its own (see :class:`RayResourcePool`)."""
    rc = cfg.recovery
    pool = RayResourcePool(list(layout.process_on_nodes), use_gpu=use_gpu, max_colocate_count=1,
                           cpus_per_bundle=cfg.ray.cpus_per_worker,
                           name_prefix=f"rrl_{cfg.trainer.run_name}_{instance}_{name}",
                           placement_timeout_s=rc.placement_timeout_s, distinct_nodes=True)
    # Ray restarts a dead rank whenever it dies: its count of an actor's restarts never refills, so
    # the controller's failure policy (recovery.max_restarts within failure_window_s) decides instead.
    return RayWorkerGroup(pool, cls, runtime_env=network_runtime_env(cfg.trainer.network_interface),
                          max_restarts=-1, max_task_retries=rc.max_task_retries,
                          call_timeout_s=rc.call_timeout_s, hang_timeout_s=rc.hang_timeout_s,
                          health_timeout_s=rc.health_timeout_s, warmup_timeout_s=rc.warmup_timeout_s)


def start_spares(rc, groups: dict[str, RayWorkerGroup], process_groups: list[RayWorkerGroup]) -> dict[str, SparePool]:
    """The warm spares of ``recovery.spares`` (``rc``; ``auto``: one per node of each process group,
    :mod:`resilient_rl.runtime.spare_sizing`) by process group name, with the one line saying what
    was chosen. ``groups``: role -> worker group; ``process_groups``: one group per set of processes."""
    # Each process group by the roles its processes host ("actor+critic+ref+rollout" colocated).
    named = {"+".join(sorted(role for role, h in groups.items() if h.workers is g.workers)) or g.name_prefix: g
             for g in process_groups}
    spans = {name: len({g.ranks.placement(r)[0] for r in range(g.world_size)} - {None}) for name, g in named.items()}
    here = ray.get_runtime_context().get_node_id()
    ranks_here = {name: sum(1 for r in range(g.world_size) if g.ranks.placement(r)[0] == here) for name, g in named.items()}
    auto = rc.spares == "auto"
    decision = decide_spares(rc.spares, spans, available_host_bytes() if auto else None,
                             cores_here() if auto else None, ranks_here)
    logger.info(decision.line)
    return {named[name].name_prefix: SparePool(named[name], n, rc.rendezvous_timeout_s)
            for name, n in decision.per_group.items() if n > 0}
