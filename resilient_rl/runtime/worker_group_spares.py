"""Warm spares of a worker group: starting them, and handing a dead rank's place to one.

:class:`SparesMixin` is a base of :class:`~resilient_rl.runtime.worker_group.RayWorkerGroup`
(see :mod:`resilient_rl.runtime.spares` for the pool that keeps spares ready).
"""

from __future__ import annotations

import logging

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from resilient_rl.runtime import master_env

logger = logging.getLogger("resilient_rl.runtime.worker_group")


class SparesMixin:
    """Warm-spare handling of a worker group (its ranks' processes, identities and placements)."""

    # ------------------------------------------------------------------ warm spares
    def start_spare(self, name: str):
        """Start one more process of this group's class outside its placement groups, with the
        restart budget of a rank: a warm spare (:mod:`resilient_rl.runtime.spares`). Its
        handle, not waited for.

        A CPU group's spare asks for a rank's resources, spread over the cluster's nodes. A GPU
        group's spare asks for no GPU and waits on a node of the group's ranks (each new spare on
        the next such node): it takes a dead rank's GPUs when it takes the rank
        (:mod:`resilient_rl.runtime.devices`), so it starts even where every GPU runs a rank."""
        options = {**self._base_options, "name": name, "scheduling_strategy": "SPREAD"}
        nodes = list(dict.fromkeys(node for node, _ in self._placements if node is not None))
        if options.get("num_gpus") and nodes:
            options["num_gpus"] = 0
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                nodes[next(self._spare_nodes) % len(nodes)], soft=False)
        # A spare reads rank 0's master address; it publishes one only once it takes rank 0.
        identity = {k: v for k, v in self._identities[0].items() if k != master_env.PUBLISH}
        return self.ray_cls_with_init(options, identity)

    def serves_a_rank(self, handle) -> bool:
        """Whether process ``handle`` serves one of the group's ranks now."""
        return any(handle is w for w in self._workers)

    def is_bundle_process(self, handle) -> bool:
        """Whether ``handle`` is a process started in one of the group's placement-group bundles."""
        return any(handle is w for w in self._bundle_workers)

    def adopt(self, rank: int, spare, timeout_s: float):
        """Make ``spare`` (a started process of this group's class) rank ``rank``: it takes the
        rank's GPUs and identity, and the group (every colocated role group sharing its
        processes too) calls it from now on. Returns the process it replaced and the spare's
        ping reply. Raises WorkerError when the spare fails to take over (it died, or it cannot
        compute on the rank's GPUs): the group is then unchanged."""
        info = self.wait_refs([self._take_rank(spare, rank)], timeout_s=timeout_s, liveness=False)[0]
        old = self._workers[rank]
        self._workers[rank] = spare  # in place: colocated role groups share this list
        self._placements[rank] = (info.node_id, info.devices)
        self.forget_liveness()
        logger.warning("%s rank %d is now served by a warm spare (pid %d)", self.name_prefix, rank, info.pid)
        return old, info

    def _take_rank(self, handle, rank: int):
        """Have process ``handle`` take rank ``rank``'s GPUs and identity; its ObjectRef (the ping reply)."""
        node, devices = self.placement(rank)
        return handle.adopt_identity.remote(self._identities[rank], devices, node)

    def rehome(self, ranks: list[int]) -> list[int]:
        """Serve each of ``ranks`` (whose process Ray has given up on) by the process started in
        the rank's own bundle again, where a warm spare served it and that process serves no other
        rank (Ray restarts it with the bundle, also on another node after a node loss). Returns
        the ranks left without a process."""
        left = []
        for rank in ranks:
            home = self._bundle_workers[rank] if rank < len(self._bundle_workers) else None
            if home is None or self.serves_a_rank(home):  # it serves this rank or another
                left.append(rank)
                continue
            self._workers[rank] = home
            self._placements[rank] = (None, None)  # known again once it answers
            self.forget_liveness()
            logger.warning("%s rank %d: the warm spare serving it is gone for good; the process of the "
                           "rank's own bundle serves it again", self.name_prefix, rank)
        return left

    def reidentify(self, infos: list) -> list:
        """Give each rank whose process answers under another identity (``infos``: their ping
        replies) its own again, and return the replies. A spare that took a rank's place and
        then died is restarted by Ray with the constructor arguments it was started with: a
        spare's, not the rank's."""
        wrong = [rank for rank, info in enumerate(infos) if self._identities
                 and (info.rank != rank or info.world_size != self.world_size)]
        if not wrong:
            return infos
        # A spare that served a rank takes the rank's GPUs again (on the rank's node: the process
        # of a GPU group's spare is restarted where it was).
        answers = self.wait_refs([self._take_rank(self._workers[r], r) for r in wrong],
                           timeout_s=self.health_timeout_s + 60.0, liveness=False)
        infos = list(infos)
        for rank, info in zip(wrong, answers):
            logger.warning("%s rank %d came back under another identity; it has its own again", self.name_prefix, rank)
            infos[rank] = info
        return self._note_placements(infos)

