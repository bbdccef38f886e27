"""Waiting on a worker group's calls: the results in rank order, failing fast on the first error,
and the calls a failed wait leaves behind.

A wait watches the ranks still running for liveness (:class:`~resilient_rl.runtime.liveness.LivenessWatch`)
under a ceiling on the whole wait, and classifies an error crossing the Ray boundary into the
project's errors, naming the group and the rank (:func:`~resilient_rl.runtime.health.classify_error`).

When a wait fails fast, the other ranks' calls run on, and nobody waits for them. Ray logs an
error result that is freed unread as "Unhandled error", with its trace, on the driver's console.
Such calls often fail in turn after the failure was handled (a survivor told to leave its
collectives raises CollectiveError), so their traces would come long after the recovery that
handled them, and read like a second failure. :class:`AbandonedCalls` reads them once they end.
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from resilient_rl.errors import WorkerTimeoutError
from resilient_rl.runtime.ended_calls import read_ended
from resilient_rl.runtime.health import classify_error
from resilient_rl.runtime.liveness import LivenessWatch


def wait_results(refs: list, role: str, timeout_s: float | None, watch: LivenessWatch | None,
                 read: set) -> list:
    """The results of ``refs`` (one per rank of ``role``, in rank order); each ref read goes into
    ``read``, so that a caller knows which were left unread when this raises.

    WorkerTimeoutError with cause "hang" names a rank ``watch`` judged hung; with cause "timeout",
    the ranks still running when ``timeout_s`` passed.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    index = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    pending = list(refs)
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        wait_s = remaining if watch is None else min(watch.poll_interval_s, remaining or watch.poll_interval_s)
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        for ref in ready:
            read.add(ref)
            # Keep the value: fetching it again would deserialize (and copy) every result twice.
            try:
                results[index[ref]] = ray.get(ref, timeout=0)
            except (RayActorError, RayTaskError) as exc:
                raise classify_error(exc, role, index[ref]) from exc
            except GetTimeoutError:  # pragma: no cover - ready refs do not time out
                read.discard(ref)
                pending.append(ref)
        if not pending:
            break
        if watch is not None:
            hung = watch.poll(index[r] for r in pending)
            if hung is not None:
                raise WorkerTimeoutError(f"{role} rank {hung.rank} is hung: {hung.detail}", role=role,
                                         rank=hung.rank, cause="hang", pid=hung.pid, hang_kind=hung.kind,
                                         stalled_s=hung.stalled_s)
        if not ready and deadline is not None and time.monotonic() >= deadline:
            ranks = sorted(index[r] for r in pending)
            raise WorkerTimeoutError(f"{role}: rank(s) {ranks} did not finish within the {timeout_s:g}s ceiling",
                                     role=role, rank=ranks[0], cause="timeout")
    return results


class AbandonedCalls:
    """Calls nobody will wait for any more, each read (its result or error dropped) once it ends.

    Reading is never waited for: :meth:`read` takes what has ended and keeps the rest, and a group
    calls it at each of its waits. A call on an actor that is killed ends with the actor's death,
    which Ray does not log as unhandled.
    """

    def __init__(self) -> None:
        self.refs: list = []

    def add(self, refs) -> None:
        self.refs.extend(refs)

    def read(self) -> int:
        """Read the calls that have ended; how many still run."""
        # Their errors are what the failed wait handled, or what followed from it.
        _, self.refs = read_ended(self.refs)
        return len(self.refs)
