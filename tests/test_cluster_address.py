"""A ``ray.address`` that points at nothing fails in seconds with exit 4 and a message naming the
key; ``resilient-rl chaos --dry-run`` prints its plan at once.

The addresses are a closed port and small servers that are not Ray (what a wrong port on a live
host looks like); one test checks that a real cluster's GCS passes the probe.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

from resilient_rl.cli import EXIT_RUNTIME, exit_code
from resilient_rl.errors import ClusterError, ConfigError
from resilient_rl.runtime import cluster
from resilient_rl.runtime.master_env import free_port


def closed_address() -> str:
    return f"127.0.0.1:{free_port('127.0.0.1')}"


@pytest.fixture
def serve():
    """``serve(mode)`` starts a TCP server on every interface (Ray connects to this node's IP, not
    loopback) and returns its loopback host:port. Modes: ``drop`` closes each connection, ``silent``
    holds it and says nothing, ``h2`` answers the HTTP/2 preface with a SETTINGS frame as a gRPC
    server (Ray's GCS) does."""
    servers, stop = [], threading.Event()

    def handle(conn: socket.socket, mode: str) -> None:
        with conn:
            if mode == "silent":
                stop.wait(30)
            elif mode == "h2":
                conn.settimeout(5)
                conn.recv(64)
                conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")

    def start(mode: str) -> str:
        server = socket.create_server(("", 0))
        server.settimeout(0.2)
        servers.append(server)

        def loop():
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                threading.Thread(target=handle, args=(conn, mode), daemon=True).start()

        threading.Thread(target=loop, daemon=True).start()
        return f"127.0.0.1:{server.getsockname()[1]}"

    yield start
    stop.set()
    for server in servers:
        server.close()


def test_a_closed_port_is_a_cluster_error_naming_the_key_and_the_address():
    address = closed_address()
    with pytest.raises(ClusterError, match=rf"ray.address={address}: no Ray cluster answers") as info:
        cluster.check_reachable(address, "ray.address", 1.0)
    assert exit_code(info.value) == EXIT_RUNTIME


def test_a_port_held_by_something_else_than_grpc_is_refused_at_once(serve):
    dropped, silent = serve("drop"), serve("silent")
    with pytest.raises(ClusterError, match=rf"ray.address={dropped}: .* is not a Ray cluster's GCS port \(it closed"):
        cluster.check_reachable(dropped, "ray.address", 1.0)
    with pytest.raises(ClusterError, match=rf"ray.address={silent}: no Ray cluster answers .*timed out"):
        cluster.check_reachable(silent, "ray.address", 0.5)


def test_a_grpc_server_passes_the_probe(serve):
    grpc = serve("h2")
    cluster.check_reachable(grpc, "ray.address", 2.0)
    cluster.check_reachable(f"ray://{grpc}", "ray.address", 2.0)


@pytest.mark.ray
def test_a_real_clusters_gcs_passes_the_probe(ray_cluster):
    gcs = ray_cluster.get_runtime_context().gcs_address
    cluster.check_reachable(gcs, "ray.address", 3.0)
    host, port = gcs.rsplit(":", 1)
    cluster.check_reachable(f"127.0.0.1:{port}", "ray.address", 3.0)  # Ray's own rewrite of loopback
    # A driver in another process joins it through the probe and the bounded wait.
    code = ("import ray; from resilient_rl.runtime.cluster import join; "
            f"join('127.0.0.1:{port}', 'ray.address', 3.0, namespace='rrl-tests', log_to_driver=False); "
            "print(ray.get(ray.remote(lambda: 42).remote())); ray.shutdown()")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "42"


def test_the_address_comes_from_the_config_key_before_the_environment(monkeypatch):
    from resilient_rl.config.runtime import RayConfig

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    assert cluster.cluster_address(RayConfig(address="10.0.0.8:6379")) == ("10.0.0.8:6379", "ray.address")
    assert cluster.cluster_address(RayConfig()) == ("10.0.0.9:6379", "RAY_ADDRESS")
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster.cluster_address(RayConfig()) == (None, "")
    with pytest.raises(ConfigError, match="connect_timeout_s"):
        RayConfig(connect_timeout_s=0)


def test_join_bounds_rays_own_wait_and_names_the_key_when_ray_fails(serve, monkeypatch):
    not_ray, seen = serve("h2"), {}

    def failing_init(**kwargs):
        seen["wait"] = os.environ.get("RAY_gcs_server_port_wait_time_s")
        raise ConnectionError(f"Failed to connect to Ray cluster at {kwargs['address']}")

    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    monkeypatch.setattr(cluster.ray, "init", failing_init)
    with pytest.raises(ClusterError, match=rf"RAY_ADDRESS={not_ray}: cannot join a Ray cluster there within 2.5s"):
        cluster.join(not_ray, "RAY_ADDRESS", 2.5)
    assert seen["wait"] == "3"  # attempts, about a second apart
    assert "RAY_gcs_server_port_wait_time_s" not in os.environ

    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "60")  # the operator's own budget is kept
    with pytest.raises(ClusterError):
        cluster.join(not_ray, "ray.address", 2.5)
    assert seen["wait"] == "60"


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "resilient_rl.cli", "-q", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def test_train_with_an_address_that_points_at_nothing_exits_4_naming_the_key(tmp_path):
    address = closed_address()
    proc = _cli("train", f"ray.address={address}", f"trainer.output_dir={tmp_path}/runs",
                f"checkpoint.root={tmp_path}/ckpt", cwd=tmp_path)
    assert proc.returncode == EXIT_RUNTIME, proc.stderr[-3000:]
    assert f"resilient-rl: error: ray.address={address}: no Ray cluster answers" in proc.stderr
    assert not (tmp_path / "runs").exists(), "the probe comes before the run folder is written"


