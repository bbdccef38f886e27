"""A local cluster's processes start with few glibc malloc arenas (``MALLOC_ARENA_MAX``): with one
per thread, a worker surviving recoveries kept more free-but-resident memory after each one
(``bench/recovery_memory.py``). No Ray cluster starts here: ``ray.init`` is replaced."""

from __future__ import annotations

import os

import pytest

from resilient_rl import env
from resilient_rl.config.schema import load_config
from resilient_rl.runtime import cluster


@pytest.fixture
def started(monkeypatch):
    """``cluster.connect`` starting a local cluster: the environment ``ray.init`` saw (which its
    processes inherit), in a copy of this process's environment."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    os.environ.pop("MALLOC_ARENA_MAX", None)
    os.environ.pop("RAY_ADDRESS", None)
    seen: dict = {}
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", lambda **kwargs: seen.update(os.environ))
    monkeypatch.setattr(cluster, "capture_worker_output", lambda: None)

    def start(user_value: str | None = None) -> dict:
        if user_value is not None:
            os.environ["MALLOC_ARENA_MAX"] = user_value
        assert cluster.connect(load_config(None, []).ray) is True
        return seen

    return start


def test_a_local_cluster_inherits_capped_malloc_arenas(started):
    assert started()["MALLOC_ARENA_MAX"] == env.MALLOC_ARENAS == "2"


def test_the_users_malloc_arena_setting_is_kept(started):
    assert started("8")["MALLOC_ARENA_MAX"] == "8"
