"""Health of worker groups: probes that answer while a rank is busy, killing hung ranks,
waiting for Ray to restart dead ones, and telling a broken collective from a bug.

Every rank is probed with ``health()`` (:class:`~resilient_rl.runtime.worker.RankWorker`'s health
protocol). A class that declares ``answers_during_calls`` answers from its own thread
(``@ray.remote(concurrency_groups=HEALTH_GROUPS)``), so a rank blocked in a collective (waiting
on a stopped peer) still answers and only the stopped rank is killed; other classes may look
hung while a long call runs. Such classes also declare ``call_off_rendezvous`` and
``leave_collectives`` in that group, so a rendezvous a peer failed in can be called off.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable

import ray
from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, RayTaskError

from resilient_rl.errors import CollectiveError, DeviceMemoryError, WorkerDiedError, WorkerError
from resilient_rl.process_state import process_alive
from resilient_rl.runtime import deadline_call
from resilient_rl.runtime.worker_group_spares import rehome

logger = logging.getLogger(__name__)

#: How long a probe waits for a read from Ray's control plane before it takes "no answer" (a
#: control plane gone with the job would block it for a minute: :mod:`.deadline_call`).
READ_WITHIN_S = 2.0

#: The concurrency groups such classes declare: ``@ray.remote(concurrency_groups=HEALTH_GROUPS)``:
#: "health" for health calls, "snapshot" for keeping the ring neighbours' snapshot copies (a call
#: that may wait for a neighbour; see ``HeldSnapshots.hold_snapshot``).
HEALTH_GROUPS = {"health": 1, "snapshot": 1}


@ray.remote(num_cpus=0)
def _sigkill(pid: int) -> None:
    import os
    import signal

    os.kill(pid, signal.SIGKILL)


def kill_process(pid: int, node_id: str) -> None:
    """SIGKILL ``pid`` on node ``node_id`` (directly when it is this node, else by a task pinned there)."""
    import os
    import signal

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        local = ray.get_runtime_context().get_node_id() == node_id
    except Exception:
        local = False
    if local:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    try:
        ray.get(_sigkill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(pid),
                timeout=30)
    except Exception as exc:  # the node may be gone with the process
        logger.warning("could not kill pid %d on node %s: %s", pid, node_id, exc)


def node_answers(node_id: str, timeout_s: float = 1.0) -> bool:
    """Whether node ``node_id``'s raylet accepts a connection now: False for a node Ray lists as
    dead or not at all, or whose raylet refuses or does not answer within ``timeout_s``, and when
    Ray's control plane does not answer within :data:`READ_WITHIN_S`.

    Ray marks a lost node dead only after its health checks fail for seconds; its raylet's port
    tells at once (a killed raylet refuses the connection; a machine that went away does not answer)."""
    nodes = deadline_call.within("nodes", ray.nodes, READ_WITHIN_S, otherwise=[])
    record = next((n for n in nodes if n.get("NodeID") == node_id), None)
    if record is None or not record.get("Alive"):
        return False
    try:
        with socket.create_connection((record["NodeManagerAddress"], int(record["NodeManagerPort"])), timeout_s):
            return True
    except (OSError, KeyError, ValueError):
        return False


def process_gone(pid: int, node_id: str | None) -> bool:
    """Whether process ``pid`` of node ``node_id`` has exited (or is a zombie), as far as this
    node can see: False for a process on another node (Ray tells of those)."""
    try:
        if ray.get_runtime_context().get_node_id() != node_id:
            return False
    except Exception:
        return False
    return not process_alive(pid)




#: What ``ray.get`` of a worker call's result raises when the call failed: mapped by :func:`classify_error`.
CALL_ERRORS = (RayActorError, RayTaskError, ObjectLostError, NodeDiedError)


def classify_error(exc: BaseException, group: str, rank: int) -> WorkerError:
    """Map an exception raised by ``ray.get`` on rank ``rank`` of ``group`` to the project's error tree.

    A result lost with the node that held it (the call ended, then its node went away before the
    result was read: Ray cannot re-run an actor's call) is the node's loss, which a recovery
    replays; left untyped it would reach the controller as a library exception and end the run."""
    where = f"{group} rank {rank}"
    if isinstance(exc, RayActorError):
        return WorkerDiedError(f"{where} died: {exc}", role=group, rank=rank, cause="died")
    if isinstance(exc, (ObjectLostError, NodeDiedError)):
        return WorkerError(f"{where}: its result was lost with its node: {exc}", role=group, rank=rank,
                           cause="node_lost")
    if isinstance(exc, RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        if isinstance(cause, CollectiveError):  # typed in the worker (runtime.leave_collective)
            return CollectiveError(f"{where}: collective failed: {cause}", role=group, rank=rank, cause="collective")
        if isinstance(cause, DeviceMemoryError):  # typed in the worker (workers.out_of_memory)
            return DeviceMemoryError(f"{where} {cause}", role=group, rank=rank)
        return WorkerError(f"{where} raised {type(cause).__name__}: {cause}", role=group, rank=rank, cause="exception")
    return WorkerError(f"{where}: {exc}", role=group, rank=rank, cause="unknown")


def _actor_record(actor) -> dict:
    """The GCS's record of ``actor`` (state, pid, restarts); empty when it cannot be read."""
    try:
        return deadline_call.within("actor-record", lambda: ray._private.state.actors(actor._actor_id.hex()),
                                    READ_WITHIN_S, otherwise={}) or {}
    except Exception:  # the GCS may be briefly unreachable: nothing known
        return {}


def dead_for_good(actor) -> bool:
    """Whether Ray has given up on ``actor`` (state DEAD: no restarts left, or killed for good)."""
    return _actor_record(actor).get("State") == "DEAD"


def replaced(actor, pid: int) -> bool:
    """Whether Ray already runs ``actor`` in a process other than ``pid`` (it restarted it)."""
    record = _actor_record(actor)
    return record.get("State") == "ALIVE" and record.get("Pid") not in (None, pid)


def answers_during_calls(group) -> bool:
    """Whether the ranks of ``group`` (a :class:`RayWorkerGroup`) answer health calls while a call
    runs: its worker class declares ``answers_during_calls`` (see RankWorker's health protocol)."""
    init = getattr(group, "ray_cls_with_init", None)
    cls = init.cls if init is not None else None
    cls = getattr(cls, "__ray_actor_class__", cls)  # the Python class behind Ray's actor class
    return bool(cls is not None and getattr(cls, "answers_during_calls", False))


def probe(group, timeout_s: float = 2.0, gone: Callable[[int], bool] | None = None) -> dict[int, object]:
    """Health of every rank of ``group`` (a :class:`RayWorkerGroup`) without waiting behind running
    calls where the class allows it.

    Returns rank -> WorkerInfo, or the exception (died, unavailable) or None (no answer within
    ``timeout_s``: hung, stopped, or queued behind a long call on a class without a health group).
    ``gone(rank)`` says a rank's process is known to have exited: its probe is not waited for
    (Ray takes a second or more to report a death; a SIGKILLed process is gone at once).
    """
    refs = [w.health.remote() for w in group.workers]
    index = {ref: rank for rank, ref in enumerate(refs)}
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=len(pending),
                                  timeout=min(remaining, 0.05) if gone else remaining)
        for ref in ready:
            try:
                out[index[ref]] = ray.get(ref)
            except Exception as exc:  # died or restarting
                out[index[ref]] = exc
        if gone is not None:
            for ref in [r for r in pending if gone(index[r])]:
                pending.remove(ref)
                out[index[ref]] = WorkerDiedError(f"{group.name_prefix} rank {index[ref]}: its process exited",
                                                  role=group.name_prefix, rank=index[ref], cause="died")
    for ref in pending:
        out[index[ref]] = None
    return dict(sorted(out.items()))


