"""Environment variables read by resilient-rl, in one place.

Nothing else in the package reads ``os.environ`` for configuration; other modules ask here.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator


def get(name: str, default: str | None = None) -> str | None:
    """Return the value of environment variable ``name`` (or ``default``)."""
    return os.environ.get(name, default)


def cuda_visible_devices() -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of entries (indices or UUIDs), None when unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


#: The variables torch's caching allocator reads its settings from, the first one set winning.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def alloc_conf() -> tuple[str, str] | None:
    """The caching allocator's settings as the user gave them: ``(variable, value)`` of the first
    of :data:`ALLOC_CONF_VARS` that is set and not empty; None when none is."""
    for name in ALLOC_CONF_VARS:
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return None


def ray_address() -> str | None:
    """``RAY_ADDRESS``: an existing cluster to join, if the user set one."""
    return os.environ.get("RAY_ADDRESS") or None


def log_level() -> str:
    """``RRL_LOG_LEVEL`` (default INFO)."""
    return os.environ.get("RRL_LOG_LEVEL", "INFO").upper()


def mlflow_tracking_uri() -> str | None:
    """``MLFLOW_TRACKING_URI``: the MLflow server or store the ``mlflow`` logger uses, if the user set one."""
    return os.environ.get("MLFLOW_TRACKING_URI") or None


def allow_mlflow_file_store() -> None:
    """Let mlflow use a local file store (``MLFLOW_ALLOW_FILE_STORE=true``) unless the user decided otherwise."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def fail_fast_on_dead_actors() -> None:
    """Have Ray fail a call to an actor whose process died at once, unless the user decided
    otherwise (``RAY_timeout_ms_task_wait_for_death_info=0``).

    By default Ray holds such a call for up to a second, waiting for the death to be reported,
    then fails it with the same ``ActorUnavailableError`` anyway: a rank that dies inside a call
    with no peer to notice (a world of one, a rollout generating) was found 1.2 s after its death
    here, 6 ms with this. Read when this process connects to Ray (set it before ``ray.init``);
    the processes of a local cluster it starts inherit it."""
    os.environ.setdefault("RAY_timeout_ms_task_wait_for_death_info", "0")


#: glibc malloc arenas of the processes of a local cluster (``MALLOC_ARENA_MAX``), see below.
MALLOC_ARENAS = "2"


def limit_malloc_arenas() -> None:
    """Cap the glibc malloc arenas of the processes of a local cluster this process starts (they
    inherit it), unless the user set ``MALLOC_ARENA_MAX``.

    glibc gives the threads of a process up to 8 arenas per core, and memory freed in one arena
    is reused only by allocations made there. A worker that survives a recovery frees its engine
    and builds the next one while its threads change (the old process group's go, the new one's
    come): each recovery left about 0.3 MB more free-but-resident memory in its arenas (in-use
    bytes flat; ``bench/recovery_memory.py``), with 2 arenas none. glibc reads it when a process
    starts: ``mallopt`` from a running Ray worker comes too late (its arenas exist by then). Set it
    before ``ray.init``; on a cluster started by ``ray start``, set it in the nodes' environment."""
    os.environ.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENAS)


def ray_uses_tls() -> bool:
    """``RAY_USE_TLS``: Ray's gRPC connections are encrypted (Ray reads it too)."""
    return os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true")


#: Ray's count of GCS connection attempts (about a second apart) when a driver joins a cluster.
RAY_GCS_WAIT = "RAY_gcs_server_port_wait_time_s"


@contextlib.contextmanager
def ray_gcs_wait(timeout_s: float) -> Iterator[None]:
    """Within the block, a driver joining a cluster gives up on a GCS that does not answer after
    about ``timeout_s`` seconds, not Ray's 20 attempts (a port held by something that is not Ray:
    the dashboard's 8265, a proxy), unless the user set ``RAY_gcs_server_port_wait_time_s``.
    Ray reads it when the driver connects; it is removed afterwards, so a local cluster started
    later in this process waits for its GCS as long as Ray's default."""
    if RAY_GCS_WAIT in os.environ:
        yield
        return
    os.environ[RAY_GCS_WAIT] = str(max(1, math.ceil(timeout_s)))
    try:
        yield
    finally:
        os.environ.pop(RAY_GCS_WAIT, None)


RAY_AUTH_MODE = "RAY_AUTH_MODE"


def ray_token_auth_for_join() -> bool:
    """Turn Ray's token authentication on for a driver about to join a cluster, where
    ``RAY_AUTH_MODE`` is unset and a token is at hand (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``
    or ``~/.ray/auth_token``); returns whether it is on.

    Ray turns it on by itself for a new local cluster when a token exists (and writes one when
    none does), but not for a driver joining one: a controller's cluster started on this machine
    then refused ``resilient-rl chaos`` and any other joining driver with ``InvalidAuthToken``,
    reported only as a connection that timed out. A token sent to a cluster without
    authentication is not checked, so turning it on never stops a join that would work."""
    mode = os.environ.get(RAY_AUTH_MODE)
    if mode is not None:
        return mode.strip().lower() == "token"
    token_at_hand = bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")) or \
        os.path.exists(os.path.join(os.path.expanduser("~"), ".ray", "auth_token"))
    if token_at_hand:
        os.environ[RAY_AUTH_MODE] = "token"
    return token_at_hand


#: Opt-in for the chaos suite's fault-injecting ``faulty://`` filesystem (never on in production).
FAULT_INJECTION = "RRL_FAULT_INJECTION"


def fault_injection() -> bool:
    """``RRL_FAULT_INJECTION``: whether this process may open ``faulty://`` storage URLs."""
    return os.environ.get(FAULT_INJECTION, "").strip().lower() not in ("", "0", "false", "no")


#: fsspec implementations a process registers only when opted in, by protocol: the class path
#: (fsspec imports it on first use), so storage code never imports the fault injectors.
OPT_IN_FILESYSTEMS = {"faulty": "resilient_rl.faults.storage.FaultyFileSystem"}


def opt_in_filesystems() -> dict[str, str]:
    """The opt-in fsspec implementations this process may register (none unless
    ``RRL_FAULT_INJECTION`` is set)."""
    return dict(OPT_IN_FILESYSTEMS) if fault_injection() else {}
