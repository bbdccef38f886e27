"""Losing a worker node of a multi-raylet cluster: the groups come back on the remaining node.

The scenario needs a ``ray.cluster_utils`` cluster of a CPU-less head and two worker nodes on this
machine. A driver is connected to one cluster at a time, so the ``multi_node`` fixture shuts the
suite's local cluster down for this test, and shuts its own down afterwards; the next test that
asks for ``chaos_ray`` starts the suite's cluster again. The test may therefore run in any order
with the rest of the suite.
"""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from suite import chaos_overrides
from resilient_rl.faults.harness import check_invariants, run_training
from resilient_rl.faults.nodes import RemoveNodeOf


@pytest.fixture
def multi_node(reference):
    """A head without CPUs and two 8-CPU worker nodes, connected in place of the suite's cluster.

    Depends on ``reference`` so that the fault-free run is made on the suite's cluster before it
    is shut down. Leaves Ray shut down (``chaos_ray`` starts the suite's cluster on next use)."""
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=8)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="rrl-chaos-nodes", log_to_driver=False, configure_logging=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_worker_node_lost(reference, chaos_dir, multi_node):
    hook = RemoveNodeOf(multi_node, rank=1, step=4)  # the node of actor rank 1, as step 4 starts
    # The simulated nodes share this machine's disk: the local checkpoint root is shared.
    result = run_training(chaos_overrides(chaos_dir) + ["recovery.restart_timeout_s=120",
                                                        "checkpoint.shared_filesystem=true"], "node-loss",
                          hooks=(hook,))
    assert hook.removed is not None, f"the node was not removed (run error: {result.error!r})"
    check_invariants(result, reference)
    restarted_nodes = {e["node"] for e in result.events_of("worker_restarted")}
    assert hook.removed not in restarted_nodes, "restarted workers run on a surviving node"