def test_train_with_an_address_that_is_not_ray_exits_4_naming_the_key(tmp_path, serve):
    dropped = serve("drop")
    proc = _cli("train", f"ray.address={dropped}", f"trainer.output_dir={tmp_path}/runs",
                f"checkpoint.root={tmp_path}/ckpt", cwd=tmp_path)
    assert proc.returncode == EXIT_RUNTIME, proc.stderr[-3000:]
    assert f"resilient-rl: error: ray.address={dropped}: " in proc.stderr
    assert "is not a Ray cluster's GCS port" in proc.stderr


def test_chaos_with_an_address_that_points_at_nothing_exits_4_naming_the_flag(tmp_path):
    address = closed_address()
    proc = _cli("chaos", "somerun", "--address", address, "--dry-run", cwd=tmp_path)
    assert proc.returncode == EXIT_RUNTIME, proc.stderr[-3000:]
    assert f"--address={address}: no Ray cluster answers" in proc.stderr


def test_a_chaos_dry_run_prints_the_plan_and_the_workers_without_waiting(monkeypatch):
    from resilient_rl.faults import monkey as chaos

    workers = [chaos.Target(f"rrl_r_ab12_actor_{rank}", "actor", rank, 100 + rank, "node") for rank in range(2)]
    monkeypatch.setattr(chaos, "find_run_workers", lambda run: workers if run == "r" else [])
    slept, lines = [], []
    done = chaos.ChaosMonkey("r", interval_s=600, max_faults=3, seed=5, dry_run=True, sleep=slept.append,
                             echo=lines.append).run()
    assert slept == [] and len(done) == 3
    assert "3 fault(s) every 600s" in lines[0] and "(dry run)" in lines[0]
    assert lines[1] == "chaos: 2 live worker(s): actor rank 0 (pid 100), actor rank 1 (pid 101)"
    assert [line.split(":")[1].strip() for line in lines[2:]] == ["at +600s", "at +1200s", "at +1800s"]

    with pytest.raises(chaos.FaultError, match="no live workers of run 'other'"):
        chaos.ChaosMonkey("other", interval_s=600, max_faults=1, sleep=slept.append, echo=lines.append).run()
    assert slept == [], "a run without workers fails at once, not an interval later"


def test_the_probe_checks_the_address_ray_connects_to_not_only_loopback():
    server = socket.create_server(("127.0.0.1", 0))  # loopback only: Ray would connect to this node's IP
    try:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        if cluster._bootstrap_address(address) == address:
            pytest.skip("Ray keeps loopback addresses on this machine")
        with pytest.raises(ClusterError, match=rf"ray.address={address}: no Ray cluster answers at"):
            cluster.check_reachable(address, "ray.address", 1.0)
    finally:
        server.close()


def test_a_joining_driver_turns_ray_token_auth_on_where_a_token_is_at_hand(tmp_path, monkeypatch):
    """Ray turns token authentication on for a new local cluster when ~/.ray/auth_token exists,
    but not for a driver joining it, which the cluster then refuses; the mode a user set stands."""
    from resilient_rl import env

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert env.ray_token_auth_for_join() is False and "RAY_AUTH_MODE" not in os.environ
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 32)
    assert env.ray_token_auth_for_join() is True and os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert env.ray_token_auth_for_join() is False and os.environ["RAY_AUTH_MODE"] == "disabled"
