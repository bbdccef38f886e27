"""A registered method's call in flight on a worker group.

``wg.method(x)`` dispatches, runs and collects in one go. :meth:`RayWorkerGroup.submit` stops after
the dispatch and returns a :class:`GroupCall`, so that a controller can put several independent calls
in flight at once (on one group they queue in its processes and run back to back; on different
groups they run side by side) and collect each later exactly as the blocking call would have.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from resilient_rl.protocol import DataProto, unpad_dataproto
from resilient_rl.protocol.future import DataProtoFuture
from resilient_rl.runtime.group_wait import wait_calls


class GroupCall:
    """The ObjectRefs of one call on a group's ranks, and how to collect them."""

    def __init__(self, group, refs: list, collect: Callable | None = None, pad_size: int = 0, rank_zero: bool = False,
                 timeout_s: float | None = None):
        self.group, self.refs, self.timeout_s = group, refs, timeout_s
        self._collect, self._pad_size, self._rank_zero = collect, pad_size, rank_zero

    def result(self) -> Any:
        """Wait for every rank (watching their liveness, as a blocking call does, within
        ``timeout_s``, by default the group's ``call_timeout_s``) and collect (by default: each
        rank's value, in rank order)."""
        return self.collect(self.group.wait_refs(self.refs, timeout_s=self.timeout_s))

    def collect(self, values: list) -> Any:
        """What :meth:`result` returns, from every rank's value (in rank order)."""
        if self._collect is None:
            return values
        if self._rank_zero:
            return self._collect(self.group, values[0])
        output = self._collect(self.group, values)
        if self._pad_size and isinstance(output, DataProto):
            output = unpad_dataproto(output, self._pad_size)
        return output

    def future(self) -> Any:
        """What a non-blocking call returns, as in verl: the collect function applied to the
        ObjectRefs (a :class:`DataProtoFuture` for DataProto modes, the list of refs for the
        others), rank zero's ref alone for rank-zero execution. Padding added by the dispatch is
        dropped when the future is resolved."""
        if self._rank_zero:
            return self.refs[0]
        output = self._collect(self.group, list(self.refs))
        if self._pad_size and isinstance(output, DataProtoFuture):
            pad, inner = self._pad_size, output.dispatch_fn
            output.dispatch_fn = (lambda d: unpad_dataproto(inner(d) if inner else d, pad))
        return output

    def abandon(self) -> None:
        """Nobody will wait for this call: its group reads it once it ends (see
        :class:`~resilient_rl.runtime.group_wait.AbandonedCalls`)."""
        self.group.abandoned.add(self.refs)


def results_in_order(calls: Iterable[GroupCall]) -> Iterator[Any]:
    """Each call's result, waited for in the order given. When one fails (or the caller stops
    iterating), the calls after it are abandoned to their groups before the failure propagates:
    a call on another group that fails in turn (its collective's peer died) is then read, not
    left for Ray to log as an unhandled error."""
    calls = list(calls)
    for i, call in enumerate(calls):
        try:
            yield call.result()
        except BaseException:
            for later in calls[i + 1:]:
                later.abandon()
            raise


def results_together(calls: Iterable[GroupCall]) -> list:
    """Each call's result, where the calls' ranks wait on each other (one collective spans their
    groups: the weight sync's actor and rollout ranks). All are waited for at once, so the first
    failure of any ends the wait: waited for in order, a dead rollout rank would be heard of only
    once the actor's call, blocked on it, ended (NCCL within a node: after
    ``recovery.collective_timeout_s``). The ceiling on the wait is the smallest call's. When it
    fails, the calls' unread ranks are abandoned to their groups (see :meth:`GroupCall.abandon`)."""
    calls = list(calls)
    ceilings = [t for t in (c.group.call_timeout_s if c.timeout_s is None else c.timeout_s for c in calls)
                if t is not None]
    values = wait_calls([call.group.waited(call.refs) for call in calls], min(ceilings) if ceilings else None)
    return [call.collect(v) for call, v in zip(calls, values)]
