"""A rendezvous that can be called off: the store of a process-group generation, and a barrier
every rank passes before torch builds the group on it.

``torch.distributed.init_process_group`` waits for every peer inside C++ until its timeout: a rank
that died while the group formed leaves the others blocked there, and the next generation's
rendezvous queues behind that call. Here each rank first joins the generation's ``TCPStore``
(hosted by rank 0) and waits until every rank has arrived, in a loop that gives up as soon as the
controller calls the generation off (:func:`call_off`, sent from the worker's health thread) or
its deadline passes. Only once every rank is there does torch build the group, which then does
not wait for anyone.

A rank connects to the store only once rank 0's port accepts connections: torch's client, started
before the server listens, backs off for about half a second before it tries again, and in a
recovery the ranks reach the rendezvous at nearly the same time, so that wait would be paid in most
rejoins.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time

import torch.distributed as dist

from resilient_rl.errors import CollectiveError

__all__ = ["call_off", "join_store"]

_ARRIVED = "rrl/arrived"
_POLL_S = 0.01
_CONNECT_TRY_S = 1.0

_LOCK = threading.Lock()
_CALLED_OFF = {"generation": -1}  # every rendezvous of this generation or an older one is off


def call_off(generation: int) -> None:
    """Call off this process's rendezvous of ``generation`` (and of any older one): a rank
    waiting for its peers there gives up within milliseconds."""
    with _LOCK:
        _CALLED_OFF["generation"] = max(_CALLED_OFF["generation"], int(generation))


def _check(generation: int, rank: int, deadline: float, timeout_s: float, waiting_for: str) -> None:
    with _LOCK:
        off = generation <= _CALLED_OFF["generation"]
    if off:
        raise CollectiveError(f"rank {rank}: the rendezvous of generation {generation} was called off "
                              f"while waiting for {waiting_for} (a peer failed)", rank=rank, cause="collective")
    if time.monotonic() > deadline:
        raise CollectiveError(f"rank {rank}: the rendezvous of generation {generation} timed out after "
                              f"{timeout_s:.0f}s waiting for {waiting_for}", rank=rank, cause="collective")


def _listening(addr: str, port: int) -> bool:
    """Whether ``addr:port`` accepts a TCP connection now."""
    try:
        with socket.create_connection((addr, port), timeout=_CONNECT_TRY_S):
            return True
    except OSError:
        return False


def join_store(generation: int, addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The generation's store, once all ``world_size`` ranks have joined it; rank 0 hosts it.

    Raises :class:`CollectiveError` when the generation is called off or ``timeout_s`` passes
    first (a peer died or never came), or when rank 0's store is gone."""
    deadline = time.monotonic() + timeout_s
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(addr, port, world_size, True, timeout=timeout, wait_for_workers=False)
    else:
        while True:  # rank 0 may not host it yet: connect once it listens, checking in between
            _check(generation, rank, deadline, timeout_s, f"rank 0's store at {addr}:{port}")
            if not _listening(addr, port):
                time.sleep(_POLL_S)
                continue
            try:
                store = dist.TCPStore(addr, port, world_size, False,
                                      timeout=datetime.timedelta(seconds=_CONNECT_TRY_S), wait_for_workers=False)
                break
            except (RuntimeError, dist.DistError):
                continue
        store.set_timeout(timeout)
    try:
        store.add(_ARRIVED, 1)
        while store.add(_ARRIVED, 0) < world_size:
            _check(generation, rank, deadline, timeout_s, "its peers")
            time.sleep(_POLL_S)
    except (RuntimeError, dist.DistError) as exc:  # rank 0, and its store, went away
        raise CollectiveError(f"rank {rank}: the store of generation {generation} at {addr}:{port} failed: {exc}",
                              rank=rank, cause="collective") from exc
    return store
