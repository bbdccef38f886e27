"""Liveness of the ranks running a call: hung means "stopped advancing", not "took long".

While a worker group waits for a call's results, it asks the ranks still running for their
health every ``poll_interval_s`` (through the health concurrency group, one call in flight per
rank at most, never blocking) and judges with :func:`judge`:

- a rank whose health call has not answered for ``health_timeout_s`` is *unresponsive*: its
  process is stopped (SIGSTOP) or wedged below Python. A process still running its start-up
  imports (its last reply said ``warming``, or it has not answered since it started) gets
  ``warmup_timeout_s`` instead: those imports hold the interpreter for seconds on a loaded host;
- a rank that answers, is inside a registered call, and reports no progress
  (:mod:`resilient_rl.runtime.progress`) for ``hang_timeout_s`` is *stalled*: stuck in a
  collective, a deadlock, an endless loop.

A call that keeps advancing is healthy however long it runs; ``recovery.call_timeout_s`` remains
only as a generous ceiling on a whole call. When several ranks stall together (the peers of a hung
rank wait for it in a collective), the one that stopped advancing first is named.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from resilient_rl.runtime.progress import ProgressSnapshot


@dataclass
class RankWatch:
    """What the controller knows of one rank's liveness.

    ``sent_at`` is when the health call now in flight was sent (None: none in flight);
    ``snapshot`` the progress from the latest reply; ``pid`` the process that sent it;
    ``warming`` whether that process was still running its start-up imports."""

    sent_at: float | None = None
    last_sent: float | None = None
    snapshot: ProgressSnapshot | None = None
    pid: int | None = None
    ref: object | None = None
    warming: bool = False


@dataclass(frozen=True)
class Hung:
    """A rank judged hung: ``kind`` is "unresponsive" or "stalled"; ``stalled_s`` is how long its
    health call went unanswered, or it went without progress (the hang's age when judged)."""

    rank: int
    kind: str
    detail: str
    pid: int | None = None
    stalled_s: float | None = None


def judge(watches: dict[int, RankWatch], now: float, hang_timeout_s: float, health_timeout_s: float,
          warmup_timeout_s: float | None = None) -> Hung | None:
    """The hung rank among ``watches`` at time ``now`` (monotonic seconds), or None when all are live.

    Pure: no Ray, no clock of its own, so the decision is unit-tested with a fake clock."""
    def limit(w: RankWatch) -> tuple[float, str]:
        if w.warming and warmup_timeout_s is not None:
            return max(warmup_timeout_s, health_timeout_s), "warmup_timeout_s"
        return health_timeout_s, "health_timeout_s"

    silent = [(now - w.sent_at, r) for r, w in watches.items()
              if w.sent_at is not None and now - w.sent_at > limit(w)[0]]
    if silent:
        waited, rank = max(silent)
        seconds, key = limit(watches[rank])
        starting = " while starting up" if key == "warmup_timeout_s" else ""
        return Hung(rank, "unresponsive", f"its health call has not answered for {waited:.1f}s{starting} "
                    f"(recovery.{key}={seconds:g}): the process is stopped or wedged", watches[rank].pid, waited)
    stalled = [(w.snapshot.age_s, r) for r, w in watches.items()
               if w.snapshot is not None and w.snapshot.call is not None and w.snapshot.age_s > hang_timeout_s]
    if stalled:
        age, rank = max(stalled)
        call = watches[rank].snapshot.call
        return Hung(rank, "stalled", f"it is inside {call!r} and has not advanced for {age:.1f}s "
                    f"(recovery.hang_timeout_s={hang_timeout_s:g})", watches[rank].pid, age)
    return None


class LivenessWatch:
    """Non-blocking health polling of a worker group's ranks (Ray side of :func:`judge`)."""

    def __init__(self, workers: list, hang_timeout_s: float, health_timeout_s: float,
                 poll_interval_s: float = 1.0, clock=time.monotonic, warmup_timeout_s: float | None = None,
                 table=None) -> None:
        """``table``: the group's :class:`~resilient_rl.runtime.group_ranks.RankTable`, which says
        whether a rank's process was still starting when last heard of (before this watch's first
        reply from it) and learns it from every reply here."""
        self.workers = workers
        self.hang_timeout_s = hang_timeout_s
        self.health_timeout_s = health_timeout_s
        self.warmup_timeout_s = warmup_timeout_s
        self.table = table
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self.watches: dict[int, RankWatch] = {}

    def fresh(self) -> None:
        """Before a wait: take the replies that arrived since the last one (for the rank table),
        forget what they told of progress (a health call still in flight stays: one per rank), and
        ask each rank the table still takes for starting up whether it is.

        A process is taken for starting up until a reply says otherwise, and a call shorter than
        ``poll_interval_s`` ends before any health call is sent: without asking, a process would
        keep its start-up allowance (``warmup_timeout_s``) long after its start, and its stop
        would be found only by the call's ceiling (the recovery then waiting out that allowance)."""
        self._collect()
        for watch in self.watches.values():
            watch.snapshot = None
        if self.table is None:
            return
        now = self.clock()
        for rank in range(len(self.workers)):
            if self.table.is_warming(rank):
                watch = self.watches.setdefault(rank, RankWatch(warming=True))
                if watch.ref is None:
                    self._send(rank, watch, now)

    def poll(self, ranks) -> Hung | None:
        """Collect the replies that arrived, send calls where due to ``ranks``, judge those ranks."""
        now = self.clock()
        ranks = list(ranks)
        self._collect()
        for rank in ranks:
            if rank not in self.watches:
                self.watches[rank] = RankWatch(warming=self.table is not None and self.table.is_warming(rank))
            watch = self.watches[rank]
            if watch.ref is None and (watch.last_sent is None or now - watch.last_sent >= self.poll_interval_s):
                self._send(rank, watch, now)
        return judge({r: self.watches[r] for r in ranks}, now, self.hang_timeout_s, self.health_timeout_s,
                     self.warmup_timeout_s)

    def _send(self, rank: int, watch: RankWatch, now: float) -> None:
        watch.ref = self.workers[rank].health.remote()
        watch.sent_at = watch.last_sent = now

    def _collect(self) -> None:
        """Take the health replies that have arrived (never waits)."""
        from resilient_rl.runtime.ended_calls import read_ended

        inflight = {w.ref: r for r, w in self.watches.items() if w.ref is not None}
        ended, _ = read_ended(inflight)
        for ref, info, error in ended:
            watch = self.watches[inflight[ref]]
            watch.ref = watch.sent_at = None
            if error is not None:  # the rank died: the call's own result says so
                continue
            watch.snapshot = ProgressSnapshot(info.call, info.progress_age_s or 0.0, info.advances)
            watch.pid, watch.warming = info.pid, bool(getattr(info, "warming", False))
            if self.table is not None:
                self.table.note(inflight[ref], info)
