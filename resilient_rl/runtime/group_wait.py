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
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError

from resilient_rl.errors import WorkerTimeoutError
from resilient_rl.runtime.ended_calls import read_ended
from resilient_rl.runtime.health import CALL_ERRORS, classify_error
from resilient_rl.runtime.liveness import LivenessWatch


@dataclass
class Waited:
    """One group's call in a wait: its refs (one per rank), the group's name, its liveness watch
    (None: not watched), and where the refs a failed wait leaves unread go (None: nowhere)."""

    refs: list
    role: str
    watch: LivenessWatch | None
    abandoned: AbandonedCalls | None = None


def wait_calls(calls: list[Waited], timeout_s: float | None) -> list[list]:
    """Each call's results (one per rank, in rank order), waiting on all of them at once: the
    first error of any call raises at once (classified under its group), and every call's ranks
    are watched while they run. Calls whose ranks wait on each other (a collective spans their
    groups) are waited for this way, so that one group's dead rank is not hidden behind a wait on
    the other's blocked ranks. When the wait fails, each call's unread refs go to its ``abandoned``
    (the other ranks' calls run on).

    WorkerTimeoutError with cause "hang" names a rank a watch judged hung; with cause "timeout",
    the ranks still running when ``timeout_s`` passed.
    """
    index = {ref: (call, rank) for call in calls for rank, ref in enumerate(call.refs)}
    read: set = set()
    try:
        return _wait(calls, index, read, timeout_s)
    except BaseException:
        for call in calls:
            if call.abandoned is not None:
                call.abandoned.add([r for r in call.refs if r not in read])
        raise


def _wait(calls: list[Waited], index: dict, read: set, timeout_s: float | None) -> list[list]:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    results: dict[int, list] = {id(call): [None] * len(call.refs) for call in calls}
    intervals = [call.watch.poll_interval_s for call in calls if call.watch is not None]
    pending = list(index)

    def running(call: Waited) -> list[int]:
        return [r for c, r in map(index.get, pending) if c is call]

    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        wait_s = remaining if not intervals else min(min(intervals), remaining or min(intervals))
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        for ref in ready:
            call, rank = index[ref]
            read.add(ref)
            # Keep the value: fetching it again would deserialize (and copy) every result twice.
            try:
                results[id(call)][rank] = ray.get(ref, timeout=0)
            except CALL_ERRORS as exc:
                raise classify_error(exc, call.role, rank) from exc
            except GetTimeoutError:  # pragma: no cover - ready refs do not time out
                read.discard(ref)
                pending.append(ref)
        if not pending:
            break
        for call in calls:
            hung = None if call.watch is None else call.watch.poll(running(call))
            if hung is not None:
                raise WorkerTimeoutError(f"{call.role} rank {hung.rank} is hung: {hung.detail}", role=call.role,
                                         rank=hung.rank, cause="hang", pid=hung.pid, hang_kind=hung.kind,
                                         stalled_s=hung.stalled_s)
        if not ready and deadline is not None and time.monotonic() >= deadline:
            late = [(call.role, sorted(ranks)) for call in calls if (ranks := running(call))]
            names = "; ".join(f"{name}: rank(s) {ranks}" for name, ranks in late)
            raise WorkerTimeoutError(f"{names} did not finish within the {timeout_s:g}s ceiling", role=late[0][0],
                                     rank=late[0][1][0], cause="timeout")
    return [results[id(call)] for call in calls]


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
