"""Warm spares of a worker group: starting one, and handing a dead rank's place to one.

Functions of a :class:`~resilient_rl.runtime.worker_group.RayWorkerGroup` through its public
surface: its ranks (``group.ranks``), its class and actor options, and its waits (see
:mod:`resilient_rl.runtime.spares` for the pool that keeps spares ready).
"""

from __future__ import annotations

import logging

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from resilient_rl.runtime import master_env

logger = logging.getLogger("resilient_rl.runtime.worker_group")

#: Ray's switch for setting a process's visible-devices variables when it is given no accelerator.
OVERRIDE_ON_ZERO = "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"


def start_spare(group, name: str, turn: int):
    """Start one more process of ``group``'s class outside its placement groups, with the restart
    budget of a rank: a warm spare (:mod:`resilient_rl.runtime.spares`). Its handle, not waited for.

    A CPU group's spare asks for a rank's resources, spread over the cluster's nodes. A GPU group's
    spare asks for no GPU and waits on a node of the group's ranks (the ``turn``-th such node,
    round robin): it takes a dead rank's GPUs when it takes the rank
    (:mod:`resilient_rl.runtime.devices`), so it starts even where every GPU runs a rank."""
    options = {**group.actor_options, "name": name, "scheduling_strategy": "SPREAD"}
    nodes = list(dict.fromkeys(node for node, _ in group.ranks.placements if node is not None))
    if options.get("num_gpus") and nodes:
        options["num_gpus"] = 0
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[turn % len(nodes)], soft=False)
        # Older Ray releases set CUDA_VISIBLE_DEVICES="" in a process given no GPU unless told not
        # to: the spare would see no GPU, decide at start that it computes on the CPU, and CUDA,
        # once anything asked it, would list no device for good. Its variable stays unset instead.
        runtime_env = dict(options.get("runtime_env") or {})
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), OVERRIDE_ON_ZERO: "0"}
        options["runtime_env"] = runtime_env
    # A spare reads rank 0's master address; it publishes one only once it takes rank 0.
    identity = {k: v for k, v in group.ranks.identities[0].items() if k != master_env.PUBLISH}
    return group.ray_cls_with_init(options, identity)


def adopt(group, rank: int, spare, timeout_s: float):
    """Make ``spare`` (a started process of ``group``'s class) rank ``rank``: it takes the rank's
    GPUs and identity, and the group (every colocated role group sharing its processes too) calls
    it from now on. Returns the process it replaced and the spare's ping reply. Raises WorkerError
    when the spare fails to take over (it died, or it cannot compute on the rank's GPUs): the group
    is then unchanged."""
    info = group.wait_refs([_take_rank(group, spare, rank)], timeout_s=timeout_s, liveness=False)[0]
    old = group.ranks.serve(rank, spare, (info.node_id, info.devices), warming=info.warming)
    group.forget_liveness()
    logger.warning("%s rank %d is now served by a warm spare (pid %d)", group.name_prefix, rank, info.pid)
    return old, info


def _take_rank(group, handle, rank: int):
    """Have process ``handle`` take rank ``rank``'s GPUs and identity; its ObjectRef (the ping reply)."""
    node, devices = group.ranks.placement(rank)
    return handle.adopt_identity.remote(group.ranks.identities[rank], devices, node)


def rehome(group, ranks: list[int]) -> list[int]:
    """Serve each of ``ranks`` (whose process Ray has given up on) by the process started in the
    rank's own bundle again, where a warm spare served it and that process serves no other rank
    (Ray restarts it with the bundle, also on another node after a node loss). Returns the ranks
    left without a process."""
    left = []
    table = group.ranks
    for rank in ranks:
        home = table.bundle_handles[rank] if rank < len(table.bundle_handles) else None
        if home is None or table.serves_a_rank(home):  # it serves this rank or another
            left.append(rank)
            continue
        table.serve(rank, home)  # placement known again once it answers
        group.forget_liveness()
        logger.warning("%s rank %d: the warm spare serving it is gone for good; the process of the "
                       "rank's own bundle serves it again", group.name_prefix, rank)
    return left


def reidentify(group, infos: list) -> list:
    """Give each rank of ``group`` whose process answers under another identity (``infos``: their
    ping replies) its own again, and return the replies. A spare that took a rank's place and then
    died is restarted by Ray with the constructor arguments it was started with: a spare's, not
    the rank's."""
    wrong = [rank for rank, info in enumerate(infos) if group.ranks.identities
             and (info.rank != rank or info.world_size != group.world_size)]
    if not wrong:
        return infos
    # A spare that served a rank takes the rank's GPUs again (on the rank's node: the process of a
    # GPU group's spare is restarted where it was).
    answers = group.wait_refs([_take_rank(group, group.workers[r], r) for r in wrong],
                              timeout_s=group.health_timeout_s + 60.0, liveness=False)
    infos = list(infos)
    for rank, info in zip(wrong, answers):
        logger.warning("%s rank %d came back under another identity; it has its own again", group.name_prefix, rank)
        infos[rank] = info
    return group.ranks.note_placements(infos)
