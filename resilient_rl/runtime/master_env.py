"""The ``MASTER_ADDR``/``MASTER_PORT`` a rank finds in its environment before its ``__init__``.

A verl worker may call ``torch.distributed.init_process_group()`` (env://) in its constructor, so
every rank must know rank 0's address and a free port there before any constructor runs. The
ranks of a group start all at once (no rank waits for another's process to start), so rank 0's
process picks the port on its own node and publishes it in the cluster's key-value store under
the group's key; the other ranks read it there before their constructors run.

Rank 0 publishes again whenever its constructor runs again (Ray restarting it, or a spare taking
its place), so a rank restarted after it reads the new master. The controller's own rendezvous
(:meth:`Worker.rendezvous`) refreshes these variables on every rank of each new generation.
"""

from __future__ import annotations

import socket
import time

from resilient_rl.errors import WorkerError

#: Identity keys: the group's store key, and "1" on the rank that publishes (rank 0).
KEY = "RRL_MASTER_KEY"
PUBLISH = "RRL_MASTER_PUBLISH"
_NAMESPACE = "rrl_master"


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` of this node right now ("": every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def resolve(identity: dict[str, str], node_ip: str, timeout_s: float = 300.0) -> dict[str, str]:
    """``identity`` with ``MASTER_ADDR``/``MASTER_PORT`` filled in (published by rank 0, or read)."""
    key = identity.get(KEY)
    if not key or "MASTER_ADDR" in identity:
        return identity
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

    if identity.get(PUBLISH) == "1":
        value = f"{node_ip}:{free_port()}"
        _internal_kv_put(key, value, overwrite=True, namespace=_NAMESPACE)
    else:
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            raw = _internal_kv_get(key, namespace=_NAMESPACE)
            if raw:
                value = raw.decode()
                break
            if time.monotonic() >= deadline:
                raise WorkerError(f"rank {identity.get('RANK')} of group {identity.get('RRL_WORKER_GROUP')!r}: rank 0 "
                                  f"did not publish MASTER_ADDR/MASTER_PORT within {timeout_s:g}s",
                                  rank=int(identity.get("RANK", 0)))
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
    addr, port = value.rsplit(":", 1)
    return {**identity, "MASTER_ADDR": addr, "MASTER_PORT": port}


def forget(key: str) -> None:
    """Drop a group's entry (the group was shut down)."""
    try:
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_initialized

        if _internal_kv_initialized():
            _internal_kv_del(key, namespace=_NAMESPACE)
    except Exception:  # noqa: BLE001 -- the cluster is gone: so is the entry
        pass
