"""runtime/cluster.on_every_node: node-local clean-up runs in the controller's own process for the
controller's node (no worker process started for it) and as a task on each other node."""

from __future__ import annotations

import os

from resilient_rl.runtime.cluster import on_every_node


def _recorder():
    """A function that appends its process id to a file; made here, so that Ray sends it by value
    (a task's worker cannot import this test module)."""
    def record(path: str) -> None:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
    return record


def _pids(path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def test_without_ray_it_runs_here(tmp_path):
    on_every_node(_recorder(), str(tmp_path / "ran"), wait_s=5)
    assert _pids(tmp_path / "ran") == [os.getpid()]


def test_each_other_node_gets_a_task(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        on_every_node(_recorder(), str(tmp_path / "ran"), wait_s=60)
        pids = _pids(tmp_path / "ran")
        assert len(pids) == 2 and os.getpid() in pids, pids  # here for the head, a task on the worker node
    finally:
        ray.shutdown()
        cluster.shutdown()


# After the multi-node case: the module's cluster stays up until the module ends.
def test_on_a_one_node_cluster_it_runs_in_this_process_and_starts_no_task(ray_cluster, tmp_path):
    on_every_node(_recorder(), str(tmp_path / "ran"), wait_s=30)
    assert _pids(tmp_path / "ran") == [os.getpid()]
