"""Losing a worker node of a multi-raylet cluster: the groups come back on the remaining node.

Runs last (file name) because it replaces the suite's local cluster with a ``ray.cluster_utils``
cluster of a CPU-less head and two worker nodes on this machine.
"""

from __future__ import annotations

import ray
from ray.cluster_utils import Cluster

from conftest import chaos_overrides
from resilient_rl.faults.harness import check_invariants, run_training


class RemoveNode:
    """Hook: remove the node hosting actor rank 1 when step ``step`` starts."""

    def __init__(self, cluster: Cluster, step: int):
        self.cluster, self.step, self.removed = cluster, step, None

    def on_step_start(self, trainer, step):
        if step != self.step or self.removed:
            return
        group = trainer.roles.distinct_groups()[0]
        _, node_id = trainer.roles.known_workers[(group.name_prefix, 1)]
        node = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
        self.removed = node_id
        self.cluster.remove_node(node, allow_graceful=False)


def test_worker_node_lost(reference, chaos_dir):
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=8)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="rrl-chaos-nodes", log_to_driver=False, configure_logging=False)
        hook = RemoveNode(cluster, step=4)
        result = run_training(chaos_overrides(chaos_dir) + ["recovery.restart_timeout_s=120"], "node-loss",
                              hooks=(hook,))
        assert hook.removed is not None, "the node was removed"
        check_invariants(result, reference)
        restarted_nodes = {e["node"] for e in result.events_of("worker_restarted")}
        assert hook.removed not in restarted_nodes, "restarted workers run on a surviving node"
    finally:
        ray.shutdown()
        cluster.shutdown()

