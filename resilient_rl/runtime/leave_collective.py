"""Leaving a broken collective at once, on every rank, instead of after the group's timeout.

When a rank dies inside a collective, only the ranks that exchange bytes with it directly see
its sockets close. A gloo ring all-reduce over four ranks makes this plain: the dead rank's two
neighbours raise at once, but a third rank waits on a neighbour that is alive and has already
left the call, and waits for the group's whole timeout (``recovery.collective_timeout_s``). A
survivor that raised also keeps its own sockets open (its process group lives on until the next
generation's rendezvous), so nothing tells that third rank. Neither ``ProcessGroupGloo.abort``
nor ``shutdown`` closes the sockets (torch 2.13; both return at once and the peer still waits),
and destroying the group closes them only when nothing else holds it (an FSDP2 device mesh does).

So this process remembers which sockets its process groups opened (:func:`recording`, around
every group creation) and :func:`leave_collectives` shuts them down: every peer inside a call
with this rank then sees its connection closed and raises at once, and so on around the group.
It runs in two places:

- in the worker, when a call ends with a collective error (``runtime.dispatch``): the cascade
  reaches every rank of the group within milliseconds, with no controller round trip;
- from the controller, through the rank's health thread, for survivors still inside a call once
  recovery knows a rank is dead (:meth:`~resilient_rl.recovery.recovering.Recovering`): a
  machine that vanishes sends no FIN, so nothing else would end their wait.

On NCCL, ``abort`` is the communicator's own way out and is used instead. Where ``/proc`` is
missing (not Linux), no socket is known and recovery falls back to killing the stuck survivors
after ``recovery.hang_timeout_s``.

A socket is counted as the group's when it appeared while the group was being created, is TCP,
is not listening, and is not an accepted connection on a port this process listened on before
(the worker's own Ray server). An unrelated connection opened by another thread in that window
may be counted too; shutting it down costs one failed remote call on a path that already
recovers from a failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from typing import Callable, Iterator

import torch.distributed

from resilient_rl.errors import CollectiveError

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
#: The process group a socket or abort belongs to when none is named: torch's default group and
#: its subgroups (a 2-D mesh's), which one rendezvous joins and one destroy ends.
PROCESS_GROUP = "process group"
_OWNED: dict[int, str] = {}  # socket inode -> the group (PROCESS_GROUP, "weight channel") that opened it
_LEFT: set[str] = set()  # the groups this process left since it last joined them

_MARKERS = ("gloo", "nccl", "connection reset by peer", "connection closed by peer", "broken pipe",
            "socket timeout", "timed out waiting for")


def collective_error(exc: BaseException, rank: int | None = None) -> CollectiveError | None:
    """``exc`` typed as a :class:`~resilient_rl.errors.CollectiveError` where it is a collective's
    failure (a peer died, left or hung), None for any other error (a bug in the method is not a
    peer's failure). Called where a worker's call ends (:mod:`resilient_rl.runtime.dispatch`), so
    the controller only checks the type: torch's distributed errors (``DistError``: backend,
    network, store) and the errors a backend's transport raises as plain ``RuntimeError`` or
    ``OSError`` naming it (gloo's "Connection closed by peer", NCCL's, a socket timeout)."""
    if isinstance(exc, CollectiveError):
        return exc
    dist_error = getattr(torch.distributed, "DistError", ())
    text = str(exc).lower()
    if isinstance(exc, dist_error) or (isinstance(exc, (RuntimeError, OSError)) and any(m in text for m in _MARKERS)):
        return CollectiveError(f"rank {rank}: collective failed: {type(exc).__name__}: {exc}", rank=rank,
                               cause="collective")
    return None


def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) of this process's network namespace's TCP sockets."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{name}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            local, remote, state, inode = parts[1], parts[2], parts[3], int(parts[9])
            table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return table


def _socket_fds() -> dict[int, int]:
    """inode -> file descriptor of this process's open sockets."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(fd)
    return out


_LISTEN = "0A"  # /proc/net/tcp state code of a listening socket


@contextlib.contextmanager
def recording(group: str = PROCESS_GROUP) -> Iterator[None]:
    """Count the TCP connections opened inside this block as ``group``'s (see the module
    docstring for which ones)."""
    before = set(_socket_fds())
    listening = {lp for lp, _, state in _tcp_table().values() if state == _LISTEN}
    try:
        yield
    finally:
        table = _tcp_table()
        new = {inode for inode in set(_socket_fds()) - before
               if inode in table and table[inode][2] != _LISTEN and table[inode][0] not in listening}
        with _LOCK:
            _OWNED.update(dict.fromkeys(new, group))


