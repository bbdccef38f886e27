"""A worker call's result lost with its node is the node's loss (cause ``node_lost``, which a
recovery replays), not a library exception that ends the run.

A real two-node cluster: a call on the second node ends with its result kept in that node's
object store, then the node is removed before the controller reads the result. Ray cannot run an
actor's call again to rebuild the result, so reading it raises ``ObjectLostError``.
"""

from __future__ import annotations

import numpy as np
import pytest

from resilient_rl.errors import Cause, WorkerError
from resilient_rl.recovery.causes import RECOVERABLE_CAUSES, classify
from resilient_rl.runtime.group_wait import Waited, wait_calls


def test_a_result_lost_with_its_node_is_a_lost_node_naming_the_rank():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        other = cluster.add_node(num_cpus=1, resources={"other": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)

        @ray.remote(num_cpus=0.1, resources={"other": 0.1}, max_restarts=0)
        class Rank:
            def result(self):
                return np.zeros(300_000)  # past the inline limit: kept in its node's object store

        rank = Rank.remote()
        ref = rank.result.remote()
        ray.wait([ref], fetch_local=False, timeout=60)
        cluster.remove_node(other)
        with pytest.raises(WorkerError) as info:
            wait_calls([Waited(refs=[ref], role="actor", watch=None)], timeout_s=60)
        assert info.value.cause is Cause.NODE_LOST and (info.value.role, info.value.rank) == ("actor", 0)
        assert classify(info.value).cause in RECOVERABLE_CAUSES
    finally:
        ray.shutdown()
        cluster.shutdown()
