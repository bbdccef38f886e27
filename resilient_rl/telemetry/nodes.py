"""The other nodes of a run, for telemetry: the Ray node table and :class:`RemoteNodeExporter`.

Every node that hosts workers, other than the controller's, gets a small Ray actor running a
:class:`~resilient_rl.telemetry.NodeExporter`, pinned there with a
``NodeAffinitySchedulingStrategy``; :class:`RemoteNodeExporter` starts, feeds and stops it for
:class:`~resilient_rl.telemetry.hook.TelemetryHook`.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from resilient_rl.errors import TelemetryError
from resilient_rl.telemetry import NodeExporter

logger = logging.getLogger(__name__)

Worker = tuple[str, int]  # (role, rank)


def ray_if_initialized():
    import ray

    return ray if ray.is_initialized() else None


def node_table() -> dict[str, tuple[str, str]]:
    """Ray node id -> (label, IP) of every live node: the hostname, made unique when needed."""
    ray = ray_if_initialized()
    if ray is None:
        return {}
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    hosts = [n.get("NodeManagerHostname") or n["NodeManagerAddress"] for n in nodes]
    return {n["NodeID"]: (host if hosts.count(host) == 1 else f"{host}-{n['NodeID'][:8]}",
                          n["NodeManagerAddress"])
            for n, host in zip(nodes, hosts)}


class RemoteNodeExporter:
    """A :class:`NodeExporter` in a Ray actor pinned to one node."""

    def __init__(self, node_id: str, node: str, bind_address: str, port: int, advertise_host: str,
                 gpu_max_age_s: float, timeout_s: float) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.node_id, self.node, self.timeout_s = node_id, node, timeout_s
        cls = ray.remote(NodeExporter).options(
            num_cpus=0, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
        self.actor = cls.remote(node, bind_address, port, advertise_host, gpu_max_age_s)
        try:
            self.target: str = self._get(self.actor.start.remote())
        except BaseException:
            ray.kill(self.actor)
            raise

    def _get(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except Exception as exc:  # Ray wraps the actor's error, or the call timed out
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, TelemetryError):
                raise TelemetryError(f"node {self.node}: {cause}") from exc
            raise TelemetryError(f"node {self.node}: device exporter failed: {exc}") from exc

    def set_processes(self, pids: Mapping[Worker, int]) -> None:
        self._get(self.actor.set_processes.remote(dict(pids)))

    def set_gpu_assignments(self, assignments: Mapping[str, tuple[str, str]], wait: bool = True) -> None:
        """Label this node's GPUs; ``wait=False`` sends without waiting (from the training loop)."""
        ref = self.actor.set_gpu_assignments.remote(dict(assignments))
        if wait:
            self._get(ref)

    def stop(self) -> None:
        import ray

        try:
            self._get(self.actor.stop.remote())
        except TelemetryError as exc:
            logger.debug("stopping the device exporter of %s: %s", self.node, exc)
        ray.kill(self.actor)

