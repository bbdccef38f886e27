"""Connecting to Ray: a local cluster by default, an existing one when ``ray.address`` is set.

What the workers print (warnings, tracebacks) is sent to the run's ``train.log`` instead of the
driver's terminal, where it would tear the progress bar (see :mod:`resilient_rl.runtime.worker_output`).
A worker's exception still reaches the controller with its traceback and is reported there.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from typing import Callable

import ray

from resilient_rl import env
from resilient_rl.errors import ClusterError
from resilient_rl.runtime.worker_output import capture_worker_output, release_worker_output

logger = logging.getLogger(__name__)

#: ``host:port``, ``ray://host:port`` or ``[v6 host]:port`` (what ``ray.address`` allows, and ``RAY_ADDRESS``).
_HOST_PORT = re.compile(r"(?:[a-z]+://)?(?P<host>\[[^\]]+\]|[^\s:/\[\]]+):(?P<port>\d+)/?")


def cluster_address(ray_cfg) -> tuple[str | None, str]:
    """The cluster to join and what named it: ``ray.address``, else the ``RAY_ADDRESS`` environment
    variable (set by ``ray job submit`` for its entrypoint); (None, "") to start a local cluster."""
    if ray_cfg.address:
        return ray_cfg.address, "ray.address"
    address = env.ray_address()
    return (address, "RAY_ADDRESS") if address else (None, "")


def check_reachable(address: str, source: str, timeout_s: float) -> None:
    """Raise :class:`ClusterError` naming ``source`` unless a gRPC server (what Ray's GCS is)
    answers at ``address`` within ``timeout_s``.

    ``ray.init`` retries a dead address for minutes before it fails with an error that names
    neither the key nor the address; one connection attempt answers in milliseconds (refused) or
    ``timeout_s`` (an unreachable host, a server that says nothing). The address probed is the one Ray connects to
    (:func:`_bootstrap_address`: ``auto`` resolved, ``127.0.0.1`` replaced by this node's IP).
    Forms that are not host:port are left to Ray.
    """
    target = _bootstrap_address(address)
    match = _HOST_PORT.fullmatch(target)
    if match is None:
        return
    host, port = match["host"].strip("[]"), int(match["port"])
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            # Ray's GCS and client server speak gRPC: HTTP/2, whose server greets a client's
            # preface with a SETTINGS frame. Something else on the port (a dashboard's HTTP/1, a
            # server that drops the connection) would hold ray.init for about 40 s per attempt.
            # Under TLS the server waits for a TLS hello instead: the TCP connection is all we check.
            answer = None if env.ray_uses_tls() else _http2_greeting(conn, timeout_s)
    except OSError as exc:  # also a server that accepts the connection and says nothing (TimeoutError)
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise ClusterError(f"{source}={address}: no Ray cluster answers at {host}:{port} ({why} after at most "
                           f"{timeout_s:g}s); start one there (`ray start --head --port={port}`), fix {source}, "
                           f"or leave it unset to start a local cluster") from exc
    if answer is not None and answer[3:4] != _SETTINGS:
        seen = f"it answered {answer[:16]!r}" if answer else "it closed the connection"
        raise ClusterError(f"{source}={address}: {host}:{port} is not a Ray cluster's GCS port ({seen} to a gRPC "
                           f"greeting); `ray start --head` prints the address to join (port 6379 by default)")


#: HTTP/2's client connection preface, then an empty SETTINGS frame (RFC 9113, 3.4 and 6.5).
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
#: The frame type byte of SETTINGS, the first frame an HTTP/2 server sends.
_SETTINGS = b"\x04"


def _http2_greeting(conn: socket.socket, timeout_s: float) -> bytes:
    """The first bytes (a frame header: 9) the server at ``conn`` sends after HTTP/2's client
    preface; fewer, or b"", when it closes the connection. TimeoutError when it says nothing
    within ``timeout_s``."""
    conn.settimeout(timeout_s)
    try:
        conn.sendall(_PREFACE)
        answer = b""
        while len(answer) < 9:
            chunk = conn.recv(9 - len(answer))
            if not chunk:
                break
            answer += chunk
        return answer
    except (ConnectionResetError, BrokenPipeError):  # dropped while greeting: nothing Ray can talk to either
        return b""


def _bootstrap_address(address: str) -> str:
    """The host:port ``ray.init(address=...)`` connects to: Ray resolves ``auto`` (``RAY_ADDRESS``,
    the newest local cluster) and replaces a loopback host by this node's IP, so a server that
    listens on loopback only is not what Ray reaches. A Ray Client address (``ray://``) is used as
    given. Falls back to ``address`` where Ray's resolver is missing or refuses it (Ray then
    reports the error itself)."""
    if address.startswith("ray://"):
        return address
    try:  # private to Ray, but it is the very function ray.init calls
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(address) or address
    except Exception:  # noqa: BLE001 -- any failure here is Ray's to report, from ray.init
        return address


def join(address: str, source: str, timeout_s: float, **init_kwargs) -> None:
    """``ray.init`` to the cluster at ``address``: probed first (:func:`check_reachable`), Ray's
    own wait for its GCS bounded by ``timeout_s`` too (:func:`~resilient_rl.env.ray_gcs_wait`), and
    Ray's connection errors re-raised as a :class:`ClusterError` naming ``source``."""
    check_reachable(address, source, timeout_s)
    token = env.ray_token_auth_for_join()
    try:
        with env.ray_gcs_wait(timeout_s):
            ray.init(address=address, **init_kwargs)
    except (ConnectionError, TimeoutError, RuntimeError) as exc:
        if ray.is_initialized():  # half-connected: leave no driver state behind for the caller's retry
            ray.shutdown()
        auth = ("; a cluster with Ray's token authentication needs its token here (RAY_AUTH_TOKEN, or "
                "~/.ray/auth_token)" if token else "; a cluster with Ray's token authentication needs "
                "RAY_AUTH_MODE=token and its token here (RAY_AUTH_TOKEN, or ~/.ray/auth_token)")
        raise ClusterError(f"{source}={address}: cannot join a Ray cluster there within {timeout_s:g}s ({exc}); "
                           f"is it Ray's GCS port (`ray start --head` prints it, 6379 by default)? Raise "
                           f"ray.connect_timeout_s for a head that is still starting{auth}") from exc


def connect(ray_cfg) -> bool:
    """Initialise Ray for this controller; returns whether this call initialised it.

    True when it started a local cluster or connected to the one at ``ray.address``; False when
    Ray was already initialised by the caller (a test's cluster, a notebook's), which stays as it
    is. Pass the result to :func:`disconnect`.
    """
    if ray.is_initialized():
        return False
    env.fail_fast_on_dead_actors()
    address, source = cluster_address(ray_cfg)
    if address:
        join(address, source, ray_cfg.connect_timeout_s, namespace=ray_cfg.namespace, log_to_driver=True)
        capture_worker_output()
        return True
    env.limit_malloc_arenas()  # the local cluster's workers inherit it (not a joined cluster's)
    ray.init(**local_cluster_options(ray_cfg))
    capture_worker_output()
    return True


def local_cluster_options(ray_cfg, log_to_driver: bool = True) -> dict:
    """``ray.init`` arguments of a new local cluster with the ``ray`` section's resources.

    ``address="local"``: always a new cluster, never one a stale ``/tmp/ray/ray_current_cluster``
    file points at."""
    kwargs = dict(address="local", num_cpus=ray_cfg.num_cpus, include_dashboard=False, namespace=ray_cfg.namespace,
                  log_to_driver=log_to_driver, configure_logging=False)
    if ray_cfg.num_gpus is not None:
        kwargs["num_gpus"] = ray_cfg.num_gpus
    if ray_cfg.object_store_memory:
        kwargs["object_store_memory"] = ray_cfg.object_store_memory
    return kwargs


def alive_nodes() -> int:
    """Nodes of the Ray cluster this process is connected to that are alive (1 without Ray)."""
    if not ray.is_initialized():
        return 1
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def control_plane_answers(timeout_s: float = 2.0) -> bool:
    """Whether the Ray cluster this process is connected to still answers (its GCS, within
    ``timeout_s``); True without Ray. A scheduler that signals every process of a job takes the
    GCS down with the run: calls through it would then wait until Ray ends the process (after
    60 s, with exit code 1)."""
    if not ray.is_initialized():
        return True
    try:
        ray._private.worker.global_worker.gcs_client.internal_kv_exists(  # the one GCS call with a deadline
            b"rrl-probe", b"resilient-rl", timeout=timeout_s)
    except Exception:  # noqa: BLE001 -- RpcError, a timeout: it does not answer
        return False
    return True


#: How long a controller waits for a Ray control plane that stopped answering before it takes the
#: cluster for gone. Ray ends a process whose GCS stays away 60 s (its
#: ``gcs_rpc_server_reconnect_timeout_s``), with exit code 1 and nothing recorded: well before that.
CONTROL_PLANE_WAIT_S = 20.0


def control_plane_back(within_s: float = CONTROL_PLANE_WAIT_S, give_up: Callable[[], bool] = lambda: False,
                       every_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
                       sleep: Callable[[float], None] = time.sleep) -> bool:
    """Whether the Ray control plane answers now or within ``within_s`` (a GCS restarting);
    False as soon as ``give_up()`` is true (a preemption signal: the cluster went down with the
    job). Probes every ``every_s`` with short sleeps between, so the process's signal handlers run
    while it waits (a call into a GCS that is gone would block them until Ray ends the process)."""
    deadline = clock() + within_s
    while True:
        if give_up():
            return False
        if control_plane_answers(timeout_s=min(2.0, max(every_s, deadline - clock()))):
            return True
        if clock() >= deadline:
            return False
        sleep(every_s)


def disconnect(owned: bool) -> None:
    """Undo :func:`connect`; ``owned`` is what it returned.

    When ``connect`` initialised Ray, shut the connection down (and with it the local cluster it
    started; a cluster at ``ray.address`` keeps running) and give the workers' output back to Ray.
    Otherwise leave Ray to whoever initialised it.
    """
    if not owned:
        return
    if ray.is_initialized():
        ray.shutdown()
    release_worker_output()


def on_every_node(fn, *args, wait_s: float | None = None) -> None:
    """Run ``fn(*args)`` once on every live Ray node, for work on a node's own files (its
    ``/dev/shm``): on this process's node here, in this process (no worker process to start, which
    costs seconds of CPU on a small machine), and on each other node as a task needing no CPU,
    pinned to it. Outside Ray (or through Ray Client, where this process is on no node) every node
    gets the task, or, with Ray not initialised, the call runs here only. ``wait_s``: wait that
    long for the tasks (None: not waited for). Raises what ``fn`` raises here, and Ray's errors."""
    if not ray.is_initialized():
        fn(*args)
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = None if ray.util.client.ray.is_connected() else ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != here]
    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args)
            for node in others]
    if here is not None:
        fn(*args)
    if refs and wait_s is not None:
        ray.get(refs, timeout=wait_s)