def forget(group: str | None = None) -> None:
    """``group`` is gone (destroyed; None: every group): its sockets are not counted any more,
    and the group this process joins next in its place has not been left."""
    with _LOCK:
        for inode in [i for i, g in _OWNED.items() if group in (None, g)]:
            del _OWNED[inode]
        if group is None:
            _LEFT.clear()
        else:
            _LEFT.discard(group)


def has_left() -> bool:
    """Whether this process left a group's collectives (:func:`leave_collectives` shut its
    connections down or aborted its communicator) that it has not joined again since: the
    process's worker group must join a new generation before its next collective, whichever
    group's failure it left for (a sync that fails in the split placement leaves the actor's
    and the rollout's)."""
    with _LOCK:
        return bool(_LEFT)


def owned() -> int:
    """How many of the groups' sockets are open now."""
    with _LOCK:
        return len(_OWNED.keys() & set(_socket_fds()))


#: How ProcessGroupNCCL's watchdog meets a collective's error or timeout: ``2`` aborts the
#: communicators (every pending NCCL call then ends with an error) and leaves the process alone.
#: torch's default, ``3``, ends the process from the watchdog thread instead: a survivor of a dead
#: peer (across nodes NCCL sees the peer's sockets close) or a rank left waiting past
#: ``recovery.collective_timeout_s`` would die rather than raise, as it does on gloo, and cost a
#: restart. Both names torch reads are honoured where a user has set one.
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
_NCCL_ERROR_HANDLING_NAMES = (*NCCL_ERROR_HANDLING, "NCCL_ASYNC_ERROR_HANDLING")  # and its older name


def survive_nccl_errors() -> None:
    """Called before this process creates an NCCL group (torch reads the variable then): its
    collectives' errors and timeouts raise in the process instead of ending it
    (:data:`NCCL_ERROR_HANDLING`), unless the user chose otherwise."""
    if not any(name in os.environ for name in _NCCL_ERROR_HANDLING_NAMES):
        os.environ.update(NCCL_ERROR_HANDLING)


def uses_nccl(backend: str) -> bool:
    """Whether a process group's backend string has NCCL in it.

    ``get_backend()`` returns the string the group was created with, so a GPU group made as
    ``"cpu:gloo,cuda:nccl"`` never equals ``"nccl"``: each ``device:backend`` part is read.
    """
    return any(part.strip().rpartition(":")[2].strip() == "nccl" for part in str(backend).lower().split(","))


def abort_nccl() -> bool:
    """Abort this process's NCCL communicators (every pending NCCL call raises); False, doing
    nothing, when there is no group or it has no NCCL part."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not uses_nccl(dist.get_backend()) \
            or not hasattr(dist.distributed_c10d, "_abort_process_group"):
        return False
    dist.distributed_c10d._abort_process_group()
    return True


#: NCCL groups of this process outside torch's default one (the weight channel) -> their abort.
_ABORTS: dict[str, Callable[[], None]] = {}


def abort_on_leave(name: str, abort: Callable[[], None] | None) -> None:
    """Have :func:`leave_collectives` also call ``abort`` for the NCCL group ``name`` that is not
    torch's default group (None: the group is gone). ``abort`` runs on whichever thread leaves,
    while a call may be blocked in the group: it must take no lock that call holds."""
    with _LOCK:
        if abort is None:
            _ABORTS.pop(name, None)
        else:
            _ABORTS[name] = abort


def leave_collectives(reason: str = "") -> int:
    """End every collective this process is in, and the peers' waits on it: abort NCCL
    communicators, shut down the groups' sockets. Returns the number of sockets shut down.
    Safe to call from any thread, more than once, and with no group."""
    left: set[str] = set()
    try:
        if abort_nccl():
            left.add(PROCESS_GROUP)
    except Exception as exc:  # noqa: BLE001 -- a half-gone group: the sockets below still close
        left.add(PROCESS_GROUP)
        logger.warning("aborting the NCCL communicator raised %s", exc)
    with _LOCK:
        aborts = list(_ABORTS.items())
    for name, abort in aborts:
        left.add(name)
        try:
            abort()
        except Exception as exc:  # noqa: BLE001 -- the others, and the sockets, still end
            logger.warning("aborting the %s raised %s", name, exc)
    fds = _socket_fds()
    with _LOCK:
        targets = [fds[i] for i in _OWNED if i in fds]
        left.update(_OWNED.values())  # also where gloo closed the sockets already (a peer's failure)
        _LEFT.update(left)
    closed = 0
    for fd in targets:
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            with socket.socket(fileno=dup) as s:
                s.shutdown(socket.SHUT_RDWR)
                closed += 1
        except OSError:
            pass  # already closed by the peer or by gloo
    if closed:
        logger.warning("left the process group's collectives (%d connections shut down)%s", closed,
                       f": {reason}" if reason else "")
    return closed
