"""Connecting the controller to Ray: a cluster the caller set up is left to the caller."""

from __future__ import annotations

import pytest

from resilient_rl.config.schema import load_config
from resilient_rl.runtime import cluster
from resilient_rl.runtime.cluster import connect, disconnect
from resilient_rl.testing.clock import FakeClock


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


def test_a_live_control_plane_answers(ray_cluster):
    assert cluster.control_plane_answers() and cluster.control_plane_back(0.0)


@pytest.mark.parametrize("answers, back, waited", [
    ([True], True, 0.0),                          # answers: no wait
    ([False, False, True], True, 1.0),            # a GCS restarting: waited for
    ([False] * 100, False, 20.0),                 # gone: given up at the bound
])
def test_a_silent_control_plane_is_waited_for_up_to_the_bound(monkeypatch, answers, back, waited):
    script = iter(answers)
    monkeypatch.setattr(cluster, "control_plane_answers", lambda timeout_s: next(script))
    clock = FakeClock(start=0.0)
    assert cluster.control_plane_back(20.0, clock=clock, sleep=clock.sleep) is back
    assert clock.now == waited


def test_a_preemption_signal_ends_the_wait_at_once(monkeypatch):
    """The job's own signal took the cluster down: nothing will come back; the signal is acted on."""
    probes = []
    monkeypatch.setattr(cluster, "control_plane_answers", lambda timeout_s: probes.append(timeout_s) or False)
    clock = FakeClock(start=0.0)
    assert not cluster.control_plane_back(20.0, give_up=lambda: len(probes) >= 2, clock=clock, sleep=clock.sleep)
    assert len(probes) == 2 and clock.now == 1.0  # no probe after the signal
