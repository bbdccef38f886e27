"""Connecting the controller to Ray: a cluster the caller set up is left to the caller."""

from __future__ import annotations

from resilient_rl.config.schema import load_config
from resilient_rl.runtime.cluster import connect, disconnect


def test_a_cluster_initialised_by_the_caller_outlives_connect_and_disconnect(ray_cluster):
    ray = ray_cluster
    cfg = load_config(None, ["ray.num_cpus=2"])

    owned = connect(cfg.ray)
    assert owned is False
    disconnect(owned)

    assert ray.is_initialized()

    @ray.remote
    def answer() -> int:
        return 42

    assert ray.get(answer.remote()) == 42