def leave_collectives(group, ranks: list[int], reason: str) -> None:
    """Tell ``ranks`` of ``group`` to leave their collectives (their health thread hears it while
    a call is blocked; see :mod:`resilient_rl.runtime.leave_collective`). Not waited for."""
    for rank in ranks:
        try:
            group.workers[rank].leave_collectives.remote(reason)
        except Exception:  # noqa: BLE001 -- a dead handle: it is in no collective
            pass


def kill_rank(group, rank: int, pid: int, node_id: str) -> None:
    """SIGKILL rank ``rank``'s process (a hung or stopped one); Ray then restarts the actor."""
    kill_process(pid, node_id)
    logger.warning("%s rank %d (pid %d) killed so that Ray restarts it", group.name_prefix, rank, pid)


def permanently_dead(group) -> list[int]:
    """Ranks of ``group`` whose actor Ray has given up on (state DEAD: no restarts left)."""
    return [rank for rank, w in enumerate(group.workers) if dead_for_good(w)]


def wait_alive(group, timeout_s: float, while_waiting: Callable[[], None] | None = None) -> list:
    """Wait until every rank of ``group`` answers a ping (restarted actors included);
    WorkerDiedError past ``timeout_s``. ``while_waiting`` is called before each try (every few
    seconds at most)."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        if while_waiting is not None:
            while_waiting()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorkerDiedError(f"{group.name_prefix}: not every rank came back within {timeout_s:g}s: {last}",
                                  role=group.name_prefix, rank=getattr(last, "rank", None), cause="died")
        try:
            return group.ping(timeout_s=min(remaining, 5.0))
        except (WorkerError, RayActorError) as exc:
            last = exc
            # A rank whose warm spare Ray gave up on goes back to its own bundle's process.
            dead = rehome(group, permanently_dead(group))
            if dead:
                spent = "killed for good" if group.max_restarts < 0 else f"max_restarts={group.max_restarts} spent"
                raise WorkerDiedError(f"{group.name_prefix} rank {dead[0]} is dead and Ray will not restart it "
                                      f"({spent})", role=group.name_prefix,
                                      rank=dead[0], cause="exhausted") from exc
            time.sleep(0.2)
