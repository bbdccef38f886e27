"""Shared fixtures: one local Ray cluster per test module (``ray.init`` costs seconds here), a one-rank
process group, a settable clock, the bench scripts as modules."""

from __future__ import annotations

import os
import sys

import pytest

from resilient_rl.env import fail_fast_on_dead_actors

# The clusters tests start handle dead actors as the trainer's own do (see resilient_rl.env).
fail_fast_on_dead_actors()


@pytest.fixture(scope="module", autouse=True)
def _no_cluster_left_by_another_file():
    """Each test file starts with no Ray connection in this process. Under ``pytest -n`` a process
    runs files of both suites, and the chaos suite keeps its cluster up from one of its files to
    the next: a ``ray.init`` here would fail on it, and code that joins the connection it finds
    (``runtime.cluster.connect``) would join a cluster of other settings."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    yield


@pytest.fixture(scope="module")
def ray_cluster():
    """A local CPU Ray cluster with generous logical CPUs; shut down after the module."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=16, include_dashboard=False, namespace="rrl-tests",
             object_store_memory=256 * 1024**2, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def moto():
    """A moto S3 server on loopback with buckets ``ckpt`` and ``store``, or the reason it cannot start."""
    from resilient_rl.testing.s3 import MotoServer, MotoUnavailable

    try:
        server = MotoServer.start()
    except MotoUnavailable as exc:
        yield str(exc)
        return
    server.create_bucket("ckpt")
    server.create_bucket("store")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def single_rank_group():
    """A one-rank gloo process group in this process (FSDP2 on one rank), unless one is up already."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def clock():
    """A settable Unix clock, so ages are exact without sleeping."""
    from resilient_rl.testing.clock import FakeClock

    return FakeClock(1_700_000_000.0)


@pytest.fixture
def bench(monkeypatch):
    """The bench scripts as modules (``gpu``, ``train``), importable as they import each other."""
    from resilient_rl.testing.bench_scripts import BENCH

    monkeypatch.syspath_prepend(str(BENCH))
    import gpu
    import train

    return gpu, train


@pytest.fixture(autouse=True)
def _fresh_secret_registry():
    """Each test starts with no secret values noted: the redactor is process-wide, so a secret an
    earlier test's config carried (a fake key, a user name) would be redacted from this test's
    messages wherever its text appears."""
    from resilient_rl.config import secrets

    with secrets._seen_lock:
        saved = set(secrets._seen)
        secrets._seen.clear()
    yield
    with secrets._seen_lock:
        secrets._seen.clear()
        secrets._seen.update(saved)


@pytest.fixture
def no_ray(monkeypatch):
    """A resume refused for its config must not get as far as the cluster."""
    import resilient_rl.runtime.cluster as cluster

    def refuse(*_a, **_k):
        raise AssertionError("the cluster was started")
    monkeypatch.setattr(cluster, "connect", refuse)
