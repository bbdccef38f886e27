"""Losing a whole node: a multi-raylet cluster on one machine and a hook that removes a rank's node.

``ray.cluster_utils.Cluster`` starts a head and worker raylets on this machine, each a node of its
own to Ray (its own node id, resources and object store), so roles across nodes, their placement
groups and a node loss run for real, with the processes of the removed node killed. What it cannot
show is a network between them: every node shares this machine's loopback, ``/dev/shm`` and CPU.
A rank's node memory is found by its node id (:mod:`resilient_rl.workers.snapshots.node_memory`), so a
process on another node does not read the lost node's copies even though the files are visible.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import ray

from resilient_rl.faults.injectors import wait_in_call, wait_snapshot
from resilient_rl.trainer.hooks import TrainerHook


@contextlib.contextmanager
def local_nodes(workers: int = 3, cpus_per_node: int = 8, object_store_bytes: int = 128 * 2**20,
                namespace: str = "rrl-nodes", health_check_ms: int | None = None):
    """A connected cluster of a CPU-less head and ``workers`` worker nodes (logical CPUs: the
    ranks' CPU shares are small); Ray is shut down and the cluster removed on exit. The driver
    must not be connected to another cluster. ``health_check_ms``: the GCS's health-check period
    and timeout for the raylets (None: Ray's defaults)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise RuntimeError("local_nodes: this process is already connected to a Ray cluster")
    # A node that stops answering is declared dead after about period x threshold (Ray's defaults:
    # 3 s x 5): a lost node's placement groups are placed again only then.
    system = {"health_check_period_ms": health_check_ms, "health_check_timeout_ms": health_check_ms,
              "health_check_failure_threshold": 3} if health_check_ms else {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": object_store_bytes,
                                                            "_system_config": system})
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=cpus_per_node, object_store_memory=object_store_bytes)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=False, configure_logging=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class RemoveNodeOf(TrainerHook):
    """Trainer hook: once step ``step`` is under way, remove (ungracefully: its raylet and its
    ranks' processes die at once, :func:`lose_node`) the worker node that hosts rank ``rank`` of the
    first process group.

    The node goes from a thread, while the step runs: ``delay_s`` after the step starts and, with
    ``in_call``, once ``role`` rank ``rank`` is inside that registered call and has advanced there
    (a fault that strikes mid-step whatever the machine's load, not after the step has ended). With
    ``after_snapshot`` the step starts only once the snapshot of the previous step is complete (as
    :meth:`FaultSchedule.after_snapshot <resilient_rl.faults.injectors.FaultSchedule.after_snapshot>`).
    ``removed`` is the node id, ``fired_at`` the wall-clock time of the removal, ``ranks`` the
    (group, rank)s that ran on the node, ``nodes_before`` every rank's node then."""

    def __init__(self, cluster, rank: int, step: int, delay_s: float = 0.0, after_snapshot: bool = False,
                 in_call: str | None = None, role: str = "actor"):
        self.cluster, self.rank, self.step = cluster, rank, step
        self.delay_s, self.after_snapshot, self.in_call, self.role = delay_s, after_snapshot, in_call, role
        self.removed: str | None = None
        self.fired_at: float | None = None
        self.ranks: list[tuple[str, int]] = []
        self.nodes_before: dict[tuple[str, int], str] = {}  # (group, rank) -> its node before the removal
        self._thread: threading.Thread | None = None

    def on_step_start(self, trainer, step: int) -> None:
        if step != self.step or self._thread is not None:
            return
        if self.after_snapshot:
            wait_snapshot(trainer, step - 1)
        roles = trainer.roles
        known = roles.known_workers
        _, node_id = known[(roles.process_groups()[0], self.rank)]
        node = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
        self.ranks = sorted(key for key, (_, nid) in known.items() if nid == node_id)
        self.nodes_before = {key: nid for key, (_, nid) in known.items()}
        pids = node_pids(known, node_id)
        self._thread = threading.Thread(target=self._remove, args=(roles, node, node_id, pids), name="remove-node",
                                        daemon=True)
        self._thread.start()

    def _remove(self, roles, node, node_id: str, pids: list[int]) -> None:
        time.sleep(self.delay_s)
        if self.in_call and not wait_in_call(roles, self.role, self.rank, self.in_call):
            return  # not removed: the test's own check (``removed``) reports it
        self.fired_at = time.time()
        lose_node(self.cluster, node, pids)
        self.removed = node_id


def node_pids(known: dict, node_id: str) -> list[int]:
    """The processes on node ``node_id`` of the ranks in ``known`` (a pool's ``known_workers``:
    ``(group, rank) -> (pid, node id)``)."""
    return sorted({pid for pid, nid in known.values() if nid == node_id})


def lose_node(cluster, node, pids: list[int]) -> None:
    """Remove worker ``node`` of ``cluster`` ungracefully, with the rank processes ``pids`` on it.

    A lost node's processes die with it: the ranks first, at once, so that the loss strikes a rank
    inside its call whatever the machine's load; then ``Cluster.remove_node`` kills the node's
    raylet and Ray's other processes there, which takes seconds on a busy machine (a rank whose
    raylet is gone dies only once it notices, and one inside a call finishes it, and its step,
    first)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cluster.remove_node(node, allow_graceful=False)
